"""A model as shapes: abstract parameters, abstract cache pools by object kind, and reduced layer stacks.

Nothing here allocates a weight or a cache page: parameters come from the family's `init_params` run
under `jax.eval_shape` with a stand-in random generator (`ShapeRng`: traced zeros instead of draws), the
pools from `cache.pools.build_pools` under `jax.eval_shape`, so an 80B- or 671B-parameter model costs
the memory of its shapes.

`--quantization fp8` keeps every linear weight of the layers (the ones a checkpoint's FP8 release
stores in FP8 and `LLM(quantization="fp8")` keeps in FP8) as an `Fp8Weight` with 128 x 128 block scales;
embeddings, norms, routers of DeepSeek models and the LM head stay in the run dtype. This is the layout
of the published FP8 releases up to the few tensors a release leaves unquantized.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from cache.pools import (
    build_pools,
)
from cache.state import ModelCache, leaf_nbytes
from hybrid_jax.layers.linear import Fp8Weight
from hybrid_jax.models import get_model


class ShapeRng:
    """Stands in for numpy's Generator in `init_params`: normal draws become zeros built by jnp (traced, so
    abstract under jax.eval_shape); the small host-side draws (Gated DeltaNet's A_log, V4's hash table)
    are cheap constants."""

    def normal(self, loc=0.0, scale=1.0, size=None):
        return jnp.zeros(size, jnp.float32)

    def uniform(self, low=0.0, high=1.0, size=None):
        return np.full(size, (low + high) / 2, np.float32)

    def permutation(self, n):
        return np.arange(n)


# Per family: the (module, weight) names of the linear weights an FP8 release stores in FP8.
FP8_LINEAR = {
    "qwen3_next": {("gdn", "qkvz"), ("gdn", "ba"), ("gdn", "out_proj"), ("attn", "qg"), ("attn", "kv"), ("attn", "o_proj"),
                   ("moe", "in_proj"),
                   ("moe", "shared_down"), ("moe", "gate_up"), ("moe", "down"), ("mlp", "gate_up"), ("mlp", "down")},
    "deepseek_v32": {("attn", n) for n in ("q_a", "q_b", "kv_a", "w_uk", "w_uv", "o_proj", "idx_q", "idx_k")}
    | {("moe", n) for n in ("gate_up", "down", "shared_gate_up", "shared_down")} | {("mlp", "gate_up"), ("mlp", "down")},
    "deepseek_v4": {("attn", n) for n in ("q_a", "q_b", "kv", "o_a", "o_b", "c_kv", "c_gate", "i_kv", "i_gate", "i_q")}
    | {("moe", n) for n in ("gate_up", "down", "shared_gate_up", "shared_down")},
}
FP8_BLOCK = (128, 128)


def family(model_type: str) -> str:
    """The parameter layout a model_type uses (Qwen3.5 has Qwen3-Next's, GLM-5 DeepSeek-V3.2's)."""
    if model_type == "glm_moe_dsa":
        return "deepseek_v32"
    return "qwen3_next" if model_type.startswith("qwen3_5") else model_type


def abstract_params(cfg, dtype, quantization: str | None = None):
    """The model's parameters in this project's layout as ShapeDtypeStructs (nothing allocated)."""
    model = get_model(cfg.model_type)
    params = jax.eval_shape(lambda: model.init_params(cfg, dtype=dtype, rng=ShapeRng()))
    if quantization is None:
        return params
    if quantization != "fp8":
        raise ValueError(f"quantization {quantization!r} is not supported by plan; known: fp8")
    names = FP8_LINEAR[family(cfg.model_type)]
    params["layers"] = [{mod: ({k: _fp8(v) if (mod, k) in names else v for k, v in sub.items()}
                               if isinstance(sub, dict) else sub) for mod, sub in lp.items()}
                        for lp in params["layers"]]
    return params


def _fp8(a) -> Fp8Weight:
    *lead, K, N = a.shape
    bk, bn = FP8_BLOCK
    return Fp8Weight(w=jax.ShapeDtypeStruct(a.shape, jnp.float8_e4m3fn),
                     scale=jax.ShapeDtypeStruct((*lead, math.ceil(K / bk), math.ceil(N / bn)), jnp.float32),
                     block=FP8_BLOCK)


def tree_nbytes(tree) -> int:
    """Bytes of every array leaf of a pytree (arrays or ShapeDtypeStructs)."""
    return sum(leaf_nbytes(x) for x in jax.tree_util.tree_leaves(tree))


# ---- cache --------------------------------------------------------------------------------------

def abstract_layout(cfg, dtype, max_model_len: int, page_size: int) -> ModelCache:
    """The model's cache for one row of max_model_len tokens, as shapes (what the engine sizes pools from)."""
    model = get_model(cfg.model_type)
    return jax.eval_shape(lambda: model.new_cache(cfg, 1, max_model_len, dtype, page_size=page_size))


