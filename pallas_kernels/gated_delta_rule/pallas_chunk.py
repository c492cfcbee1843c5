"""Chunked gated delta rule (prefill) in Pallas: the WY / UT form of chunk.py, one chunk per step.

Per chunk of C tokens (gc: cumulative log decay inside the chunk, computed in the kernel):
    A  = (I + tril(beta_i k_i.k_j exp(gc_i - gc_j), -1))^-1     by repeated squaring (matmuls only)
    u  = A (beta v)     w = A (beta k exp(gc))     v' = u - w h
    o  = (q exp(gc)) h + tril(q_i.k_j exp(gc_i - gc_j)) v'
    h <- exp(gc_last) h + (k exp(gc_last - gc))^T v'
Gating (cumsum of g, every exp, the masks), beta and the q/k l2norm are fused; all dots are fp32 at
`precision=HIGHEST` (the TPU MXU would otherwise round fp32 operands to bf16). The state block
[K, block_v] never leaves the chip between chunks. The update is independent per value column, so
V is split into blocks for parallelism (`ChunkConfig.block_v`).

Backends (both proven by `jax.export` on CPU in tests/pallas_kernels/test_export.py):
  * TPU, Mosaic TPU (`backend="tpu"`): grid (B, HV, V / block_v, chunks); the chunk axis is
    sequential ("arbitrary") and the state sits in a VMEM scratch buffer across it, so the pipeline
    streams one [C, K] block of q/k/v per step. Blocks obey the (8, 128) rule: C is a multiple of
    8 and K, block_v are full dims (or block_v a multiple of 128). Chunk metadata is in SMEM.
  * GPU, Triton (`backend="gpu"`): Triton programs cannot carry scratch across grid steps, so the
    grid is (B, HV, V / block_v) and each program walks the chunks with `lax.fori_loop`, the state in
    registers. JAX 0.10's default Mosaic GPU lowering lacks dot_general in this form and the
    reductions; Triton lowers both (export needs
    `DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")`). Every tile the kernel loads or stores
    ([C, K], [C, block_v], [K, block_v]) has power-of-two dims, so C, K, block_v must be powers of
    two; the refs themselves may have any size (e.g. the padded T).
The per-chunk math (`chunk_step`) is shared by both. With the static `delta_rule=False` it is Mamba2's SSD
rule instead (pallas_kernels.mamba2): no delta correction, so A = I, v' = beta v and no inverse is formed.

Variable-length batches: every sequence is padded to a multiple of C (varlen.chunk_layout) so no
chunk straddles two sequences; each chunk carries its sequence id and a reset flag.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import abi
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.gated_delta_rule import varlen
from pallas_kernels.gated_delta_rule.common import check_inputs, default_scale
from pallas_kernels.gated_delta_rule.pallas_recurrent import (
    copy_states, row_to_col, time_block_specs, whole_sequence_specs)
from pallas_kernels.kernel_params import TPU_VMEM_LIMIT, check_backend, compiler_params, cost

ABI = abi.GATED_DELTA_RULE   # writes state[N, HV, K, V] f32, like every other implementation
_HI = jax.lax.Precision.HIGHEST
_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Block sizes. chunk_size: tokens per chunk; block_v: state columns per program (None: V)."""
    chunk_size: int = 64
    block_v: int | None = None
    num_warps: int = 4          # Triton only
    num_stages: int = 1         # Triton only


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HI,
                               preferred_element_type=jnp.float32)


def _dot_nt(a, b):   # a @ b^T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                               preferred_element_type=jnp.float32)


def _dot_tn(a, b):   # a^T @ b
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI,
                               preferred_element_type=jnp.float32)


def chunk_step(h, q, k, v, g, beta, *, scale: float, use_l2norm: bool, delta_rule: bool = True):
    """One chunk. h [K, bv] f32; q, k [C, K]; v [C, bv]; g, beta [C, 1] f32.
    delta_rule=False: no delta correction (Mamba2's SSD rule): A = I, so v' = beta v and no inverse.
    Returns (o [C, bv] f32, new h [K, bv] f32). Only 2-D elementwise ops, reductions and dots."""
    q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    if use_l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    q = q * scale
    C = q.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    eye = (i == j).astype(jnp.float32)
    g_row = jnp.sum(eye * g, axis=0, keepdims=True)                         # [1, C]
    gc = jnp.sum(jnp.where(j <= i, g_row, 0.0), axis=1, keepdims=True)     # [C, 1] cumsum
    gc_row = jnp.sum(eye * gc, axis=0, keepdims=True)                      # [1, C]
    # the last row of gc, not sum(g): another order of the same sum, whose rounding would not cancel in
    # g_last - gc (|gc| reaches ~1e3 when a head decays fast, where one f32 ulp is 1e-4)
    last = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1               # (no slices: Triton lacks them)
    g_last = jnp.sum(jnp.where(last, gc, 0.0), axis=0, keepdims=True)              # [1, 1]
    diff = gc - gc_row                                                      # [C, C]
    if delta_rule:
        v_new = _delta_values(h, k, v, beta, jnp.exp(gc), diff, eye, i, j)
    else:
        v_new = beta * v
    attn = _dot_nt(q, k) * jnp.exp(jnp.where(j <= i, diff, _NEG))
    o = _dot(q * jnp.exp(gc), h) + _dot(attn, v_new)
    h = jnp.exp(g_last) * h + _dot_tn(k * jnp.exp(g_last - gc), v_new)
    return o, h


