"""Token-by-token Mamba2 SSD in plain XLA: the recurrent op's fast path off Pallas (a decode step, a
speculative verify window, replay).

The rule is the reference's (naive.py), S <- a S + B (dt x)^T with a = exp(dt A), y = S^T C, arranged
so each token reads the state once:
    y = a S^T C + (dt x) (B . C)        (S_new^T C expanded: one contraction of the old state)
    S = a S + B (dt x)^T                (one fused pass)
with the state carried K-major, [B, G, dstate, r, headdim], as Gated DeltaNet's fused_recurrent.py does:
the contraction over dstate is then one batched matmul with the r heads of a group side by side.
The results equal the reference's up to rounding (a different order of the same products).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule.naive import STATIC, recurrent_gated_delta_rule

ABI = abi.MAMBA2_SSD

_HI = jax.lax.Precision.HIGHEST


def _update_k_major(S, q_t, k_t, v_t, g_t, b_t):
    # S: [B, G, N, r, P]; q_t (C), k_t (B): [B, G, N]; v_t (x): [B, G, r, P]; g_t, b_t: [B, G, r]
    a = jnp.exp(g_t)
    proj = jnp.einsum("bhk,bhkrv->bhrv", q_t, S, precision=_HI)                     # [B, G, r, P]
    delta = v_t * b_t[..., None]
    o_t = a[..., None] * proj + delta * jnp.sum(q_t * k_t, axis=-1)[:, :, None, None]
    S = a[:, :, None, :, None] * S + k_t[:, :, :, None, None] * delta[:, :, None]
    return S, o_t, delta


# Same arguments and returns as `naive.naive_recurrent_ssd`.
fused_recurrent_ssd_xla = jax.jit(
    functools.partial(recurrent_gated_delta_rule, update=_update_k_major, k_major=True), static_argnames=STATIC)
