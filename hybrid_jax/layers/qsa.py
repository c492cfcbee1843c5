"""Qwen4-Exp's indexed attention: Qwen3.5's gated attention (layers.attention's projections, norms, RoPE
and output gate) over the tokens a QSA indexer selects for each query.

The indexer, for a query at position p (p + 1 visible tokens, blocks of C = indexer_compress_ratio from 0):
  qi = RoPE(norm_q(x Wq)) [Hi, Di];  raw key ki = x Wk [Di] (kept per position, cache.mla.IndexerKeyGroup)
  block j (complete when (j + 1) C <= p + 1): kb_j = RoPE_{jC}(norm_k(mean of ki over the block))
  score_j = sum_h relu(qi_h . kb_j) / sqrt(Di);  the Top-(budget / C) complete blocks are selected
  the query attends to the selected blocks' tokens and to the incomplete block's tokens (the tail).

Only the pages a row uses are read, never its page table's whole span (issue 54: at the release's 262,144-token
max_model_len a span-wide read asked for buffers sized by the table). The indexer walks the row's keys in blocks
of QSA_BLOCK_KEYS positions only as far as the step's furthest query (a loop with a run-time trip count, as the
dense MLA read of Kimi-Linear), folding each block's scores into a running Top-K (as the DSA indexer's XLA
path); the attention then gathers the (Top-K + 1) C selected positions' K / V rows through the page table
(`physical_rows`, as the DSA sparse read) and attends in query blocks of QSA_BLOCK_Q. The step's own entries
are read from the new arrays, not the pools, so a deferred write sees them too. XLA only (no kernel yet); a
ragged step runs this on its tiles (models.ragged.over_tiles).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from cache.mla import write_paged
from hybrid_jax.layers.attention import _gated_output, _qkv, whole_pool, write_kv
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.norms import rms_norm_zero_centered
from hybrid_jax.layers.rope import apply_rope
from hybrid_jax.parallel.context import per_device
from pallas_kernels.ragged_paged_attention.common import cdiv
from pallas_kernels.ragged_paged_attention.xla import gather_any
from pallas_kernels.sparse_attention.common import physical_rows

QSA_BLOCK_KEYS = 512    # key positions per iteration of the indexer's walk
QSA_BLOCK_Q = 16        # queries per step of the sparse read


@dataclasses.dataclass(frozen=True)
class RowSpan:
    """What each row of a step can read: positions < start [B] from the pools, start .. last [B] from the
    step's new entries (new[b, pos - start]); last = start - 1 for a row with no new token."""
    start: jax.Array
    last: jax.Array


def row_span(positions: jax.Array, valid: jax.Array) -> RowSpan:
    """The span of a step whose row b holds positions[b, 0] + t at t (models.common.token_positions)."""
    start = positions[:, 0]
    return RowSpan(start=start, last=start + jnp.sum(valid, axis=1, dtype=jnp.int32) - 1)


