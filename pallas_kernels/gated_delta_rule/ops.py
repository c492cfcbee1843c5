"""Public gated delta rule ops: one signature, implementations chosen by `impl`.

  impl="reference"  token-level `lax.scan` (naive.py)
  impl="xla"        chunked WY/UT form in plain XLA (chunk.py); the recurrent op a token scan
                    arranged for XLA (fused_recurrent.py), what a decode step or a short verify
                    window wants
  impl="pallas"     Pallas kernels (interpret mode on CPU)
  impl="auto"       Pallas on GPU/TPU, XLA on CPU
The platform is the one the program is lowered for (pallas_kernels.dispatch), so exporting or compiling
for a TPU from a CPU host carries the Mosaic kernel.

Every implementation takes `cu_seqlens` (a packed batch, B == 1, sequence n spanning tokens
cu_seqlens[n] .. cu_seqlens[n + 1] - 1, see varlen.py): the state is reset to initial_state[n] at
each sequence's start and the final state is [N, HV, K, V]. Shapes stay static; the values of
cu_seqlens may change without a retrace. Every implementation writes the same state layout, so all
share one kernel ABI id (`pallas_kernels.abi.GATED_DELTA_RULE`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import context_parallel, dispatch
from pallas_kernels.gated_delta_rule import chunk as _chunk
from pallas_kernels.gated_delta_rule import fused_recurrent as _fused_recurrent
from pallas_kernels.gated_delta_rule import naive as _naive
from pallas_kernels.gated_delta_rule.common import (check_inputs, check_state_indices, on_gathered_rows,
                                                    per_token_output)


def _pallas_chunk():
    from pallas_kernels.gated_delta_rule import pallas_chunk  # noqa: PLC0415
    return pallas_chunk.chunk_gated_delta_rule_pallas


def _pallas_recurrent():
    from pallas_kernels.gated_delta_rule import pallas_recurrent  # noqa: PLC0415
    return pallas_recurrent.fused_recurrent_gated_delta_rule_pallas


def _on_args(fn, **kw):
    """fn(q, k, v, g, beta, initial_state=, cu_seqlens=, **kw) as a function of the dispatched tuple."""
    return lambda q, k, v, g, beta, h0, cu, **be: fn(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **kw, **be)


def chunk_gated_delta_rule(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV]  log decay
    beta: jax.Array,         # [B, T, HV]
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    chunk_size: int | None = None,           # None: each implementation's best (XLA on CPU 32, Pallas 64)
    impl: str = "auto",
    context_axis: str | None = None,         # inside shard_map: tokens split by position over this axis
):
    """Gated delta rule over a whole sequence (prefill). Returns (o [B, T, HV, V], final [N, HV, K, V] or None).
    context_axis: called inside `jax.shard_map` over that mesh axis with q, k, v, g, beta split along T
    (each device a span of positions) and initial_state, cu_seqlens whole: the context-parallel form
    (pallas_kernels.context_parallel); o is the device's span, the final state every sequence's."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return run_chunk_op("chunk_gated_delta_rule", impl, (q, k, v, g, beta, initial_state, cu_seqlens),
                        _naive.naive_recurrent_gated_delta_rule, _chunk.chunk_gated_delta_rule_xla, _pallas_chunk,
                        chunk_size=chunk_size, context_axis=context_axis, output_final_state=output_final_state,
                        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def run_chunk_op(op: str, impl: str, args: tuple, reference, xla, pallas, *, chunk_size, context_axis,
                 output_final_state: bool, **kw):
    """A chunked delta-rule op (this rule's, or KDA's) on args (q, k, v, g, beta, h0, cu): reference / xla /
    pallas() its implementations, on one device or context-parallel over `context_axis`."""
    def rule(q, k, v, g, beta, h0, cu, final=output_final_state):
        k2 = dict(kw, output_final_state=final)
        return dispatch.run(
            op, impl, (q, k, v, g, beta, h0, cu), reference=_on_args(reference, **k2),
            xla=_on_args(xla, chunk_size=chunk_size, **k2),
            pallas=lambda: _on_args(pallas(), chunk_size=chunk_size, **k2))
    return context_parallel.run_rule(rule, args, context_axis, output_final_state)


def fused_recurrent_gated_delta_rule(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV]
    beta: jax.Array,         # [B, T, HV]
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    output_all_states: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,
    impl: str = "auto",
    output_deltas: bool = False,
    state_indices: jax.Array | None = None,  # [B] int32 rows of a pooled initial_state [P, HV, K, V]
):
    """Token-by-token gated delta rule (decode, speculative verify).
    Returns (o, final state or None) and, with output_all_states, the states [B, T, HV, K, V] too, or,
    with output_deltas, every token's state update [B, T, HV, V] (`state_after` rebuilds the state
    after any one token from them).
    state_indices: initial_state is a pool [P, HV, K, V] f32 whose row state_indices[b] is batch row b's
    state; the final state is the pool with those rows updated (the Pallas TPU kernel reads and writes
    them in place; the other implementations gather and scatter)."""
    if state_indices is not None:
        pool = check_state_indices(q, v, initial_state, state_indices, cu_seqlens,
                                   per_token_output(output_all_states, output_deltas))
        idx = state_indices.astype(jnp.int32)

        def gathered(fn):
            return lambda q, k, v, g, beta, pool, idx: on_gathered_rows(
                lambda h0: fn(q, k, v, g, beta, h0, None), pool, idx, output_final_state)
        kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        pooled = dict(kw, output_final_state=output_final_state)
        return dispatch.run(
            "fused_recurrent_gated_delta_rule", impl, (q, k, v, g, beta, pool, idx),
            reference=gathered(_on_args(_naive.naive_recurrent_gated_delta_rule, **kw)),
            xla=gathered(_on_args(_fused_recurrent.fused_recurrent_gated_delta_rule_xla, **kw)),
            pallas=lambda: (lambda q, k, v, g, beta, pool, idx, **be: _pallas_recurrent()(
                q, k, v, g, beta, initial_state=pool, state_indices=idx, **pooled, **be)))
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    kw = dict(scale=scale, output_final_state=output_final_state, output_all_states=output_all_states,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output_deltas=output_deltas)
    return dispatch.run(
        "fused_recurrent_gated_delta_rule", impl, (q, k, v, g, beta, initial_state, cu_seqlens),
        reference=_on_args(_naive.naive_recurrent_gated_delta_rule, **kw),
        xla=_on_args(_fused_recurrent.fused_recurrent_gated_delta_rule_xla, **kw),
        pallas=lambda: _on_args(_pallas_recurrent(), **kw))