def _delta_values(h, k, v, beta, eg, diff, eye, i, j):
    """The delta rule's corrected values v' = u - w h [C, bv], from the UT inverse A:
    u = A (beta v), w = A (beta exp(gc) k)."""
    C = k.shape[0]
    n_mat = beta * _dot_nt(k, k) * jnp.exp(jnp.where(j < i, diff, _NEG))
    # (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... (N strictly lower, so nilpotent)
    p = -n_mat
    a_inv = eye + p
    n = 2
    while n < C:
        p = _dot(p, p)
        a_inv = _dot(a_inv, eye + p)
        n *= 2
    u = _dot(a_inv, beta * v)                                               # [C, bv]
    w = _dot(a_inv, beta * eg * k)                                          # [C, K]
    return u - _dot(w, h)


def _tpu_kernel(seq_ref, flag_ref,            # [B * NC] int32 in SMEM
                q_ref, k_ref,                 # [C, K]
                v_ref,                        # [C, bv]
                g_ref, b_ref,                 # [NC, C] f32: the head's whole sequence, lane-dense
                h0_ref,                       # [NB, K, bv] f32
                o_ref,                        # [C, bv]
                hT_ref,                       # [NB, K, bv] f32 (aliases h0)
                h_scr,                        # [K, bv] f32 VMEM scratch: the state across chunks
                *, scale, use_l2norm, NC, delta_rule=True):
    b, c = pl.program_id(0), pl.program_id(3)

    @pl.when(c == 0)
    def _():
        copy_states(h0_ref, hT_ref)

    s = seq_ref[b * NC + c]
    h = jnp.where((flag_ref[b * NC + c] & 1) == 1, h0_ref[s], h_scr[...])
    C = q_ref.shape[0]
    eye = (jax.lax.broadcasted_iota(jnp.int32, (C, C), 0) == jax.lax.broadcasted_iota(jnp.int32, (C, C), 1))
    g, beta = (row_to_col(r[pl.ds(c, 1), :], eye.astype(jnp.float32)) for r in (g_ref, b_ref))   # [C, 1]
    o, h = chunk_step(h, q_ref[...], k_ref[...], v_ref[...], g, beta, scale=scale, use_l2norm=use_l2norm,
                      delta_rule=delta_rule)
    o_ref[...] = o.astype(o_ref.dtype)
    h_scr[...] = h
    hT_ref[s] = h


def _gpu_kernel(seq_ref, flag_ref,            # [B * NC] int32
                q_ref, k_ref,                 # [Tp, K]
                v_ref,                        # [Tp, bv]
                g_ref, b_ref,                 # [Tp, 1] f32
                h0_ref,                       # [NB, K, bv] f32
                o_ref,                        # [Tp, bv]
                hT_ref,                       # [NB, K, bv] f32 (aliases h0)
                *, scale, use_l2norm, NC, C, delta_rule=True):
    b = pl.program_id(0)
    copy_states(h0_ref, hT_ref)

    def body(c, h):
        s = seq_ref[b * NC + c]
        h = jnp.where((flag_ref[b * NC + c] & 1) == 1, h0_ref[s], h)
        rows = pl.ds(c * C, C)
        o, h = chunk_step(h, q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], g_ref[rows, :],
                          b_ref[rows, :], scale=scale, use_l2norm=use_l2norm, delta_rule=delta_rule)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        hT_ref[s] = h
        return h

    jax.lax.fori_loop(0, NC, body, jnp.zeros(h0_ref.shape[1:], jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                             "chunk_size", "config", "backend", "interpret", "delta_rule"))
