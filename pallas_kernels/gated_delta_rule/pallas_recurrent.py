"""Fused recurrent gated delta rule in Pallas: decode steps and speculative-verify windows.

One program per (batch row, value head, V block) walks the tokens with `lax.fori_loop`; the state
block [K, block_v] lives on chip (vector registers / VMEM on TPU, registers / shared memory on
GPU) for the whole window and goes back to HBM once, at the end. Gating (exp(g)), beta and the
q/k l2norm are fused into the loop. The update is independent per value column, so V is split
into blocks for parallelism (`RecurrentConfig.block_v`).

Backends (both are proven by `jax.export` tests on CPU, tests/pallas_kernels/test_export.py):
  * TPU: Mosaic TPU. Blocks are [T, K] / [T, block_v] rows (the (8, 128) rule holds: T, K are full
    dims, block_v is V or a multiple of 128); per-token metadata sits in SMEM.
  * GPU: Triton (`pallas.triton.CompilerParams`). JAX 0.10's default Mosaic GPU lowering lacks the
    reductions this kernel needs; Triton lowers them. Export needs
    `DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")`. Value shapes are powers of two
    (K and block_v must be).
The same kernel body serves both: the token step uses only elementwise ops and row/column
reductions (a q/k row becomes a column via a masked reduction against the identity), no M=1 matmul
and no transposes, which both lowerings handle.

With output_all_states the kernel also writes the state after every token, [B, T, HV, K, V]
(the speculative-decoding checkpoints: rollback by selecting slot `accepted - 1`). That block holds
T states on chip, so it is meant for short windows. With output_deltas it writes instead every
token's rank-one update delta_t, [B, T, HV, V], K times less: `rebuild.state_after` makes the state
after any one token from them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule import varlen
from pallas_kernels.gated_delta_rule.common import check_inputs, default_scale, per_token_output

ABI = abi.GATED_DELTA_RULE   # writes state[N, HV, K, V] f32, like every other implementation
BACKENDS = ("tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Block sizes. block_v: columns of the state per program (None: all of V)."""
    block_v: int | None = None
    num_warps: int = 4         # Triton only


def default_backend() -> str:
    """The kernel variant for the current default device: `gpu` on GPUs, `tpu` otherwise."""
    return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"


def compiler_params(backend: str, semantics: tuple[str, ...], num_warps: int = 4, num_stages: int | None = None):
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        return pltpu.CompilerParams(dimension_semantics=semantics)
    if backend == "gpu":
        from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
        return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")


def smem_spec(backend: str, n: int):
    """A whole small int32 vector: SMEM on TPU, an ordinary block on GPU."""
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((n,), lambda *_: (0,))


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


def _recurrent_kernel(seq_ref, flag_ref,                  # [B * T] int32 (SMEM on TPU)
                      q_ref, k_ref,                       # [T, K]
                      v_ref,                              # [T, bv]
                      g_ref, b_ref,                       # [T, 1] f32
                      h0_ref,                             # [NB, K, bv] f32
                      o_ref,                              # [T, bv]
                      hT_ref,                             # [NB, K, bv] f32 (aliases h0)
                      *rest,                              # states_ref [T, K, bv] or deltas_ref [T, bv] f32
                      scale: float, use_l2norm: bool, T: int, keep: str | None):
    states_ref = rest[0] if keep == "states" else None
    deltas_ref = rest[0] if keep == "deltas" else None
    b = pl.program_id(0)
    K = q_ref.shape[1]
    ii = jax.lax.broadcasted_iota(jnp.int32, (K, K), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (K, K), 1)
    eye = (ii == jj).astype(jnp.float32)
    copy_states(h0_ref, hT_ref)

    def step(t, S):
        s = seq_ref[b * T + t]
        flag = flag_ref[b * T + t]
        first, valid = (flag & 1) == 1, (flag & 2) == 2
        S = jnp.where(first, h0_ref[s], S)
        q = q_ref[pl.ds(t, 1), :].astype(jnp.float32)          # [1, K]
        k = k_ref[pl.ds(t, 1), :].astype(jnp.float32)
        if use_l2norm:
            q, k = l2norm_row(q), l2norm_row(k)
        q_col, k_col = row_to_col(q * scale, eye), row_to_col(k, eye)   # [K, 1]
        v = v_ref[pl.ds(t, 1), :].astype(jnp.float32)          # [1, bv]
        S = S * jnp.exp(g_ref[pl.ds(t, 1), :])                 # [1, 1] broadcast
        kv = jnp.sum(k_col * S, axis=0, keepdims=True)         # [1, bv] = S^T k
        delta = (v - kv) * b_ref[pl.ds(t, 1), :]               # [1, bv]
        S = S + k_col * delta
        o = jnp.sum(q_col * S, axis=0, keepdims=True)          # [1, bv] = S^T q
        o_ref[pl.ds(t, 1), :] = jnp.where(valid, o, 0.0).astype(o_ref.dtype)
        hT_ref[s] = jnp.where(valid, S, hT_ref[s])
        if states_ref is not None:
            states_ref[t] = S
        if deltas_ref is not None:
            deltas_ref[pl.ds(t, 1), :] = jnp.where(valid, delta, 0.0)
        return S

    jax.lax.fori_loop(0, T, step, jnp.zeros(h0_ref.shape[1:], jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "output_all_states",
                                             "use_qk_l2norm_in_kernel", "config", "backend", "interpret",
                                             "output_deltas"))
