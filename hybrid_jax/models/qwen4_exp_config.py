"""Qwen4-Exp (`model_type: qwen4_exp`, text-only `qwen4_exp_text`) configuration: Qwen3.5-MoE's fields
(parsed by models.qwen3_5_config) plus what Qwen4-Exp adds, as `Qwen4ExpConfig`, a subclass of Qwen3-Next's
`ModelConfig`.

What Qwen4-Exp adds to the math, each field read and checked here:
  - "indexed_attention" layers (the release names them "full_attention"): Qwen3.5's gated attention over
    the tokens a QSA indexer selects (indexer_n_heads, indexer_kv_heads = 1, indexer_head_dim,
    indexer_budget, indexer_compress_ratio: all required when a layer is indexed);
  - hyper-connections: hc_count residual streams, a rank-hc_lowrank input mixer (hc_count > 1);
  - PLE on `ple_layer_ids` (one-indexed, Gated DeltaNet layers only): hashed n-gram embeddings
    (ngram_size, heads_per_ngram, ngram_vocab_size_base, make_ngram_vocab_size_divisible_by, seed,
    ple_embed_dim) and a dilated depthwise conv (ple_conv_kernel_size, dilation ngram_size); the n-gram
    context restarts after the text model's first eos_token_id, which must be set;
  - output_gate_type: the Gated DeltaNet output gate's activation ("silu" or "sigmoid"; hidden_act when unset).
The multimodal config's vision_config is not read (the vision tower is not run; its weights are skipped
at load). `split_ngram_parts` is a checkpoint-layout matter (the loader concatenates the shards it finds).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import eos_ids
from hybrid_jax.models.qwen3_5_config import qwen3_5_config
from hybrid_jax.models.qwen3_next_config import ModelConfig

LIN, IDX = "linear_attention", "indexed_attention"
# transformers' Qwen4ExpTextConfig defaults where they differ from what the Qwen3-Next parser assumes
TEXT_DEFAULTS = dict(num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
                     moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=32768)
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@dataclasses.dataclass(frozen=True)
class Qwen4ExpConfig(ModelConfig):
    SUPPORTED_LAYER_TYPES: ClassVar[tuple[str, ...]] = (LIN, IDX)
    ATTENTION_TYPES: ClassVar[tuple[str, ...]] = (IDX,)
    # hyper-connections
    hc_count: int = 4
    hc_lowrank: int = 320
    # PLE: zero-indexed layers and each one's rank among the model's PLE layers (its hash seed and primes)
    ple_layers: tuple[int, ...] = ()
    ple_ranks: tuple[int, ...] = ()
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    ngram_vocab_multiple: int = 128
    ngram_seed: int = 1234
    ple_eos_id: int = 0
    # QSA indexer
    indexer_n_heads: int = 0
    indexer_head_dim: int = 0
    indexer_budget: int = 0
    indexer_compress_ratio: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.check_qsa()
        if self.hc_count <= 1 or self.hc_lowrank <= 0:
            raise ConfigError(f"hc_count must be > 1 and hc_lowrank > 0; got {self.hc_count}, {self.hc_lowrank}")
        if self.output_gate not in ("silu", "sigmoid"):
            raise ConfigError(f"output_gate_type {self.output_gate!r} is not supported ('silu' or 'sigmoid')")
        if self.num_experts <= 0:
            raise ConfigError("Qwen4-Exp needs num_experts > 0 (every layer is MoE)")
        bad = [i + 1 for i in self.ple_layers if self.layer_types[i] != LIN]
        if bad:
            raise ConfigError(f"ple_layer_ids {bad} are not linear_attention layers (PLE runs on those only)")
        if self.ple_layers and (self.ple_embed_dim <= 0 or self.ple_embed_dim % self.ngram_heads
                                or self.ngram_size < 2 or self.ple_conv_kernel_size < 1):
            raise ConfigError(f"ple_embed_dim={self.ple_embed_dim} must be a positive multiple of the n-gram heads "
                              f"(ngram_size - 1) * heads_per_ngram = {self.ngram_heads}, with ngram_size >= 2")

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_conv_state_len(self) -> int:
        """Past positions the dilated PLE conv reads: (kernel - 1) * dilation (= ngram_size)."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def qsa_block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    def ffn_kind(self, i: int) -> str:
        """Every layer is MoE; a PLE layer's ("ple+moe") also adds its n-gram embedding before the mixer, so it
        is a kind of its own for the planner's reduced stacks (equal kinds compute the same thing)."""
        return "ple+moe" if i in self.ple_layers else "moe"

    def with_layers(self, indices: Sequence[int]) -> Self:
        """FamilyConfig.with_layers; a kept PLE layer keeps its rank (its hashes and table sizes)."""
        rank = dict(zip(self.ple_layers, self.ple_ranks))
        kept = [(j, rank[i]) for j, i in enumerate(indices) if i in rank]
        bare = dataclasses.replace(self, ple_layers=(), ple_ranks=())   # the old ids may not fit the new layers
        return dataclasses.replace(super(Qwen4ExpConfig, bare).with_layers(indices),
                                   ple_layers=tuple(j for j, _ in kept), ple_ranks=tuple(r for _, r in kept))

    def check_qsa(self) -> None:
        if IDX in self.layer_types and self.rotary_dim > self.indexer_head_dim:
            raise ConfigError(f"the attention's RoPE dimensions ({self.rotary_dim}) must fit the QSA index head "
                              f"(indexer_head_dim={self.indexer_head_dim})")


