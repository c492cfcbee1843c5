"""Fused recurrent gated delta rule in Pallas: decode steps and speculative-verify windows.

One kernel for both decays: Gated DeltaNet's, one log decay per head (g [B, T, HV]: the state is scaled
by a scalar), and Kimi Delta Attention's, one per key channel (g [B, T, HV, K]: row c of the state
[K, V] is scaled by exp(g[c])). The choice is static, made from g.ndim; the GDN path is unchanged by it.
A second static choice, `delta_rule=False`, drops the delta correction: Mamba2's SSD rule (pallas_kernels.mamba2).
A third, `state_vk` (with delta_rule=False, TPU), keeps the state value-major, [V, K] a head: Mamba2's head
dim (V = 64) is narrower than a TPU lane tile, and an f32 array of minor dim 64 is laid out by the TPU with its
last two axes swapped, so a [K, V] state pool was copied into the kernel's layout and back every decode step.

The state block [K, block_v] stays on chip (VMEM on TPU, registers / shared memory on GPU) for the
whole window and goes back to HBM once per sequence. Gating (exp(g)), beta and the q/k l2norm are
fused into the token step. The update is independent per value column, so V is split into blocks for
parallelism (`RecurrentConfig.block_v`). The token step (`_token_step`) is shared by both variants:
elementwise ops and row/column reductions only (a q/k row becomes a column via a masked reduction
against the identity), no M=1 matmul and no transposes, which both lowerings handle.

Backends (lowered by `jax.export` and, for TPU, compiled by Mosaic in the tests):
  * TPU (Mosaic): grid (B, HV, V / block_v, T / block_t), the time axis sequential, the state in a
    VMEM scratch across it. Each grid step loads aligned [block_t, K] / [block_t, block_v] blocks
    whole (block_t = T for short windows, else 16: a bf16 tile) and unrolls its tokens with static
    row offsets; Mosaic cannot prove a single bf16 row at a dynamic offset aligned (E2003), and a
    per-token state output over all of T would not fit VMEM (E1001 at T = 200 on v5e). Outputs
    gather in an f32 scratch and are stored as one aligned block. A per-head g and beta travel
    lane-dense, [T / block_t, block_t] per head, resident for the head ([T, 1] columns would be padded
    to 128 lanes in HBM); a per-channel g is a [block_t, K] block per value head, walked like q / k
    (f32: block_t = 16 is two sublane tiles). Per-token metadata (sequence id, flags) sits in SMEM.
  * GPU (Triton, `pallas.triton.CompilerParams`): grid (B, HV, V / block_v); each program walks
    the tokens with `lax.fori_loop`. JAX 0.10's default Mosaic GPU lowering lacks the reductions
    this kernel needs; Triton lowers them. Export needs
    `DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")`. K and block_v must be powers of two.

With output_all_states the kernel also writes the state after every token, [B, T, HV, K, V]
(the speculative-decoding checkpoints: rollback by selecting slot `accepted - 1`), meant for short
windows. With output_deltas it writes instead every token's rank-one update delta_t, [B, T, HV, V],
K times less: `rebuild.state_after` makes the state after any one token from them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import abi
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.gated_delta_rule import varlen
from pallas_kernels.gated_delta_rule.common import (check_inputs, check_state_indices, default_scale,
                                                    on_gathered_rows, per_token_output)
from pallas_kernels.kernel_params import TPU_VMEM_LIMIT, check_backend, compiler_params, cost, smem_spec

ABI = abi.GATED_DELTA_RULE   # writes state[N, HV, K, V] f32, like every other implementation


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Block sizes. block_v: columns of the state per program (None: all of V). block_t: tokens per
    TPU grid step when T is longer (a multiple of 16, bf16's sublane tile)."""
    block_v: int | None = None
    block_t: int = 16          # TPU only
    num_warps: int = 4         # Triton only


def row_to_col(x, eye):
    """[1, K] -> [K, 1] without a transpose: sum_j eye[i, j] x[j]."""
    return jnp.sum(eye * x, axis=1, keepdims=True)


def l2norm_row(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + eps)


