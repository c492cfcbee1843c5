"""Blocked XLA paths of the sparse-attention ops (the CPU default).

indexer_topk_xla walks the paged keys in blocks of `block_keys`: per block it scores every query
against the block (a [B, T, H, block] tile, never [B, T, H, S]), sums the heads, and merges the
block into a running Top-K (`lax.top_k` over K + block candidates). It walks only as far as the
furthest key a query of the step can read (a loop with a run-time trip count): the work follows the
context the rows hold, never the page table's capacity (a release's max_model_len). sparse_mla_xla gathers only the
selected latent rows through the page table and attends in the absorbed form, in query blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.common import cdiv
from pallas_kernels.sparse_attention.common import physical_rows


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    block_keys: int = 512      # keys scored per step of the running Top-K (whole pages)
    block_q: int = 64          # queries per step of the sparse attention


def _scores_block(q, w, keys, pos, q_positions, kv_lengths, valid_page, head_axis):
    # q [B, T, H, D] f32; keys [B, bs, D] f32; pos [bs]; valid_page [B, bs]
    s = jnp.einsum("bthd,bsd->bths", q, keys, precision=jax.lax.Precision.HIGHEST)
    s = jnp.einsum("bths,bth->bts", jax.nn.relu(s), w, precision=jax.lax.Precision.HIGHEST)
    if head_axis is not None:                   # this device's heads: the other devices' added in
        s = jax.lax.psum(s, head_axis)
    ok = (pos[None, None, :] <= q_positions[:, :, None]) & (pos[None, None, :] < kv_lengths[:, None, None])
    return jnp.where(ok & valid_page[:, None, :], s, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("topk", "config", "head_axis", "layer"))
def indexer_topk_xla(q, w, k_pages, page_table, q_positions, kv_lengths, *, topk: int, k_scale=None,
                     config: XlaConfig = XlaConfig(), head_axis: str | None = None, layer: int | None = None):
    """q [B, T, H, D], w [B, T, H], k_pages [P, ps, D], k_scale [P, ps] | None, page_table [B, NP]
    -> indices [B, T, topk] int32 (best first, -1 padding). head_axis: inside shard_map with the heads
    split over that mesh axis, each key block's scores are summed over it before the block is merged.
    layer: k_pages [L, P, ps, D] (k_scale [L, P, ps]) are the layers' stacks, read in place (a slice of
    one layer would be a copy of its whole pool every step)."""
    P, ps, D = k_pages.shape[-3:]
    B, NP = page_table.shape
    T = q.shape[1]
    bp = max(1, min(NP, config.block_keys // ps))          # pages per block
    nb = -(-NP // bp)
    pt = jnp.pad(page_table, ((0, 0), (0, nb * bp - NP)), constant_values=-1).reshape(B, nb, bp)
    qf, wf = q.astype(jnp.float32), w.astype(jnp.float32)
    reach = jnp.minimum(q_positions + 1, kv_lengths[:, None])             # keys each query may read
    n = jnp.clip(cdiv(jnp.max(reach), bp * ps), 0, nb)                    # blocks up to the furthest one

    def step(i, carry):
        vals, idx = carry
        pages = pt[:, i]                                                  # [B, bp]
        okp = (pages >= 0) & (pages < P)
        safe = jnp.clip(pages, 0, P - 1)
        at = safe if layer is None else (layer, safe)
        keys = k_pages[at].astype(jnp.float32)                            # [B, bp, ps, D]
        if k_scale is not None:
            keys = keys * k_scale[at][..., None]
        keys = keys.reshape(B, bp * ps, D)
        pos = i * bp * ps + jnp.arange(bp * ps, dtype=jnp.int32)
        s = _scores_block(qf, wf, keys, pos, q_positions, kv_lengths, jnp.repeat(okp, ps, axis=1), head_axis)
        cand_v = jnp.concatenate([vals, s], axis=-1)
        cand_i = jnp.concatenate([idx, jnp.broadcast_to(pos, s.shape)], axis=-1)
        v, j = jax.lax.top_k(cand_v, topk)
        return v, jnp.take_along_axis(cand_i, j, axis=-1)

    init = (jnp.full((B, T, topk), -jnp.inf, jnp.float32), jnp.full((B, T, topk), -1, jnp.int32))
    vals, idx = jax.lax.fori_loop(0, n, step, init)
    return jnp.where(jnp.isfinite(vals), idx, -1).astype(jnp.int32)


def _attend(q_lat, q_rope, latent, rope, rows, ok, scale):
    # q_lat [B, t, H, R]; rows, ok [B, t, K] -> [B, t, H, R] f32
    P, ps, R = latent.shape
    lat = latent.reshape(P * ps, R)[rows].astype(jnp.float32)           # [B, t, K, R] (only the selected rows)
    rp = rope.reshape(P * ps, -1)[rows].astype(jnp.float32)             # [B, t, K, Dr]
    hp = jax.lax.Precision.HIGHEST
    s = (jnp.einsum("bthr,btkr->bthk", q_lat.astype(jnp.float32), lat, precision=hp)
         + jnp.einsum("bthr,btkr->bthk", q_rope.astype(jnp.float32), rp, precision=hp)) * scale
    s = jnp.where(ok[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bthk,btkr->bthr", e, lat, precision=hp)
    return o / jnp.where(l > 0, l, 1.0)


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def sparse_mla_xla(q_lat, q_rope, latent, rope, page_table, indices, kv_lengths, *, scale: float,
                   config: XlaConfig = XlaConfig()):
    """q_lat [B, T, H, R], q_rope [B, T, H, Dr], latent [P, ps, R], rope [P, ps, Dr], page_table [B, NP],
    indices [B, T, K], kv_lengths [B] -> o_lat [B, T, H, R] f32."""
    P, ps, _ = latent.shape
    B, T = indices.shape[:2]
    rows, ok = physical_rows(indices, page_table, ps, P, kv_lengths)     # [B, T, K]
    tq = config.block_q
    if T <= tq:
        return _attend(q_lat, q_rope, latent, rope, rows, ok, scale)
    n = -(-T // tq)
    pad = n * tq - T

    def split(x):   # [B, T, ...] -> [n, B, tq, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n, tq) + x.shape[2:]), 1, 0)

    o = jax.lax.map(lambda a: _attend(a[0], a[1], latent, rope, a[2], a[3], scale),
                    (split(q_lat), split(q_rope), split(rows), split(ok)))
    return jnp.moveaxis(o, 0, 1).reshape((B, n * tq) + o.shape[3:])[:, :T]
