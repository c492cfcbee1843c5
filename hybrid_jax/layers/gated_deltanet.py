"""Gated DeltaNet mixer (Qwen3-Next's linear attention).

Fused input projection (q | k | v | z | b | a, converted from HF's per-key-head-grouped layout at
load), causal depthwise conv over q|k|v with a (W-1)-token conv state, l2-normalised q/k, the gated
delta rule (chunked for prefill, recurrent for a decode step), gated RMSNorm, output projection.
Padding tokens (valid = False) get g = 0 and beta = 0, which leave the recurrent state untouched.

Speculative decoding: `fused_recurrent=True` runs the token-level kernel whatever T (a verify or
replay window numerically equal to T decode steps); `per_token_states=True` (implies it) also
returns what the state after any position is made from, so a verify step can roll back by selecting
the state after its last accepted token: the conv inputs (each position's conv window is a slice of
them) and the recurrence's per-token rank-one updates (`pallas_kernels.state_after`), rather than
T copies of the conv window and of the [HV, K, V] state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from cache.state import conv_state_after
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.norms import gated_rms_norm


def causal_conv(x: jax.Array, conv_state: jax.Array, w: jax.Array, n_new: jax.Array, return_window: bool = False):
    """Depthwise causal conv + SiLU.  x: [B, T, C]; conv_state: [B, W-1, C]; w: [W, C]; n_new: [B].
    Returns (y [B, T, C], new conv_state [B, W-1, C]: the last W-1 inputs up to each row's end) and,
    with return_window, the conv state and inputs [B, W-1+T, C] (`cache.state.conv_state_after` reads the state
    after any position from it)."""
    W = w.shape[0]
    T = x.shape[1]
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)       # [B, W-1+T, C]
    y = sum(window[:, j:j + T] * w[j] for j in range(W))
    new_state = conv_state_after(window, n_new - 1, W)
    if return_window:
        return jax.nn.silu(y), new_state, window
    return jax.nn.silu(y), new_state


def gated_deltanet(p: dict, x: jax.Array, valid: jax.Array, n_new: jax.Array, conv_state: jax.Array,
                   ssm_state: jax.Array, *, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                   head_v_dim: int, eps: float, impl: str = "auto", fused_recurrent: bool = False,
                   per_token_states: bool = False):
    """x: [B, T, Hd]; valid: [B, T]; n_new: [B]; conv_state: [B, W-1, C]; ssm_state: [B, HV, K, V] fp32.
    Returns (out [B, T, Hd], conv_state, ssm_state) and, with per_token_states, a dict of what the
    states after every position are made from: conv_window [B, W-1+T, C] (for `RecurrentGroup.truncate`);
    ssm0 [B, HV, K, V] (the state before the window), k [B, T, H, K], g [B, T, HV] and delta
    [B, T, HV, V] fp32 (for `pallas_kernels.state_after`, with use_qk_l2norm_in_kernel=True).
    Padding positions (past n_new) have g = 0 and delta = 0: their state is the last real one."""
    B, T, _ = x.shape
    H, HV, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    proj = linear(x, p["in_proj"])
    qkv, z, b, a = jnp.split(proj, [2 * H * K + HV * V, 2 * H * K + 2 * HV * V, 2 * H * K + 2 * HV * V + HV],
                             axis=-1)
    if per_token_states:
        qkv, conv_state, conv_window = causal_conv(qkv, conv_state, p["conv"], n_new, return_window=True)
    else:
        qkv, conv_state = causal_conv(qkv, conv_state, p["conv"], n_new)
    q, k, v = jnp.split(qkv, [H * K, 2 * H * K], axis=-1)
    q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + p["dt_bias"])
    beta = jnp.where(valid[..., None], beta, 0.0)
    g = jnp.where(valid[..., None], g, 0.0)
    if per_token_states:
        parts = {"conv_window": conv_window, "ssm0": ssm_state, "k": k, "g": g}
        o, ssm_state, parts["delta"] = pallas_kernels.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=ssm_state, output_final_state=True, output_deltas=True,
            use_qk_l2norm_in_kernel=True, impl=impl)
    elif T == 1 or fused_recurrent:
        o, ssm_state = pallas_kernels.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=ssm_state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, impl=impl)
    else:
        o, ssm_state = pallas_kernels.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=ssm_state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, impl=impl)
    o = gated_rms_norm(o.astype(x.dtype), z.reshape(B, T, HV, V), p["norm"], eps)
    out = linear(o.reshape(B, T, HV * V), p["out_proj"])
    if per_token_states:
        return out, conv_state, ssm_state, parts
    return out, conv_state, ssm_state
