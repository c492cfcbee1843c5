"""RMSNorm variants, computed in fp32 and cast back to the input dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _rms(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm_zero_centered(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen3-Next's RMSNorm: the weight is stored around 0 and applied as (1 + w).
    x: [..., D]; w: [D]."""
    return (_rms(x, eps) * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float, act=jax.nn.silu) -> jax.Array:
    """Norm before gate: (w * rmsnorm(x)) * act(gate) (SiLU; Qwen4-Exp may use a sigmoid). x, gate: [..., D]; w: [D]."""
    y = w * _rms(x, eps).astype(x.dtype)
    return (y * act(gate.astype(jnp.float32))).astype(x.dtype)


def sigmoid_gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Kimi-Linear's output norm: (w * rmsnorm(x)) * sigmoid(gate), all in fp32, cast back once.
    x, gate: [..., D]; w: [D]."""
    y = w.astype(jnp.float32) * _rms(x, eps)
    return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
