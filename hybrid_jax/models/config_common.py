"""What every model family's frozen config shares: the layer pattern lookup and the fields every
config.json maps the same way (norm eps, activation, tied embeddings, special token ids, dtype)."""
from __future__ import annotations

from hybrid_jax.errors import ConfigError


class LayerPattern:
    """Mixin for a config dataclass with a `layer_types` tuple (one mixer name per layer)."""

    layer_types: tuple[str, ...]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers whose mixer is `kind`."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


def eos_ids(v) -> tuple[int, ...]:
    """config.json's `eos_token_id` (None, an int or a list) -> a tuple of ids."""
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def common_fields(d: dict) -> dict:
    """The config.json fields every family reads alike, as keyword arguments of its config dataclass."""
    return dict(rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), hidden_act=str(d.get("hidden_act", "silu")),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids(d.get("eos_token_id")), pad_token_id=d.get("pad_token_id"),
                dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"))


def check_grouped_topk(E: int, n_group: int, topk_group: int, k: int, names=("n_routed_experts", "n_group",
                                                                           "num_experts_per_tok")) -> None:
    """ConfigError unless DeepSeek's group-limited Top-K routing can run: E experts in n_group groups of
    at least 2 (a group scores by its two best), topk_group groups chosen, k experts among them.
    names: how the family's config.json spells the three counts (for the message)."""
    e, g, kk = names
    if E <= 0 or n_group <= 0 or E % n_group:
        raise ConfigError(f"{e}={E} must be a positive multiple of {g}={n_group}")
    if not 0 < topk_group <= n_group:
        raise ConfigError(f"topk_group={topk_group} must be in [1, {g}={n_group}]")
    if E // n_group < 2:
        raise ConfigError(f"each expert group needs >= 2 experts (group score = top-2 sum); got {E // n_group}")
    if not 0 < k <= topk_group * (E // n_group):
        raise ConfigError(f"{kk}={k} must be in [1, experts in the {topk_group} chosen groups]")
