"""Token-level reference of Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel.

For every token t and value head hv (key head h = hv // (HV // H)), with g_t [K] the log decay:
    S <- diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t
It is the Gated DeltaNet reference (pallas_kernels.gated_delta_rule.naive) run with a per-channel gate:
the scan, the packed batches (cu_seqlens) and the per-token outputs are that module's; only the decay
broadcasts over the state's rows instead of the whole state.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule.naive import STATIC, recurrent_gated_delta_rule

ABI = abi.KIMI_DELTA_ATTENTION   # writes state[N, HV, K, V] f32, like every other implementation

# q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] log decay (<= 0); beta [B, T, HV]; the rest as
# `recurrent_gated_delta_rule`'s (initial_state [N, HV, K, V] f32, cu_seqlens, output_all_states,
# output_deltas). Returns (o [B, T, HV, V], final [N, HV, K, V] f32 or None[, states | deltas]).
recurrent_kda = functools.partial(recurrent_gated_delta_rule, per_channel=True)
naive_recurrent_kda = jax.jit(recurrent_kda, static_argnames=STATIC)
