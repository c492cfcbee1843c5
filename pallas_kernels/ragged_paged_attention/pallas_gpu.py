"""Pallas ragged paged attention for GPU (Triton): one program per (tile, kv head) walks its sequence's pages.

The batch arrives as tiles, as for the TPU kernel (kernel_io): `tile` query rows of one sequence laid out per kv
head ([Mp, D], row t * Gq + i: the tile's row t, query head i of the kv head), and the range of pages its rows can
see. Program (w, h) keeps its queries and the online-softmax state (running max, sum, accumulator [Mp, D], f32)
in registers and loops (`fori_loop`, dynamic bounds) over those pages: each page's K and V for head h are loaded
from the whole pools ([P * ps, Hkv * D], gathered in-kernel through the page table), scored with tl.dot, masked
(causal, window, length) and folded in. A page id is clamped into the pool; slots past kv_len are masked out of the
scores and zeroed in V.

Triton wants power-of-two blocks: the head dim and the page size must be powers of two >= 16, the rows per kv
head are padded to a power of two >= 16. Export needs `DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")`
(see tests/pallas_kernels/test_export.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import abi
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.gated_delta_rule.pallas_recurrent import compiler_params
from pallas_kernels.ragged_paged_attention import kernel_io
from pallas_kernels.ragged_paged_attention.common import Dims, as_int32, cap_scores, softmax_fold, visible
from pallas_kernels.ragged_paged_attention.kernel_io import BLK_HI, BLK_LO, KV_LEN, POS0, SEQ, META_WIDTH

ABI = abi.RAGGED_PAGED_ATTENTION
TARGET_ROWS = 64          # query rows per program: the [rows, D] accumulator lives in registers


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(x, 1) - 1).bit_length())


def check_gpu_layout(dims: Dims):
    for name, x in (("head dim", dims.head_dim), ("page size", dims.page_size)):
        if x < 16 or x & (x - 1):
            raise KernelUnsupported(f"the Triton ragged paged attention kernel needs the {name} a power of two >= 16;"
                                    f" got {x}")


def _kernel(meta_ref,                 # [8] int32: this tile's metadata row
            pt_ref,                   # [L] int32: the page table, flattened (padded)
            q_ref,                    # [Mp, D]
            k_ref, v_ref,             # [P * ps, Hkv * D]: whole pools
            o_ref,                    # [Mp, D]
            *, P, NP, ps, Gq, D, sm_scale, sliding_window, soft_cap):
    h = pl.program_id(1)
    seq, pos0, kv_len = meta_ref[SEQ], meta_ref[POS0], meta_ref[KV_LEN]
    q = q_ref[...]
    Mp = q.shape[0]
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    q_pos = pos0 + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (Mp, ps), 0), jnp.int32(Gq))
    col = jax.lax.broadcasted_iota(jnp.int32, (Mp, ps), 1)
    v_row = jax.lax.broadcasted_iota(jnp.int32, (ps, D), 0)

    def page_step(p, carry):
        m, l, acc = carry
        page = jnp.clip(pt_ref[seq * NP + p], 0, P - 1)
        k = k_ref[pl.ds(page * ps, ps), pl.ds(h * D, D)]
        v = v_ref[pl.ds(page * ps, ps), pl.ds(h * D, D)]
        s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32) * sm_scale        # [Mp, ps]
        vis = visible(q_pos, p * ps + col, kv_len, NP * ps, sliding_window)
        m_new, l_new, alpha, e = softmax_fold(m, l, jnp.where(vis, cap_scores(s, soft_cap), -jnp.inf))
        v = jnp.where(p * ps + v_row < kv_len, v, jnp.zeros_like(v))
        pv = jax.lax.dot_general(e.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32)                # [Mp, D]
        return m_new, l_new, alpha * acc + pv

    init = (jnp.full((Mp, 1), -jnp.inf, jnp.float32), jnp.zeros((Mp, 1), jnp.float32),
            jnp.zeros((Mp, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(meta_ref[BLK_LO], meta_ref[BLK_HI], page_step, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_q_len", "decode_only",
                                             "num_kv_pages_per_block", "num_queries_per_block",
                                             "decode_queries_per_block", "num_warps", "interpret"))
def ragged_paged_attention_gpu(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                               max_q_len: int | None = None, decode_only: bool = False,
                               num_kv_pages_per_block: int | None = None,
                               num_queries_per_block: int | None = None,
                               decode_queries_per_block: int | None = None, num_warps: int | None = None,
                               interpret: bool = False):
    """Shapes as ops.ragged_paged_attention -> o [N, Hq, D] in q.dtype. A program walks one page at a time
    (num_kv_pages_per_block is accepted for the common signature and must be None or 1); prefill tiles hold
    num_queries_per_block rows (default: about 64 rows per kv head), decode tiles decode_queries_per_block, else
    max_q_len, else 1."""
    N, Hq, D = q.shape
    P, ps, Hkv, _ = k_pages.shape
    R, NP = page_indices.shape
    dims = Dims(N, Hq, D, P, ps, Hkv, R, NP)
    if not interpret:
        check_gpu_layout(dims)
    if num_kv_pages_per_block not in (None, 1):
        raise KernelUnsupported(f"the Triton kernel reads one page per step: num_kv_pages_per_block must be None or 1; "
                         f"got {num_kv_pages_per_block}")
    prefill = min(num_queries_per_block or max(1, TARGET_ROWS // dims.group), N)
    decode = min(decode_queries_per_block or max_q_len or 1, prefill)
    kv_lens, page_indices, cu_q_lens, ns = as_int32(kv_lens, page_indices, cu_q_lens, num_seqs)
    tiles = kernel_io.kernel_tiles(q, kv_lens, cu_q_lens, ns, dims, decode_tile=decode, prefill_tile=prefill,
                                   block=ps, sliding_window=sliding_window, rows_multiple=_pow2, decode_only=decode_only)
    pt = page_indices.reshape(-1)
    pt = jnp.pad(pt, (0, _pow2(pt.shape[0], 1) - pt.shape[0]))
    k_flat, v_flat = (x.reshape(P * ps, Hkv * D) for x in (k_pages, v_pages))
    warps = num_warps or (8 if D > 128 else 4)
    kernel = functools.partial(_kernel, P=P, NP=NP, ps=ps, Gq=dims.group, D=D, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    outs = []
    for t in tiles:
        W, _, Mp, _ = t.q.shape
        pool = pl.BlockSpec((P * ps, Hkv * D), lambda w, h: (0, 0))
        outs.append(pl.pallas_call(
            kernel, grid=(W, Hkv),
            in_specs=[pl.BlockSpec((None, META_WIDTH), lambda w, h: (w, 0)),
                      pl.BlockSpec((pt.shape[0],), lambda w, h: (0,)),
                      pl.BlockSpec((None, None, Mp, D), lambda w, h: (w, h, 0, 0)), pool, pool],
            out_specs=pl.BlockSpec((None, None, Mp, D), lambda w, h: (w, h, 0, 0)),
            out_shape=jax.ShapeDtypeStruct(t.q.shape, q.dtype),
            compiler_params=compiler_params("gpu", (), warps), interpret=interpret,
            name="ragged_paged_attention",
        )(t.meta, pt, t.q, k_flat, v_flat))
    return kernel_io.token_major(outs, tiles, dims, q.dtype)
