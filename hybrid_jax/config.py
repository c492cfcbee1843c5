"""Model configuration: a frozen dataclass read from a Hugging Face `config.json`.

`model_type` picks the mapping; `layer_types` names each layer's mixer. A model type or a layer
type this project does not implement fails here, with its name, before any weight is read; so does a
field of the wrong JSON type ("hidden_size": "64", "num_hidden_layers": 4.5, a list where a number
belongs: models.config_common.check_field_types), each error naming the file and the field.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.rope import ROPE_TYPES, RopeSpec, rope_dict
from hybrid_jax.models.config_common import LayerPattern, common_fields

# Every mixer the architecture family knows; SUPPORTED_LAYER_TYPES is what runs today.
KNOWN_LAYER_TYPES = ("linear_attention", "full_attention", "sliding_attention", "sparse_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention")
SUPPORTED_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig(LayerPattern):
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
        unsupported = sorted({t for t in self.layer_types if t not in SUPPORTED_LAYER_TYPES})
        if unsupported:
            raise ConfigError(f"layer type(s) {unsupported} are not supported yet for model_type "
                              f"{self.model_type!r}; supported: {list(SUPPORTED_LAYER_TYPES)}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                              f"{self.num_hidden_layers}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"]
        if "full_attention" in self.layer_types:
            positive += ["num_attention_heads", "num_key_value_heads", "head_dim"]
        if "linear_attention" in self.layer_types:
            positive += ["linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                         "linear_num_key_heads", "linear_num_value_heads"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive; got {getattr(self, name)}")
        if "full_attention" in self.layer_types and self.num_attention_heads % self.num_key_value_heads:
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

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim(self.head_dim)

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim


def config_from_hf_dict(d: dict[str, Any], source: str = "config.json"):
    """Maps a Hugging Face config dict to the config dataclass of its model family (by `model_type`).
    Raises ConfigError naming what is wrong (and `source`, the file it came from): first every field
    any family reads is checked for its JSON type (models.config_common.check_field_types)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source} must hold a JSON object")
    from hybrid_jax.models import config_parser  # noqa: PLC0415  (the registry imports the families lazily)
    from hybrid_jax.models.config_common import check_field_types  # noqa: PLC0415
    try:
        check_field_types(d)
        parse = config_parser(d.get("model_type"))
        return parse(d)
    except KeyError as e:
        raise ConfigError(f"{source} lacks the required field {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError, ArithmeticError) as e:
        nulls = sorted(k for k, v in d.items() if v is None)
        raise ConfigError(f"{source} has a malformed value: {type(e).__name__}: {e}"
                          + (f" (fields that are null: {nulls})" if nulls else "")) from None


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


def parse_rope(d: dict[str, Any], family: str, *, partial_rotary_factor: float = 1.0,
               max_position_embeddings: int = 32768, types: tuple[str, ...] = ROPE_TYPES) -> RopeSpec:
    """A config's RoPE: `rope_parameters` or the legacy `rope_scaling`, with the top-level rope_theta,
    partial_rotary_factor, max_position_embeddings (the family's default when absent) and, for YaRN,
    original_max_position_embeddings, as transformers reads them."""
    r = rope_dict(d)
    if d.get("original_max_position_embeddings") is not None and r.get("rope_type") == "yarn":
        r["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    return RopeSpec.parse(r, family=family, theta=float(d.get("rope_theta") or 10000.0),
                          partial_rotary_factor=float(d.get("partial_rotary_factor") or partial_rotary_factor),
                          max_position_embeddings=int(d.get("max_position_embeddings") or max_position_embeddings),
                          types=types)


def load_config(path: str) -> ModelConfig:
    """Reads `<path>/config.json` (or the file itself)."""
    f = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(f):
        raise ConfigError(f"no config.json found at {f}")
    try:
        with open(f, encoding="utf-8") as fh:
            d = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None
    return config_from_hf_dict(d, source=f)
