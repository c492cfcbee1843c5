"""Token-level reference of Mamba2's SSD rule: one `lax.scan` step per token.

For every token t and head h (group h // (H // G)), with dt_t the processed time step:
    S <- exp(dt_t A_h) S + B_t (dt_t x_t)^T          S [dstate, headdim]
    y_t = S^T C_t                                   (the D x skip term is added by ops.py)
It is the gated delta rule's reference scan (pallas_kernels.gated_delta_rule.naive) given this update,
which has no delta correction; q = C, k = B, v = x, g = dt A, beta = dt (common.py). Packed batches
(cu_seqlens) and the per-token outputs (states, or the updates dt x) are that module's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule.naive import STATIC, decay, recurrent_gated_delta_rule

ABI = abi.MAMBA2_SSD   # computes on state[N, H, dstate, headdim] f32; ops.py holds the ABI's transpose


def _update(S, q_t, k_t, v_t, g_t, b_t):
    # S: [B, G, r, N, P]; q_t (C), k_t (B): [B, G, N]; v_t (x): [B, G, r, P]; g_t (dt A), b_t (dt): [B, G, r]
    S = decay(S, g_t)
    delta = v_t * b_t[..., None]
    S = S + k_t[:, :, None, :, None] * delta[:, :, :, None, :]
    o_t = jnp.einsum("bhk,bhrkv->bhrv", q_t, S, precision="highest")
    return S, o_t, delta


# The gated delta rule's reference signature (q, k, v, g, beta, scale=, initial_state=, ...) with Mamba2's
# update: q = C, k = B [B, T, G, N]; v = x [B, T, H, P]; g = dt A, beta = dt [B, T, H]; pass scale=1.0.
# Returns (y [B, T, H, P] without the D term, final [N, H, dstate, headdim] f32 or None[, states | deltas]).
recurrent_ssd = functools.partial(recurrent_gated_delta_rule, update=_update)
naive_recurrent_ssd = jax.jit(recurrent_ssd, static_argnames=STATIC)
