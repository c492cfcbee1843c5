"""What every model family's frozen config shares, and how any family's config.json is read.

  FamilyConfig        the interface every family's config satisfies: what the engine, the loaders,
                      the planner and the parallel checks read from a config, so that none of
                      them probes a family's own fields
  LayerPattern, MLPLayerPattern
                      mixins implementing its layer-pattern part (`layers_of`; `ffn_kind` and
                      `with_layers` for a config with `mlp_layer_types`)
  common_fields, eos_ids, parse_rope, check_grouped_topk
                      the pieces of config.json every family's parser reads alike (norm eps,
                      activation, tied embeddings, special token ids, dtype; RoPE; grouped Top-K)
  check_field_types   the JSON type of every field any family reads
  config_from_hf_dict, load_config
                      a config.json dict / file -> the config of its family, by `model_type` (the
                      registry in hybrid_jax.models names each model type's parser)

The parsers convert with int() / float() / bool(), which take a wrong type without a word:
"num_hidden_layers": 4.5 became a 4-layer model, "tie_word_embeddings": "false" tied the
embeddings, "hidden_size": "64" was read as 64, and a list where a number belongs surfaced as
int()'s TypeError, naming no field. So before any parser runs, every field it may read is checked
against its JSON type here, and a wrong one is a ConfigError naming the field (with its path inside
text_config / rope_parameters / linear_attn_config) and the value. null stays allowed (the parsers
read it as "not given"); fields no family reads are not looked at.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any, Protocol, Self, runtime_checkable

from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.rope import ROPE_TYPES, RopeSpec, rope_dict
from hybrid_jax.models import config_parser


@runtime_checkable
class FamilyConfig(Protocol):
    """What the code outside a model family reads from that family's config, whichever family it is:
    the registry key and the sizes the engine, the LLM facade and the loaders use (model_type,
    vocab_size, hidden_size, max_position_embeddings: the default max_model_len), the special token
    ids and the dtype of dtype="auto", the layer stack the planner reduces (layer_types, ffn_kind,
    with_layers) and the counts the parallel checks divide (head_counts, routed_experts). Every
    family's frozen config dataclass satisfies it (tests/hybrid_jax/test_model_contract.py); the family's
    own code reads its own fields. A config is made by its family's parser: config_from_hf_dict."""

    @property
    def model_type(self) -> str: ...                    # the registry key: models.get_model(model_type)
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...                   # the residual width
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def layer_types(self) -> tuple[str, ...]: ...       # one mixer name per layer (keys of the family's layer_types)
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def dtype(self) -> str: ...                         # the checkpoint's dtype name (what dtype="auto" runs)
    @property
    def tie_word_embeddings(self) -> bool: ...

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers whose mixer is `kind`."""

    def ffn_kind(self, i: int) -> str:
        """Layer i's feed-forward kind in the family's words ("dense", "moe", "sparse", "hash_moe");
        layers of equal (layer_types[i], ffn_kind(i)) compute the same thing."""

    def with_layers(self, indices: Sequence[int]) -> Self:
        """The config of a model made of layers `indices` of this one (in that order, repeats allowed),
        each keeping its mixer and feed-forward kind; every other field unchanged."""

    def head_counts(self) -> dict[str, int]:
        """The head-like counts a tensor-parallel split divides (attention, linear-attention and
        indexer heads, output-projection groups), by field name; key-value heads are not among
        them (replicated when fewer than the devices)."""

    @property
    def routed_experts(self) -> int:
        """Routed MoE experts per layer (what expert parallelism splits); 0 without any."""


class LayerPattern:
    """Mixin for a config dataclass with a `layer_types` tuple (one mixer name per layer)."""

    layer_types: tuple[str, ...]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers whose mixer is `kind`."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


class MLPLayerPattern(LayerPattern):
    """LayerPattern for a config dataclass that also names each layer's feed-forward in an
    `mlp_layer_types` tuple: FamilyConfig's ffn_kind and with_layers read it."""

    mlp_layer_types: tuple[str, ...]

    def ffn_kind(self, i: int) -> str:
        return self.mlp_layer_types[i]

    def with_layers(self, indices: Sequence[int]) -> Self:
        return dataclasses.replace(self, num_hidden_layers=len(indices),
                                   layer_types=tuple(self.layer_types[i] for i in indices),
                                   mlp_layer_types=tuple(self.mlp_layer_types[i] for i in indices))


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


# ---- JSON types of the fields the families read ---------------------------------------------------

_COUNTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
           "max_position_embeddings", "model_max_length", "original_max_position_embeddings",
           "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
           "linear_num_value_heads", "linear_num_heads", "linear_head_dim", "intermediate_size", "num_experts",
           "num_experts_per_tok", "num_experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size",
           "decoder_sparse_step", "full_attention_interval", "first_k_dense_replace", "moe_layer_freq",
           "n_routed_experts", "num_local_experts", "n_shared_experts", "num_shared_experts", "n_group",
           "num_expert_group", "topk_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
           "v_head_dim", "index_topk", "index_n_heads", "index_head_dim", "o_groups", "o_lora_rank", "sliding_window",
           "hc_mult", "hc_sinkhorn_iters", "num_hash_layers", "compress_rate_csa", "compress_rate_hca",
           "num_nextn_predict_layers", "index_topk_freq", "index_skip_topk_offset", "mamba_num_heads", "mamba_head_dim",
           "n_groups", "mamba_n_groups", "ssm_state_size", "conv_kernel", "mamba_d_conv",
           "moe_shared_expert_intermediate_size", "moe_latent_size", "hc_count", "hc_lowrank", "ple_embed_dim",
           "ple_conv_kernel_size", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base",
           "make_ngram_vocab_size_divisible_by", "seed", "split_ngram_parts", "indexer_n_heads", "indexer_kv_heads",
           "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
