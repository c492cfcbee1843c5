"""Ragged paged attention in plain XLA (the CPU default): tiles walked over their own key blocks only.

The batch is cut into tiles (common.plan_tiles): one decode tile per short sequence, prefill tiles of
`prefill_tile` rows for longer ones. Tiles are sorted by their number of key blocks and taken `group` at a
time; one `lax.while_loop` walks the (group, key block) units of the whole batch, a dynamic trip count of
sum over groups of (the group's longest key range / block), so work follows the context actually present,
never the table's capacity, and a new batch of lengths costs no retrace. Each unit gathers the group's pages
for one block of keys ([G, block, Hkv, D]), scores the group's queries against it and folds the block into an
online softmax (running max / sum / accumulator in fp32); a group's rows are written into the token-major
output when its last block is done. No [N, Hq, context] tensor exists: the largest is one unit's scores
[G, Hkv, tile, Hq / Hkv, block].

Formulation, measured on XLA:CPU: one batched matmul per kv head ([G, rows, D] x [G, block, D]) instead of one
5-D einsum over (group, kv head) runs the decode batch ~3x faster (XLA:CPU relayouts multi-batch-dim dots), and
gathering each head's slices straight from the pool instead of whole pages then slicing halves it again.
XLA:CPU has no 16-bit gather: a bf16 pool is gathered as uint16 (_gather_head), else the compiled step converts
the whole pool to f32 on every call. 16-bit gathers and converts still run elementwise: a bf16 batch costs about
1.5x its f32 time. Block sizes: XlaConfig. Side by side with today's padded dense attention:
benchmarks/ragged_paged_attention.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.common import (
    Dims,
    TilePlan,
    as_int32,
    cap_scores,
    cdiv,
    plan_tiles,
    softmax_fold,
    tile_classes,
    visible,
)

HP = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """block_tokens: keys per unit (rounded down to whole pages, at least one page); prefill_block_tokens: the
    same for prefill tiles (None: block_tokens).
    decode_tile: query rows of a decode tile when the caller gives no max_q_len.
    decode_group / prefill_group: tiles walked together (one unit scores G tiles against G page blocks).
    prefill_tile: query rows per prefill tile.

    Chosen on this machine's CPU (2 shared cores, 1 MiB L2; Hq 16, Hkv 2, D 256, f32, the benchmark's batches,
    medians of alternating runs): decode 32 x 1 query, groups of 1 / 2 / 4 / 8 tiles at 256 keys: 72 / 68 / 86 /
    145 ms (a unit's K and V past ~1 MiB fall out of L2), 128 keys no better; mixed (256-query chunk + 15
    decodes), prefill tiles of 32 / 64 / 128 / 256 rows: 321 / 296 / 316 / 316 ms, 512-key blocks 354 ms.
    Narrower heads take taller tiles and longer blocks: `tuned_config`."""
    block_tokens: int = 256
    decode_tile: int = 1
    decode_group: int = 2
    prefill_tile: int = 64
    prefill_group: int = 1
    prefill_block_tokens: int | None = None


def tuned_config(num_q_heads: int, num_kv_heads: int, head_dim: int) -> XlaConfig:
    """Block sizes for a head shape. A prefill unit of the defaults above scores 512 query rows per kv head
    (64-row tile x Hq / Hkv 8) against 256 keys of 256 dims; with narrow heads such a unit is so small that the
    loop's per-unit cost (gathers, the online-softmax fold, the conds) dominates, so the tile grows to about 512
    query rows per kv head and the block to about 32K key elements (tile 64..256, block 256..512 keys).
    Measured (512-query chunk, one sequence, f32, medians of 5; default -> tuned): Hq 2 / Hkv 1 / D 64 (the
    benchmarks' heads64 and proportional models) at 4,096 keys 28-32 -> 16-19 ms, at 512 keys 3.5-4.8 ->
    3.9 ms; Hq 4 / Hkv 2 / D 32 at 4,096 keys 37-39 -> 22-32 ms; Hq 16 / Hkv 2 / D 256 and Hq 8 / Hkv 1 /
    D 128 keep the defaults."""
    group = max(1, num_q_heads // max(1, num_kv_heads))
    tile = min(256, max(64, 512 // group))
    block = min(512, max(256, 32768 // max(1, head_dim)))
    base = XlaConfig()
    if (tile, block) == (base.prefill_tile, base.block_tokens):
        return base
    return dataclasses.replace(base, prefill_tile=tile, prefill_block_tokens=block)


def _bdot(a, b, ca: int, cb: int):
    """Batched (leading axis) matmul contracting a's axis ca with b's axis cb, fp32."""
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((0,), (0,))), precision=HP,
                               preferred_element_type=jnp.float32)


def gather_any(pool, index):
    """pool[index] for any dtype, in the pool's dtype. XLA:CPU has no bf16 / f16 gather: lowered for the CPU, a
    16-bit pool is gathered as uint16, else the compiled step converts the whole pool to f32 first (hoisted out
    of any loop, but once per call: work and memory growing with the pool, not with what is read). Lowered for
    an accelerator it is gathered as it is: there the bitcast is a copy of the whole pool (a TPU lays uint16 out
    apart from bf16), which cost Qwen4-Exp's sparse read 4 GiB per layer and decode step."""
    if jnp.dtype(pool.dtype).itemsize != 2:
        return pool[index]

    def as_uint16(pool):
        return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(pool, jnp.uint16)[index], pool.dtype)
    return jax.lax.platform_dependent(pool, cpu=as_uint16, default=lambda pool: pool[index])


