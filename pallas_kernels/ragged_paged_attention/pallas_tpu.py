"""Pallas ragged paged attention for TPU (Mosaic): page DMAs from HBM, double-buffered, online softmax in VMEM.

The batch arrives as tiles (kernel_io): `tile` query rows of one sequence, laid out per kv head as [Hkv, Mp, D]
(row t * Gq + i: the tile's row t, the head group's query head i), with the range of key blocks its rows can
see. One grid step per tile (grid (W,), sequential: "arbitrary", as the prefetch crosses steps; on a megacore
chip (v4, v5p) the kernel runs on one of its two cores):

  * The tiles' metadata, the flattened page table and the number of tiles with keys sit in SMEM (scalar
    prefetch). The K and V pools stay in HBM (memory_space ANY), viewed as [P, ps, Hkv * D]: a page is one
    contiguous DMA carrying every kv head, and a head's keys are a lane slice of it.
  * A key block is num_kv_pages_per_block pages. The step walks its tile's blocks with a dynamic fori_loop;
    while block j is scored, block j + 1's pages (or, at the tile's last block, the next tile's first block) are
    already being copied into the other half of a [2, pages, ps, Hkv * D] VMEM buffer, so across the whole grid
    one block's DMA overlaps the previous block's compute. The buffer half in use carries over from step to
    step in an SMEM scalar.
  * Only pages holding the sequence's keys are copied (page * ps < kv_len); a page id is clamped into the pool,
    so a bad table entry cannot fault. Slots past kv_len (an unused page's stale VMEM, a page's unwritten tail)
    are masked out of the scores and zeroed in V, so not even a NaN there reaches the output.
  * Per kv head: scores [Mp, block] = q . k^T on the MXU (bf16 in, f32 out; f32 inputs at HIGHEST precision),
    soft cap, the causal / window / length mask, and the running max, sum (lane-replicated [Mp, 128]) and
    accumulator [Mp, D] in f32 VMEM scratch. The tile's output block is written once, after its last block.

Tiles: short sequences (q_len <= the decode tile) one decode tile each, longer ones cut into prefill tiles;
each class is its own pallas_call with its own rows per tile (tuned_block_sizes). The kernel needs the head dim a
multiple of 128 (a head is a lane-aligned slice of a page) and the page size a multiple of the dtype's sublane
tile (8 rows of f32, 16 of bf16), so pages stack into a key block without a relayout.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import abi, tuning
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.gated_delta_rule.pallas_recurrent import compiler_params
from pallas_kernels.kernel_params import cost
from pallas_kernels.ragged_paged_attention import kernel_io
from pallas_kernels.ragged_paged_attention.common import Dims, as_int32, cap_scores, softmax_fold, visible
from pallas_kernels.ragged_paged_attention.kernel_io import BLK_HI, BLK_LO, KV_LEN, META_WIDTH, POS0, SEQ
from pallas_kernels.ragged_paged_attention.tuned_block_sizes import BlockSizes, tuned_block_sizes

ABI = abi.RAGGED_PAGED_ATTENTION
LANES = 128


def sublanes(dtype) -> int:
    """Rows of one (sublane, lane) tile for the dtype: 8 for 32-bit, 16 for 16-bit."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def check_tpu_layout(dims: Dims, q_dtype, kv_dtype):
    """The shapes the Mosaic kernel can lay out; KernelUnsupported (a ValueError) otherwise (interpret mode
    takes any)."""
    if dims.head_dim % LANES:
        raise KernelUnsupported(f"the TPU ragged paged attention kernel needs the head dim a multiple of {LANES} (a head "
                                f"is a lane slice of a page); got {dims.head_dim}")
    tile = max(sublanes(q_dtype), sublanes(kv_dtype))
    if dims.page_size % tile:
        raise KernelUnsupported(f"the TPU ragged paged attention kernel needs the page size a multiple of {tile} for "
                                f"{jnp.dtype(kv_dtype).name} pages; got {dims.page_size}")


