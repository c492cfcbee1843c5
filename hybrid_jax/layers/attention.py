"""Gated full attention (Qwen3-Next): query gate, q/k RMSNorm, partial RoPE, GQA, KV written into
the cache's KV group at each row's own positions.

One function serves prefill, chunked prefill and decode: the T new tokens of row b sit at positions
lengths[b] .. lengths[b] + n_new[b] - 1 and attend to every cached key at a position <= their own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_jax.layers.norms import rms_norm_zero_centered
from hybrid_jax.layers.rope import apply_rope


def write_kv(cache_kv: jax.Array, new: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Scatter new entries into their slots; invalid (padding) tokens are dropped, never clamped
    onto a live slot. cache_kv: [B, S, Hkv, D]; new: [B, T, Hkv, D]; positions, valid: [B, T]."""
    S = cache_kv.shape[1]
    idx = jnp.where(valid, positions, S)          # S is out of range: dropped
    b = jnp.arange(cache_kv.shape[0])[:, None]
    return cache_kv.at[b, idx].set(new.astype(cache_kv.dtype), mode="drop")


def gated_attention(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                    valid: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, num_heads: int,
                    num_kv_heads: int, head_dim: int, eps: float):
    """x: [B, T, Hd]; cos, sin: [B, T, R]; positions, valid: [B, T]; k_cache, v_cache: [B, S, Hkv, D].
    Returns (out [B, T, Hd], k_cache, v_cache)."""
    B, T, _ = x.shape
    Hq, Hkv, D = num_heads, num_kv_heads, head_dim
    qkv = x @ p["qkv"]
    if "qkv_bias" in p:
        qkv = qkv + p["qkv_bias"]
    q, gate, k, v = jnp.split(qkv, [Hq * D, 2 * Hq * D, 2 * Hq * D + Hkv * D], axis=-1)
    q = rms_norm_zero_centered(q.reshape(B, T, Hq, D), p["q_norm"], eps)
    k = rms_norm_zero_centered(k.reshape(B, T, Hkv, D), p["k_norm"], eps)
    v = v.reshape(B, T, Hkv, D)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    k_cache = write_kv(k_cache, k, positions, valid)
    v_cache = write_kv(v_cache, v, positions, valid)

    S = k_cache.shape[1]
    rep = Hq // Hkv
    qg = q.reshape(B, T, Hkv, rep, D)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k_cache,
                        preferred_element_type=jnp.float32) * (D ** -0.5)
    key_pos = jnp.arange(S)
    allowed = key_pos[None, None, :] <= positions[:, :, None]          # [B, T, S]
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v_cache).reshape(B, T, Hq * D)
    out = out * jax.nn.sigmoid(gate)
    out = out @ p["o_proj"]
    if "o_bias" in p:
        out = out + p["o_bias"]
    return out, k_cache, v_cache
