"""Rotary position embedding over the first `rotary_dim` channels (partial RoPE), rotate-half form."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float):
    """positions: [B, T] int -> cos, sin: [B, T, rotary_dim] fp32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, D]; cos, sin: [B, T, R] with R <= D. Channels past R pass through."""
    R = cos.shape[-1]
    xr, xp = x[..., :R], x[..., R:]
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    rot = jnp.concatenate([-xr[..., R // 2:], xr[..., :R // 2]], axis=-1)
    return jnp.concatenate([xr * c + rot * s, xp], axis=-1)
