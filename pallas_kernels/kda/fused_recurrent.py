"""Token-by-token Kimi Delta Attention in plain XLA: the recurrent op's fast path off Pallas (a decode
step, a speculative verify window, replay).

As Gated DeltaNet's (pallas_kernels.gated_delta_rule.fused_recurrent), each token reads the state
twice, here with the decay a = exp(g_t) [K] a diagonal over the state's rows:
    [S^T (a k), S^T (a q)] = one contraction of the old state          (one pass over S)
    delta = beta (v - S^T (a k))
    o     = S^T (a q) + delta (k . q)                                  (S_new^T q expanded)
    S     = diag(a) S + k delta^T                                      (one fused pass)
with the state carried K-major, [B, H, K, r, V]. The decay is per value head, so the decayed q and k
are [B, H, r, K] (Gated DeltaNet's scalar decay leaves them per key head).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule.naive import STATIC, recurrent_gated_delta_rule

ABI = abi.KIMI_DELTA_ATTENTION

_HI = jax.lax.Precision.HIGHEST


def _update_k_major(S, q_t, k_t, v_t, g_t, b_t):
    # S: [B, H, K, r, V]; q_t, k_t: [B, H, K]; v_t: [B, H, r, V]; g_t: [B, H, r, K]; b_t: [B, H, r]
    a = jnp.exp(g_t)
    qk = jnp.stack([k_t, q_t], axis=2)[:, :, None] * a[:, :, :, None]                      # [B, H, r, 2, K]
    proj = jnp.einsum("bhrxk,bhkrv->bhxrv", qk, S, precision=_HI)                            # [B, H, 2, r, V]
    delta = (v_t - proj[:, :, 0]) * b_t[..., None]
    o_t = proj[:, :, 1] + delta * jnp.sum(q_t * k_t, axis=-1)[:, :, None, None]
    S = jnp.swapaxes(a, -1, -2)[..., None] * S + k_t[:, :, :, None, None] * delta[:, :, None]
    return S, o_t, delta


# Same arguments and returns as `naive.naive_recurrent_kda`.
fused_recurrent_kda_xla = jax.jit(
    functools.partial(recurrent_gated_delta_rule, update=_update_k_major, k_major=True, per_channel=True),
    static_argnames=STATIC)
