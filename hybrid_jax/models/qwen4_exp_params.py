"""Qwen4-Exp's parameters: a deterministic random init and the one-time re-layout of a checkpoint (text model
under `model.language_model.*` or `model.*`), reusing Qwen3-Next's converters for the Gated DeltaNet
(with Qwen3.5's split input projections), gated attention and sparse MoE tensors.

  embed [V, Hd]; lm_head [Hd, V] (absent when tied); mixer {norm [N*Hd], down [N*Hd, r], up [r, N*Hd]}
  layer: attn_hc, mlp_hc {norm, down, up, inject [N*Hd, N]} (layers.hyper_connections.gated_residual)
         gdn (linear_attention) | attn (indexed_attention: layers.attention's, plus indexer {qk [Hd, (Hi+1)*Di],
         q_norm, k_norm [Di]}); moe (layers.mlp.sparse_moe)
         ple (PLE layers): table [rows, E / heads] (the checkpoint's shards concatenated; stored k rows to a
         lane-dense row, layers.ple.pack_table), key [E, N*Hd],
         value [E, Hd], norm_key, norm_query, norm_conv [N*Hd], conv [K, N*Hd]
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from hybrid_jax.errors import CheckpointError
from hybrid_jax.layers.ple import ngram_hash, pack_table, packed_rows, rows_per_lane_row, table_rows
from hybrid_jax.models.qwen3_5 import _text_prefix, split_in_proj
from hybrid_jax.models.qwen3_next_params import PARAM_AXES as QWEN3_NEXT_AXES
from hybrid_jax.models.qwen3_next_params import convert_gated_attention, convert_gdn, convert_moe
from hybrid_jax.models.qwen3_next_params import init_params as qwen3_next_init
from hybrid_jax.models.qwen4_exp_config import Qwen4ExpConfig
from hybrid_jax.weights import checked_getter, concat, to_device, to_device_linear

log = logging.getLogger(__name__)


def _hc_shapes(cfg: Qwen4ExpConfig, inject: bool) -> dict:
    C = cfg.hc_count * cfg.hidden_size
    shapes = {"norm": (C,), "down": (C, cfg.hc_lowrank), "up": (cfg.hc_lowrank, C)}
    return dict(shapes, inject=(C, cfg.hc_count)) if inject else shapes


def _ple_shapes(cfg: Qwen4ExpConfig, rank: int) -> dict:
    C, E = cfg.hc_count * cfg.hidden_size, cfg.ple_embed_dim
    rows = table_rows(ngram_hash(cfg, rank), cfg.ngram_vocab_multiple)
    w = E // cfg.ngram_heads
    return {"table": (packed_rows(rows, w), rows_per_lane_row(w) * w), "key": (E, C), "value": (E, cfg.hidden_size), "norm_key": (C,),
            "norm_query": (C,), "norm_conv": (C,), "conv": (cfg.ple_conv_kernel_size, C)}


def init_params(cfg: Qwen4ExpConfig, seed: int = 0, dtype=jnp.float32, rng=None) -> dict:
    """Deterministic random parameters in the layout above (Qwen3-Next's init for the shared blocks)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    params = qwen3_next_init(cfg, seed, dtype, rng)
    params.pop("final_norm")

    def draw(shapes: dict) -> dict:
        return {k: jnp.zeros(s, dtype) if "norm" in k else jnp.asarray(rng.normal(0.0, 0.02, s), dtype)
                for k, s in shapes.items()}

    params["mixer"] = draw(_hc_shapes(cfg, False))
    rank = dict(zip(cfg.ple_layers, cfg.ple_ranks))
    for i, lp in enumerate(params["layers"]):
        del lp["input_norm"], lp["post_norm"]
        lp["attn_hc"], lp["mlp_hc"] = draw(_hc_shapes(cfg, True)), draw(_hc_shapes(cfg, True))
        if "attn" in lp:
            Hi, Di = cfg.indexer_n_heads, cfg.indexer_head_dim
            lp["attn"]["indexer"] = draw({"qk": (cfg.hidden_size, (Hi + 1) * Di), "q_norm": (Di,), "k_norm": (Di,)})
        if i in rank:
            lp["ple"] = draw(_ple_shapes(cfg, rank[i]))
    return params


def convert_hf_weights(cfg: Qwen4ExpConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                       dtype, progress: Callable[[], None] = lambda: None) -> dict:
    """Re-lays a Qwen4-Exp checkpoint into the layout above, once, at load. Raises CheckpointError naming a
    missing or misshapen tensor, or n-gram table sizes that disagree with the config's hash."""
    t = checked_getter(get, has, progress)
    prefix = _text_prefix(has)
    if prefix == "model.language_model." and has("model.visual.patch_embed.proj.weight"):
        log.info("Qwen4-Exp: loading the text model (model.language_model.*); the vision tower (model.visual.*) "
                 "is not loaded")
    Hd = cfg.hidden_size

    def dev(a):
        return to_device(a, dtype)

    def lin(a):
        return to_device_linear(a, dtype)

    params = {"embed": dev(t(prefix + "embed_tokens.weight", (cfg.vocab_size, Hd))),
              "mixer": _convert_hc(cfg, t, prefix + "hyper_connection_mixer.", False, dev, lin), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = dev(t("lm_head.weight", (cfg.vocab_size, Hd)).T)
    rank = dict(zip(cfg.ple_layers, cfg.ple_ranks))
    for i, kind in enumerate(cfg.layer_types):
        p = f"{prefix}layers.{i}."
        lp = {"attn_hc": _convert_hc(cfg, t, p + "attn_hyper_connection.", True, dev, lin),
              "mlp_hc": _convert_hc(cfg, t, p + "mlp_hyper_connection.", True, dev, lin),
              "moe": convert_moe(cfg, t, has, p + "mlp.", lin)}
        if kind == "linear_attention":
            lp["gdn"] = convert_gdn(cfg, t, p + "linear_attn.", dev, lin, split_in_proj)
        else:
            lp["attn"] = convert_gated_attention(cfg, t, p + "self_attn.", dev, lin)
            lp["attn"]["indexer"] = _convert_indexer(cfg, t, p + "self_attn.indexer.", dev, lin)
        if i in rank:
            lp["ple"] = _convert_ple(cfg, t, has, p + "ple.", rank[i], dev, lin)
        params["layers"].append(lp)
    return params


def _convert_hc(cfg: Qwen4ExpConfig, t, a: str, inject: bool, dev, lin) -> dict:
    s = _hc_shapes(cfg, inject)
    out = {"norm": dev(t(a + "hc_norm.weight", s["norm"])),
           "down": lin(t(a + "input_mix_weight_down.weight", s["down"][::-1]).T),
           "up": lin(t(a + "input_mix_weight_up.weight", s["up"][::-1]).T)}
    if inject:
        out["inject"] = lin(t(a + "block_inject_weight.weight", s["inject"][::-1]).T)
    return out


def _convert_indexer(cfg: Qwen4ExpConfig, t, a: str, dev, lin) -> dict:
    Hi, Di = cfg.indexer_n_heads, cfg.indexer_head_dim
    return {"qk": lin(t(a + "index_qk_proj.weight", ((Hi + 1) * Di, cfg.hidden_size)).T),
            "q_norm": dev(t(a + "q_layernorm.weight", (Di,))), "k_norm": dev(t(a + "k_layernorm.weight", (Di,)))}


def _convert_ple(cfg: Qwen4ExpConfig, t, has, a: str, rank: int, dev, lin) -> dict:
    s, h = _ple_shapes(cfg, rank), ngram_hash(cfg, rank)
    e = a + "ple_embedding."
    for name, want in (("ngram_heads_vocab_sizes", h.primes), ("ngram_heads_offsets", h.offsets)):
        if has(e + name) and tuple(int(v) for v in np.asarray(t(e + name))) != tuple(want):
            raise CheckpointError(f"{e + name} disagrees with the n-gram hash config.json describes "
                                  f"(ngram_vocab_size_base, heads_per_ngram, ple_layer_ids)")
    C = cfg.hc_count * cfg.hidden_size
    w = cfg.ple_embed_dim // cfg.ngram_heads
    table = _table(t, has, e + "ngram_embedding.", (table_rows(h, cfg.ngram_vocab_multiple), w))
    return {"table": dev(pack_table(table, w)),
            "key": lin(t(a + "key_proj.weight", (C, cfg.ple_embed_dim)).T),
            "value": lin(t(a + "value_proj.weight", (cfg.hidden_size, cfg.ple_embed_dim)).T),
            "norm_key": dev(t(a + "norm_key.weight", (C,))), "norm_query": dev(t(a + "norm_query.weight", (C,))),
            "norm_conv": dev(t(a + "norm_conv.weight", (C,))),
            "conv": dev(t(a + "conv1d.weight", (C, 1, cfg.ple_conv_kernel_size))[:, 0, :].T)}


def _table(t, has, a: str, shape: tuple[int, int]) -> np.ndarray:
    """The n-gram table, whole or as the checkpoint's shards (`shard_<i>.weight`, split along the rows)."""
    if has(a + "weight"):
        return t(a + "weight", shape)
    parts, i = [], 0
    while has(f"{a}shard_{i}.weight"):
        parts.append(t(f"{a}shard_{i}.weight"))
        i += 1
    if not parts:
        raise CheckpointError(f"checkpoint lacks tensor {a + 'weight'!r} (or its shards {a}shard_<i>.weight)")
    table = concat(parts, axis=0)
    if tuple(table.shape) != tuple(shape):
        raise CheckpointError(f"{a}shard_* concatenate to {tuple(table.shape)}, expected {tuple(shape)}")
    return table



# Logical axes of every parameter (hybrid_jax.parallel.rules), first match wins. The Gated DeltaNet, the
# gated attention and the MoE split as Qwen3-Next's (heads, KV heads, experts whole or by columns). The
# indexer's one projection (every index head and the one shared key) stays whole, as its single key head
# cannot be split. The PLE n-gram table is split by rows like a vocabulary-parallel embedding (each device
# gathers the ids that fall in its rows, the partial rows are summed): at the release's sizes it is ~95 GiB,
# the largest tensor after the experts. The hyper-connection weights, the PLE projections and norms act on
# every stream's whole width and stay whole (about 1 GiB in all at the release's sizes).
PARAM_AXES = {
    "*norm*": (None,),
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    **{k: v for k, v in QWEN3_NEXT_AXES.items() if k.startswith("*/gdn/")},     # the same mixer, split alike
    "*/attn/indexer/qk": ("embed", None),
    "*/attn/qg": ("embed", "heads"),
    "*/attn/kv": ("embed", "kv_heads"),
    "*/attn/o_proj": ("heads", "embed"),
    "*/moe/in_proj": ("embed", None),
    "*/moe/shared_down": ("mlp", "embed"),
    "*/moe/gate_up": ("experts", "embed", "expert_mlp"),
    "*/moe/down": ("experts", "expert_mlp", "embed"),
    "*/ple/table": ("vocab", None),
    "*/ple/*": (None, None),
    "*_hc/*": (None, None),
    "mixer/*": (None, None),
}