def _kernel(meta_ref, pages_ref, active_ref,          # SMEM: [W * 8], [R * NP], [1] int32
            q_ref,                                    # [Hkv, Mp, D]      this tile's queries
            k_hbm, v_hbm,                             # [P, ps, Hkv * D]  pools, in HBM
            o_ref,                                    # [Hkv, Mp, D]
            k_buf, v_buf,                             # [2, bp, ps, Hkv * D] VMEM
            sems,                                     # DMA semaphores [2, 2]: (buffer half, K / V)
            half_ref,                                 # SMEM [1]: the half holding the next block
            m_sc, l_sc, acc_sc,                       # [Hkv, Mp, 128], [Hkv, Mp, 128], [Hkv, Mp, D] f32
            *, P, NP, ps, bp, Gq, D, sm_scale, sliding_window, soft_cap):
    w = pl.program_id(0)
    n_active = active_ref[0]
    Hkv, Mp, _ = q_ref.shape
    bk = bp * ps

    def field(t, f):
        return meta_ref[t * META_WIDTH + f]

    def copies(t, j, half):
        """(copy it?, descriptor) for every page of tile t's key block j, K and V, into buffer half `half`."""
        seq, kv_len = field(t, SEQ), field(t, KV_LEN)
        out = []
        for i in range(bp):
            p = j * bp + i
            page = jnp.clip(pages_ref[seq * NP + jnp.minimum(p, NP - 1)], 0, P - 1)
            used = p * ps < kv_len
            for kind, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                out.append((used, pltpu.make_async_copy(hbm.at[page], buf.at[half, i], sems.at[half, kind])))
        return out

    def start(t, j, half):
        for used, cp in copies(t, j, half):
            pl.when(used)(cp.start)

    def wait(t, j, half):
        for used, cp in copies(t, j, half):
            pl.when(used)(cp.wait)

    @pl.when((w == 0) & (n_active > 0))
    def _():
        half_ref[0] = 0
        start(0, field(0, BLK_LO), 0)

    @pl.when(w < n_active)
    def _():
        pos0, kv_len = field(w, POS0), field(w, KV_LEN)
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        q_pos = pos0 + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (Mp, bk), 0), jnp.int32(Gq))  # (no sign op)
        col = jax.lax.broadcasted_iota(jnp.int32, (Mp, bk), 1)
        v_row = jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        hi = field(w, BLK_HI)

        def block(j, half):
            nxt = 1 - half

            @pl.when(j + 1 < hi)
            def _():
                start(w, j + 1, nxt)

            @pl.when((j + 1 == hi) & (w + 1 < n_active))
            def _():
                start(w + 1, field(w + 1, BLK_LO), nxt)

            wait(w, j, half)
            vis = visible(q_pos, j * bk + col, kv_len, NP * ps, sliding_window)
            v_ok = j * bk + v_row < kv_len
            for h in range(Hkv):
                k = k_buf[half, :, :, pl.ds(h * D, D)].reshape(bk, D)
                v = v_buf[half, :, :, pl.ds(h * D, D)].reshape(bk, D)
                q = q_ref[h]
                prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
                s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=prec,
                                        preferred_element_type=jnp.float32) * sm_scale      # [Mp, bk]
                s = jnp.where(vis, cap_scores(s, soft_cap), -jnp.inf)
                m_new, l_new, alpha, e = softmax_fold(m_sc[h][:, :1], l_sc[h][:, :1], s)
                v = jnp.where(v_ok, v, jnp.zeros_like(v))
                pv = jax.lax.dot_general(e.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                                         preferred_element_type=jnp.float32)                # [Mp, D]
                acc_sc[h] = alpha * acc_sc[h] + pv
                m_sc[h] = jnp.broadcast_to(m_new, (Mp, LANES))
                l_sc[h] = jnp.broadcast_to(l_new, (Mp, LANES))
            return nxt

        half_ref[0] = jax.lax.fori_loop(field(w, BLK_LO), hi, block, half_ref[0])
        for h in range(Hkv):
            l = l_sc[h][:, :1]
            o_ref[h] = (acc_sc[h] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)

    @pl.when(w >= n_active)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _call(tiles: kernel_io.KernelTiles, k_flat, v_flat, page_indices, dims: Dims, bp: int, *, sm_scale,
          sliding_window, soft_cap, interpret):
    W, Hkv, Mp, D = tiles.q.shape
    ps, P = dims.page_size, dims.num_pages
    kernel = functools.partial(_kernel, P=P, NP=dims.pages_per_seq, ps=ps, bp=bp, Gq=dims.group, D=D,
                               sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    block = pl.BlockSpec((None, Hkv, Mp, D), lambda w, *_: (w, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(W,), in_specs=[block, any_spec, any_spec], out_specs=block,
        scratch_shapes=[pltpu.VMEM((2, bp, ps, Hkv * D), k_flat.dtype), pltpu.VMEM((2, bp, ps, Hkv * D), v_flat.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)), pltpu.SMEM((1,), jnp.int32),
                        pltpu.VMEM((Hkv, Mp, LANES), jnp.float32), pltpu.VMEM((Hkv, Mp, LANES), jnp.float32),
                        pltpu.VMEM((Hkv, Mp, D), jnp.float32)])
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(tiles.q.shape, tiles.q.dtype),
        compiler_params=compiler_params("tpu", ("arbitrary",)), interpret=interpret,
        name="ragged_paged_attention", cost_estimate=_cost(tiles, k_flat, page_indices, dims),
    )(tiles.meta.reshape(-1), page_indices.reshape(-1), tiles.num_active, tiles.q, k_flat, v_flat)