def _text(d: dict[str, Any]) -> dict[str, Any]:
    text = d.get("text_config")
    if text is None:
        if d["model_type"] == "qwen4_exp":
            raise ConfigError("qwen4_exp config.json lacks its text_config")
        return d
    if not isinstance(text, dict):
        raise ConfigError("text_config must be a JSON object")
    return text


def _layer_types(text: dict) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        return [LIN if (i + 1) % interval else IDX for i in range(int(text["num_hidden_layers"]))]
    return [IDX if t == "full_attention" else t for t in types]     # the release's name for indexed layers


def _qsa(text: dict, types: list[str]) -> dict[str, int]:
    values = {k: text.get(k) for k in QSA_FIELDS}
    if IDX not in types:
        return {}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConfigError(f"indexed_attention layers need the QSA fields; missing {missing}")
    if any(int(v) <= 0 for v in values.values()):
        raise ConfigError(f"QSA fields must be positive; got {values}")
    if int(values["indexer_kv_heads"]) != 1:
        raise ConfigError(f"indexer_kv_heads={values['indexer_kv_heads']} is not supported (QSA has one key head)")
    if int(values["indexer_budget"]) % int(values["indexer_compress_ratio"]):
        raise ConfigError("indexer_budget must be a multiple of indexer_compress_ratio")
    return {k: int(values[k]) for k in QSA_FIELDS if k != "indexer_kv_heads"}


def _ple(text: dict, d: dict, n_layers: int) -> dict[str, Any]:
    ids = sorted(set(int(i) for i in (text.get("ple_layer_ids") or ())))
    if not ids:
        return {}
    out_of_range = [i for i in ids if not 1 <= i <= n_layers]
    if out_of_range:
        raise ConfigError(f"ple_layer_ids {out_of_range} are not in [1, {n_layers}] (they are one-indexed)")
    eos = eos_ids(text.get("eos_token_id", d.get("eos_token_id")))
    if not eos:
        raise ConfigError("PLE layers need eos_token_id (the n-gram context restarts after it)")
    return dict(ple_layers=tuple(i - 1 for i in ids), ple_ranks=tuple(range(len(ids))),
                ple_embed_dim=int(text.get("ple_embed_dim") or text["hidden_size"]),
                ple_conv_kernel_size=int(text.get("ple_conv_kernel_size", 4)), ngram_size=int(text.get("ngram_size", 3)),
                heads_per_ngram=int(text.get("heads_per_ngram", 8)),
                ngram_vocab_size_base=int(text.get("ngram_vocab_size_base", 20_000_000)),
                ngram_vocab_multiple=int(text.get("make_ngram_vocab_size_divisible_by", 128)),
                ngram_seed=int(text.get("seed", 1234)), ple_eos_id=eos[0])


def qwen4_exp_config(d: dict[str, Any]) -> Qwen4ExpConfig:
    """config.json -> Qwen4ExpConfig (KeyError / ValueError / ConfigError on bad fields)."""
    text = dict(TEXT_DEFAULTS, **{k: v for k, v in _text(d).items() if v is not None})
    types = _layer_types(text)
    unknown = sorted(set(types) - {LIN, IDX})
    if unknown:
        raise ConfigError(f"unknown layer type(s) {unknown} for Qwen4-Exp; known: {[LIN, IDX]}")
    qsa, ple = _qsa(text, types), _ple(text, d, len(types))
    # Qwen3.5-MoE's parse of the shared fields, the indexed layers standing in as its full attention
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    base_text = dict(text, layer_types=["full_attention" if t == IDX else t for t in types],
                     # transformers rotates the whole head unless a partial factor is given
                     partial_rotary_factor=text.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    base = qwen3_5_config({**d, "model_type": "qwen3_5_moe", "text_config": base_text}
                          if "text_config" in d else {**base_text, "model_type": "qwen3_5_moe_text"})
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    fields.update(model_type=d["model_type"], layer_types=tuple(types),
                  output_gate=text.get("output_gate_type") or text.get("hidden_act", "silu"))
    return Qwen4ExpConfig(**fields, hc_count=int(text.get("hc_count", 4)), hc_lowrank=int(text.get("hc_lowrank", 320)),
                          **qsa, **ple)
