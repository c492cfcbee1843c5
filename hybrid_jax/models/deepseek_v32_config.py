"""DeepSeek-V3.2 (`model_type: deepseek_v32`) configuration: a frozen dataclass read from config.json.

Every layer is `sparse_attention` (MLA + the DSA indexer; transformers calls it "indexed_attention"); GLM-5's
config (glm_moe_dsa_config) may make some `shared_sparse_attention` (reusing the previous indexer's Top-K).
The first `first_k_dense_replace` layers (or `mlp_layer_types`) use a dense MLP, the rest DeepSeek's
MoE (sigmoid router with correction bias, group-limited Top-K, routed scaling, shared experts).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.rope import RopeSpec, softmax_scale
from hybrid_jax.models.config_common import MLPLayerPattern, check_grouped_topk, common_fields, parse_rope

_HF_LAYER_TYPES = {"indexed_attention": "sparse_attention", "sparse_attention": "sparse_attention"}
# sparse_attention: MLA + its own indexer; shared_sparse_attention: MLA over the previous indexer layer's
# Top-K (GLM-5's "shared" indexer layers; DeepSeek-V3.2 has none)
DSA_LAYER_TYPES = ("sparse_attention", "shared_sparse_attention")


@dataclasses.dataclass(frozen=True)
class DeepseekV32Config(MLPLayerPattern):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    # MLA
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # indexer
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    # feed-forward
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
    rope: RopeSpec = RopeSpec()              # on the qk_rope_head_dim channels
    index_rope_interleaved: bool = False     # the indexer's RoPE: half-split (V3.2) or interleaved pairs (GLM-5)
    latent_norm_eps: float = 1e-6            # q_a / kv_a norms (built with the norm's default in transformers)
    attention_bias: bool = False
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"
    # cache layout (this project's choice, not the checkpoint's)
    latent_page_size: int = 64
    index_page_size: int = 128

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - set(DSA_LAYER_TYPES))
        if bad:
            raise ConfigError(f"{self.model_type} layers must be of {list(DSA_LAYER_TYPES)}; got {bad}")
        if self.layer_types and self.layer_types[0] != "sparse_attention":
            raise ConfigError(f"{self.model_type}: layer 0 reuses an earlier layer's indexer Top-K, but no "
                              f"layer runs the indexer before it")
        if len(self.layer_types) != self.num_hidden_layers or len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types / mlp_layer_types need {self.num_hidden_layers} entries; got "
                              f"{len(self.layer_types)} / {len(self.mlp_layer_types)}")
        bad = sorted(set(self.mlp_layer_types) - {"dense", "sparse"})
        if bad:
            raise ConfigError(f"unknown mlp_layer_types {bad}; known: ['dense', 'sparse']")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "q_lora_rank", "index_topk", "index_n_heads", "index_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive; got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= index_head_dim="
                              f"{self.index_head_dim}")
        if "sparse" in self.mlp_layer_types:
            check_grouped_topk(self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok)

    def attention_layers(self) -> tuple[int, ...]:
        """Every layer: each keeps its latent (the indexer keys only the "sparse_attention" layers)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in DSA_LAYER_TYPES)

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    def head_counts(self) -> dict[str, int]:
        return {"num_attention_heads": self.num_attention_heads, "index_n_heads": self.index_n_heads}

    @property
    def routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, with YaRN's mscale correction (DeepSeek's definition)."""
        return softmax_scale(self.rope, self.qk_head_dim)


# The defaults of fields a DeepSeek-V3.2 config.json may leave out (transformers' DeepseekV32Config
# where this parser takes one; GLM-5's parser passes its own).
V32_DEFAULTS = dict(index_topk=2048, index_n_heads=64, index_head_dim=128, first_k_dense_replace=3, n_shared_experts=1,
                    n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                    max_position_embeddings=163840, moe_intermediate_size=0)


def deepseek_v32_config(d: dict[str, Any]) -> DeepseekV32Config:
    """config.json -> DeepseekV32Config (KeyError / ValueError / ConfigError on bad fields)."""
    return DeepseekV32Config(**dsa_fields(d, "deepseek_v32", V32_DEFAULTS))


def dsa_fields(d: dict[str, Any], family: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The DeepseekV32Config fields config.json `d` gives (the families built on it: DeepSeek-V3.2, GLM-5);
    `defaults`: the family's values of the fields `d` may leave out (V32_DEFAULTS' keys)."""
    def get(k):
        v = d.get(k)
        return defaults[k] if v is None else v
    n = int(d["num_hidden_layers"])
    raw = d.get("layer_types") or ["indexed_attention"] * n
    unknown = sorted({t for t in raw if t not in _HF_LAYER_TYPES})
    if unknown:
        raise ConfigError(f"unknown layer type(s) {unknown} in layer_types for {family}")
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        k = min(int(get("first_k_dense_replace")), n)
        mlp = ["dense"] * k + ["sparse"] * (n - k)
    max_pos = int(get("max_position_embeddings"))
    return dict(
        model_type=d["model_type"], vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        num_hidden_layers=n, layer_types=tuple(_HF_LAYER_TYPES[t] for t in raw),
        num_attention_heads=int(d["num_attention_heads"]),
        q_lora_rank=int(d["q_lora_rank"]), kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]), qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]), index_topk=int(get("index_topk")),
        index_n_heads=int(get("index_n_heads")), index_head_dim=int(get("index_head_dim")),
        intermediate_size=int(d["intermediate_size"]), moe_intermediate_size=int(get("moe_intermediate_size")),
        n_routed_experts=int(d.get("n_routed_experts", d.get("num_local_experts", 0)) or 0),
        n_shared_experts=int(get("n_shared_experts") or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 0) or 0),
        n_group=int(get("n_group") or 1), topk_group=int(get("topk_group") or 1),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        norm_topk_prob=bool(get("norm_topk_prob")), mlp_layer_types=tuple(mlp),
        rope=parse_rope(d, family, max_position_embeddings=max_pos),
        attention_bias=bool(d.get("attention_bias", False)), max_position_embeddings=max_pos,
        **common_fields(d))
