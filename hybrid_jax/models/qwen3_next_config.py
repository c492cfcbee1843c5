"""Qwen3-Next (`model_type: qwen3_next`) configuration: the frozen `ModelConfig` dataclass and its
config.json parser (`qwen3_next_config`). Qwen3.5 (models.qwen3_5_config) parses into the same class.

`layer_types` names each layer's mixer (Gated DeltaNet `linear_attention` or gated `full_attention`;
without it, every `full_attention_interval`-th layer is full attention). A layer type this family does
not run fails here, with its name, before any weight is read. Reading a config.json of any family
(field JSON types, the registry lookup by `model_type`, errors naming the file) is
models.config_common's `load_config` / `config_from_hf_dict`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.rope import RopeSpec
from hybrid_jax.models.config_common import LayerPattern, common_fields, parse_rope

# Every mixer the architecture family knows; SUPPORTED_LAYER_TYPES is what runs today.
KNOWN_LAYER_TYPES = ("linear_attention", "full_attention", "sliding_attention", "sparse_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention", "indexed_attention")
SUPPORTED_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig(LayerPattern):
    # the layer types a config of this class runs, and those of them that are (gated) attention; a subclass
    # (Qwen4-Exp's indexed attention) names its own
    SUPPORTED_LAYER_TYPES: ClassVar[tuple[str, ...]] = SUPPORTED_LAYER_TYPES
    ATTENTION_TYPES: ClassVar[tuple[str, ...]] = ("full_attention",)
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: RopeSpec = RopeSpec(partial_rotary_factor=0.25)
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    # Gated DeltaNet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    output_gate: str = "silu"          # the output gate's activation (Qwen4-Exp's output_gate_type may say sigmoid)
    # feed-forward
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        unknown = sorted({t for t in self.layer_types if t not in KNOWN_LAYER_TYPES})
        if unknown:
            raise ConfigError(f"unknown layer type(s) {unknown} in layer_types; known: {list(KNOWN_LAYER_TYPES)}")
        unsupported = sorted({t for t in self.layer_types if t not in self.SUPPORTED_LAYER_TYPES})
        if unsupported:
            raise ConfigError(f"layer type(s) {unsupported} are not supported yet for model_type "
                              f"{self.model_type!r}; supported: {list(self.SUPPORTED_LAYER_TYPES)}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                              f"{self.num_hidden_layers}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"]
        attention = any(t in self.ATTENTION_TYPES for t in self.layer_types)
        if attention:
            positive += ["num_attention_heads", "num_key_value_heads", "head_dim"]
        if "linear_attention" in self.layer_types:
            positive += ["linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                         "linear_num_key_heads", "linear_num_value_heads"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive; got {getattr(self, name)}")
        if attention and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if "linear_attention" in self.layer_types and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                              f"{self.num_experts}]")

    # --- derived, static facts the model and the cache use ---------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    def ffn_kind(self, i: int) -> str:
        return "moe" if self.is_moe_layer(i) else "dense"

    def with_layers(self, indices: Sequence[int]) -> Self:
        """FamilyConfig.with_layers: the kept layers' feed-forward kinds become mlp_only_layers (the
        dense ones) with decoder_sparse_step 1."""
        kinds = [self.ffn_kind(i) for i in indices]
        return dataclasses.replace(self, num_hidden_layers=len(indices),
                                   layer_types=tuple(self.layer_types[i] for i in indices),
                                   mlp_only_layers=tuple(j for j, k in enumerate(kinds) if k == "dense"),
                                   decoder_sparse_step=1)

    def head_counts(self) -> dict[str, int]:
        return {"num_attention_heads": self.num_attention_heads, "linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads}

    @property
    def routed_experts(self) -> int:
        return self.num_experts

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim(self.head_dim)

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim


def qwen3_next_config(d: dict[str, Any]) -> ModelConfig:
    """Qwen3-Next's config.json -> ModelConfig (KeyError / ValueError on bad fields)."""
    model_type = d["model_type"]
    n_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if layer_types is None:
        interval = int(d.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=tuple(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads", heads)),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rope=parse_rope(d, model_type, partial_rotary_factor=0.25),
        attention_bias=bool(d.get("attention_bias", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
        intermediate_size=int(d.get("intermediate_size") or 0),
        num_experts=int(d.get("num_experts") or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(int(i) for i in (d.get("mlp_only_layers") or ())),
        **common_fields(d),
    )