@dataclasses.dataclass(frozen=True)
class PagedSource:
    """One layer's entries: `pool` [L, P, ps, ...] (layer `layer` read in place) through page_table [B, NP],
    and the step's new entries new [B, T, ...] (not yet in the pool)."""
    pool: jax.Array
    layer: int
    page_table: jax.Array
    new: jax.Array

    def read(self, span: RowSpan, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Entries at logical positions pos [B, n] -> ([B, n, ...] in the pool's dtype, readable [B, n]);
        an unreadable position (negative, past the row's last, on a page outside the pool) reads 0."""
        ps, P = self.pool.shape[2], self.pool.shape[1]
        rows, old = physical_rows(pos, self.page_table, ps, P, span.start)
        got = gather_any(self.pool, (self.layer, rows // ps, rows % ps))
        T = self.new.shape[1]
        fresh = (pos >= span.start[:, None]) & (pos <= span.last[:, None])
        at = jnp.clip(pos - span.start[:, None], 0, T - 1)
        new = self.new.astype(self.pool.dtype)[jnp.arange(pos.shape[0])[:, None], at]
        ok = old | fresh
        mask = ok.reshape(ok.shape + (1,) * (got.ndim - 2))
        return jnp.where(mask, jnp.where(fresh.reshape(mask.shape), new, got), jnp.zeros((), got.dtype)), ok


def block_scores(p: dict, qi: jax.Array, keys: jax.Array, block_cos: jax.Array, block_sin: jax.Array, C: int,
                 eps: float) -> jax.Array:
    """qi [B, T, Hi, Di] (normed, rotated); keys [B, S, Di] raw (S a multiple of C); block_cos / sin
    [1, S / C, R] at each block's first position. Returns the blocks' scores [B, T, S / C] f32."""
    B, S, Di = keys.shape
    pooled = jnp.mean(keys.reshape(B, S // C, C, Di).astype(jnp.float32), axis=2).astype(keys.dtype)
    kb = apply_rope(rms_norm_zero_centered(pooled, p["k_norm"], eps)[:, :, None], block_cos, block_sin)[:, :, 0]
    s = jnp.einsum("bthd,bjd->btjh", qi.astype(jnp.float32), kb.astype(jnp.float32))
    return jnp.sum(jax.nn.relu(s), axis=-1) / math.sqrt(Di)


def select_blocks(p: dict, qi: jax.Array, keys: PagedSource, span: RowSpan, positions: jax.Array,
                  block_rope: Callable, *, C: int, block_topk: int, eps: float,
                  block_keys: int = QSA_BLOCK_KEYS) -> jax.Array:
    """The Top-block_topk complete blocks of each query [B, T, block_topk] int32 (best first, -1 where fewer
    are complete), walking the keys a block of about `block_keys` positions at a time, only as far as the
    step's furthest position. block_rope(starts [n]) -> RoPE cos, sin [1, n, R] at those positions."""
    B, T = positions.shape
    bs = max(1, block_keys // C) * C
    nbk = bs // C
    table_blocks = keys.page_table.shape[1] * keys.pool.shape[2] // C     # complete blocks the table can hold
    n = jnp.clip(cdiv(jnp.max(span.last) + 1, bs), 0, cdiv(table_blocks * C, bs))
    complete = (positions + 1) // C                                      # [B, T]

    def body(j, carry):
        vals, idx = carry
        pos = j * bs + jnp.arange(bs, dtype=jnp.int32)
        k, _ = keys.read(span, jnp.broadcast_to(pos, (B, bs)))
        blk = j * nbk + jnp.arange(nbk, dtype=jnp.int32)
        cos, sin = block_rope(blk * C)
        s = block_scores(p, qi, k, cos, sin, C, eps)                       # [B, T, nbk]
        s = jnp.where((blk[None, None] < complete[..., None]) & (blk < table_blocks), s, -jnp.inf)
        v, at = jax.lax.top_k(jnp.concatenate([vals, s], axis=-1), block_topk)
        cand = jnp.concatenate([idx, jnp.broadcast_to(blk, s.shape)], axis=-1)
        return v, jnp.take_along_axis(cand, at, axis=-1)

    init = (jnp.full((B, T, block_topk), -jnp.inf, jnp.float32), jnp.full((B, T, block_topk), -1, jnp.int32))
    vals, idx = jax.lax.fori_loop(0, n, body, init)
    return jnp.where(jnp.isfinite(vals), idx, -1)


def selected_positions(blocks: jax.Array, positions: jax.Array, valid: jax.Array, C: int) -> jax.Array:
    """The positions each query reads [B, T, (K + 1) C] (-1: none): the selected blocks' C tokens each,
    then the tail (the incomplete block's tokens up to the query's own)."""
    B, T, K = blocks.shape
    c = jnp.arange(C, dtype=jnp.int32)
    chosen = jnp.where(blocks[..., None] >= 0, blocks[..., None] * C + c, -1).reshape(B, T, K * C)
    tail = ((positions + 1) // C * C)[..., None] + c
    tail = jnp.where(tail <= positions[..., None], tail, -1)
    return jnp.where(valid[..., None], jnp.concatenate([chosen, tail], axis=-1), -1)


def _attend(q, k, v, ok):
    """q [B, t, Hq, D]; k, v [B, t, L, Hkv, D]; ok [B, t, L] -> [B, t, Hq, D] f32 (GQA, scaled by D^-0.5)."""
    B, t, Hq, D = q.shape
    Hkv = k.shape[3]
    qg = q.reshape(B, t, Hkv, Hq // Hkv, D).astype(jnp.float32)
    s = jnp.einsum("btgrd,btlgd->btgrl", qg, k.astype(jnp.float32)) / math.sqrt(D)
    s = jnp.where(ok[:, :, None, None, :], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    w = jnp.where(jnp.isfinite(s).any(axis=-1, keepdims=True), w, 0.0)
    return jnp.einsum("btgrl,btlgd->btgrd", w, v.astype(jnp.float32)).reshape(B, t, Hq, D)


def sparse_read(q: jax.Array, k: PagedSource, v: PagedSource, span: RowSpan, sel: jax.Array,
                block_q: int = QSA_BLOCK_Q) -> jax.Array:
    """Attention of q [B, T, Hq, D] over the K / V rows at positions sel [B, T, L] (-1: none) -> [B, T, Hq, D]
    f32, gathering only those rows, block_q queries at a time."""
    B, T, L = sel.shape

    def attend(qc, sc):
        t = sc.shape[1]
        kr, ok = k.read(span, sc.reshape(B, t * L))
        vr, _ = v.read(span, sc.reshape(B, t * L))
        shape = (B, t, L) + kr.shape[2:]
        return _attend(qc, kr.reshape(shape), vr.reshape(shape), ok.reshape(B, t, L))
    if T <= block_q:
        return attend(q, sel)
    nq = cdiv(T, block_q)
    pad = nq * block_q - T

    def split(x, fill):     # [B, T, ...] -> [nq, B, block_q, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape((B, nq, block_q) + x.shape[2:]), 1, 0)
    o = jax.lax.map(lambda a: attend(*a), (split(q, 0), split(sel, -1)))
    return jnp.moveaxis(o, 0, 1).reshape((B, nq * block_q) + o.shape[3:])[:, :T]


def indexed_attention(p: dict, x: jax.Array, cos, sin, block_rope: Callable, positions, valid, kv, ikeys, *,
                      layer: int, ilayer: int, num_heads: int, num_kv_heads: int, head_dim: int, index_heads: int,
                      index_dim: int, compress_ratio: int, block_topk: int, eps: float, defer_write: bool = False):
    """x [B, T, Hd] at positions / valid [B, T] (row b's new tokens at positions[b, 0] + t); kv: the KV group
    (k, v [L, P, ps, Hkv, D], page_table), ikeys: the indexer key group (keys [L, P2, ps2, Di]); layer / ilayer:
    this layer's slot in each; block_rope: as `select_blocks`'. p: the gated attention's weights
    (layers.attention) and indexer {qk [Hd, (Hi + 1) Di], q_norm, k_norm [Di]}.
    Returns (out [B, T, Hd], k pool, v pool, key pool) -- with defer_write the pools as they came and the
    new entries instead: (out, k [B, T, Hkv, D], v, raw keys [B, T, Di])."""
    B, T, _ = x.shape
    q, gate, k, v = _qkv(p, x, cos, sin, num_heads, num_kv_heads, head_dim, eps)
    ip = p["indexer"]
    qk = linear(x, ip["qk"]).reshape(B, T, index_heads + 1, index_dim)
    qi = apply_rope(rms_norm_zero_centered(qk[:, :, :index_heads], ip["q_norm"], eps), cos, sin)
    ki = qk[:, :, index_heads]
    if not defer_write:        # written first and read after: a pool read before its in-place write is copied whole
        kv = kv.replace(k=write_kv(kv.k, k, kv.page_table, positions, valid, layer),
                        v=write_kv(kv.v, v, kv.page_table, positions, valid, layer))
        ikeys = ikeys.replace(keys=whole_pool(write_paged(ikeys.keys, ki.astype(ikeys.keys.dtype), ikeys.page_table,
                                                          positions, valid, layer=ilayer)))
    span = row_span(positions, valid)

    # whole on every device, from whole inputs: at the release's shapes (4 indexer heads, 8 chips) the partitioner
    # split the key pool for the walk and resharded it every step (5.8 GiB a layer and decode step)
    def select(ip, qi, keys, table, ki, start, last, positions):
        return select_blocks(ip, qi, PagedSource(keys, ilayer, table, ki), RowSpan(start, last), positions,
                             block_rope, C=compress_ratio, block_topk=block_topk, eps=eps,
                             block_keys=QSA_BLOCK_KEYS)
    blocks = per_device(select, (None,) * 8, None)(ip, qi, ikeys.keys, ikeys.page_table, ki, span.start, span.last,
                                                  positions)
    sel = selected_positions(blocks, positions, valid, compress_ratio)
    o = sparse_read(q, PagedSource(kv.k, layer, kv.page_table, k), PagedSource(kv.v, layer, kv.page_table, v),
                    span, sel, block_q=QSA_BLOCK_Q)
    out = _gated_output(p, o.reshape(B, T, -1).astype(x.dtype), gate)
    if defer_write:
        return out, k, v, ki
    return out, kv.k, kv.v, ikeys.keys
