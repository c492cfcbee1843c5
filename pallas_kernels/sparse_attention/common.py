"""Shared pieces of the sparse-attention (DeepSeek DSA) ops: input checks, paged addressing, fp8 keys.

Layouts (one layer; the cache stacks layers on a leading axis and hands one slice to the op):
  page pools       latent [P, ps, R], rope [P, ps, Dr], index keys [P, ps, D]  (P pages of ps tokens)
  page_table       [B, NP] int32: row b's logical page i lives in physical page page_table[b, i]
  kv_lengths       [B] int32: row b holds tokens at logical positions 0 .. kv_lengths[b] - 1
  q_positions      [B, T] int32: the logical position of each query (-1: a padding query)
  indices          [B, T, K] int32 logical positions, -1 = padding (nothing selected in that slot)

Masking contract (documented and tested, the same in every implementation):
  * a key position j is *readable* by row b iff 0 <= j < kv_lengths[b] and its physical page
    page_table[b, j // ps] lies in [0, P). Anything else is never read: an index outside that
    range is treated as padding (-1), so a bad index can't reach another request's pages.
  * the indexer only selects readable keys with j <= q_position (causal).
Static mistakes (shapes, a Top-K larger than the table's capacity, a page table for another batch)
raise ValueError naming the problem.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0            # float8_e4m3fn's largest finite value
NEG_INF = float("-inf")


def check_page_table(page_table, batch: int, name: str = "page_table") -> tuple[int, int]:
    """page_table: [B, NP] int. Returns (B, NP)."""
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"{name} must be [B, NP] with B={batch} (one row per request); got {page_table.shape}")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array; got dtype {page_table.dtype}")
    return page_table.shape


def check_pool(pool, name: str, last: int | None = None):
    """pool: [P, ps, X]."""
    if pool.ndim != 3:
        raise ValueError(f"{name} must be a page pool [P, ps, X]; got shape {pool.shape}")
    if last is not None and pool.shape[2] != last:
        raise ValueError(f"{name} must have last dim {last}; got {pool.shape}")


def check_lengths(kv_lengths, batch: int):
    if kv_lengths.shape != (batch,):
        raise ValueError(f"kv_lengths must be [B] = ({batch},); got {kv_lengths.shape}")


def physical_rows(positions, page_table, page_size: int, num_pages: int, kv_lengths):
    """Logical positions [B, ...] -> (flat pool rows [B, ...], readable mask [B, ...]).

    Unreadable positions (negative, >= kv_lengths, or on a page outside the pool) get row 0 and
    readable = False: callers must mask them."""
    B = positions.shape[0]
    NP = page_table.shape[1]
    lens = kv_lengths.reshape((B,) + (1,) * (positions.ndim - 1))
    ok = (positions >= 0) & (positions < lens) & (positions < NP * page_size)
    pos = jnp.where(ok, positions, 0)
    flat_pt = page_table.reshape(B, NP)
    page = jnp.take_along_axis(flat_pt, (pos // page_size).reshape(B, -1), axis=1).reshape(pos.shape)
    ok = ok & (page >= 0) & (page < num_pages)
    row = jnp.where(ok, page * page_size + pos % page_size, 0)
    return row, ok


def gather_pages(pool, page_table):
    """pool [P, ps, X], page_table [B, NP] -> [B, NP * ps, X] (pages outside the pool read as page 0;
    callers mask by position)."""
    P, ps, X = pool.shape
    pt = jnp.clip(page_table, 0, P - 1)
    return pool[pt].reshape(page_table.shape[0], -1, X)


def page_valid(page_table, num_pages: int, page_size: int):
    """[B, NP] -> [B, NP * ps] bool: the slot lies on a page inside the pool."""
    ok = (page_table >= 0) & (page_table < num_pages)
    return jnp.repeat(ok, page_size, axis=1)


def quantize_fp8(k, axis: int = -1):
    """Per-token fp8 (e4m3) quantisation of indexer keys: k [..., D] -> (k8 [..., D] float8_e4m3fn,
    scale [...] f32) with k ~= k8 * scale. 132 B per token at D = 128 (vLLM's layout)."""
    k = k.astype(jnp.float32)
    amax = jnp.max(jnp.abs(k), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    k8 = (k / scale).astype(jnp.float8_e4m3fn)
    return k8, jnp.squeeze(scale, axis)


def ordered_int(x):
    """fp32 -> int32 whose signed order is the float order (-inf lowest, NaN not expected)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(i >= 0, i, i ^ jnp.int32(0x7FFFFFFF))


def indexer_weights(w, n_heads: int, head_dim: int):
    """DeepSeek's per-head weights with both scales folded in (relu(c x) = c relu(x) for c > 0):
    w [B, T, H] -> w * H^-0.5 * D^-0.5 in f32."""
    return w.astype(jnp.float32) * (n_heads ** -0.5) * (head_dim ** -0.5)
