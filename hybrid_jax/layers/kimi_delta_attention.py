"""Kimi Delta Attention mixer (Kimi-Linear's linear attention), built from Gated DeltaNet's pieces.

Per head h (H heads of K = V = head_dim; value heads = key heads):
  q_h | k_h | v_h = x W_qkv, grouped per head as the layers read them ([H, 2K + V] columns, so a device's
                    columns are whole heads), then the depthwise causal conv + SiLU (conv state as GDN's)
  g  = -exp(A_log_h) softplus(x W_fa W_fb + dt_bias)   [H, K]: the decay per key channel (low rank)
  beta = sigmoid(x W_b)                                 [H]
  o  = KDA(l2norm(q), l2norm(k), v, g, beta)            (pallas_kernels.kda, chunked or token by token)
  out = (w * rmsnorm(o) * sigmoid(x W_ga W_gb)) W_o
Padding tokens get g = 0 and beta = 0 (the state passes them). Speculative decoding as in
gated_deltanet: `fused_recurrent` runs token by token; `per_token_states` also returns what the state
after any position is made from (the conv window and the per-token updates; g is per channel).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from hybrid_jax.layers.gated_deltanet import _rule, causal_conv, ragged_causal_conv
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.norms import sigmoid_gated_rms_norm


def _gates(p: dict, x: jax.Array, valid: jax.Array, H: int, K: int):
    """(beta [..., H], g [..., H, K]) fp32, 0 at padding tokens."""
    lead = x.shape[:-1]
    f = linear(linear(x, p["f_a"]), p["f_b"]).astype(jnp.float32).reshape(lead + (H, K))
    g = -jnp.exp(p["A_log"].astype(jnp.float32))[:, None] * jax.nn.softplus(f + p["dt_bias"].reshape(H, K))
    beta = jax.nn.sigmoid(linear(x, p["b"]).astype(jnp.float32))
    return jnp.where(valid[..., None], beta, 0.0), jnp.where(valid[..., None, None], g, 0.0)


def kimi_delta_attention(p: dict, x: jax.Array, valid: jax.Array, n_new: jax.Array, conv_state: jax.Array,
                         ssm_state: jax.Array, *, num_heads: int, head_dim: int, eps: float, impl: str = "auto",
                         fused_recurrent: bool = False, per_token_states: bool = False):
    """x: [B, T, Hd]; valid: [B, T]; n_new: [B]; conv_state: [B, W-1, 3 H D]; ssm_state: [B, H, D, D] fp32.
    Returns (out [B, T, Hd], conv_state, ssm_state) and, with per_token_states, the parts of the states
    after every position (conv_window [B, W-1+T, C], ssm0, k [B, T, H, D], g [B, T, H, D], delta
    [B, T, H, D]; `cache.state.RecurrentGroup.truncate` reads them)."""
    B, T, _ = x.shape
    H, D = num_heads, head_dim
    qkv = linear(x, p["qkv"])
    if per_token_states:
        qkv, conv_state, conv_window = causal_conv(qkv, conv_state, p["conv"], n_new, return_window=True)
    else:
        qkv, conv_state = causal_conv(qkv, conv_state, p["conv"], n_new)
    qkv = qkv.reshape(B, T, H, 3 * D)
    q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
    beta, g = _gates(p, x, valid, H, D)
    rule = dict(use_qk_l2norm_in_kernel=True, impl=impl)
    if per_token_states:
        parts = {"conv_window": conv_window, "ssm0": ssm_state, "k": k, "g": g}
        o, ssm_state, parts["delta"] = _rule(pallas_kernels.fused_recurrent_kda, q, k, v, g, beta, ssm_state,
                                             output_deltas=True, **rule)
    elif T == 1 or fused_recurrent:
        o, ssm_state = _rule(pallas_kernels.fused_recurrent_kda, q, k, v, g, beta, ssm_state, **rule)
    else:
        o, ssm_state = _rule(pallas_kernels.chunk_kda, q, k, v, g, beta, ssm_state, **rule)
    gate = linear(linear(x, p["g_a"]), p["g_b"]).reshape(B, T, H, D)
    o = sigmoid_gated_rms_norm(o.astype(x.dtype), gate, p["norm"], eps)
    out = linear(o.reshape(B, T, H * D), p["o_proj"])
    if per_token_states:
        return out, conv_state, ssm_state, parts
    return out, conv_state, ssm_state


def kimi_delta_attention_ragged(p: dict, x: jax.Array, seq: jax.Array, valid: jax.Array, cu_seqlens: jax.Array,
                                conv_state: jax.Array, ssm_state: jax.Array, *, num_heads: int, head_dim: int,
                                eps: float, impl: str = "auto", context_axis: str | None = None):
    """`kimi_delta_attention` over a ragged batch, as `gated_deltanet_ragged`: x [N, Hd]; seq, valid [N];
    cu_seqlens [S + 1]; conv_state [S, W-1, 3 H D]; ssm_state [S, H, D, D] fp32 (row s: sequence s's). The
    ragged causal conv, then the chunked KDA rule over the packed sequences. Returns (out [N, Hd],
    conv_state, ssm_state). context_axis: context-parallel, as `gated_deltanet_ragged`'s."""
    N = x.shape[0]
    H, D = num_heads, head_dim
    qkv, conv_state = ragged_causal_conv(linear(x, p["qkv"]), conv_state, p["conv"], seq, cu_seqlens,
                                         context_axis=context_axis)
    qkv = qkv.reshape(1, N, H, 3 * D)
    q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
    beta, g = _gates(p, x[None], valid[None], H, D)
    o, ssm_state = _rule(pallas_kernels.chunk_kda, q, k, v, g, beta, ssm_state, cu_seqlens,
                         use_qk_l2norm_in_kernel=True, impl=impl, context_axis=context_axis)
    gate = linear(linear(x, p["g_a"]), p["g_b"]).reshape(N, H, D)
    o = sigmoid_gated_rms_norm(o[0].astype(x.dtype), gate, p["norm"], eps)
    return linear(o.reshape(N, H * D), p["o_proj"]), conv_state, ssm_state