def chunk_gated_delta_rule_pallas(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV]  log decay
    beta: jax.Array,         # [B, T, HV]
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    chunk_size: int | None = None,
    config: ChunkConfig | None = None,
    backend: str = "tpu",
    interpret: bool = False,
    delta_rule: bool = True,
):
    """Chunked Pallas kernel. Returns (o [B, T, HV, V] in v.dtype, final [N, HV, K, V] f32 or None).
    chunk_size, when given, overrides config.chunk_size. The initial state buffer is aliased to the
    final state (`input_output_aliases`), so a donated state is updated in place.
    delta_rule=False drops the delta correction: h <- exp(g) h + k (beta v)^T, Mamba2's SSD rule
    (pallas_kernels.mamba2), with no UT inverse."""
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    config = config or ChunkConfig()
    C = chunk_size or config.chunk_size
    bv = config.block_v or V
    _check_blocks(backend, C, K, V, bv)
    r = HV // H
    scale = default_scale(scale, K)
    (q, k, v, g, beta), seq, flag, NC, N, NB, pos = varlen.chunked((q, k, v, g, beta), cu_seqlens, B, T, C)
    Tp = NC * C
    h0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    qt, kt = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)          # [B, H, Tp, K]
    vt = v.transpose(0, 2, 1, 3)                                        # [B, HV, Tp, V]
    gt = g.astype(jnp.float32).transpose(0, 2, 1)                       # [B, HV, Tp]
    bt = beta.astype(jnp.float32).transpose(0, 2, 1)
    varl = cu_seqlens is not None
    kw = dict(scale=scale, use_l2norm=use_qk_l2norm_in_kernel, NC=NC, delta_rule=delta_rule)
    out_shape = [jax.ShapeDtypeStruct((B, HV, Tp, V), v.dtype), jax.ShapeDtypeStruct((N, HV, K, V), jnp.float32)]
    b_sem = "arbitrary" if varl else "parallel"   # a packed batch revisits one state block
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        grid = (B, HV, V // bv, NC)
        in_specs, out_specs = time_block_specs(B * NC, C, NC, K, bv, r, NB, varl)
        # g, beta lane-dense ([Tp, 1] columns would be padded to 128 lanes in HBM)
        gt, bt = gt.reshape(B, HV, NC, C), bt.reshape(B, HV, NC, C)
        kernel = functools.partial(_tpu_kernel, **kw)
        scratch = [pltpu.VMEM((K, bv), jnp.float32)]
        sem = (b_sem, "parallel", "parallel", "arbitrary")
        params = compiler_params(backend, sem, vmem_limit_bytes=TPU_VMEM_LIMIT)
    else:
        grid = (B, HV, V // bv)
        in_specs, out_specs = whole_sequence_specs(backend, B * NC, Tp, K, bv, r, NB, varl)
        gt, bt = gt[..., None], bt[..., None]                           # [B, HV, Tp, 1]
        kernel = functools.partial(_gpu_kernel, C=C, **kw)
        scratch = []
        params = compiler_params(backend, (b_sem, "parallel", "parallel"), config.num_warps, config.num_stages)
    o, hT = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=scratch, input_output_aliases={7: 1}, compiler_params=params,
        interpret=interpret, name="gdn_chunk" if delta_rule else "ssd_chunk",
        cost_estimate=_cost(qt, kt, vt, h0, out_shape, C, use_qk_l2norm_in_kernel, delta_rule),
    )(seq, flag, qt, kt, vt, gt, bt, h0)
    o = o.transpose(0, 2, 1, 3)                                         # [B, Tp, HV, V]
    o = varlen.unchunked(o, T, pos)
    return o, (hT if output_final_state else None)


def _cost(qt, kt, vt, h0, out_shape, C, l2norm, delta_rule=True):
    """Per chunk of C tokens and value head, the matmuls of `chunk_step`: k k^T, q k^T, the inverse by
    repeated squaring (2 log2(C) - 2 C^3 products), u, w, w h, (q e^g) h, attn v', k^T v' -- plus the
    l2norms; exp and rsqrt per token and per [C, C] mask. Without the delta rule: q k^T, (q e^g) h,
    attn v', k^T v' only."""
    B, H, Tp, K = qt.shape
    HV, V = vt.shape[1], vt.shape[-1]
    chunks = B * HV * (Tp // C)
    squarings = max(2 * (C - 1).bit_length() - 2, 0)
    mm = 2 * (2 * C * C * K + squarings * C ** 3 + C * C * V + C * C * K + 3 * C * K * V + C * C * V)
    if not delta_rule:
        mm = 2 * (C * C * K + 2 * C * K * V + C * C * V)
    return cost(chunks * (mm + (4 * C * K if l2norm else 0)), chunks * (2 * C * C + 3 * C),
                qt, kt, vt, h0, *out_shape)


def _check_blocks(backend: str, C: int, K: int, V: int, bv: int):
    check_backend(backend)
    if V % bv:
        raise KernelUnsupported(f"block_v={bv} must divide V={V}")
    if backend == "tpu":
        if C % 8:
            raise KernelUnsupported(f"TPU blocks need chunk_size a multiple of 8; got {C}")
        if bv != V and bv % 128:
            raise KernelUnsupported(f"TPU blocks need block_v = V or a multiple of 128; got block_v={bv}, V={V}")
    else:
        for name, x in (("chunk_size", C), ("K", K), ("block_v", bv)):
            if x & (x - 1) or x < 16:
                raise KernelUnsupported(f"the Triton kernel needs {name} a power of two >= 16; got {name}={x}")
