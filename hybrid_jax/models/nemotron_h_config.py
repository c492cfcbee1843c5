"""Nemotron-H (`model_type: nemotron_h`) configuration: a frozen dataclass read from config.json.

Every layer is one block, `x + mixer(rmsnorm(x))`, its mixer one of four types, given by
`hybrid_override_pattern` (one character a layer: "M" Mamba2, "*" attention, "-" MLP, "E" MoE) or by
transformers' `layers_block_type` list ("linear_attention", "full_attention", "mlp", "moe"):
  linear_attention  the Mamba2 mixer (layers.mamba2; mamba_num_heads x mamba_head_dim, n_groups,
                    ssm_state_size, conv_kernel, time_step_limit)
  full_attention    GQA without positional encoding, no biases (num_attention_heads,
                    num_key_value_heads, head_dim)
  mlp               up -> relu2 -> down (intermediate_size)
  moe               DeepSeek's sigmoid router with correction bias and group-limited Top-K over
                    ungated relu2 experts, an optional latent projection around them
                    (moe_latent_size), plus one shared relu2 MLP
Fields that would change the math and are not supported are refused by name (use_bias: the
projections' biases; mlp_bias; activations other than relu2 / silu; sliding_window).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Self

from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import LayerPattern, check_grouped_topk, common_fields

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LAYER_TYPES = tuple(PATTERN.values())


@dataclasses.dataclass(frozen=True)
class NemotronHConfig(LayerPattern):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Mamba2
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    time_step_limit: tuple[float, float]
    use_conv_bias: bool
    # feed-forward (the MoE's names are DeepSeek's, read by deepseek_v32.grouped_topk_route)
    intermediate_size: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    hidden_act: str = "relu2"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer pattern has {len(self.layer_types)} layers; num_hidden_layers is "
                              f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"unknown nemotron_h layer types {bad}; known: {list(LAYER_TYPES)}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
            _positive(self, name)
        if "linear_attention" in self.layer_types:
            for name in ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"):
                _positive(self, name)
            if self.mamba_num_heads % self.n_groups:
                raise ConfigError(f"mamba_num_heads={self.mamba_num_heads} must be a multiple of "
                                  f"n_groups={self.n_groups}")
        if "full_attention" in self.layer_types:
            for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
                _positive(self, name)
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                                  f"num_key_value_heads={self.num_key_value_heads}")
        if "mlp" in self.layer_types:
            _positive(self, "intermediate_size")
        if "moe" in self.layer_types:
            for name in ("moe_intermediate_size", "moe_shared_expert_intermediate_size"):
                _positive(self, name)
            check_grouped_topk(self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok)

    def ffn_kind(self, i: int) -> str:
        """A block is one mixer: an "mlp" block is "dense", a "moe" block "moe", a Mamba2 or attention
        block has no feed-forward ("none")."""
        return {"mlp": "dense", "moe": "moe"}.get(self.layer_types[i], "none")

    def with_layers(self, indices: Sequence[int]) -> Self:
        return dataclasses.replace(self, num_hidden_layers=len(indices),
                                   layer_types=tuple(self.layer_types[i] for i in indices))

    def head_counts(self) -> dict[str, int]:
        """Attention heads, and the Mamba2 heads and groups (a split keeps each group's heads together with
        the B / C they read: `nemotron_h_params.PARAM_AXES`); 0 for a mixer the model has no layer of."""
        mamba = "linear_attention" in self.layer_types
        return {"num_attention_heads": self.num_attention_heads if "full_attention" in self.layer_types else 0,
                "mamba_num_heads": self.mamba_num_heads if mamba else 0, "n_groups": self.n_groups if mamba else 0}

    @property
    def routed_experts(self) -> int:
        return self.n_routed_experts if "moe" in self.layer_types else 0

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the Mamba2 conv: x (heads x head dim), then B and C (groups x state size each)."""
        return self.mamba_num_heads * self.mamba_head_dim + 2 * self.n_groups * self.ssm_state_size


def _positive(cfg, name: str) -> None:
    if getattr(cfg, name) <= 0:
        raise ConfigError(f"{name} must be positive; got {getattr(cfg, name)}")


