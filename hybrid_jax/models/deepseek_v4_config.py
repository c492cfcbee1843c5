"""DeepSeek-V4 (`model_type: deepseek_v4`) configuration: a frozen dataclass read from config.json.

Every layer keeps a sliding window of raw (shared K=V) entries; `layer_types` adds a compressor:
  sliding_attention              window only ("main" RoPE)
  compressed_sparse_attention    + CSA: overlapping windows of `compress_rates[csa]` tokens, an
                                   indexer picking `index_topk` compressed entries ("compress" RoPE)
  heavily_compressed_attention   + HCA: non-overlapping windows of `compress_rates[hca]`, all read
`mlp_layer_types` picks each layer's router: `hash_moe` (frozen token-id -> experts table) or `moe`
(learned Top-K). The residual stream is `hc_mult` parallel streams (mHC hyper-connections).
RoPE "main" / "compress" differ in theta (and may use YaRN); both rotate the trailing
`rope_dim` channels with interleaved pairs.
`mtp_layer_type`: the attention type of the multi-token-prediction block's layer (the checkpoint's
`mtp.0.*`), layer `num_hidden_layers` of the original config's `compress_ratios` (or of a
`layer_types` one entry longer than the model); "sliding_attention" when neither says (the trailing 0
of the published DeepSeek-V4-Flash config).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.rope import RopeSpec, rope_dict
from hybrid_jax.models.config_common import MLPLayerPattern, common_fields

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config(MLPLayerPattern):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    sliding_window: int
    csa_rate: int
    hca_rate: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_main: RopeSpec
    rope_compress: RopeSpec
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"
    mtp_layer_type: str = "sliding_attention"

    def __post_init__(self):
        bad = sorted({t for t in self.layer_types + (self.mtp_layer_type,) if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad} in layer_types for deepseek_v4; known: {list(LAYER_TYPES)}")
        bad = sorted({t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES})
        if bad:
            raise ConfigError(f"unknown mlp_layer_types {bad} for deepseek_v4; known: {list(MLP_LAYER_TYPES)}")
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ConfigError(f"layer_types / mlp_layer_types need {n} entries; got {len(self.layer_types)} / "
                              f"{len(self.mlp_layer_types)}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported; known: {list(SCORING_FUNCS)}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "sliding_window", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive; got {getattr(self, name)}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups={self.o_groups} must divide num_attention_heads * head_dim = "
                              f"{self.num_attention_heads * self.head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts="
                              f"{self.n_routed_experts}")
        for label, r in (("main", self.rope_main), ("compress", self.rope_compress)):
            d = self.rope_dim(label)
            if d % 2 or not 0 <= d <= self.head_dim:
                raise ConfigError(f"rope '{label}' rotates {d} channels: must be even and <= head_dim={self.head_dim}")
        if "compressed_sparse_attention" in self.layer_types:
            if self.csa_rate <= 0 or self.index_topk <= 0 or self.index_n_heads <= 0:
                raise ConfigError(f"CSA needs positive compress rate, index_topk and index_n_heads; got "
                                  f"{self.csa_rate}, {self.index_topk}, {self.index_n_heads}")
            if self.rope_dim("compress") > self.index_head_dim:
                raise ConfigError(f"index_head_dim={self.index_head_dim} is smaller than the compress rope dim "
                                  f"{self.rope_dim('compress')}")
        if "heavily_compressed_attention" in self.layer_types and self.hca_rate <= 0:
            raise ConfigError(f"HCA needs a positive compress rate; got {self.hca_rate}")

    def rope_dim(self, label: str) -> int:
        r = self.rope_main if label == "main" else self.rope_compress
        return int(self.head_dim * r.partial_rotary_factor)

    def rate_of(self, layer_type: str) -> int:
        return {"compressed_sparse_attention": self.csa_rate, "heavily_compressed_attention": self.hca_rate}[layer_type]

    def head_counts(self) -> dict[str, int]:
        return {"num_attention_heads": self.num_attention_heads, "index_n_heads": self.index_n_heads,
                "o_groups": self.o_groups}

    @property
    def routed_experts(self) -> int:
        return self.n_routed_experts


ROPE_TYPES = ("default", "linear", "yarn")     # dynamic NTK would need per-row frequencies in the compressor


def _rope_spec(r: dict, d: dict, prf: float) -> RopeSpec:
    """One of V4's nested rope dicts -> RopeSpec (theta defaults to the top-level rope_theta, as in
    transformers). transformers reads YaRN's `truncate` from the top-level rope dict, which V4 nests:
    always truncated."""
    spec = RopeSpec.parse(r, family="deepseek_v4", theta=float(d.get("rope_theta", 10000.0)),
                          partial_rotary_factor=prf, types=ROPE_TYPES,
                          max_position_embeddings=int(d.get("max_position_embeddings", 1048576)))
    return dataclasses.replace(spec, truncate=True)


def deepseek_v4_config(d: dict[str, Any]) -> DeepseekV4Config:
    """config.json -> DeepseekV4Config (KeyError / ValueError / ConfigError on bad fields). Accepts the
    legacy keys transformers folds in (compress_ratios, compress_rate_csa/hca, num_hash_layers,
    qk_rope_head_dim, compress_rope_theta, rope_scaling)."""
    n = int(d["num_hidden_layers"])
    rates = dict(d.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    if d.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = d["compress_rate_csa"]
    if d.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = d["compress_rate_hca"]
    layer_types = d.get("layer_types")
    if layer_types is None and d.get("compress_ratios") is not None:
        unknown = sorted({r for r in d["compress_ratios"] if r not in _RATIO_TO_TYPE})
        if unknown:
            raise ConfigError(f"unknown compress_ratios {unknown} for deepseek_v4; known: {sorted(_RATIO_TO_TYPE)}")
        layer_types = [_RATIO_TO_TYPE[r] for r in d["compress_ratios"]]
    if layer_types is None:
        layer_types = (["heavily_compressed_attention"] * min(n, 2) +
                       ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                        for i in range(max(n - 2, 0))])
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"unknown layer type(s) {unknown} in layer_types for deepseek_v4; known: {list(LAYER_TYPES)}")
    ratios = d.get("compress_ratios") or ()          # the MTP layer's type (see above): entry n of either list
    mtp_type = (_RATIO_TO_TYPE.get(ratios[n], f"compress_ratios[{n}]={ratios[n]}") if len(ratios) > n
                else layer_types[n] if len(layer_types) > n else "sliding_attention")
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        k = int(d.get("num_hash_layers", 3) if d.get("num_hash_layers") is not None else 3)
        mlp = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    if d.get("mlp_bias"):
        raise ConfigError("mlp_bias=True is not supported for deepseek_v4")
    head_dim = int(d.get("head_dim", 512))
    prf = d.get("partial_rotary_factor")
    if prf is None:
        prf = int(d["qk_rope_head_dim"]) / head_dim if d.get("qk_rope_head_dim") is not None else 64 / 512
    prf = float(prf)
    rp = rope_dict(d)          # rope_parameters, or DeepSeek's legacy rope_scaling (its YaRN is the compress rope's)
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
    else:
        yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
        comp = {**yarn, "rope_theta": d.get("compress_rope_theta", 160000.0)}
        comp.setdefault("rope_type", "default")
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
    return DeepseekV4Config(
        model_type=d["model_type"], vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        num_hidden_layers=n, layer_types=tuple(layer_types[:n]), mlp_layer_types=tuple(mlp[:n]),
        num_attention_heads=int(d["num_attention_heads"]), head_dim=head_dim, q_lora_rank=int(d["q_lora_rank"]),
        sliding_window=int(d.get("sliding_window", 128)),
        csa_rate=int(rates.get("compressed_sparse_attention", 4)),
        hca_rate=int(rates.get("heavily_compressed_attention", 128)),
        o_groups=int(d.get("o_groups", 8)), o_lora_rank=int(d.get("o_lora_rank", 1024)),
        index_n_heads=int(d.get("index_n_heads", 64)), index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 512)),
        rope_main=_rope_spec(main, d, prf), rope_compress=_rope_spec(comp, d, prf),
        hc_mult=int(d.get("hc_mult", 4)), hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 2048)),
        n_routed_experts=int(d.get("n_routed_experts", d.get("num_local_experts", 256))),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 6)),
        scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)),
        max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
        mtp_layer_type=mtp_type, **common_fields(d))
