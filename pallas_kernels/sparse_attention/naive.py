"""Token-level references of the sparse-attention ops: dense scores, `lax.top_k`, gather + softmax.

They materialise what the fast paths avoid ([B, T, H, S] indexer scores, every gathered latent) and
exist to be obviously right. Shapes and the masking contract: see common.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention.common import gather_pages, page_valid


def key_positions_allowed(q_positions, kv_lengths, page_table, num_pages: int, page_size: int):
    """[B, T, S] bool: key j is readable by the row and j <= the query's position."""
    S = page_table.shape[1] * page_size
    j = jnp.arange(S, dtype=jnp.int32)[None, None, :]
    ok = (j < kv_lengths[:, None, None]) & (j <= q_positions[:, :, None])
    return ok & page_valid(page_table, num_pages, page_size)[:, None, :]


def index_scores_reference(q, w, k_pages, page_table, q_positions, kv_lengths, k_scale=None, head_axis=None):
    """q [B, T, H, D], w [B, T, H] (scales folded in), k_pages [P, ps, D], k_scale [P, ps] or None
    -> scores [B, T, S] f32 with -inf where a key may not be selected (S = NP * ps). head_axis: the
    heads are split over that mesh axis (inside shard_map): the partial scores are summed over it."""
    P, ps, D = k_pages.shape
    keys = gather_pages(k_pages, page_table).astype(jnp.float32)                 # [B, S, D]
    if k_scale is not None:
        keys = keys * gather_pages(k_scale[..., None], page_table)                # [B, S, 1]
    s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys,
                   precision=jax.lax.Precision.HIGHEST)                           # [B, T, H, S]
    s = jnp.einsum("bths,bth->bts", jax.nn.relu(s), w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)                           # [B, T, S]
    if head_axis is not None:
        s = jax.lax.psum(s, head_axis)
    allowed = key_positions_allowed(q_positions, kv_lengths, page_table, P, ps)
    return jnp.where(allowed, s, -jnp.inf)


def indexer_topk_reference(q, w, k_pages, page_table, q_positions, kv_lengths, *, topk: int, k_scale=None,
                           head_axis=None):
    """-> indices [B, T, topk] int32 logical positions, best first, -1 where fewer keys qualify."""
    s = index_scores_reference(q, w, k_pages, page_table, q_positions, kv_lengths, k_scale, head_axis)
    vals, idx = jax.lax.top_k(s, topk)
    return jnp.where(jnp.isfinite(vals), idx, -1).astype(jnp.int32)


def sparse_mla_reference(q_lat, q_rope, latent, rope, page_table, indices, kv_lengths, *, scale: float):
    """Absorbed MLA over the selected positions.

    q_lat [B, T, H, R] (q_nope @ W_uk), q_rope [B, T, H, Dr], latent [P, ps, R], rope [P, ps, Dr],
    indices [B, T, K] -> o_lat [B, T, H, R] f32 (multiply by W_uv outside). A query with no readable
    index gets zeros."""
    from pallas_kernels.sparse_attention.common import physical_rows  # noqa: PLC0415
    P, ps, R = latent.shape
    rows, ok = physical_rows(indices, page_table, ps, P, kv_lengths)             # [B, T, K]
    lat = latent.reshape(P * ps, R)[rows].astype(jnp.float32)                    # [B, T, K, R]
    rp = rope.reshape(P * ps, -1)[rows].astype(jnp.float32)                      # [B, T, K, Dr]
    hp = jax.lax.Precision.HIGHEST
    s = (jnp.einsum("bthr,btkr->bthk", q_lat.astype(jnp.float32), lat, precision=hp)
         + jnp.einsum("bthr,btkr->bthk", q_rope.astype(jnp.float32), rp, precision=hp)) * scale
    s = jnp.where(ok[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bthk,btkr->bthr", e / jnp.where(l > 0, l, 1.0), lat, precision=hp)


def dense_mla_reference(q_lat, q_rope, latent, rope, page_table, q_positions, kv_lengths, *, scale: float):
    """Dense (every causal, readable position) absorbed MLA: the baseline sparse attention must equal
    when Top-K >= the context. Same shapes as sparse_mla_reference, q_positions [B, T]."""
    S = page_table.shape[1] * latent.shape[1]
    j = jnp.arange(S, dtype=jnp.int32)
    idx = jnp.where(j[None, None, :] <= q_positions[:, :, None], j[None, None, :], -1)
    return sparse_mla_reference(q_lat, q_rope, latent, rope, page_table, idx, kv_lengths, scale=scale)
