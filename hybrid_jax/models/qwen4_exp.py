"""Qwen4-Exp (hybrid Gated DeltaNet + QSA-indexed gated attention, MoE, hyper-connections, PLE) as pure
functions, recombined from the project's pieces: Qwen3-Next's Gated DeltaNet mixer and step state
(`qwen3_next._linear_attention`, `HybridStep`), layers.qsa's indexed attention over the full-KV pages and
DeepSeek-V3.2's indexer-key pages (`cache.mla.IndexerKeyGroup`, here raw keys), the sparse MoE with a shared
expert (layers.mlp.sparse_moe), Qwen4-Exp's gated residual (layers.hyper_connections.gated_residual) and PLE
(layers.ple, its per-request state in cache.ple.PLEGroup).

The residual is N = hc_count streams [B, T, N, Hd] (the embedding copied into each). A layer:
  x += ple(x, tokens)                                   (PLE layers only)
  h, w = gated_residual(attn_hc, x);  x = x + w * mixer(h)     (per stream n: x_n + w_n mixer(h))
  h, w = gated_residual(mlp_hc, x);   x = x + w * moe(h)
and the LM head reads gated_residual(mixer, x) (no other final norm). Parameters: qwen4_exp_params.py.
Cache: "linear_attention" (RecurrentGroup), "ple" (PLEGroup, the PLE layers), "full_attention" (KVGroup) and
"indexer" (IndexerKeyGroup, raw QSA keys), the last two over the indexed layers.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from cache import ModelCache
from cache.mla import IndexerKeyGroup, contiguous_page_table
from cache.ple import PLEGroup, ple_group
from cache.state import DEFAULT_KV_PAGE_SIZE, KVGroup, recurrent_group
from hybrid_jax.layers.hyper_connections import gated_residual, hc_merge
from hybrid_jax.layers.mlp import sparse_moe
from hybrid_jax.layers.ple import ngram_hash, ple
from hybrid_jax.layers.qsa import indexed_attention
from hybrid_jax.layers.rope import rope_cos_sin
from hybrid_jax.models.common import finish_step, token_positions
from hybrid_jax.models.contract import LayerType, ModelFamily, StepOutput
from hybrid_jax.models.qwen3_next import HybridStep, _linear_attention
from hybrid_jax.models.ragged import RaggedBatch, over_tiles
from hybrid_jax.models.qwen4_exp_config import Qwen4ExpConfig
from hybrid_jax.models.qwen4_exp_params import PARAM_AXES, convert_hf_weights, init_params
from hybrid_jax.parallel.context import kv_replicas
from pallas_kernels import abi as kernel_abi


def new_cache(cfg: Qwen4ExpConfig, batch_size: int, capacity: int, dtype, page_size: int = DEFAULT_KV_PAGE_SIZE
              ) -> ModelCache:
    """An empty cache: the groups above, pages of min(page_size, capacity) tokens, contiguous per row (with r
    copies of each KV head under a layout that keeps them, `parallel.kv_replicas`)."""
    groups = {}
    lin, idx = cfg.layers_of("linear_attention"), cfg.layers_of("indexed_attention")
    if lin:
        groups["linear_attention"] = recurrent_group(
            lin, batch_size, cfg.linear_conv_kernel_dim, cfg.linear_conv_dim,
            (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), dtype)
    if cfg.ple_layers:
        groups["ple"] = ple_group(cfg.ple_layers, batch_size, cfg.ngram_size - 1, cfg.ple_conv_state_len,
                                  cfg.hc_count * cfg.hidden_size, dtype)
    if idx:
        ps = min(page_size, capacity)
        table = contiguous_page_table(batch_size, capacity, ps)
        hkv = cfg.num_key_value_heads * kv_replicas(cfg.num_key_value_heads)     # r copies under a layout
        shape = (len(idx), table.size, ps, hkv, cfg.head_dim)
        groups["full_attention"] = KVGroup(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), page_table=table,
                                           layer_ids=idx)
        groups["indexer"] = IndexerKeyGroup(keys=jnp.zeros((len(idx), table.size, ps, cfg.indexer_head_dim), dtype),
                                            scale=None, page_table=table, layer_ids=idx,
                                            writer_abi=kernel_abi.QSA_RAW_KEYS.id)
    return ModelCache(groups=groups, lengths=jnp.zeros((batch_size,), jnp.int32),
                      version=jnp.zeros((batch_size,), jnp.int32))


@dataclasses.dataclass
class Qwen4Step(HybridStep):
    """HybridStep plus what Qwen4-Exp's layers read: the tokens (PLE), the RoPE of QSA blocks' first
    positions (block_rope: starts [n] -> cos, sin [1, n, R]), the indexer keys and the PLE group (written in
    place layer by layer)."""
    tokens: jax.Array | None = None
    block_rope: Callable | None = None
    ikeys: jax.Array | None = None
    ple: PLEGroup | None = None
    i_new: list = dataclasses.field(default_factory=list)


def _indexed_attention(cfg: Qwen4ExpConfig, lp: dict, h: jax.Array, step: Qwen4Step, i: int) -> jax.Array:
    kv, ik = step.cache.groups["full_attention"], step.cache.groups["indexer"]
    out, k, v, ki = indexed_attention(
        lp["attn"], h, step.cos, step.sin, step.block_rope, step.positions, step.valid,
        kv.replace(k=step.k_all, v=step.v_all), ik.replace(keys=step.ikeys), layer=kv.layer_ids.index(i),
        ilayer=ik.layer_ids.index(i), num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, index_heads=cfg.indexer_n_heads, index_dim=cfg.indexer_head_dim,
        compress_ratio=cfg.indexer_compress_ratio, block_topk=cfg.qsa_block_topk, eps=cfg.rms_norm_eps,
        defer_write=step.defer_kv_write)
    if step.defer_kv_write:
        step.k_new.append(k)
        step.v_new.append(v)
        step.i_new.append(ki)
    else:
        step.k_all, step.v_all, step.ikeys = k, v, ki
    return out


# The family's layer types: the mixer each runs and the cache groups it keeps its objects in (a PLE layer is
# a linear_attention layer whose PLE state is in "ple").
LAYER_TYPES = {"linear_attention": LayerType(_linear_attention, ("linear_attention", "ple")),
               "indexed_attention": LayerType(_indexed_attention, ("full_attention", "indexer"))}


def _ple(cfg: Qwen4ExpConfig, lp: dict, x: jax.Array, step: Qwen4Step, i: int) -> jax.Array:
    g = step.ple
    s = g.layer_ids.index(i)
    add, ctx, conv = ple(lp["ple"], ngram_hash(cfg, cfg.ple_ranks[cfg.ple_layers.index(i)]), x, step.tokens,
                         step.n_new, step.positions, g.ctx[s], g.conv[s], eps=cfg.rms_norm_eps)
    step.ple = g.with_layer_state(s, ctx, conv)
    return x + add


def _layers(cfg: Qwen4ExpConfig, params: dict, x: jax.Array, step: Qwen4Step, return_hidden: bool):
    cache, eps = step.cache, cfg.rms_norm_eps
    kv = cache.groups.get("full_attention")
    if kv is not None:
        step.k_all, step.v_all, step.ikeys = kv.k, kv.v, cache.groups["indexer"].keys
    step.rec, step.ple = cache.groups.get("linear_attention"), cache.groups.get("ple")
    hidden = [x] if return_hidden else None
    for i, lp in enumerate(params["layers"]):
        if "ple" in lp:
            x = _ple(cfg, lp, x, step, i)
        h, w = gated_residual(lp["attn_hc"], x, eps=eps)
        x = hc_merge(w, None, LAYER_TYPES[cfg.layer_types[i]].mixer(cfg, lp, h, step, i), x)
        h, w = gated_residual(lp["mlp_hc"], x, eps=eps)
        moe = sparse_moe(lp["moe"], h, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                         norm_topk_prob=cfg.norm_topk_prob)
        x = hc_merge(w, None, moe, x)
        if return_hidden:
            hidden.append(x)
    groups = dict(cache.groups)
    if step.rec is not None:
        groups["linear_attention"] = step.rec
    if step.ple is not None:
        groups["ple"] = step.ple
    if kv is not None:
        groups["full_attention"] = kv.replace(k=step.k_all, v=step.v_all)
        groups["indexer"] = groups["indexer"].replace(keys=step.ikeys)
    return x, groups, hidden


def forward(cfg: Qwen4ExpConfig, params: dict, cache: ModelCache, tokens: jax.Array, n_new: jax.Array, *,
            logits_at: str = "last", impl: str = "auto", return_hidden: bool = False,
            fused_recurrent: bool = False, per_token_states: bool = False, defer_kv_write: bool = False,
            return_final_hidden: bool = False) -> StepOutput:
    """tokens [B, T] int32 (right-padded), n_new [B]. Same contract as qwen3_next.forward (`hidden` and
    `final_hidden` are the streams [.., N, Hd]); defer_kv_write leaves the KV and indexer-key pages unwritten
    and returns {"k", "v": [L, B, T, Hkv, D], "keys": [L, B, T, Di]} for `write_deferred_kv`."""
    B, T = tokens.shape
    positions, valid = token_positions(cache, T, n_new)
    seq_len = cache.lengths + n_new
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope, seq_len=seq_len)
    step = Qwen4Step(cache, positions, valid, n_new, impl, cos=cos, sin=sin, fused_recurrent=fused_recurrent,
                     per_token_states=per_token_states, defer_kv_write=defer_kv_write, tokens=tokens)
    step.block_rope = functools.partial(_block_rope, cfg, jnp.max(seq_len)[None])
    x = jnp.broadcast_to(params["embed"][tokens][:, :, None, :], (B, T, cfg.hc_count, cfg.hidden_size))
    x, groups, hidden = _layers(cfg, params, x, step, return_hidden)
    flat = x.reshape(B, T, -1)
    out = finish_step(cfg, params, cache, groups, flat, n_new, final_norm=final_norm, logits_at=logits_at,
                      hidden=hidden, final_hidden=x if return_final_hidden else None,
                      per_token=step.per_token if per_token_states else None)
    if defer_kv_write:
        out = out.replace(deferred={"k": jnp.stack(step.k_new), "v": jnp.stack(step.v_new),
                                    "keys": jnp.stack(step.i_new)} if step.k_new else {})
    return out


def _block_rope(cfg: Qwen4ExpConfig, seq_len: jax.Array, starts: jax.Array):
    """RoPE cos, sin [1, n, R] at the QSA blocks' first positions starts [n] (the step's longest row's
    seq_len [1] for a dynamic scaling)."""
    return rope_cos_sin(starts[None], cfg.rotary_dim, cfg.rope, seq_len=seq_len)


# Tokens per tile of a long sequence in a ragged step (`over_tiles`): its tiles run one after another.
RAGGED_TILE = 128


def forward_ragged(cfg: Qwen4ExpConfig, params: dict, cache: ModelCache, batch: RaggedBatch, *, impl: str = "auto",
                   return_final_hidden: bool = False) -> StepOutput:
    """One step over a ragged batch (hybrid_jax.models.ragged): the padded `forward` run on the batch's tiles
    as rows (`over_tiles`: the decode tokens in one call, a longer sequence in tiles of RAGGED_TILE tokens, in
    order), each tile on the row state (recurrent, PLE, page tables) its sequence's previous tile left, the KV
    and indexer-key pools written in place. Returns logits [S, V] at each sequence's last token;
    return_final_hidden: `final_hidden` [N, hc_count, Hd]."""
    N, C = batch.tokens.shape[0], cfg.hc_count * cfg.hidden_size

    def tile_step(x, positions, valid, lengths, n_new, rows_t, pools):
        out = forward(cfg, params, _joined(cache, rows_t, pools, lengths), x["tokens"], n_new, impl=impl,
                      return_final_hidden=True)
        return {"tokens": x["tokens"], "hidden": out.final_hidden.reshape(x["hidden"].shape)}, *_split(out.cache)

    x = {"tokens": batch.tokens, "hidden": jnp.zeros((N, C), params["embed"].dtype)}
    out, rows, pools = over_tiles(tile_step, x, *_split(cache), batch, cache.lengths, prefill_tile=RAGGED_TILE)
    groups = _joined(cache, rows, pools, cache.lengths).groups
    flat = out["hidden"]
    res = finish_step(cfg, params, cache, groups, flat[batch.last_index()][:, None], batch.n_new,
                      final_norm=final_norm, logits_at="all")
    return res.replace(logits=res.logits[:, 0],
                       final_hidden=flat.reshape(N, cfg.hc_count, cfg.hidden_size) if return_final_hidden else None)


def _split(cache: ModelCache) -> tuple[dict, dict]:
    """A cache as `over_tiles` carries it: the per-row parts with the row axis first (states, page tables),
    and the pools."""
    rows, pools, g = {}, {}, cache.groups
    for name in ("linear_attention", "ple"):
        if name in g:
            if g[name].view_rows is not None:
                raise ValueError("a ragged step takes its recurrent rows gathered, not as an in-place view")
            rows[name] = {f: getattr(g[name], f).swapaxes(0, 1) for f in g[name].ROW_FIELDS}
    if "full_attention" in g:
        rows["tables"] = {"full_attention": g["full_attention"].page_table, "indexer": g["indexer"].page_table}
        pools.update(k=g["full_attention"].k, v=g["full_attention"].v, keys=g["indexer"].keys)
    return rows, pools


def _joined(cache: ModelCache, rows: dict, pools: dict, lengths: jax.Array) -> ModelCache:
    """`_split`'s parts (of the rows `lengths` [R] describes) as a cache with `cache`'s groups."""
    groups = dict(cache.groups)
    for name in ("linear_attention", "ple"):
        if name in rows:
            groups[name] = groups[name].replace(**{f: a.swapaxes(0, 1) for f, a in rows[name].items()})
    if "tables" in rows:
        t = rows["tables"]
        groups["full_attention"] = groups["full_attention"].replace(k=pools["k"], v=pools["v"],
                                                                    page_table=t["full_attention"])
        groups["indexer"] = groups["indexer"].replace(keys=pools["keys"], page_table=t["indexer"])
    return ModelCache(groups=groups, lengths=lengths, version=jnp.zeros_like(lengths))


def final_norm(cfg: Qwen4ExpConfig, params: dict, x: jax.Array) -> jax.Array:
    """The final hyper-connection mixer: streams [..., N * Hd] (or [..., N, Hd]) -> [..., Hd]."""
    streams = x.reshape(x.shape[:-1] + (cfg.hc_count, cfg.hidden_size)) if x.shape[-1] != cfg.hidden_size else x
    return gated_residual(params["mixer"], streams, eps=cfg.rms_norm_eps)[0]


FAMILY = ModelFamily(
    name="qwen4_exp", forward=forward, forward_ragged=forward_ragged, new_cache=new_cache, init_params=init_params,
    convert_hf_weights=convert_hf_weights, final_norm=final_norm, layer_types=LAYER_TYPES,
    param_axes=PARAM_AXES, row_tables=("layers/*/ple/table",))
