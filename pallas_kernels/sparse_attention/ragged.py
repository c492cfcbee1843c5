"""Ragged (flat, token-major) forms of the DSA ops, for steps that mix prefill chunks and decodes.

A ragged batch holds N query tokens back to back: sequence s owns rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1,
reads its keys through page_table[s] and holds kv_lengths[s] keys after the step. The batch is cut into tiles
that stay inside one sequence, with the tile planner of the ragged paged attention op
(`pallas_kernels.ragged_paged_attention.common.plan_tiles`): one tile of `max_q_len` rows per short sequence (a
decode, a speculative verify window), tiles of `prefill_tile` rows for the longer ones. Each group of tiles runs
the padded op (`ops.indexer_topk`, `ops.sparse_mla_attention`, any impl) as a [G, tile] batch whose rows carry
their sequence's page table, inside a loop whose trip count is the number of real tiles: a sequence's keys are
read once per tile (not once per query token), nothing is padded to the longest sequence, and the static
bound on tiles costs nothing when the batch has fewer.

`dense_mla_attention_ragged` runs the dense MLA (every causal key; Kimi-Linear) on the same tiles.

Shapes: N tokens, S sequences, H heads, K = topk; every op's result is token-major ([N, ...]), rows of
padding tokens are 0 / -1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.common import Dims, cdiv, plan_tiles, tile_classes
from pallas_kernels.sparse_attention import ops
from pallas_kernels.sparse_attention.common import physical_rows

PREFILL_TILE = 64      # query rows per tile of a long sequence
GROUP = 4              # tiles per call of the padded op


def _over_tiles(fn, outs, token_arrays, page_table, cu_seqlens, kv_lengths, *, page_size: int, max_q_len: int,
                prefill_tile: int, group: int):
    """Runs fn(tile_arrays, page_table [G, NP], kv_lengths [G], q_positions [G, tile]) -> tile outputs
    ([G, tile, ...] each) over the real tiles of both classes, in groups of `group`, and scatters them into
    `outs` (token-major arrays [N, ...]). token_arrays: token-major inputs gathered per tile."""
    N = token_arrays[0].shape[0]
    S, NP = page_table.shape
    dims = Dims(N, 1, 1, 1, page_size, 1, S, NP)         # only the sizes the planner reads
    num_seqs = jnp.full((1,), S, jnp.int32)
    for tile, longer_than, at_most in tile_classes(N, min(max_q_len, N), min(prefill_tile, N)):
        plan = plan_tiles(kv_lengths, cu_seqlens, num_seqs, dims, tile=tile, longer_than=longer_than,
                          at_most=at_most, block=1, sliding_window=None)
        W = plan.size
        G = max(1, min(group, W))
        pad = cdiv(W, G) * G - W
        rows = jnp.pad(plan.token_rows(N), ((0, pad), (0, 0)), constant_values=N)           # [W', tile]
        seq = jnp.pad(plan.seq, (0, pad))
        real = jnp.pad(plan.rows, (0, pad)) > 0
        kv_len = jnp.where(real, jnp.pad(plan.kv_len, (0, pad)), 0)
        pos = jnp.pad(plan.pos0, (0, pad))[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]
        q_pos = jnp.where(rows < N, pos, -1)                                                  # [W', tile]
        n_groups = cdiv(jnp.sum(real.astype(jnp.int32)), G)      # real tiles come first

        def body(i, outs, rows=rows, seq=seq, kv_len=kv_len, q_pos=q_pos, G=G):
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * G, G)    # noqa: E731
            r = sl(rows)
            safe = jnp.minimum(r, N - 1)
            got = fn([a[safe] for a in token_arrays], page_table[sl(seq)], sl(kv_len), sl(q_pos))
            return tuple(o.at[r].set(g.astype(o.dtype), mode="drop") for o, g in zip(outs, got))
        outs = jax.lax.fori_loop(0, n_groups, body, tuple(outs))
    return outs


def indexer_topk_ragged(
    q: jax.Array,              # [N, H, D]
    w: jax.Array,              # [N, H]
    k_pages: jax.Array,        # [P, ps, D] (or the layers' stack [L, P, ps, D] with `layer`)
    page_table: jax.Array,     # [S, NP] int32
    cu_seqlens: jax.Array,     # [S + 1] int32
    kv_lengths: jax.Array,     # [S] int32, this step's tokens included
    *,
    topk: int,
    k_scale: jax.Array | None = None,
    impl: str = "auto",
    layer: int | None = None,
    max_q_len: int = 1,
    prefill_tile: int = PREFILL_TILE,
    group: int = GROUP,
    head_axis: str | None = None,
) -> jax.Array:
    """`ops.indexer_topk` over a ragged batch -> indices [N, topk] int32 (-1 padded; padding tokens all -1).
    A token's position is kv_lengths[s] - (its sequence's step tokens) + its index in the step.
    head_axis: the heads are split over that mesh axis (see ops.indexer_topk)."""
    if q.ndim != 3 or w.shape != q.shape[:2]:
        raise ValueError(f"q must be [N, H, D] and w [N, H]; got {q.shape}, {w.shape}")
    out = jnp.full((q.shape[0], topk), -1, jnp.int32)

    def fn(t, pt, kl, qp):
        return (ops.indexer_topk(t[0], t[1], k_pages, pt, qp, kl, topk=topk, k_scale=k_scale, impl=impl,
                                 layer=layer, head_axis=head_axis),)
    return _over_tiles(fn, (out,), (q, w), page_table, cu_seqlens, kv_lengths, page_size=k_pages.shape[-2],
                       max_q_len=max_q_len, prefill_tile=prefill_tile, group=group)[0]


def sparse_mla_attention_ragged(
    q_lat: jax.Array,          # [N, H, R]
    q_rope: jax.Array,         # [N, H, Dr]
    latent: jax.Array,         # [P, ps, R] (or [L, P, ps, R] with `layer`)
    rope: jax.Array,           # [P, ps, Dr]
    page_table: jax.Array,     # [S, NP] int32
    cu_seqlens: jax.Array,     # [S + 1] int32
    indices: jax.Array,        # [N, K] int32 logical positions, -1 = padding
    kv_lengths: jax.Array,     # [S] int32
    *,
    scale: float,
    impl: str = "auto",
    layer: int | None = None,
    max_q_len: int = 1,
    prefill_tile: int = PREFILL_TILE,
    group: int = GROUP,
) -> jax.Array:
    """`ops.sparse_mla_attention` over a ragged batch -> o_lat [N, H, R] f32 (padding tokens 0)."""
    out = jnp.zeros(q_lat.shape, jnp.float32)

    def fn(t, pt, kl, qp):
        return (ops.sparse_mla_attention(t[0], t[1], latent, rope, pt, t[2], kl, scale=scale, impl=impl,
                                         layer=layer),)
    return _over_tiles(fn, (out,), (q_lat, q_rope, indices), page_table, cu_seqlens, kv_lengths,
                       page_size=latent.shape[-2], max_q_len=max_q_len, prefill_tile=prefill_tile, group=group)[0]


def dense_mla_attention_ragged(
    q_lat: jax.Array,          # [N, H, R]
    q_rope: jax.Array,         # [N, H, Dr]
    latent: jax.Array,         # [P, ps, R] (or [L, P, ps, R] with `layer`)
    rope: jax.Array,           # [P, ps, Dr]
    page_table: jax.Array,     # [S, NP] int32
    cu_seqlens: jax.Array,     # [S + 1] int32
    kv_lengths: jax.Array,     # [S] int32
    *,
    scale: float,
    layer: int | None = None,
    max_q_len: int = 1,
    prefill_tile: int = PREFILL_TILE,
    group: int = GROUP,
) -> jax.Array:
    """`ops.dense_mla_attention` over a ragged batch -> o_lat [N, H, R] f32 (padding tokens 0): each group
    of tiles reads its sequences' pages only as far as its furthest query."""
    out = jnp.zeros(q_lat.shape, jnp.float32)

    def fn(t, pt, kl, qp):
        return (ops.dense_mla_attention(t[0], t[1], latent, rope, pt, qp, kl, scale=scale, layer=layer),)
    return _over_tiles(fn, (out,), (q_lat, q_rope), page_table, cu_seqlens, kv_lengths,
                       page_size=latent.shape[-2], max_q_len=max_q_len, prefill_tile=prefill_tile, group=group)[0]


def sparse_hit_rate_ragged(indices: jax.Array, page_table: jax.Array, seq: jax.Array, valid: jax.Array,
                           page_resident: jax.Array, page_size: int, kv_lengths: jax.Array) -> jax.Array:
    """`ops.sparse_hit_rate` per sequence of a ragged batch: indices [N, K], seq, valid [N] -> [S] f32."""
    S = page_table.shape[0]
    P = page_resident.shape[0]
    rows, ok = physical_rows(indices[:, None], page_table[seq], page_size, P, kv_lengths[seq])     # [N, 1, K]
    ok = ok & valid[:, None, None]
    hit = ok & page_resident[rows // page_size]
    n = jax.ops.segment_sum(jnp.sum(ok, axis=(1, 2)), seq, num_segments=S)
    h = jax.ops.segment_sum(jnp.sum(hit, axis=(1, 2)), seq, num_segments=S)
    return jnp.where(n > 0, h / jnp.maximum(n, 1), 1.0).astype(jnp.float32)