def _cost(tiles: kernel_io.KernelTiles, k_flat, page_indices, dims: Dims) -> pl.CostEstimate:
    """The most a tile class can cost, which a step at full context costs: every tile reads its sequence's
    whole page table span of K and V (NP pages; the lengths are not static) and scores its Mp rows per kv
    head against those keys (q k^T and p v: 4 D FLOPs a pair, one exp). The pools themselves are not
    counted whole: only the pages read are (they are the stack of every layer, read one layer at a time)."""
    W, Hkv, Mp, D = tiles.q.shape
    keys = dims.pages_per_seq * dims.page_size
    pages = W * keys * Hkv * D * 2 * jnp.dtype(k_flat.dtype).itemsize
    return cost(4 * W * Hkv * Mp * keys * D, W * Hkv * Mp * keys, tiles.q, tiles.q, tiles.meta, page_indices,
                extra_bytes=pages)


def ragged_paged_attention_tpu(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                               max_q_len: int | None = None, decode_only: bool = False,
                               num_kv_pages_per_block: int | None = None,
                               num_queries_per_block: int | None = None,
                               decode_queries_per_block: int | None = None, interpret: bool = False):
    """Shapes as ops.ragged_paged_attention -> o [N, Hq, D] in q.dtype. The decode tile holds
    decode_queries_per_block rows, else max_q_len, else the table's; block sizes not given come from the tuned
    table of the chip lowered for (pallas_kernels.tuning.current_chip; none when interpreted), else the
    hand-picked one. They are resolved here, outside the jitted body, so a trace is keyed by the sizes it used;
    interpret: run on the CPU (any shapes)."""
    N, Hq, D = q.shape
    P, ps, Hkv, _ = k_pages.shape
    R, NP = page_indices.shape
    dims = Dims(N, Hq, D, P, ps, Hkv, R, NP)
    if not interpret:
        check_tpu_layout(dims, q.dtype, k_pages.dtype)
    sizes = tuned_block_sizes(k_pages.dtype, dims.group, D, ps, pages_per_seq=NP, num_tokens=N,
                              num_kv_pages_per_block=num_kv_pages_per_block,
                              num_queries_per_block=num_queries_per_block,
                              decode_queries_per_block=decode_queries_per_block or max_q_len,
                              num_kv_heads=Hkv, chip=None if interpret else tuning.current_chip())
    return _attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                      sliding_window=sliding_window, soft_cap=soft_cap, decode_only=decode_only, sizes=sizes,
                      interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "decode_only", "sizes",
                                             "interpret"))
def _attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
               sliding_window: int | None, soft_cap: float | None, decode_only: bool, sizes: BlockSizes,
               interpret: bool):
    N, Hq, D = q.shape
    P, ps, Hkv, _ = k_pages.shape
    R, NP = page_indices.shape
    dims = Dims(N, Hq, D, P, ps, Hkv, R, NP)
    bp = sizes.num_kv_pages_per_block
    kv_lens, page_indices, cu_q_lens, ns = as_int32(kv_lens, page_indices, cu_q_lens, num_seqs)
    sub = max(sublanes(q.dtype), sublanes(k_pages.dtype))
    tiles = kernel_io.kernel_tiles(q, kv_lens, cu_q_lens, ns, dims, decode_tile=sizes.decode_queries_per_block,
                                   prefill_tile=sizes.num_queries_per_block, block=bp * ps,
                                   sliding_window=sliding_window, rows_multiple=lambda m: kernel_io.round_up(m, sub),
                                   decode_only=decode_only)
    k_flat, v_flat = (x.reshape(P, ps, Hkv * D) for x in (k_pages, v_pages))
    outs = [_call(t, k_flat, v_flat, page_indices, dims, bp, sm_scale=sm_scale, sliding_window=sliding_window,
                  soft_cap=soft_cap, interpret=interpret) for t in tiles]
    return kernel_io.token_major(outs, tiles, dims, q.dtype)

