"""Gated DeltaNet mixer (Qwen3-Next's linear attention).

Fused input projection (q | k | v | z | b | a, converted from HF's per-key-head-grouped layout at
load), causal depthwise conv over q|k|v with a (W-1)-token conv state, l2-normalised q/k, the gated
delta rule (chunked for prefill, recurrent for a decode step), gated RMSNorm, output projection.
Padding tokens (valid = False) get g = 0 and beta = 0, which leave the recurrent state untouched.

Speculative decoding: `fused_recurrent=True` runs the token-level kernel whatever T (a verify or
replay window numerically equal to T decode steps); `per_token_states=True` (implies it) also
returns the conv window and recurrent state after every position, so a verify step can roll back
by selecting the state after its last accepted token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from hybrid_jax.layers.norms import gated_rms_norm


def causal_conv(x: jax.Array, conv_state: jax.Array, w: jax.Array, n_new: jax.Array, all_states: bool = False):
    """Depthwise causal conv + SiLU.  x: [B, T, C]; conv_state: [B, W-1, C]; w: [W, C]; n_new: [B].
    Returns (y [B, T, C], new conv_state [B, W-1, C]: the last W-1 inputs up to each row's end) and,
    with all_states, the conv state after every position t (the W-1 inputs ending at t): [B, T, W-1, C]."""
    W = w.shape[0]
    T = x.shape[1]
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)       # [B, W-1+T, C]
    y = sum(window[:, j:j + T] * w[j] for j in range(W))
    new_state = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, W - 1, axis=0))(window, n_new)
    if all_states:
        per_pos = jnp.stack([window[:, t + 1:t + W] for t in range(T)], axis=1)      # [B, T, W-1, C]
        return jax.nn.silu(y), new_state, per_pos
    return jax.nn.silu(y), new_state


def gated_deltanet(p: dict, x: jax.Array, valid: jax.Array, n_new: jax.Array, conv_state: jax.Array,
                   ssm_state: jax.Array, *, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                   head_v_dim: int, eps: float, impl: str = "auto", fused_recurrent: bool = False,
                   per_token_states: bool = False):
    """x: [B, T, Hd]; valid: [B, T]; n_new: [B]; conv_state: [B, W-1, C]; ssm_state: [B, HV, K, V] fp32.
    Returns (out [B, T, Hd], conv_state, ssm_state) and, with per_token_states, the states after every
    position too: conv [B, T, W-1, C] and ssm [B, T, HV, K, V] fp32 (padding positions repeat the last)."""
    B, T, _ = x.shape
    H, HV, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    proj = x @ p["in_proj"]
    qkv, z, b, a = jnp.split(proj, [2 * H * K + HV * V, 2 * H * K + 2 * HV * V, 2 * H * K + 2 * HV * V + HV],
                             axis=-1)
    if per_token_states:
        qkv, conv_state, conv_all = causal_conv(qkv, conv_state, p["conv"], n_new, all_states=True)
    else:
        qkv, conv_state = causal_conv(qkv, conv_state, p["conv"], n_new)
    q, k, v = jnp.split(qkv, [H * K, 2 * H * K], axis=-1)
    q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + p["dt_bias"])
    beta = jnp.where(valid[..., None], beta, 0.0)
    g = jnp.where(valid[..., None], g, 0.0)
    if per_token_states:
        o, ssm_state, ssm_all = pallas_kernels.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=ssm_state, output_final_state=True, output_all_states=True,
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
    out = o.reshape(B, T, HV * V) @ p["out_proj"]
    if per_token_states:
        return out, conv_state, ssm_state, conv_all, ssm_all
    return out, conv_state, ssm_state