def copy_states(src_ref, dst_ref):
    """dst[n] = src[n] for every n: output blocks start uninitialised on chip, so states of sequences
    the kernel never visits (empty ones) must be carried over explicitly."""
    def body(n, _):
        dst_ref[n] = src_ref[n]
        return 0
    jax.lax.fori_loop(0, src_ref.shape[0], body, 0)


def _token_step(S, q, k, v, g, beta, eye, *, scale: float, use_l2norm: bool, per_channel: bool = False,
                delta_rule: bool = True):
    """One token. S [K, bv] f32; q, k [1, K] f32; v [1, bv] f32; beta [1, 1] f32; g [1, 1] f32 (one
    decay for the head) or, per_channel, [1, K] f32 (one per key channel: row c of S decays by exp(g[c])).
    delta_rule=False drops the delta correction (the update is k (beta v)^T: Mamba2's SSD rule).
    Returns (new S, o [1, bv] = S_new^T q, delta [1, bv])."""
    if use_l2norm:
        q, k = l2norm_row(q), l2norm_row(k)
    q_col, k_col = row_to_col(q * scale, eye), row_to_col(k, eye)   # [K, 1]
    S = S * (row_to_col(jnp.exp(g), eye) if per_channel else jnp.exp(g))   # [K, 1] or [1, 1]
    if delta_rule:
        kv = jnp.sum(k_col * S, axis=0, keepdims=True)               # [1, bv] = S^T k
        delta = (v - kv) * beta
    else:
        delta = v * beta
    S = S + k_col * delta
    return S, jnp.sum(q_col * S, axis=0, keepdims=True), delta


def _token_step_vk(S, q, k, v, g, beta, eye_v):
    """`_token_step` without the delta rule on a value-major state S [bv, K] (the transpose of
    _token_step's): S <- exp(g) S + (beta v)^T k, o = (S q^T)^T. eye_v [bv, bv] turns the value row into a
    column and the output column back into a row."""
    delta = v * beta                                                   # [1, bv]
    S = S * jnp.exp(g) + row_to_col(delta, eye_v) * k                  # [bv, 1] * [1, K]
    o_col = jnp.sum(S * q, axis=1, keepdims=True)                      # [bv, 1]
    return S, jnp.sum(eye_v * o_col, axis=0, keepdims=True), delta


def _eye(K):
    ii = jax.lax.broadcasted_iota(jnp.int32, (K, K), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (K, K), 1)
    return (ii == jj).astype(jnp.float32)


def _gpu_kernel(seq_ref, flag_ref,                        # [B * T] int32
                q_ref, k_ref,                             # [T, K]
                v_ref,                                    # [T, bv]
                g_ref,                                    # [T, 1] f32, per_channel [T, K]
                b_ref,                                    # [T, 1] f32
                h0_ref,                                   # [NB, K, bv] f32
                o_ref,                                    # [T, bv]
                hT_ref,                                   # [NB, K, bv] f32 (aliases h0)
                *rest,                                    # states_ref [T, K, bv] or deltas_ref [T, bv] f32
                scale: float, use_l2norm: bool, T: int, keep: str | None, per_channel: bool = False,
                delta_rule: bool = True):
    out_ref = rest[0] if keep else None
    b = pl.program_id(0)
    eye = _eye(q_ref.shape[1])
    copy_states(h0_ref, hT_ref)

    def step(t, S):
        s = seq_ref[b * T + t]
        flag = flag_ref[b * T + t]
        first, valid = (flag & 1) == 1, (flag & 2) == 2
        S = jnp.where(first, h0_ref[s], S)
        S_new, o, delta = _token_step(
            S, q_ref[pl.ds(t, 1), :].astype(jnp.float32), k_ref[pl.ds(t, 1), :].astype(jnp.float32),
            v_ref[pl.ds(t, 1), :].astype(jnp.float32), g_ref[pl.ds(t, 1), :], b_ref[pl.ds(t, 1), :], eye,
            scale=scale, use_l2norm=use_l2norm, per_channel=per_channel, delta_rule=delta_rule)
        S = jnp.where(valid, S_new, S)
        o_ref[pl.ds(t, 1), :] = jnp.where(valid, o, 0.0).astype(o_ref.dtype)
        hT_ref[s] = jnp.where(valid, S, hT_ref[s])
        if keep == "states":
            out_ref[t] = S
        if keep == "deltas":
            out_ref[pl.ds(t, 1), :] = jnp.where(valid, delta, 0.0)
        return S

    jax.lax.fori_loop(0, T, step, jnp.zeros(h0_ref.shape[1:], jnp.float32))


