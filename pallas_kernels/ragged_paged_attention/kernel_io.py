"""What the Pallas kernels (TPU and GPU) share around the kernel itself: the tiles' metadata table, the queries
laid out per tile and kv head, and the way back to token-major rows. Plain XLA, [W]-sized work besides the
query / output copies.

Per tile (common.TilePlan), the kernels read one int32 row of META_FIELDS; tiles with keys to read come first
(in sequence order), so a kernel can prefetch the next tile's first block without searching for it, and
`num_active` says how many there are.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.common import Dims, TilePlan, plan_tiles, tile_classes

META_FIELDS = ("seq", "pos0", "kv_len", "blk_lo", "blk_hi")
SEQ, POS0, KV_LEN, BLK_LO, BLK_HI = range(len(META_FIELDS))
META_WIDTH = 8                                  # a row padded to 8 ints


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """One tile class, ready for a kernel.

    meta        [W, META_WIDTH] int32   the fields above, tiles with keys first
    num_active  [1] int32               tiles with at least one key block
    q           [W, Hkv, Mp, D]         the tile's queries per kv head: row t * Gq + i is the tile's row t,
                                        the kv head's query head i; rows >= tile * Gq (padding) are 0
    token_rows  [W, tile] int32         each tile row's q row (N: none)
    """
    meta: jax.Array
    num_active: jax.Array
    q: jax.Array
    token_rows: jax.Array
    tile: int


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def kernel_tiles(q, kv_lens, cu_q_lens, num_seqs, dims: Dims, *, decode_tile: int, prefill_tile: int, block: int,
                 sliding_window, rows_multiple, decode_only: bool = False) -> list[KernelTiles]:
    """The batch's tile classes (common.tile_classes) in kernel layout. rows_multiple(m) -> Mp: the padded
    query rows per kv head the kernel wants for m = tile * Gq real ones."""
    out = []
    for tile, longer_than, at_most in tile_classes(dims.num_tokens, decode_tile, prefill_tile, decode_only):
        plan = plan_tiles(kv_lens, cu_q_lens, num_seqs, dims, tile=tile, longer_than=longer_than, at_most=at_most,
                          block=block, sliding_window=sliding_window)
        if plan.size:
            out.append(_lay_out(q, plan, dims, rows_multiple(tile * dims.group)))
    return out


def _lay_out(q, plan: TilePlan, dims: Dims, Mp: int) -> KernelTiles:
    N, Hkv, Gq, D = dims.num_tokens, dims.num_kv_heads, dims.group, dims.head_dim
    active = plan.blk_hi > plan.blk_lo
    plan = plan.take(jnp.argsort(~active, stable=True))
    meta = jnp.stack([plan.seq, plan.pos0, plan.kv_len, plan.blk_lo, plan.blk_hi], axis=1)
    meta = jnp.pad(meta, ((0, 0), (0, META_WIDTH - meta.shape[1]))).astype(jnp.int32)
    rows = plan.token_rows(N)                                                    # [W, T]
    W, T = rows.shape
    qt = jnp.where((rows < N)[..., None, None], jnp.take(q, jnp.minimum(rows, N - 1), axis=0), 0)  # [W, T, Hq, D]
    qt = qt.reshape(W, T, Hkv, Gq, D).transpose(0, 2, 1, 3, 4).reshape(W, Hkv, T * Gq, D)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, Mp - T * Gq), (0, 0)))
    return KernelTiles(meta=meta, num_active=jnp.sum(active, dtype=jnp.int32).reshape(1), q=qt, token_rows=rows,
                       tile=T)


def token_major(outs: list[jax.Array], tiles: list[KernelTiles], dims: Dims, dtype) -> jax.Array:
    """Kernel outputs [W, Hkv, Mp, D] (one per tile class) -> o [N, Hq, D]: each q row takes its tile row, rows no
    tile holds get 0."""
    N, Hq, Hkv, Gq, D = dims.num_tokens, dims.num_q_heads, dims.num_kv_heads, dims.group, dims.head_dim
    flat, rows = [], []
    for o, t in zip(outs, tiles):
        W, T = t.token_rows.shape
        o = o[:, :, :T * Gq].reshape(W, Hkv, T, Gq, D).transpose(0, 2, 1, 3, 4).reshape(W * T, Hq, D)
        flat.append(o.astype(dtype))
        rows.append(t.token_rows.reshape(-1))
    flat.append(jnp.zeros((1, Hq, D), dtype))                                   # the row of zeros
    flat = jnp.concatenate(flat, axis=0)
    rows = jnp.concatenate(rows)
    src = jnp.full((N,), flat.shape[0] - 1, jnp.int32).at[rows].set(jnp.arange(rows.shape[0], dtype=jnp.int32),
                                                                    mode="drop")
    return flat[src]