def pool_pages(layout: ModelCache, max_num_seqs: int, max_model_len: int) -> dict[str, int]:
    """Pages of each paged group for max_num_seqs requests of max_model_len tokens (the engine's default
    budget, `engine.runner.default_budget`)."""
    return {n: max_num_seqs * -(-max_model_len // g.page_tokens) for n, g in layout.groups.items() if g.paged}


def abstract_pools(layout: ModelCache, rows: int, pages: dict[str, int]) -> ModelCache:
    """The engine's pools as shapes: `rows` request rows (null row included), `pages` per paged group."""
    return jax.eval_shape(lambda: build_pools(layout, rows, pages, {}))


# Row fields whose kind is not their group's: the Gated DeltaNet group holds two objects.
FIELD_KINDS = {("recurrent_state", "conv"): "conv_state"}
KIND_LABELS = {"full_kv": "full KV", "recurrent_state": "recurrent state", "conv_state": "conv state",
               "mla_latent": "MLA latent", "indexer_keys": "indexer keys", "compressed_kv": "compressed entries",
               "indexer_entries": "indexer entries", "swa_window": "SWA window", "uncompressed_tail": "tail",
               "csa_overlap": "CSA overlap", "row_metadata": "page tables, lengths"}


def field_kind(group, field: str) -> str:
    return FIELD_KINDS.get((group.kind, field), group.kind)


def bytes_by_kind(pools: ModelCache) -> dict[str, int]:
    """Bytes of a cache (arrays or shapes) by object kind; page tables and the per-row lengths and
    versions are 'row_metadata'. Sums to every byte of the pytree."""
    out: dict[str, int] = {}
    for g in pools.groups.values():
        fields = {**g.page_fields(), **g.row_fields()}
        for f in fields:
            k = field_kind(g, f)
            out[k] = out.get(k, 0) + leaf_nbytes(getattr(g, f))
    out["row_metadata"] = tree_nbytes(pools) - sum(out.values())
    return out


def request_bytes(layout: ModelCache, context: int) -> int:
    """Bytes one request of `context` tokens holds: its row of every slot group and the pages of every
    paged group its tokens fill (page tables and counters excluded: fixed per engine row)."""
    total = 0
    for g in layout.groups.values():
        total += g.row_nbytes()
        if g.paged:
            total += -(-context // g.page_tokens) * g.page_nbytes()
    return total


# ---- reduced layer stacks -------------------------------------------------------------------------

def layer_signature(cfg, i: int) -> tuple[str, str]:
    """What layer i computes: (mixer, feed-forward kind). Layers of equal signature cost the same."""
    return cfg.layer_types[i], cfg.ffn_kind(i)


def layer_counts(cfg) -> dict[tuple[str, str], int]:
    """Signature -> number of layers, in order of first appearance."""
    out: dict[tuple[str, str], int] = {}
    for i in range(cfg.num_hidden_layers):
        s = layer_signature(cfg, i)
        out[s] = out.get(s, 0) + 1
    return out


def select_layers(cfg, indices: list[int]):
    """The config of a model made of layers `indices` of cfg (in that order, repeats allowed), every other
    field unchanged: the layers keep their mixer and feed-forward kind."""
    return cfg.with_layers(indices)


def first_of_each(cfg) -> dict[tuple[str, str], int]:
    """Signature -> index of its first layer."""
    out: dict[tuple[str, str], int] = {}
    for i in range(cfg.num_hidden_layers):
        out.setdefault(layer_signature(cfg, i), i)
    return out
