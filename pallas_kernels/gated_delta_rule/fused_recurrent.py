"""Token-by-token gated delta rule in plain XLA: the recurrent op's fast path off Pallas (a decode
step, a speculative verify window, replay).

The recurrence is the reference's (naive.py), S <- a S + k delta^T with a = exp(g) and
delta = beta (v - a S^T k), o = S^T q, arranged so each token reads the state twice instead of
five times:
    [S^T k, S^T q] = one contraction of the old state with [k; q]        (one pass over S)
    delta = beta (v - a S^T k)
    o     = a S^T q + delta (k . q)                                      (no pass: S_new^T q expanded)
    S     = a S + k delta^T                                              (one fused pass)
and the state is carried K-major, [B, H, K, r, V] (one transpose before and after the scan), so
the contraction over K is a plain batched matmul with the r value heads of a key head side by side:
XLA:CPU otherwise transposes the state every token. At B = 8, T = 33 (H = 2, r = 2, K = V = 32)
one layer's scan ran 216 us against the reference's 627 us. The results equal the reference's up
to rounding (a different order of the same products).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule.naive import STATIC, recurrent_gated_delta_rule

ABI = abi.GATED_DELTA_RULE   # writes state[N, HV, K, V] f32, like every other implementation

_HI = jax.lax.Precision.HIGHEST


def _update_k_major(S, q_t, k_t, v_t, g_t, b_t):
    # S: [B, H, K, r, V]; q_t, k_t: [B, H, K]; v_t: [B, H, r, V]; g_t, b_t: [B, H, r]
    a = jnp.exp(g_t)
    proj = jnp.einsum("bhxk,bhkrv->bhxrv", jnp.stack([k_t, q_t], axis=2), S, precision=_HI)   # [B, H, 2, r, V]
    delta = (v_t - a[..., None] * proj[:, :, 0]) * b_t[..., None]
    o_t = a[..., None] * proj[:, :, 1] + delta * jnp.sum(q_t * k_t, axis=-1)[:, :, None, None]
    S = a[:, :, None, :, None] * S + k_t[:, :, :, None, None] * delta[:, :, None]
    return S, o_t, delta


# Same arguments and returns as `naive.naive_recurrent_gated_delta_rule`.
fused_recurrent_gated_delta_rule_xla = jax.jit(
    functools.partial(recurrent_gated_delta_rule, update=_update_k_major, k_major=True), static_argnames=STATIC)
