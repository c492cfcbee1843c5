"""Token-by-token Kimi Delta Attention in plain XLA: the recurrent op's fast path off Pallas (a decode
step, a speculative verify window, replay).

As Gated DeltaNet's (pallas_kernels.gated_delta_rule.fused_recurrent), each token reads the state
twice, here with the decay a = exp(g_t) [K] a diagonal over the state's rows:
    [S^T (a k), S^T (a q)] = one contraction of the old state          (one pass over S)
    delta = beta (v - S^T (a k))
    o     = S^T (a q) + delta (k . q)                                  (S_new^T q expanded)
    S     = diag(a) S + k delta^T                                      (one fused pass)
The decay is per value head, so the decayed q and k are too ([B, H, r, K]), and the state is carried as
the reference lays it out, [B, H, r, K, V]: the contraction is then a matmul batched over (B, H, r). GDN's
K-major layout, [B, H, K, r, V], which lets the r value heads of a key head share one matmul, made XLA:CPU
move the state every token here: at B = 1, T = 2048, H = 16, K = V = 128 it ran 386 ms against 135 ms.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule.naive import STATIC, recurrent_gated_delta_rule

ABI = abi.KIMI_DELTA_ATTENTION

_HI = jax.lax.Precision.HIGHEST


def _update(S, q_t, k_t, v_t, g_t, b_t):
    # S: [B, H, r, K, V]; q_t, k_t: [B, H, K]; v_t: [B, H, r, V]; g_t: [B, H, r, K]; b_t: [B, H, r]
    a = jnp.exp(g_t)
    qk = jnp.stack([k_t, q_t], axis=2)[:, :, None] * a[:, :, :, None]                      # [B, H, r, 2, K]
    proj = jnp.einsum("bhrxk,bhrkv->bhrxv", qk, S, precision=_HI)                            # [B, H, r, 2, V]
    delta = (v_t - proj[:, :, :, 0]) * b_t[..., None]
    o_t = proj[:, :, :, 1] + delta * jnp.sum(q_t * k_t, axis=-1)[:, :, None, None]
    S = a[..., None] * S + k_t[:, :, None, :, None] * delta[:, :, :, None, :]
    return S, o_t, delta


# Same arguments and returns as `naive.naive_recurrent_kda`.
fused_recurrent_kda_xla = jax.jit(functools.partial(recurrent_gated_delta_rule, update=_update, per_channel=True),
                                  static_argnames=STATIC)