def _tpu_kernel(seq_ref, flag_ref,                        # [B * Tp] int32 in SMEM
                q_ref, k_ref,                             # [Tb, K]
                v_ref,                                    # [Tb, bv]
                g_ref,                                    # [NT, Tb] f32 (the head's whole window);
                                                          # per_channel [Tb, K] f32 (this block's)
                b_ref,                                    # [NT, Tb] f32 (the head's whole window)
                h0_ref,                                   # [NB, K, bv] f32
                o_ref,                                    # [Tb, bv]
                hT_ref,                                   # [NB, K, bv] f32 (aliases h0)
                *rest,                                    # [states_ref [Tb, K, bv] | deltas_ref [Tb, bv]],
                                                          # S_scr [K, bv] f32, o_scr [Tb, bv] f32
                scale: float, use_l2norm: bool, Tp: int, Tb: int, keep: str | None, varl: bool,
                per_channel: bool = False, delta_rule: bool = True, state_vk: bool = False):
    out_ref = rest[0] if keep else None
    S_scr, o_scr = rest[-2:]
    b, tb = pl.program_id(0), pl.program_id(3)

    @pl.when(tb == 0)
    def _():
        copy_states(h0_ref, hT_ref)
        S_scr[...] = jnp.zeros(S_scr.shape, jnp.float32)

    eye = _eye(v_ref.shape[1] if state_vk else q_ref.shape[1])
    qs, ks, vs = (r[...].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))    # aligned whole-block loads
    b_row = b_ref[pl.ds(tb, 1), :]                                             # [1, Tb]
    if per_channel:
        gs = g_ref[...]                                   # [Tb, K], like q / k
    else:
        g_row = g_ref[pl.ds(tb, 1), :]                    # [1, Tb]
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, Tb), 1)
    S = S_scr[...]
    for r in range(Tb):                                   # static offsets: aligned slices of the blocks
        i = b * Tp + tb * Tb + r
        s = seq_ref[i]
        flag = flag_ref[i]
        first, valid = (flag & 1) == 1, (flag & 2) == 2
        S = jnp.where(first, h0_ref[s], S)
        if per_channel:
            g = gs[r:r + 1]                                                        # [1, K]
        else:
            g = jnp.sum(jnp.where(lane == r, g_row, 0.0), axis=1, keepdims=True)  # [1, 1]
        beta = jnp.sum(jnp.where(lane == r, b_row, 0.0), axis=1, keepdims=True)
        if state_vk:
            S_new, o, delta = _token_step_vk(S, qs[r:r + 1] * scale, ks[r:r + 1], vs[r:r + 1], g, beta, eye)
        else:
            S_new, o, delta = _token_step(S, qs[r:r + 1], ks[r:r + 1], vs[r:r + 1], g, beta, eye,
                                          scale=scale, use_l2norm=use_l2norm, per_channel=per_channel,
                                          delta_rule=delta_rule)
        S = jnp.where(valid, S_new, S)                    # tokens of no sequence leave the state alone
        o_scr[r:r + 1, :] = jnp.where(valid, o, 0.0)
        if varl:
            hT_ref[s] = jnp.where(valid, S, hT_ref[s])
        if keep == "states":
            out_ref[r] = S
        if keep == "deltas":
            out_ref[r:r + 1, :] = jnp.where(valid, delta, 0.0)
    S_scr[...] = S
    if not varl:                                          # one sequence per row: its state after the block
        hT_ref[0] = S
    o_ref[...] = o_scr[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "output_all_states",
                                             "use_qk_l2norm_in_kernel", "config", "backend", "interpret",
                                             "output_deltas", "delta_rule", "state_vk"))
