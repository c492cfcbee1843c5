"""Public Mamba2 (SSD) ops, in mamba_ssm's terms (x, dt, A, B, C, D, dt_bias; common.py), implementations
chosen by `impl` like every op here:

  impl="reference"  token-level `lax.scan` (naive.py)
  impl="xla"        the chunked SSD form (chunk.py); the recurrent op a token scan arranged for XLA
                    (fused_recurrent.py)
  impl="pallas"     Gated DeltaNet's Pallas kernels without the delta correction (`delta_rule=False`:
                    gated_delta_rule/pallas_chunk.py, pallas_recurrent.py); interpret mode on CPU
  impl="auto"       Pallas on GPU/TPU, XLA on CPU
chosen by the platform the program is lowered for (pallas_kernels.dispatch). The time step (dt_bias,
softplus, clamp) and the D skip term are computed here, in XLA, around whichever implementation runs.
Every implementation takes `cu_seqlens` and writes the state [N, H, headdim, dstate] f32, transformers'
layout (`pallas_kernels.abi.MAMBA2_SSD` v3): the token-by-token Pallas kernel holds it so (`state_vk`: a
minor axis of 128 lanes, which the TPU lays out as given); the others compute on [.., dstate, headdim], the
gated delta rule's [K, V], and are transposed around (`_headdim_major`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import context_parallel, dispatch
from pallas_kernels.gated_delta_rule.common import check_state_indices, on_gathered_rows, per_token_output
from pallas_kernels.gated_delta_rule.ops import _on_args
from pallas_kernels.mamba2 import chunk as _chunk
from pallas_kernels.mamba2 import fused_recurrent as _fused_recurrent
from pallas_kernels.mamba2 import naive as _naive
from pallas_kernels.mamba2.common import NO_LIMIT, TimeStep, as_rule_args, check_inputs, with_skip

_RULE = dict(scale=1.0, use_qk_l2norm_in_kernel=False)


def _t(state):
    return None if state is None else jnp.swapaxes(state, -1, -2)


def _headdim_major(fn, all_states: bool = False):
    """fn(q, k, v, g, beta, h0, cu) over [.., dstate, headdim] states (the gated delta rule's [K, V]) as a
    function of the ABI's [.., headdim, dstate]: the initial state, the final one and, with all_states,
    the per-token states transposed."""
    def run(q, k, v, g, beta, h0, cu, **be):
        out = fn(q, k, v, g, beta, _t(h0), cu, **be)
        return (out[0], _t(out[1])) + tuple(_t(x) if all_states else x for x in out[2:])
    return run


def _pallas_chunk():
    from pallas_kernels.gated_delta_rule import pallas_chunk  # noqa: PLC0415
    return functools.partial(pallas_chunk.chunk_gated_delta_rule_pallas, delta_rule=False)


def _pallas_recurrent():
    from pallas_kernels.gated_delta_rule import pallas_recurrent  # noqa: PLC0415
    return functools.partial(pallas_recurrent.fused_recurrent_gated_delta_rule_pallas, delta_rule=False)


def chunk_mamba2(
    x: jax.Array,            # [B, T, H, P]
    dt: jax.Array,           # [B, T, H]  raw time step
    A: jax.Array,            # [H]  negative: -exp(A_log)
    B: jax.Array,            # [B, T, G, N]
    C: jax.Array,            # [B, T, G, N]
    *,
    D: jax.Array | None = None,              # [H]
    dt_bias: jax.Array | None = None,        # [H]
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_state: jax.Array | None = None,  # [N, H, headdim, dstate] f32
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    chunk_size: int | None = None,           # None: each implementation's best (XLA 32, Pallas 64)
    impl: str = "auto",
    context_axis: str | None = None,         # inside shard_map: tokens split by position over this axis
):
    """Mamba2's scan over a whole sequence (prefill), mamba_chunk_scan_combined's rule (no z).
    Returns (y [B, T, H, P] in x.dtype, final [N, H, headdim, dstate] f32 or None).
    context_axis: the context-parallel form, as `chunk_gated_delta_rule`'s (x, dt, B, C split along T)."""
    check_inputs(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens)
    a = as_rule_args(x, dt, A, B, C, dt_bias, TimeStep(dt_softplus, tuple(dt_limit)))

    def rule(q, k, v, g, beta, h0, cu, final=output_final_state):       # states [.., dstate, headdim]
        kw = dict(_RULE, output_final_state=final)
        return dispatch.run(
            "chunk_mamba2", impl, (q, k, v, g, beta, h0, cu),
            reference=_on_args(_naive.naive_recurrent_ssd, **kw),
            xla=_on_args(_chunk.chunk_ssd_xla, chunk_size=chunk_size, **kw),
            pallas=lambda: _on_args(_pallas_chunk(), chunk_size=chunk_size, **kw))
    y, final = context_parallel.run_rule(rule, (a.q, a.k, a.v, a.g, a.beta, _t(initial_state), cu_seqlens),
                                         context_axis, output_final_state)
    local_cu = context_parallel.local_cu_seqlens(cu_seqlens, x.shape[1], context_axis)
    return with_skip(y, x, D, local_cu), _t(final)


def fused_recurrent_mamba2(
    x: jax.Array,            # [B, T, H, P]
    dt: jax.Array,           # [B, T, H]
    A: jax.Array,            # [H]
    B: jax.Array,            # [B, T, G, N]
    C: jax.Array,            # [B, T, G, N]
    *,
    D: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_state: jax.Array | None = None,  # [N, H, headdim, dstate] f32 (a pool [P, ...] with state_indices)
    output_final_state: bool = False,
    output_all_states: bool = False,
    output_deltas: bool = False,
    cu_seqlens: jax.Array | None = None,
    state_indices: jax.Array | None = None,  # [B] int32 rows of a pooled initial_state
    impl: str = "auto",
):
    """Token-by-token Mamba2 (decode, speculative verify), selective_state_update's rule for T tokens.
    Returns (y, final state or None) and, with output_all_states, the state after every token
    [B, T, H, headdim, dstate] f32 too, or, with output_deltas, every token's update dt x [B, T, H, P] f32
    (`pallas_kernels.state_after(h0, B, dt A, deltas, idx)` rebuilds the state after any one token).
    state_indices: initial_state is a pool [P, H, headdim, dstate] f32 whose row state_indices[b] is batch
    row b's state; the final state is the pool with those rows updated (in place on TPU)."""
    check_inputs(x, dt, A, B, C, D, dt_bias, None if state_indices is not None else initial_state, cu_seqlens)
    a = as_rule_args(x, dt, A, B, C, dt_bias, TimeStep(dt_softplus, tuple(dt_limit)))
    args = (a.q, a.k, a.v, a.g, a.beta)
    if state_indices is not None:
        out = _pooled(args, initial_state, state_indices, cu_seqlens, output_final_state,
                      per_token_output(output_all_states, output_deltas), impl)
    else:
        kw = dict(_RULE, output_final_state=output_final_state, output_all_states=output_all_states,
                  output_deltas=output_deltas)
        out = dispatch.run(
            "fused_recurrent_mamba2", impl, args + (initial_state, cu_seqlens),
            reference=_headdim_major(_on_args(_naive.naive_recurrent_ssd, **kw), output_all_states),
            xla=_headdim_major(_on_args(_fused_recurrent.fused_recurrent_ssd_xla, **kw), output_all_states),
            pallas=lambda: _on_args(_pallas_recurrent(), state_vk=True, **kw))
    return (with_skip(out[0], x, D, cu_seqlens),) + tuple(out[1:])


def _pooled(args, pool, state_indices, cu_seqlens, output_final_state, keep, impl):
    """fused_recurrent_mamba2 over rows state_indices of a state pool (GDN's pooled decode)."""
    q, _, v, _, _ = args
    check_state_indices(q, v, jax.ShapeDtypeStruct(pool.shape[:2] + pool.shape[:1:-1], pool.dtype), state_indices,
                        cu_seqlens, keep)                 # checked as [P, H, dstate, headdim], the rule's terms
    idx = state_indices.astype(jnp.int32)
    kw = dict(_RULE, output_final_state=True)

    def gathered(fn):
        return lambda q, k, v, g, beta, pool, idx: on_gathered_rows(
            lambda h0: _headdim_major(fn)(q, k, v, g, beta, h0, None), pool, idx, output_final_state)
    return dispatch.run(
        "fused_recurrent_mamba2", impl, args + (pool, idx),
        reference=gathered(_on_args(_naive.naive_recurrent_ssd, **kw)),
        xla=gathered(_on_args(_fused_recurrent.fused_recurrent_ssd_xla, **kw)),
        pallas=lambda: (lambda q, k, v, g, beta, pool, idx, **be: _pallas_recurrent()(
            q, k, v, g, beta, initial_state=pool, state_indices=idx, state_vk=True,
            **dict(_RULE, output_final_state=output_final_state), **be)))