def fused_recurrent_gated_delta_rule_pallas(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV]  log decay
    beta: jax.Array,         # [B, T, HV]
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    output_all_states: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    config: RecurrentConfig | None = None,
    backend: str | None = None,
    interpret: bool = False,
    output_deltas: bool = False,
):
    """Fused recurrent kernel. Returns (o [B, T, HV, V] in v.dtype, final [N, HV, K, V] f32 or None)
    and, with output_all_states, the state after every token [B, T, HV, K, V] f32, or, with
    output_deltas, every token's state update [B, T, HV, V] f32.

    The initial state buffer is aliased to the final state (`input_output_aliases`): under
    `jax.jit(..., donate_argnames=...)` the state is updated in place."""
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    keep = per_token_output(output_all_states, output_deltas)
    config = config or RecurrentConfig()
    backend = backend or default_backend()
    bv = config.block_v or V
    _check_blocks(backend, K, V, bv)
    r = HV // H
    scale = default_scale(scale, K)
    if cu_seqlens is None:
        N, NB = B, 1
        t = jnp.arange(T, dtype=jnp.int32)
        seq = jnp.zeros((B * T,), jnp.int32)
        flag = jnp.tile(jnp.where(t == 0, 3, 2).astype(jnp.int32), B)
    else:
        N = NB = varlen.check_cu_seqlens(cu_seqlens)
        s, first, valid = varlen.token_layout(cu_seqlens, T)
        seq, flag = s, first.astype(jnp.int32) + 2 * valid.astype(jnp.int32)
    h0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    qt, kt = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)         # [B, H, T, K]
    vt = v.transpose(0, 2, 1, 3)                                       # [B, HV, T, V]
    gt = g.astype(jnp.float32).transpose(0, 2, 1)[..., None]           # [B, HV, T, 1]
    bt = beta.astype(jnp.float32).transpose(0, 2, 1)[..., None]

    hblk = (lambda b, h, j: (b, h, 0, j)) if cu_seqlens is None else (lambda b, h, j: (0, h, 0, j))
    in_specs = [
        smem_spec(backend, B * T), smem_spec(backend, B * T),
        pl.BlockSpec((None, None, T, K), lambda b, h, j: (b, jax.lax.div(h, r), 0, 0)),
        pl.BlockSpec((None, None, T, K), lambda b, h, j: (b, jax.lax.div(h, r), 0, 0)),
        pl.BlockSpec((None, None, T, bv), lambda b, h, j: (b, h, 0, j)),
        pl.BlockSpec((None, None, T, 1), lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((None, None, T, 1), lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((NB, None, K, bv), hblk),
    ]
    out_specs = [pl.BlockSpec((None, None, T, bv), lambda b, h, j: (b, h, 0, j)),
                 pl.BlockSpec((NB, None, K, bv), hblk)]
    out_shape = [jax.ShapeDtypeStruct((B, HV, T, V), v.dtype), jax.ShapeDtypeStruct((N, HV, K, V), jnp.float32)]
    if keep == "states":
        out_specs.append(pl.BlockSpec((None, T, None, K, bv), lambda b, h, j: (b, 0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, T, HV, K, V), jnp.float32))
    if keep == "deltas":
        out_specs.append(pl.BlockSpec((None, None, T, bv), lambda b, h, j: (b, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, HV, T, V), jnp.float32))
    kernel = functools.partial(_recurrent_kernel, scale=scale, use_l2norm=use_qk_l2norm_in_kernel, T=T, keep=keep)
    # The batch axis revisits the same state block in a packed batch, so it is sequential there.
    sem = ("parallel" if cu_seqlens is None else "arbitrary", "parallel", "parallel")
    outs = pl.pallas_call(
        kernel, grid=(B, HV, V // bv), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={7: 1},
        compiler_params=compiler_params(backend, sem, config.num_warps),
        interpret=interpret, name="gdn_fused_recurrent",
    )(seq, flag, qt, kt, vt, gt, bt, h0)
    o = outs[0].transpose(0, 2, 1, 3)
    final = outs[1] if output_final_state else None
    if keep == "states":
        return o, final, outs[2]
    if keep == "deltas":
        return o, final, outs[2].transpose(0, 2, 1, 3)
    return o, final


def _check_blocks(backend: str, K: int, V: int, bv: int):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if V % bv:
        raise ValueError(f"block_v={bv} must divide V={V}")
    if backend == "tpu" and bv != V and bv % 128:
        raise ValueError(f"TPU blocks need block_v = V or a multiple of 128; got block_v={bv}, V={V}")
    if backend == "gpu":
        for name, x in (("K", K), ("block_v", bv)):
            if x & (x - 1):
                raise ValueError(f"the Triton kernel needs {name} a power of two; got {name}={x}")