def fused_recurrent_gated_delta_rule_pallas(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV] log decay per head (GDN), or [B, T, HV, K] per key channel (KDA)
    beta: jax.Array,         # [B, T, HV]
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    output_all_states: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    config: RecurrentConfig | None = None,
    backend: str = "tpu",
    interpret: bool = False,
    output_deltas: bool = False,
    state_indices: jax.Array | None = None,  # [B] int32: row b's state is initial_state[state_indices[b]]
    delta_rule: bool = True,
    state_vk: bool = False,
):
    """Fused recurrent kernel. Returns (o [B, T, HV, V] in v.dtype, final [N, HV, K, V] f32 or None)
    and, with output_all_states, the state after every token [B, T, HV, K, V] f32, or, with
    output_deltas, every token's state update [B, T, HV, V] f32.

    state_indices [B] (no cu_seqlens, no per-token output): initial_state is a pool [P, HV, K, V] f32
    of which row b reads and writes row state_indices[b]; the final state is the pool with those rows
    updated (rows visited twice, e.g. padding pointing at one null row, end as one of them). On TPU the
    kernel reaches the rows through a scalar-prefetched index and updates the pool in place (aliased):
    a decode step moves each row's state once, with no gather before or scatter after; the Triton
    variant gathers and scatters around the kernel.

    g [B, T, HV] decays the state of a head by one factor (Gated DeltaNet), g [B, T, HV, K] each of its
    key rows by its own (Kimi Delta Attention); the kernel is chosen statically from g.ndim.
    delta_rule=False drops the delta correction, S <- exp(g) S + k (beta v)^T (Mamba2's SSD rule,
    pallas_kernels.mamba2); output_deltas are then beta v. state_vk (with delta_rule=False): every state
    (initial, pool, final, output_all_states) is value-major, [.., HV, V, K] (module docstring: why).
    The initial state buffer is aliased to the final state (`input_output_aliases`): under
    `jax.jit(..., donate_argnames=...)` the state is updated in place."""
    per_channel = g.ndim == 4
    keep = per_token_output(output_all_states, output_deltas)
    if state_vk and (delta_rule or per_channel):
        raise KernelUnsupported("a value-major state (state_vk) is for the rule without the delta correction and "
                                "with one decay per head (Mamba2's)")
    if state_vk and backend != "tpu":             # the Triton kernel keeps [K, V]: transposed around it
        out = fused_recurrent_gated_delta_rule_pallas(
            q, k, v, g, beta, scale=scale, initial_state=_vk(initial_state), output_final_state=output_final_state,
            output_all_states=output_all_states, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens, config=config, backend=backend, interpret=interpret, output_deltas=output_deltas,
            state_indices=state_indices, delta_rule=delta_rule)
        return (out[0], _vk(out[1])) + ((_vk(out[2]),) if keep == "states" else out[2:])
    checked = _vk_shape(initial_state) if state_vk else initial_state     # the checks read [.., K, V]
    if state_indices is not None:
        check_state_indices(q, v, checked, state_indices, cu_seqlens, keep)
        pool = initial_state
        if backend != "tpu":
            return on_gathered_rows(lambda h0: fused_recurrent_gated_delta_rule_pallas(
                q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, config=config, backend=backend, interpret=interpret,
                delta_rule=delta_rule),
                pool, state_indices.astype(jnp.int32), output_final_state)
        initial_state = pool
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, None if state_indices is not None else checked,
                                     cu_seqlens, per_channel=per_channel)
    KV = (V, K) if state_vk else (K, V)           # a state's last two axes
    config = config or RecurrentConfig()
    bv = config.block_v or V
    _check_blocks(backend, K, V, bv)
    r = HV // H
    scale = default_scale(scale, K)
    if cu_seqlens is None:
        N, NB = (B if state_indices is None else initial_state.shape[0]), 1
        t = jnp.arange(T, dtype=jnp.int32)
        seq = jnp.zeros((B * T,), jnp.int32)
        flag = jnp.tile(jnp.where(t == 0, 3, 2).astype(jnp.int32), B)
    else:
        N = NB = varlen.check_cu_seqlens(cu_seqlens)
        s, first, valid = varlen.token_layout(cu_seqlens, T)
        seq, flag = s, first.astype(jnp.int32) + 2 * valid.astype(jnp.int32)
    h0 = (jnp.zeros((N, HV, *KV), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    qt, kt = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)         # [B, H, T, K]
    vt = v.transpose(0, 2, 1, 3)                                       # [B, HV, T, V]
    gt = g.astype(jnp.float32).swapaxes(1, 2)                          # [B, HV, T] (per_channel [B, HV, T, K])
    bt = beta.astype(jnp.float32).transpose(0, 2, 1)
    varl = cu_seqlens is not None
    out_shape = [jax.ShapeDtypeStruct((B, HV, T, V), v.dtype), jax.ShapeDtypeStruct((N, HV, *KV), jnp.float32)]
    if keep == "states":
        out_shape.append(jax.ShapeDtypeStruct((B, T, HV, *KV), jnp.float32))
    if keep == "deltas":
        out_shape.append(jax.ShapeDtypeStruct((B, HV, T, V), jnp.float32))
    # The batch axis revisits the same state block in a packed batch, so it is sequential there.
    b_sem = "arbitrary" if varl else "parallel"
    if backend == "tpu":
        Tb = T if T <= config.block_t else config.block_t
        NT = -(-T // Tb)
        Tp = NT * Tb
        pad = ((0, 0), (0, 0), (0, Tp - T))
        # Tokens past T (the last block's tail) belong to no sequence: flag 0. Their q/k/v rows are the
        # block padding Pallas adds; the state ignores them and their outputs are clipped.
        seq = jnp.pad(seq.reshape(B, T), ((0, 0), (0, Tp - T))).reshape(-1)
        flag = jnp.pad(flag.reshape(B, T), ((0, 0), (0, Tp - T))).reshape(-1)
        bt = jnp.pad(bt, pad).reshape(B, HV, NT, Tb)
        gt = jnp.pad(gt, pad + ((0, 0),)) if per_channel else jnp.pad(gt, pad).reshape(B, HV, NT, Tb)
        in_specs, out_specs = time_block_specs(B * Tp, Tb, NT, K, bv, r, NB, varl, per_channel=per_channel,
                                               state_vk=state_vk)
        if keep == "states":
            out_specs.append(pl.BlockSpec((None, Tb, None, bv, K), lambda b, h, j, t: (b, t, h, j, 0)) if state_vk
                             else pl.BlockSpec((None, Tb, None, K, bv), lambda b, h, j, t: (b, t, h, 0, j)))
        if keep == "deltas":
            out_specs.append(pl.BlockSpec((None, None, Tb, bv), lambda b, h, j, t: (b, h, t, j)))
        kernel = functools.partial(_tpu_kernel, scale=scale, use_l2norm=use_qk_l2norm_in_kernel, Tp=Tp, Tb=Tb,
                                   keep=keep, varl=varl, per_channel=per_channel, delta_rule=delta_rule,
                                   state_vk=state_vk)
        grid = (B, HV, V // bv, NT)
        scratch = [pltpu.VMEM((bv, K) if state_vk else (K, bv), jnp.float32), pltpu.VMEM((Tb, bv), jnp.float32)]
        params = compiler_params(backend, (b_sem, "parallel", "parallel", "arbitrary"),
                                 vmem_limit_bytes=TPU_VMEM_LIMIT)
        if state_indices is not None:
            # the state blocks are the pool's rows state_indices[b]: a scalar-prefetched index, the
            # pool aliased to the final state (rows no program visits keep what they held)
            in_specs, out_specs = pooled_specs(in_specs, out_specs, 7, 1)
            outs = pl.pallas_call(
                lambda idx_ref, *refs: kernel(*refs),
                grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=in_specs,
                                                       out_specs=out_specs, scratch_shapes=scratch),
                out_shape=out_shape, input_output_aliases={8: 1}, compiler_params=params, interpret=interpret,
                name=_kernel_name(per_channel, delta_rule),
                cost_estimate=_cost(q, k, v, None, out_shape[:1], HV, use_qk_l2norm_in_kernel,
                                    g if per_channel else None, state_rows=B, delta_rule=delta_rule),
            )(state_indices.astype(jnp.int32), seq, flag, qt, kt, vt, gt, bt, h0)
            return outs[0].transpose(0, 2, 1, 3), (outs[1] if output_final_state else None)
    else:
        in_specs, out_specs = whole_sequence_specs(backend, B * T, T, K, bv, r, NB, varl, per_channel=per_channel)
        bt = bt[..., None]                                             # [B, HV, T, 1]
        gt = gt if per_channel else gt[..., None]                      # [B, HV, T, 1] (per_channel [.., K])
        if keep == "states":
            out_specs.append(pl.BlockSpec((None, T, None, K, bv), lambda b, h, j: (b, 0, h, 0, j)))
        if keep == "deltas":
            out_specs.append(pl.BlockSpec((None, None, T, bv), lambda b, h, j: (b, h, 0, j)))
        kernel = functools.partial(_gpu_kernel, scale=scale, use_l2norm=use_qk_l2norm_in_kernel, T=T, keep=keep,
                                   per_channel=per_channel, delta_rule=delta_rule)
        grid, scratch = (B, HV, V // bv), []
        params = compiler_params(backend, (), config.num_warps)
    outs = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
        input_output_aliases={7: 1}, compiler_params=params, interpret=interpret,
        name=_kernel_name(per_channel, delta_rule),
        cost_estimate=_cost(q, k, v, h0, out_shape, HV, use_qk_l2norm_in_kernel, g if per_channel else None,
                            delta_rule=delta_rule),
    )(seq, flag, qt, kt, vt, gt, bt, h0)
    o = outs[0].transpose(0, 2, 1, 3)
    final = outs[1] if output_final_state else None
    if keep == "states":
        return o, final, outs[2]
    if keep == "deltas":
        return o, final, outs[2].transpose(0, 2, 1, 3)
    return o, final


def _vk(state):
    """A state's last two axes swapped (None stays None)."""
    return None if state is None else jnp.swapaxes(state, -1, -2)


def _vk_shape(state):
    """The shape a value-major state has in [.., K, V] terms, for the checks (None stays None)."""
    return None if state is None else jax.ShapeDtypeStruct(state.shape[:-2] + state.shape[:-3:-1], state.dtype)


def _kernel_name(per_channel: bool, delta_rule: bool) -> str:
    if not delta_rule:
        return "kda_ssd_fused_recurrent" if per_channel else "ssd_fused_recurrent"
    return "kda_fused_recurrent" if per_channel else "gdn_fused_recurrent"


def time_block_specs(n_meta: int, Tb: int, NT: int, K: int, bv: int, r: int, NB: int, varl: bool,
                     per_channel: bool = False, state_vk: bool = False):
    """The Mosaic layout of the GDN / KDA kernels: grid (B, HV, V / bv, NT), the last axis walking blocks of
    Tb tokens (q, k [Tb, K] of key head h // r; v [Tb, bv]); g and beta lane-dense, the head's whole
    [NT, Tb] resident, or, per_channel, g [Tb, K] of value head h walked like q / k (over g [B, HV, Tp, K]);
    the state block [NB, K, bv] ([NB, bv, K] value-major, state_vk); the two int32 vectors [n_meta] in SMEM.
    Returns (in_specs, out_specs) for (seq, flag, q, k, v, g, beta, h0) -> (o [Tb, bv], final state)."""
    hmap = ((lambda b, h, j, t: (0 if varl else b, h, j, 0)) if state_vk  # noqa: E731
            else (lambda b, h, j, t: (0 if varl else b, h, 0, j)))
    qk = pl.BlockSpec((None, None, Tb, K), lambda b, h, j, t: (b, jax.lax.div(h, r), t, 0))
    gates = pl.BlockSpec((None, None, NT, Tb), lambda b, h, j, t: (b, h, 0, 0))
    decay = pl.BlockSpec((None, None, Tb, K), lambda b, h, j, t: (b, h, t, 0)) if per_channel else gates
    rows = pl.BlockSpec((None, None, Tb, bv), lambda b, h, j, t: (b, h, t, j))
    state = pl.BlockSpec((NB, None, bv, K) if state_vk else (NB, None, K, bv), hmap)
    return ([smem_spec("tpu", n_meta), smem_spec("tpu", n_meta), qk, qk, rows, decay, gates, state], [rows, state])


def pooled_specs(in_specs: list, out_specs: list, state_in: int, state_out: int):
    """The specs of a kernel whose state block is a pool's row: index maps take the scalar-prefetched
    row indices as a trailing argument; the state's (in_specs[state_in], out_specs[state_out], block
    (1, None, K, bv) at (0, h, 0, j)) go to row idx[b], the others ignore it."""
    def ignore(spec):
        if spec.index_map is None:
            return spec
        return pl.BlockSpec(spec.block_shape, lambda *a, f=spec.index_map: f(*a[:-1]), memory_space=spec.memory_space)

    def row(spec):
        def index_map(b, h, j, t, idx, f=spec.index_map):
            return (idx[b],) + tuple(f(b, h, j, t))[1:]
        return pl.BlockSpec(spec.block_shape, index_map)

    ins = [row(sp) if i == state_in else ignore(sp) for i, sp in enumerate(in_specs)]
    outs = [row(sp) if i == state_out else ignore(sp) for i, sp in enumerate(out_specs)]
    return ins, outs


def whole_sequence_specs(backend: str, n_meta: int, L: int, K: int, bv: int, r: int, NB: int, varl: bool,
                         per_channel: bool = False):
    """The Triton layout of the GDN / KDA kernels: program (b, h, j) holds its head's whole sequence of L
    tokens (q, k [L, K] of key head h // r; v [L, bv]; g, beta [L, 1], or, per_channel, g [L, K]) and its
    state block [NB, K, bv]; the two per-step int32 vectors [n_meta] (sequence ids, flags) whole. Returns
    (in_specs, out_specs) for (seq, flag, q, k, v, g, beta, h0) -> (o [L, bv], final state)."""
    hmap = lambda b, h, j: (0 if varl else b, h, 0, j)  # noqa: E731
    qk = pl.BlockSpec((None, None, L, K), lambda b, h, j: (b, jax.lax.div(h, r), 0, 0))
    col = pl.BlockSpec((None, None, L, 1), lambda b, h, j: (b, h, 0, 0))
    decay = pl.BlockSpec((None, None, L, K), lambda b, h, j: (b, h, 0, 0)) if per_channel else col
    rows = pl.BlockSpec((None, None, L, bv), lambda b, h, j: (b, h, 0, j))
    state = pl.BlockSpec((NB, None, K, bv), hmap)
    return ([smem_spec(backend, n_meta), smem_spec(backend, n_meta), qk, qk, rows, decay, col, state], [rows, state])


def _cost(q, k, v, h0, out_shape, HV, l2norm, g_channels=None, state_rows: int = 0, delta_rule: bool = True):
    """Per token and value head: decay, S^T k, the rank-one update and S^T q over the [K, V] state
    (7 K V flops), the l2norms (4 K); exp(g) and two rsqrt. g_channels: a per-channel g [B, T, HV, K],
    K exps a token and as many bytes as q (a per-head g is negligible beside q, k, v). state_rows: the
    rows of a state pool read and written once each (h0 and the final state left out of out_shape).
    Without the delta rule S^T k is not formed: 5 K V flops."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    tokens = B * T * HV
    return cost(tokens * ((7 if delta_rule else 5) * K * V + (4 * K if l2norm else 0)),
                tokens * ((1 if g_channels is None else K) + (2 if l2norm else 0)),
                q, k, v, g_channels, h0, *out_shape, extra_bytes=2 * state_rows * HV * K * V * 4)


def _check_blocks(backend: str, K: int, V: int, bv: int):
    check_backend(backend)
    if V % bv:
        raise KernelUnsupported(f"block_v={bv} must divide V={V}")
    if backend == "tpu" and bv != V and bv % 128:
        raise KernelUnsupported(f"TPU blocks need block_v = V or a multiple of 128; got block_v={bv}, V={V}")
    if backend == "gpu":
        for name, x in (("K", K), ("block_v", bv)):
            if x & (x - 1):
                raise KernelUnsupported(f"the Triton kernel needs {name} a power of two; got {name}={x}")
