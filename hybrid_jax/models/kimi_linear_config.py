"""Kimi-Linear (`model_type: kimi_linear`) configuration: a frozen dataclass read from config.json.

Layers are `linear_attention` (Kimi Delta Attention) or `full_attention` (MLA without positional
encoding: `mla_use_nope`), given by `linear_attn_config`'s 1-based `kda_layers` / `full_attn_layers`
(or a 0-based `layer_types` list, as transformers writes it). The feed-forward is DeepSeek's: a dense
MLP in the first `first_k_dense_replace` layers (or per `mlp_layer_types`), else the MoE with a sigmoid
router, correction bias, group-limited Top-K, routed scaling and shared experts. Field names follow the
release (`num_experts`, `num_experts_per_token`, `moe_renormalize`, `num_expert_group`,
`num_shared_experts`) and transformers' aliases of them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import MLPLayerPattern, check_grouped_topk, common_fields

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(MLPLayerPattern):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # Kimi Delta Attention
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MLA (no positional encoding; the "rope" channels are a shared key part, never rotated)
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # feed-forward (DeepSeek's names, read by deepseek_v32.deepseek_moe)
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"
    # cache layout (this project's choice)
    latent_page_size: int = 64

    def __post_init__(self):
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ConfigError(f"layer_types / mlp_layer_types need {n} entries; got {len(self.layer_types)} / "
                              f"{len(self.mlp_layer_types)}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"unknown kimi_linear layer types {bad}; known: {list(LAYER_TYPES)}")
        bad = sorted(set(self.mlp_layer_types) - {"dense", "sparse"})
        if bad:
            raise ConfigError(f"unknown mlp_layer_types {bad}; known: ['dense', 'sparse']")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim",
                     "linear_conv_kernel_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive; got {getattr(self, name)}")
        if "full_attention" in self.layer_types:
            for name in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"{name} must be positive; got {getattr(self, name)}")
        if "sparse" in self.mlp_layer_types:
            check_grouped_topk(self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok,
                               names=("num_experts", "num_expert_group", "num_experts_per_token"))

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    def head_counts(self) -> dict[str, int]:
        return {"num_attention_heads": self.num_attention_heads, "linear_num_heads": self.linear_num_heads}

    @property
    def routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the KDA short convolution: q, k and v of every head."""
        return 3 * self.linear_num_heads * self.linear_head_dim


def _first(d: dict, *names, default=None):
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def _layer_types(d: dict, n: int) -> list[str]:
    """The per-layer mixers: linear_attn_config's 1-based kda_layers / full_attn_layers (the release's
    form), else layer_types. Both given must agree; each layer named exactly once."""
    lac = d.get("linear_attn_config") or {}
    listed = None
    if "kda_layers" in lac or "full_attn_layers" in lac:
        kda, full = [int(i) for i in lac.get("kda_layers") or ()], [int(i) for i in lac.get("full_attn_layers") or ()]
        every = sorted(kda + full)
        if every != list(range(1, n + 1)):
            raise ConfigError(f"linear_attn_config's kda_layers {kda} and full_attn_layers {full} (1-based) must "
                              f"name each of the {n} layers once")
        listed = ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n)]
    given = d.get("layer_types")
    if given is not None and listed is not None and list(given) != listed:
        raise ConfigError(f"layer_types {list(given)} disagrees with linear_attn_config's kda_layers / full_attn_layers "
                          f"({listed})")
    if listed is None and given is None:
        raise ConfigError("kimi_linear config.json needs linear_attn_config.kda_layers / full_attn_layers or layer_types")
    return listed if listed is not None else [str(t) for t in given]


def kimi_linear_config(d: dict[str, Any]) -> KimiLinearConfig:
    """config.json -> KimiLinearConfig (KeyError / ValueError / ConfigError on bad fields). Fields that would
    change the math and are not supported are refused by name: a query low-rank projection (q_lora_rank),
    RoPE in the MLA layers (mla_use_nope false), a router other than sigmoid, MoE layers every other layer."""
    n = int(d["num_hidden_layers"])
    lac = d.get("linear_attn_config") or {}
    if d.get("q_lora_rank") is not None:
        raise ConfigError(f"kimi_linear with q_lora_rank={d['q_lora_rank']} is not supported (Kimi-Linear's "
                          f"MLA projects queries directly: q_lora_rank null)")
    if d.get("mla_use_nope") is False:
        raise ConfigError("kimi_linear with mla_use_nope false (RoPE in the MLA layers) is not supported")
    act = d.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise ConfigError(f"kimi_linear moe_router_activation_func {act!r} is not supported (only 'sigmoid')")
    if d.get("mlp_layer_types") is None and int(d.get("moe_layer_freq", 1) or 1) != 1:
        raise ConfigError(f"kimi_linear moe_layer_freq={d['moe_layer_freq']} is not supported without mlp_layer_types")
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        k = min(int(d.get("first_k_dense_replace", 1)), n)
        mlp = ["dense"] * k + ["sparse"] * (n - k)
    grouped = bool(d.get("use_grouped_topk", True))
    heads = int(d.get("num_attention_heads", 0) or 0)
    return KimiLinearConfig(
        model_type=d["model_type"], vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        num_hidden_layers=n, layer_types=tuple(_layer_types(d, n)),
        linear_num_heads=int(_first(lac, "num_heads", default=_first(d, "linear_num_heads", default=32))),
        linear_head_dim=int(_first(lac, "head_dim", default=_first(d, "linear_head_dim", default=128))),
        linear_conv_kernel_dim=int(_first(lac, "short_conv_kernel_size",
                                          default=_first(d, "linear_conv_kernel_dim", default=4))),
        num_attention_heads=heads, kv_lora_rank=int(d.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)), qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
        v_head_dim=int(d.get("v_head_dim") or 128),
        intermediate_size=int(d.get("intermediate_size") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        n_routed_experts=int(_first(d, "num_experts", "n_routed_experts", "num_local_experts", default=0)),
        n_shared_experts=int(_first(d, "num_shared_experts", "n_shared_experts", default=1)),
        num_experts_per_tok=int(_first(d, "num_experts_per_token", "num_experts_per_tok", default=0)),
        n_group=int(_first(d, "num_expert_group", "n_group", default=1)) if grouped else 1,
        topk_group=int(_first(d, "topk_group", default=1)) if grouped else 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(_first(d, "moe_renormalize", "norm_topk_prob", default=True)),
        mlp_layer_types=tuple(mlp),
        max_position_embeddings=int(_first(d, "model_max_length", "max_position_embeddings", default=1048576)),
        **common_fields(d))
