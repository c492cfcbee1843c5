"""Public Kimi Delta Attention ops: Gated DeltaNet's signatures (pallas_kernels.gated_delta_rule.ops) with
the decay per key channel, g [B, T, HV, K]; implementations chosen by `impl` like every op here:

  impl="reference"  token-level `lax.scan` (naive.py)
  impl="xla"        chunked WY/UT form in log space (chunk.py); the recurrent op a token scan
                    arranged for XLA (fused_recurrent.py)
  impl="pallas"     Pallas kernels (interpret mode on CPU): the chunked kernel pallas_chunk.py, the
                    recurrent one Gated DeltaNet's, which takes a per-channel gate
  impl="auto"       Pallas on GPU/TPU, XLA on CPU
chosen by the platform the program is lowered for (pallas_kernels.dispatch). Every implementation takes
`cu_seqlens` and writes the state [N, HV, K, V] f32 (`pallas_kernels.abi.KIMI_DELTA_ATTENTION`).
"""
from __future__ import annotations

import jax

from pallas_kernels import dispatch
from pallas_kernels.gated_delta_rule.common import check_inputs
from pallas_kernels.gated_delta_rule.ops import _on_args, _pallas_recurrent, run_chunk_op
from pallas_kernels.kda import chunk as _chunk
from pallas_kernels.kda import fused_recurrent as _fused_recurrent
from pallas_kernels.kda import naive as _naive


def _pallas_chunk():
    from pallas_kernels.kda import pallas_chunk  # noqa: PLC0415
    return pallas_chunk.chunk_kda_pallas


def chunk_kda(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV, K]  log decay per key channel
    beta: jax.Array,         # [B, T, HV]
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    chunk_size: int | None = None,           # None: each implementation's best
    impl: str = "auto",
    context_axis: str | None = None,         # inside shard_map: tokens split by position over this axis
):
    """KDA over a whole sequence (prefill). Returns (o [B, T, HV, V], final [N, HV, K, V] or None).
    context_axis: the context-parallel form, as `chunk_gated_delta_rule`'s."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    return run_chunk_op("chunk_kda", impl, (q, k, v, g, beta, initial_state, cu_seqlens), _naive.naive_recurrent_kda,
                        _chunk.chunk_kda_xla, _pallas_chunk, chunk_size=chunk_size, context_axis=context_axis,
                        output_final_state=output_final_state, scale=scale,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_kda(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV, K]
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
):
    """Token-by-token KDA (decode, speculative verify). Returns (o, final state or None) and, with
    output_all_states, the states [B, T, HV, K, V] too, or, with output_deltas, every token's state
    update [B, T, HV, V] (`pallas_kernels.state_after` rebuilds the state after any one token)."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    kw = dict(scale=scale, output_final_state=output_final_state, output_all_states=output_all_states,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output_deltas=output_deltas)
    return dispatch.run(
        "fused_recurrent_kda", impl, (q, k, v, g, beta, initial_state, cu_seqlens),
        reference=_on_args(_naive.naive_recurrent_kda, **kw),
        xla=_on_args(_fused_recurrent.fused_recurrent_kda_xla, **kw),
        pallas=lambda: _on_args(_pallas_recurrent(), **kw))
