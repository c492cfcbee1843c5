"""Shared pieces of the gated delta rule implementations: input checks, l2norm, head grouping.

Conventions (flash-linear-attention's):
  q, k: [B, T, H, K]      v: [B, T, HV, V] with HV a multiple of H
  g (log decay), beta:    [B, T, HV]  (g [B, T, HV, K] for a per-channel decay, KDA)
  state:                  [N, HV, K, V] in fp32 (N = B, or the number of sequences with cu_seqlens)
Value head `hv` reads key head `hv // (HV // H)`; keys are never repeated in memory.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in fp32 (matches fla and transformers)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens=None, per_channel: bool = False):
    """Validates shapes; returns (B, T, H, K, HV, V). Raises ValueError naming the problem.
    per_channel: the decay is one per key channel, g [B, T, HV, K] (Kimi Delta Attention), not one
    per head, g [B, T, HV] (Gated DeltaNet)."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got q {q.shape}, k {k.shape}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}; got {v.shape}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H}")
    if per_channel and g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {(B, T, HV, K)} (a decay per key channel); got {g.shape}")
    if not per_channel and g.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)}; got {g.shape}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}; got {beta.shape}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs a packed batch with B == 1; got B={B}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1; got shape {cu_seqlens.shape}")
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must be an integer array; got dtype {cu_seqlens.dtype}")
        n = cu_seqlens.shape[0] - 1
    else:
        n = B
    if initial_state is not None and initial_state.shape != (n, HV, K, V):
        raise ValueError(f"initial_state must be [N, HV, K, V] = {(n, HV, K, V)}; got {initial_state.shape}")
    return B, T, H, K, HV, V


def check_state_indices(q, v, initial_state, state_indices, cu_seqlens, keep) -> jax.Array:
    """Validates a pooled initial state (`state_indices` [B] int32 into initial_state [P, HV, K, V] f32);
    returns the pool. Raises ValueError naming the problem."""
    B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    if initial_state is None:
        raise ValueError("state_indices index rows of initial_state, which is missing")
    if cu_seqlens is not None:
        raise ValueError("state_indices are for one sequence per batch row; a packed batch (cu_seqlens) has none")
    if keep is not None:
        raise ValueError("state_indices update the pool's rows in place; per-token states or deltas are not kept")
    if state_indices.shape != (B,) or not jnp.issubdtype(state_indices.dtype, jnp.integer):
        raise ValueError(f"state_indices must be [B] = ({B},) integers; got {state_indices.shape} {state_indices.dtype}")
    if initial_state.ndim != 4 or initial_state.shape[1:] != (HV, K, V) or initial_state.dtype != jnp.float32:
        raise ValueError(f"a pooled initial_state must be [P, HV, K, V] = [P, {HV}, {K}, {V}] float32; got "
                         f"{initial_state.shape} {initial_state.dtype}")
    return initial_state


def on_gathered_rows(fn, pool: jax.Array, idx: jax.Array, output_final_state: bool):
    """A pooled rule run on the rows it names: fn(h0 [B, HV, K, V]) -> (o, final [B, HV, K, V]) over
    pool[idx]; returns (o, the pool with rows idx replaced, or None)."""
    o, final = fn(pool[idx])
    return o, (pool.at[idx].set(final) if output_final_state else None)


def prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Casts to fp32, applies l2norm and the query scale. Returns fp32 (q, k, v, g, beta)."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q.astype(jnp.float32) * scale
    return (q, k.astype(jnp.float32), v.astype(jnp.float32),
            g.astype(jnp.float32), beta.astype(jnp.float32))


def per_token_output(output_all_states: bool, output_deltas: bool) -> str | None:
    """What a recurrent kernel writes per token besides o: "states" (the state after every token,
    [B, T, HV, K, V]), "deltas" (every token's rank-one update, [B, T, HV, V]) or None."""
    if output_all_states and output_deltas:
        raise ValueError("output_all_states and output_deltas are exclusive: the deltas stand in for the states")
    return "states" if output_all_states else ("deltas" if output_deltas else None)


def default_scale(scale, K):
    return K ** -0.5 if scale is None else scale