def _layer_types(d: dict) -> list[str]:
    """The per-layer mixers: hybrid_override_pattern (the release's form) or layers_block_type /
    layer_types (transformers'); both given must agree."""
    listed = None
    pattern = d.get("hybrid_override_pattern")
    if pattern is not None:
        bad = sorted(set(pattern) - set(PATTERN))
        if bad:
            raise ConfigError(f"hybrid_override_pattern has unknown layer characters {bad}; known: {sorted(PATTERN)}")
        listed = [PATTERN[c] for c in pattern]
    given = d.get("layers_block_type") or d.get("layer_types")
    if given is not None and listed is not None and list(given) != listed:
        raise ConfigError(f"layers_block_type {list(given)} disagrees with hybrid_override_pattern {pattern!r}")
    if listed is None and given is None:
        raise ConfigError("nemotron_h config.json needs hybrid_override_pattern or layers_block_type")
    return listed if listed is not None else [str(t) for t in given]


def _refuse_unsupported(d: dict) -> None:
    """Fields that change the math and are not implemented, refused by name."""
    for name in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias"):
        if d.get(name):
            raise ConfigError(f"nemotron_h with {name}=true is not supported (the projections have no biases here)")
    for name, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if d.get(name, want) != want:
            raise ConfigError(f"nemotron_h {name} {d[name]!r} is not supported (only {want!r})")
    if d.get("sliding_window") is not None:
        raise ConfigError(f"nemotron_h with sliding_window={d['sliding_window']} is not supported (full attention)")


def _first(d: dict, *names, default=None):
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def _bound(v) -> float:
    """A time_step_limit bound: a number, or transformers' JSON spelling of a non-finite float
    ({"__float__": "Infinity"})."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"time_step_limit bound {v!r} is not a number") from None


def _time_step_limit(d: dict) -> tuple[float, float]:
    lim = _first(d, "time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))
    if not isinstance(lim, (list, tuple)) or len(lim) != 2:
        raise ConfigError(f"time_step_limit must be [low, high]; got {lim!r}")
    lo, hi = _bound(lim[0]), _bound(lim[1])
    if not 0.0 <= lo <= hi:
        raise ConfigError(f"time_step_limit must be [low, high] with 0 <= low <= high; got {lim!r}")
    return lo, hi


def nemotron_h_config(d: dict[str, Any]) -> NemotronHConfig:
    """config.json -> NemotronHConfig (KeyError / ValueError / ConfigError on bad fields). Accepts the
    release's field names (mamba_n_groups, mamba_d_conv, mamba_dt_limit, mamba_conv_bias) and
    transformers'. An MTP block (num_nextn_predict_layers > 0: Nemotron 3 Super's) is not implemented: the model
    loads without it, the loader warning that its mtp.* tensors were left (speculative.mtp.check_all_read), and
    speculative method 'mtp' is refused by name (speculative.mtp.check_mtp)."""
    _refuse_unsupported(d)
    types = _layer_types(d)
    n = int(d.get("num_hidden_layers") or len(types))
    hidden = int(d["hidden_size"])
    heads = int(d.get("num_attention_heads") or 0)
    fields = common_fields(d)
    fields.update(rms_norm_eps=float(_first(d, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
                  hidden_act=str(d.get("mlp_hidden_act", "relu2")))
    latent = d.get("moe_latent_size")
    return NemotronHConfig(
        model_type=d["model_type"], vocab_size=int(d["vocab_size"]), hidden_size=hidden, num_hidden_layers=n,
        layer_types=tuple(types), num_attention_heads=heads,
        num_key_value_heads=int(_first(d, "num_key_value_heads", default=heads)),
        head_dim=int(_first(d, "head_dim", "attention_head_dim", default=hidden // heads if heads else 0)),
        mamba_num_heads=int(d.get("mamba_num_heads", 128)), mamba_head_dim=int(d.get("mamba_head_dim", 64)),
        n_groups=int(_first(d, "n_groups", "mamba_n_groups", default=8)),
        ssm_state_size=int(d.get("ssm_state_size", 128)),
        conv_kernel=int(_first(d, "conv_kernel", "mamba_d_conv", default=4)),
        time_step_limit=_time_step_limit(d),
        use_conv_bias=bool(_first(d, "use_conv_bias", "mamba_conv_bias", default=True)),
        intermediate_size=int(d.get("intermediate_size") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        moe_shared_expert_intermediate_size=int(d.get("moe_shared_expert_intermediate_size") or 0),
        moe_latent_size=None if latent is None else int(latent),
        n_routed_experts=int(_first(d, "n_routed_experts", "num_local_experts", default=0)),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        max_position_embeddings=int(d.get("max_position_embeddings") or 4096), **fields)
