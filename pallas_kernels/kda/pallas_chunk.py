"""Chunked Kimi Delta Attention (prefill) in Pallas: the gated delta rule with a decay per key channel,
in the WY / UT form of Gated DeltaNet's kernel (pallas_kernels/gated_delta_rule/pallas_chunk.py), one
chunk per step, computed in log space.

Per chunk of C tokens and value head, with gc [C, K] the cumulative log decay from the chunk start
(one column per key channel, non-increasing down the rows since g <= 0) and G_ij = exp(gc_i - gc_j):
    N  = tril(beta_i sum_c k_i[c] k_j[c] G_ij[c], -1)         P = tril(sum_c q_i[c] k_j[c] G_ij[c])
    v' = (I + N)^-1 (beta (v - (k exp(gc)) h))                 (= u - w h of the UT form)
    o  = (q exp(gc)) h + P v'
    h <- diag(exp(gc_last)) h + (k exp(gc_last - gc))^T v'
Numerical stability: exp(gc) and exp(-gc) of a whole chunk are never formed (a decay near 0, g ~ -20 a
token, makes exp(-gc) overflow f32 within a few tokens). The chunk is split into sub-blocks of c rows
(`SUB_BLOCK` = 16, or 8 when C is not a multiple of 16):
  * a pair of sub-blocks b > p is one matmul of factors that are both <= 1, taken against the reference
    point r = gc at the row before sub-block b (the last row of sub-block b - 1):
        (x_i exp(gc_i - gc_r)) . (k_j exp(gc_r - gc_j)),   i in b (gc_i <= gc_r), j in p (gc_j >= gc_r);
  * a diagonal sub-block is elementwise, a static loop over its c columns j: [c, K] ops with
    exp(gc_i - gc_j) masked for i < j on the exponent (a large negative) before the exp.
Every other exp (exp(gc), exp(gc_last - gc), exp(gc_last)) has a non-positive argument. The inverse is
block forward substitution over the sub-blocks: row block b solves its own (I + N_bb), inverted by
Gated DeltaNet's matmul-only repeated squaring, against the earlier blocks' v'. gc inside a sub-block is
one matmul with a lower-triangular ones matrix; rows of a value are taken by masked reductions (exact),
never by slicing, which Triton lacks. Everything is f32, every dot at precision HIGHEST.

Grid, layout, varlen and state aliasing are Gated DeltaNet's (its helpers, with the per-channel option):
  * TPU (Mosaic): grid (B, HV, V / block_v, chunks), the chunk axis sequential with the state in a VMEM
    scratch; per step aligned whole-block loads of q, k [C, K] (key head h // r), g [C, K] (value head h),
    v [C, block_v], cast to f32 and sliced at static multiples of 8 rows (f32 sublane tiles); beta
    lane-dense [chunks, C] resident per head; outputs gather in an f32 scratch, stored as one block.
  * GPU (Triton): grid (B, HV, V / block_v), each program walks its chunks with `lax.fori_loop`, loading
    [c, .] sub-blocks from its refs at dynamic offsets; C, K, block_v powers of two >= 16.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import abi
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.gated_delta_rule import varlen
from pallas_kernels.gated_delta_rule.common import check_inputs, default_scale
from pallas_kernels.gated_delta_rule.pallas_chunk import ChunkConfig, _check_blocks, _dot, _dot_nt, _dot_tn
from pallas_kernels.gated_delta_rule.pallas_recurrent import (
    copy_states, l2norm_row, row_to_col, time_block_specs, whole_sequence_specs)
from pallas_kernels.kernel_params import TPU_VMEM_LIMIT, compiler_params, cost

ABI = abi.KIMI_DELTA_ATTENTION   # writes state[N, HV, K, V] f32, like every KDA implementation
SUB_BLOCK = 16
_NEG = -1e30

__all__ = ["ChunkConfig", "SUB_BLOCK", "chunk_kda_pallas", "kda_chunk_step"]


def sub_block(C: int) -> int:
    """Rows per sub-block of a chunk of C rows."""
    if C % SUB_BLOCK == 0:
        return SUB_BLOCK
    if C % 8 == 0:
        return 8
    raise KernelUnsupported(f"chunk_size must be a multiple of 8; got {C}")


def _unit_lower_inverse(n_mat, eye):
    """(I + N)^-1 for strictly lower-triangular N [c, c] by repeated squaring (matmuls only):
    (I - N)(I + N^2)(I + N^4)..., N being nilpotent."""
    p = -n_mat
    inv = eye + p
    n = 2
    while n < n_mat.shape[0]:
        p = _dot(p, p)
        inv = _dot(inv, eye + p)
        n *= 2
    return inv


def _row(x, rows, j):
    """Row j of x [c, n] as [1, n]: a masked reduction (exact), no slice."""
    return jnp.sum(jnp.where(rows == j, x, 0.0), axis=0, keepdims=True)


def kda_chunk_step(h, load, store, *, nb: int, c: int, scale: float, use_l2norm: bool):
    """One chunk of nb sub-blocks of c rows. h [K, bv] f32: the state entering the chunk.
    load(b) -> (q, k [c, K], v [c, bv], g [c, K] f32, beta [c, 1] f32) of sub-block b (rows b c ..);
    store(b, o [c, bv] f32) takes its output. Returns the state after the chunk [K, bv] f32.
    Only 2-D elementwise ops, reductions and dots (see the module docstring for the stability rules)."""
    K = h.shape[0]
    f32 = jnp.float32
    ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye_c = (ii == jj).astype(f32)
    tril_c = (jj <= ii).astype(f32)
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, K), 0)
    base = jnp.zeros((1, K), f32)      # gc at the row before sub-block b (0 before the chunk)
    done = []                          # (k, gc, v') of the sub-blocks so far
    for b in range(nb):
        q, k, v, g, beta = load(b)
        q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
        if use_l2norm:
            q, k = l2norm_row(q), l2norm_row(k)
        q = q * scale
        gc = base + _dot(tril_c, g)                                        # [c, K]
        # the diagonal sub-block, elementwise: column j of P and N
        p_diag = jnp.zeros((c, c), f32)
        n_diag = jnp.zeros((c, c), f32)
        for j in range(c):
            e = jnp.exp(jnp.where(rows >= j, gc - _row(gc, rows, j), _NEG)) * _row(k, rows, j)   # [c, K]
            col = (jj == j).astype(f32)
            p_diag = p_diag + jnp.sum(q * e, axis=1, keepdims=True) * col
            n_diag = n_diag + jnp.sum(k * e, axis=1, keepdims=True) * col
        n_diag = beta * jnp.where(ii > jj, n_diag, 0.0)
        # earlier sub-blocks: factors <= 1 about the reference point `base`
        left = jnp.exp(gc - base)                                          # gc <= base
        ql, kl = q * left, k * left
        pairs = []
        for kp, gcp, vp in done:
            right = kp * jnp.exp(base - gcp)                               # gcp >= base
            pairs.append((_dot_nt(ql, right), beta * _dot_nt(kl, right), vp))
        eg = jnp.exp(gc)
        rhs = beta * (v - _dot(k * eg, h))                                 # [c, bv]
        for _, n_bp, vp in pairs:
            rhs = rhs - _dot(n_bp, vp)
        v_new = _dot(_unit_lower_inverse(n_diag, eye_c), rhs)
        o = _dot(q * eg, h) + _dot(p_diag, v_new)
        for p_bp, _, vp in pairs:
            o = o + _dot(p_bp, vp)
        store(b, o)
        done.append((k, gc, v_new))
        base = _row(gc, rows, c - 1)
    eye_k = (jax.lax.broadcasted_iota(jnp.int32, (K, K), 0)
             == jax.lax.broadcasted_iota(jnp.int32, (K, K), 1)).astype(f32)
    h = row_to_col(jnp.exp(base), eye_k) * h                               # diag(exp(gc_last)) h
    for kp, gcp, vp in done:
        h = h + _dot_tn(kp * jnp.exp(base - gcp), vp)
    return h


def _tpu_kernel(seq_ref, flag_ref,            # [B * NC] int32 in SMEM
                q_ref, k_ref,                 # [C, K]
                v_ref,                        # [C, bv]
                g_ref,                        # [C, K] f32
                b_ref,                        # [NC, C] f32: the head's whole sequence, lane-dense
                h0_ref,                       # [NB, K, bv] f32
                o_ref,                        # [C, bv]
                hT_ref,                       # [NB, K, bv] f32 (aliases h0)
                h_scr,                        # [K, bv] f32 VMEM scratch: the state across chunks
                o_scr,                        # [C, bv] f32 VMEM scratch: the chunk's outputs
                *, scale, use_l2norm, NC, c):
    b, ch = pl.program_id(0), pl.program_id(3)

    @pl.when(ch == 0)
    def _():
        copy_states(h0_ref, hT_ref)

    s = seq_ref[b * NC + ch]
    h = jnp.where((flag_ref[b * NC + ch] & 1) == 1, h0_ref[s], h_scr[...])
    C = q_ref.shape[0]
    qs, ks, vs, gs = (r[...].astype(jnp.float32) for r in (q_ref, k_ref, v_ref, g_ref))   # aligned whole blocks
    b_row = b_ref[pl.ds(ch, 1), :]                                                     # [1, C]
    lane = jax.lax.broadcasted_iota(jnp.int32, (c, C), 1) - jax.lax.broadcasted_iota(jnp.int32, (c, C), 0)

    def load(i):
        rows = slice(i * c, (i + 1) * c)                  # static, a multiple of 8 rows: f32-tile aligned
        beta = jnp.sum(jnp.where(lane == i * c, b_row, 0.0), axis=1, keepdims=True)   # [c, 1]
        return qs[rows], ks[rows], vs[rows], gs[rows], beta

    def store(i, o):
        o_scr[i * c:(i + 1) * c, :] = o

    h = kda_chunk_step(h, load, store, nb=C // c, c=c, scale=scale, use_l2norm=use_l2norm)
    o_ref[...] = o_scr[...].astype(o_ref.dtype)
    h_scr[...] = h
    hT_ref[s] = h


def _gpu_kernel(seq_ref, flag_ref,            # [B * NC] int32
                q_ref, k_ref,                 # [Tp, K]
                v_ref,                        # [Tp, bv]
                g_ref,                        # [Tp, K] f32
                b_ref,                        # [Tp, 1] f32
                h0_ref,                       # [NB, K, bv] f32
                o_ref,                        # [Tp, bv]
                hT_ref,                       # [NB, K, bv] f32 (aliases h0)
                *, scale, use_l2norm, NC, C, c):
    b = pl.program_id(0)
    copy_states(h0_ref, hT_ref)

    def body(ch, h):
        s = seq_ref[b * NC + ch]
        h = jnp.where((flag_ref[b * NC + ch] & 1) == 1, h0_ref[s], h)

        def load(i):
            rows = pl.ds(ch * C + i * c, c)
            return q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], g_ref[rows, :], b_ref[rows, :]

        def store(i, o):
            o_ref[pl.ds(ch * C + i * c, c), :] = o.astype(o_ref.dtype)

        h = kda_chunk_step(h, load, store, nb=C // c, c=c, scale=scale, use_l2norm=use_l2norm)
        hT_ref[s] = h
        return h

    jax.lax.fori_loop(0, NC, body, jnp.zeros(h0_ref.shape[1:], jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                             "chunk_size", "config", "backend", "interpret"))
def chunk_kda_pallas(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV, K]  log decay per key channel, <= 0
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
):
    """Chunked KDA kernel. Returns (o [B, T, HV, V] in v.dtype, final [N, HV, K, V] f32 or None).
    chunk_size, when given, overrides config.chunk_size (a multiple of 8; of 16 for the sub-blocks of
    16). The initial state buffer is aliased to the final state (`input_output_aliases`), so a donated
    state is updated in place."""
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    config = config or ChunkConfig()
    C = chunk_size or config.chunk_size
    bv = config.block_v or V
    _check_blocks(backend, C, K, V, bv)
    c = sub_block(C)
    r = HV // H
    scale = default_scale(scale, K)
    (q, k, v, g, beta), seq, flag, NC, N, NB, pos = varlen.chunked((q, k, v, g, beta), cu_seqlens, B, T, C)
    h0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    qt, kt = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)          # [B, H, Tp, K]
    vt = v.transpose(0, 2, 1, 3)                                        # [B, HV, Tp, V]
    gt = g.astype(jnp.float32).transpose(0, 2, 1, 3)                    # [B, HV, Tp, K]
    bt = beta.astype(jnp.float32).transpose(0, 2, 1)                    # [B, HV, Tp]
    varl = cu_seqlens is not None
    kw = dict(scale=scale, use_l2norm=use_qk_l2norm_in_kernel, NC=NC, c=c)
    out_shape = [jax.ShapeDtypeStruct((B, HV, NC * C, V), v.dtype), jax.ShapeDtypeStruct((N, HV, K, V), jnp.float32)]
    b_sem = "arbitrary" if varl else "parallel"   # a packed batch revisits one state block
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        grid = (B, HV, V // bv, NC)
        in_specs, out_specs = time_block_specs(B * NC, C, NC, K, bv, r, NB, varl, per_channel=True)
        bt = bt.reshape(B, HV, NC, C)                                   # lane-dense
        kernel = functools.partial(_tpu_kernel, **kw)
        scratch = [pltpu.VMEM((K, bv), jnp.float32), pltpu.VMEM((C, bv), jnp.float32)]
        params = compiler_params(backend, (b_sem, "parallel", "parallel", "arbitrary"),
                                 vmem_limit_bytes=TPU_VMEM_LIMIT)
    else:
        grid = (B, HV, V // bv)
        in_specs, out_specs = whole_sequence_specs(backend, B * NC, NC * C, K, bv, r, NB, varl, per_channel=True)
        bt = bt[..., None]                                              # [B, HV, Tp, 1]
        kernel = functools.partial(_gpu_kernel, C=C, **kw)
        scratch = []
        params = compiler_params(backend, (b_sem, "parallel", "parallel"), config.num_warps, config.num_stages)
    o, hT = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=scratch, input_output_aliases={7: 1}, compiler_params=params,
        interpret=interpret, name="kda_chunk",
        cost_estimate=_cost(qt, kt, vt, gt, h0, out_shape, C, c, bv, use_qk_l2norm_in_kernel),
    )(seq, flag, qt, kt, vt, gt, bt, h0)
    o = o.transpose(0, 2, 1, 3)                                         # [B, Tp, HV, V]
    o = varlen.unchunked(o, T, pos)
    return o, (hT if output_final_state else None)


def _cost(qt, kt, vt, gt, h0, out_shape, C, c, bv, l2norm):
    """Per chunk of C tokens, value head and value block of bv columns (the key-side work is redone per
    value block), the work of `kda_chunk_step` over its nb = C / c sub-blocks and nb (nb - 1) / 2 pairs:
      matmuls (2 flops a multiply-add): gc (c^2 K a sub-block), the pairs' q k^T and k k^T (2 c^2 K),
      the inverses by repeated squaring (2 log2(c) - 2 products of c^3), (k e^g) h and (q e^g) h
      (2 c K bv a sub-block), N v' and P v' of the pairs (2 c^2 bv), the inverse and P_bb times v'
      (2 c^2 bv a sub-block), the state update (c K bv a sub-block);
      the diagonal sub-blocks elementwise (5 c^2 K), the l2norms (4 C K);
    exps: c^2 K per diagonal sub-block, 4 c K per sub-block (left factor, exp(gc), the state update's and
    the row of the pairs' right factors), c K per pair, K for exp(gc_last); two rsqrt per token."""
    B, H, Tp, K = qt.shape
    HV, V = vt.shape[1], vt.shape[-1]
    programs = B * HV * (Tp // C) * (V // bv)
    nb = C // c
    pairs = nb * (nb - 1) // 2
    squarings = max(2 * (c - 1).bit_length() - 2, 0)
    mm = 2 * (nb * (c * c * K + squarings * c ** 3 + 2 * c * K * bv + 2 * c * c * bv + c * K * bv)
              + pairs * (2 * c * c * K + 2 * c * c * bv))
    flops = programs * (mm + nb * 5 * c * c * K + (4 * C * K if l2norm else 0))
    exps = programs * (nb * (c * c * K + 4 * c * K) + pairs * c * K + K + (2 * C if l2norm else 0))
    return cost(flops, exps, qt, kt, vt, gt, h0, *out_shape)