def _gather_head(pool, pages, h):
    """pool [P, ps, Hkv, D], pages [G, bp] -> kv head h of those pages [G, bp, ps, D] in f32. Gathering one head's
    slices straight from the pool (not all heads, then slicing) halves the decode time; a 16-bit pool goes
    through `gather_any`."""
    return gather_any(pool, (pages, slice(None), h)).astype(jnp.float32)


def _walk(out, q, k_pages, v_pages, page_indices, plan: TilePlan, dims: Dims, *, group: int, sm_scale: float,
          sliding_window, soft_cap):
    """Attention for the tiles of `plan`, written into out [N, Hq, D] at their rows."""
    N, Hq, D = dims.num_tokens, dims.num_q_heads, dims.head_dim
    Hkv, Gq, ps, P = dims.num_kv_heads, dims.group, dims.page_size, dims.num_pages
    T, bk = plan.tile, plan.block
    M = T * Gq                                                            # query rows per kv head
    bp = bk // ps                                                         # pages per unit
    G = max(1, min(group, plan.size))
    ng = cdiv(plan.size, G)
    order = jnp.argsort(plan.blk_lo - plan.blk_hi, stable=True)          # longest key range first, empty last
    order = jnp.concatenate([order, jnp.full((ng * G - plan.size,), order[-1], order.dtype)])
    p = plan.take(order)
    empty = p.blk_hi <= p.blk_lo
    if ng * G > plan.size:                                                # padding tiles: nothing to read or write
        empty = empty | (jnp.arange(ng * G) >= plan.size)
    seq, pos0, kv_len = (x.reshape(ng, G) for x in (p.seq, p.pos0, p.kv_len))
    lo = jnp.where(empty, jnp.iinfo(jnp.int32).max, p.blk_lo).reshape(ng, G).min(axis=1)
    hi = jnp.where(empty, 0, p.blk_hi).reshape(ng, G).max(axis=1)
    units = jnp.maximum(hi - lo, 0)
    ends = jnp.cumsum(units)
    starts = ends - units
    rows = jnp.where(empty[:, None], N, p.token_rows(N)).reshape(ng, G, T)
    pt = jnp.pad(page_indices, ((0, 0), (0, cdiv(dims.pages_per_seq, bp) * bp - dims.pages_per_seq)))
    r = jnp.arange(T, dtype=jnp.int32)
    c = jnp.arange(bk, dtype=jnp.int32)

    def load_q(g):
        idx = rows[g]                                                     # [G, T]
        qg = jnp.take(q, jnp.minimum(idx, N - 1), axis=0).astype(jnp.float32) * sm_scale
        qg = jnp.where((idx < N)[..., None, None], qg, 0.0).reshape(G, T, Hkv, Gq, D)
        return qg.transpose(0, 2, 1, 3, 4).reshape(G, Hkv, M, D)         # row t * Gq + i: token t, head i

    def body(carry):
        u, qg, m, l, acc, out = carry
        g = jnp.searchsorted(ends, u, side="right").astype(jnp.int32)
        j = lo[g] + u - starts[g]
        first = u == starts[g]
        qg = jax.lax.cond(first, load_q, lambda _: qg, g)
        pages = jax.lax.dynamic_slice_in_dim(pt[seq[g]], j * bp, bp, axis=1)       # [G, bp]
        pages = jnp.clip(pages, 0, P - 1)
        k_pos = j * bk + c                                                 # [bk]
        readable = k_pos[None, :] < kv_len[g][:, None]                     # [G, bk]
        q_pos = pos0[g][:, None] + r[None, :]                              # [G, T]
        vis = visible(q_pos[:, :, None], k_pos[None, None, :], kv_len[g][:, None, None], dims.capacity,
                      sliding_window)                                      # [G, T, bk]
        vis = jnp.broadcast_to(vis[:, :, None, :], (G, T, Gq, bk)).reshape(G, M, bk)
        m_out, l_out, acc_out = [], [], []
        for h in range(Hkv):      # one batched matmul per kv head: XLA:CPU runs these ~3x faster than 5-D einsums
            k = _gather_head(k_pages, pages, h).reshape(G, bk, D)
            v = _gather_head(v_pages, pages, h).reshape(G, bk, D)
            v = jnp.where(readable[:, :, None], v, 0.0)                    # a slot past kv_len may hold NaN
            s = cap_scores(_bdot(qg[:, h], k, 2, 2), soft_cap)            # [G, M, bk]
            m_new, l_new, alpha, e = softmax_fold(jnp.where(first, -jnp.inf, m[h]), jnp.where(first, 0.0, l[h]),
                                                  jnp.where(vis, s, -jnp.inf))
            acc_out.append(alpha * jnp.where(first, 0.0, acc[h]) + _bdot(e, v, 2, 1))
            m_out.append(m_new)
            l_out.append(l_new)

        def write(out):
            o = jnp.stack([(a / jnp.where(t > 0, t, 1.0)).reshape(G, T, Gq, D) for a, t in zip(acc_out, l_out)],
                          axis=2).reshape(G, T, Hq, D)
            return out.at[rows[g]].set(o.astype(out.dtype), mode="drop")
        out = jax.lax.cond(u == ends[g] - 1, write, lambda o: o, out)
        return u + 1, qg, tuple(m_out), tuple(l_out), tuple(acc_out), out

    stat = jnp.zeros((G, M, 1), jnp.float32)
    init = (jnp.int32(0), jnp.zeros((G, Hkv, M, D), jnp.float32), (stat - jnp.inf,) * Hkv, (stat,) * Hkv,
            (jnp.zeros((G, M, D), jnp.float32),) * Hkv, out)
    return jax.lax.while_loop(lambda cr: cr[0] < ends[-1], body, init)[-1]


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_q_len", "config",
                                             "decode_only"))
def ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                               max_q_len: int | None = None, config: XlaConfig | None = None, decode_only: bool = False):
    """Shapes as ops.ragged_paged_attention -> o [N, Hq, D] in q.dtype. max_q_len: the decode tile's rows (a
    hint: longer sequences take the prefill tiles). config: None = tuned_config for the head shape."""
    N, Hq, D = q.shape
    P, ps, Hkv, _ = k_pages.shape
    config = tuned_config(Hq, Hkv, D) if config is None else config
    R, NP = page_indices.shape
    dims = Dims(N, Hq, D, P, ps, Hkv, R, NP)
    kv_lens, page_indices, cu_q_lens, ns = as_int32(kv_lens, page_indices, cu_q_lens, num_seqs)
    blocks = [max(1, min(b // ps, NP)) * ps
              for b in (config.block_tokens, config.prefill_block_tokens or config.block_tokens)]
    decode_tile = min(max_q_len or config.decode_tile, config.prefill_tile, N)
    out = jnp.zeros((N, Hq, D), q.dtype)
    for (tile, longer_than, at_most), group, bk in zip(tile_classes(N, decode_tile, min(config.prefill_tile, N), decode_only),
                                                       (config.decode_group, config.prefill_group), blocks):
        plan = plan_tiles(kv_lens, cu_q_lens, ns, dims, tile=tile, longer_than=longer_than, at_most=at_most,
                          block=bk, sliding_window=sliding_window)
        if plan.size:
            out = _walk(out, q, k_pages, v_pages, page_indices, plan, dims, group=group, sm_scale=sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap)
    return out