_FLOATS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "routed_scaling_factor", "hc_eps", "swiglu_limit",
           "compress_rope_theta", "layer_norm_epsilon")
_BOOLS = ("attention_bias", "tie_word_embeddings", "norm_topk_prob", "moe_renormalize", "use_grouped_topk",
          "attn_output_gate", "mla_use_nope", "mlp_bias", "indexer_rope_interleave", "rope_interleave",
          "use_sliding_window", "use_bias", "mamba_proj_bias", "use_conv_bias", "mamba_conv_bias")
_STRS = ("model_type", "hidden_act", "dtype", "torch_dtype", "scoring_func", "topk_method", "moe_router_activation_func",
         "mamba_ssm_dtype", "hybrid_override_pattern", "mlp_hidden_act", "mamba_hidden_act",
         "output_gate_type")


def _is_int(v) -> bool:
    """An integer in JSON: 4 or 4.0, not 4.5, not true."""
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


# kind -> (test, what the field must be)
_KINDS = {
    "count": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "id": (_is_int, "an integer (a token id)"),
    "ids": (lambda v: _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)),
            "an integer or a list of integers (token ids)"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "counts": (lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
               "a list of non-negative integers"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
}
FIELD_KINDS: dict[str, str] = {
    **{k: "count" for k in _COUNTS}, **{k: "float" for k in _FLOATS}, **{k: "bool" for k in _BOOLS},
    **{k: "str" for k in _STRS},
    "bos_token_id": "id", "pad_token_id": "id", "eos_token_id": "ids",
    "layer_types": "strs", "mlp_layer_types": "strs", "indexer_types": "strs", "layers_block_type": "strs",
    "mlp_only_layers": "counts", "compress_ratios": "counts", "ple_layer_ids": "counts",
    "text_config": "object", "rope_parameters": "object", "rope_scaling": "object", "linear_attn_config": "object",
    "compress_rates": "object", "quantization_config": "object",
}
ROPE_KINDS: dict[str, str] = {
    "rope_type": "str", "type": "str", "rope_theta": "float", "partial_rotary_factor": "float", "factor": "float",
    "beta_fast": "float", "beta_slow": "float", "mscale": "float", "mscale_all_dim": "float",
    "attention_factor": "float", "original_max_position_embeddings": "count", "truncate": "bool",
    "mrope_section": "counts", "mrope_interleaved": "bool",
}
LINEAR_ATTN_KINDS: dict[str, str] = {"num_heads": "count", "head_dim": "count", "short_conv_kernel_size": "count",
                                     "kda_layers": "counts", "full_attn_layers": "counts"}
REQUIRED_NOT_NULL = ("vocab_size", "hidden_size", "num_hidden_layers")


def _shown(v) -> str:
    """A value as config.json spells it, and what it is: '"64" (a string)', 'true (a boolean)'."""
    what = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return f"{text if len(text) <= 80 else text[:77] + '...'} ({what})"


def _check(d: dict, kinds: dict[str, str], where: str) -> None:
    for key, kind in kinds.items():
        if key not in d or d[key] is None:
            continue
        ok, what = _KINDS[kind]
        v = d[key]
        if not ok(v):
            raise ConfigError(f"field {where}{key} must be {what}; got {_shown(v)}")


def check_field_types(d: dict, where: str = "") -> None:
    """ConfigError naming the first field of config.json dict `d` (and of its text_config,
    rope_parameters / rope_scaling with their nested rope dicts, linear_attn_config and
    compress_rates) whose value is not of the JSON type the families read it as. null is allowed
    except for REQUIRED_NOT_NULL (in the dict that holds the language model: text_config if there is one)."""
    _check(d, FIELD_KINDS, where)
    if not where:
        text = isinstance(d.get("text_config"), dict)
        model = d["text_config"] if text else d
        for key in REQUIRED_NOT_NULL:
            if key in model and model[key] is None:
                raise ConfigError(f"field {'text_config.' if text else ''}{key} must be {_KINDS['count'][1]}; got null")
    if isinstance(d.get("text_config"), dict):
        check_field_types(d["text_config"], f"{where}text_config.")
    for rope in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(rope), dict):
            _check_rope(d[rope], f"{where}{rope}.")
    if isinstance(d.get("linear_attn_config"), dict):
        _check(d["linear_attn_config"], LINEAR_ATTN_KINDS, f"{where}linear_attn_config.")
    if isinstance(d.get("compress_rates"), dict):
        _check(d["compress_rates"], dict.fromkeys(d["compress_rates"], "count"), f"{where}compress_rates.")


def _check_rope(r: dict, where: str) -> None:
    """A rope dict: its own fields, and those of rope dicts nested in it (DeepSeek-V4's main /
    compress, or one per layer type)."""
    _check(r, ROPE_KINDS, where)
    for k, v in r.items():
        if isinstance(v, dict):
            _check_rope(v, f"{where}{k}.")


# ---- reading a config.json of any family ---------------------------------------------------------

def config_from_hf_dict(d: dict[str, Any], source: str = "config.json") -> FamilyConfig:
    """Maps a Hugging Face config dict to the config dataclass of its model family (by `model_type`).
    Raises ConfigError naming what is wrong (and `source`, the file it came from): first every field
    any family reads is checked for its JSON type (check_field_types)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source} must hold a JSON object")
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


def load_config(path: str) -> FamilyConfig:
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
