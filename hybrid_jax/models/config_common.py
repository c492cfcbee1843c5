"""What every model family's frozen config shares: the layer pattern lookup and the fields every
config.json maps the same way (norm eps, activation, tied embeddings, special token ids, dtype)."""
from __future__ import annotations


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
