"""Gated full attention (Qwen3-Next): query gate, q/k RMSNorm, partial RoPE, GQA, KV written into
the cache's KV group at each row's own positions.

One function serves prefill, chunked prefill and decode: the T new tokens of row b sit at positions
lengths[b] .. lengths[b] + n_new[b] - 1 and attend to every cached key at a position <= their own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.norms import rms_norm_zero_centered
from hybrid_jax.layers.rope import apply_rope


def write_kv(cache_kv: jax.Array, new: jax.Array, positions: jax.Array, valid: jax.Array,
             layer: int | slice | None = None) -> jax.Array:
    """Scatter new entries into their slots; invalid (padding) tokens are dropped, never clamped
    onto a live slot. cache_kv: [B, S, Hkv, D], or with `layer` the group's stack [L, B, S, Hkv, D]
    (written in place: XLA updates the stack's buffer instead of slicing the layer out, writing the
    copy and stacking the layers again, each a copy of the whole cache per step);
    new: [B, T, Hkv, D], or [L, B, T, Hkv, D] with layer=slice(None) (every layer in one write);
    positions, valid: [B, T]."""
    B, S = cache_kv.shape[-4:-2]
    idx = jnp.where(valid, positions, S)          # S is out of range: dropped
    b = jnp.arange(B)[:, None]
    at = cache_kv.at[b, idx] if layer is None else cache_kv.at[layer, b, idx]
    return at.set(new.astype(cache_kv.dtype), mode="drop")


def _scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """qg: [B, G, R, T, D]; k: [B, S, G, D] -> [B, G, R, T, S] fp32, as one batched matmul per group."""
    B, G, R, T, D = qg.shape
    s = jnp.matmul(qg.reshape(B, G, R * T, D), k.transpose(0, 2, 3, 1), preferred_element_type=jnp.float32)
    return s.reshape(B, G, R, T, k.shape[1])


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """p: [B, G, R, T, S]; v: [B, S, G, D] -> [B, G, R, T, D] fp32."""
    B, G, R, T, S = p.shape
    o = jnp.matmul(p.reshape(B, G, R * T, S).astype(v.dtype), v.transpose(0, 2, 1, 3),
                   preferred_element_type=jnp.float32)
    return o.reshape(B, G, R, T, v.shape[-1])


def _partial(scores: jax.Array, v: jax.Array):
    """Unnormalised softmax pieces of one key block: (m, l, o) with m the row max, l the sum of
    exp(s - m) and o the exp-weighted values. Rows with every key masked get m = -inf, l = o = 0."""
    m = jnp.max(scores, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(scores - m_safe)
    return m, jnp.sum(e, axis=-1, keepdims=True), _weighted(e, v)


def _merge(parts):
    """Combines (m, l, o) pieces of disjoint key sets into normalised attention output."""
    m = parts[0][0]
    for p in parts[1:]:
        m = jnp.maximum(m, p[0])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    l = sum(jnp.exp(jnp.where(jnp.isfinite(pm), pm - m_safe, -jnp.inf)) * pl for pm, pl, _ in parts)
    o = sum(jnp.exp(jnp.where(jnp.isfinite(pm), pm - m_safe, -jnp.inf)) * po for pm, _, po in parts)
    return o / jnp.where(l > 0, l, 1.0)


def _attend_cache(qg, k_cache, v_cache, limit, inclusive: bool):
    """Dense attention over every cache slot whose position is <= (or <) `limit` [B, 1, 1, T, 1]."""
    S = k_cache.shape[1]
    kpos = jnp.arange(S)[None, None, None, None, :]
    allowed = kpos <= limit if inclusive else kpos < limit
    s = jnp.where(allowed, _scores(qg, k_cache), -jnp.inf)
    return _merge([_partial(s, v_cache)])


BLOCK_Q = 256


def _online_step(carry, s, v):
    """Folds one key block's scores s [B, G, R, Q, K] and values v [B, K, G, D] into the running
    softmax (m, l, o)."""
    m, l, o = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    e = jnp.exp(s - m_new)
    return m_new, l * alpha + jnp.sum(e, axis=-1, keepdims=True), o * alpha + _weighted(e, v)


def _prefill_attention(qg, k_new, v_new, k_cache, v_cache, positions):
    """Attention of T > 1 new tokens, flash style in plain XLA: per query block of BLOCK_Q, first
    the cached prefix (slots < lengths; a lax.cond skips it at run time when no row has one), then
    the earlier key blocks of the new tokens in a fori_loop (no mask needed), then the diagonal
    block under the causal mask. Scores never exist beyond one [BLOCK_Q, BLOCK_Q] tile per head.
    qg: [B, G, R, T, D]; k_new, v_new: [B, T, G, D]; positions: [B, T]."""
    B, G, R, T, D = qg.shape
    BQ = min(BLOCK_Q, T)
    nq = -(-T // BQ)
    pad = nq * BQ - T
    if pad:   # padded keys sit after every real query: the causal mask hides them
        qg = jnp.pad(qg, [(0, 0)] * 3 + [(0, pad), (0, 0)])
        k_new = jnp.pad(k_new, [(0, 0), (0, pad), (0, 0), (0, 0)])
        v_new = jnp.pad(v_new, [(0, 0), (0, pad), (0, 0), (0, 0)])
    limit = positions[:, 0][:, None, None, None, None]                       # = lengths
    has_prefix = jnp.any(positions[:, 0] > 0)
    S = k_cache.shape[1]
    causal = jnp.arange(BQ)[None, :] <= jnp.arange(BQ)[:, None]

    def with_prefix(qb):
        s = jnp.where(jnp.arange(S)[None, None, None, None, :] < limit, _scores(qb, k_cache), -jnp.inf)
        return _partial(s, v_cache)

    def no_prefix(qb):
        shape = qb.shape[:-1] + (1,)
        return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(qb.shape, jnp.float32))

    outs = []
    for i in range(nq):
        qb = qg[:, :, :, i * BQ:(i + 1) * BQ]
        carry = jax.lax.cond(has_prefix, with_prefix, no_prefix, qb)

        def body(j, carry, qb=qb):
            kb = jax.lax.dynamic_slice_in_dim(k_new, j * BQ, BQ, axis=1)
            vb = jax.lax.dynamic_slice_in_dim(v_new, j * BQ, BQ, axis=1)
            return _online_step(carry, _scores(qb, kb), vb)

        carry = jax.lax.fori_loop(0, i, body, carry)
        kb, vb = k_new[:, i * BQ:(i + 1) * BQ], v_new[:, i * BQ:(i + 1) * BQ]
        m, l, o = _online_step(carry, jnp.where(causal, _scores(qb, kb), -jnp.inf), vb)
        outs.append(o / l)
    out = jnp.concatenate(outs, axis=3) if nq > 1 else outs[0]
    return out[:, :, :, :T]


def gated_attention(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                    valid: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, num_heads: int,
                    num_kv_heads: int, head_dim: int, eps: float, layer: int | None = None,
                    defer_write: bool = False):
    """x: [B, T, Hd]; cos, sin: [B, T, R]; positions, valid: [B, T]; k_cache, v_cache: [B, S, Hkv, D],
    or with `layer` the KV group's stacks [L, B, S, Hkv, D], updated in place (`write_kv`).
    Returns (out [B, T, Hd], k_cache, v_cache), the caches in the shape they came in.
    defer_write: the caches are only read (the prefix, slots < positions[:, 0]; the new tokens
    attend to each other from their fresh entries, for any T) and the new entries k, v
    [B, T, Hkv, D] are returned in place of the caches, for the caller to write (`write_kv`):
    a program that branches between forwards then writes the cache once, after the branch,
    instead of in every branch (XLA copies a cache that a conditional's branches update)."""
    B, T, _ = x.shape
    Hq, Hkv, D = num_heads, num_kv_heads, head_dim
    qkv = linear(x, p["qkv"])
    if "qkv_bias" in p:
        qkv = qkv + p["qkv_bias"]
    q, gate, k, v = jnp.split(qkv, [Hq * D, 2 * Hq * D, 2 * Hq * D + Hkv * D], axis=-1)
    q = rms_norm_zero_centered(q.reshape(B, T, Hq, D), p["q_norm"], eps)
    k = rms_norm_zero_centered(k.reshape(B, T, Hkv, D), p["k_norm"], eps)
    v = v.reshape(B, T, Hkv, D)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    if not defer_write:
        k_cache = write_kv(k_cache, k, positions, valid, layer)
        v_cache = write_kv(v_cache, v, positions, valid, layer)
    k_layer, v_layer = (k_cache, v_cache) if layer is None else (k_cache[layer], v_cache[layer])

    rep = Hq // Hkv
    qg = q.reshape(B, T, Hkv, rep, D).transpose(0, 2, 3, 1, 4) * jnp.asarray(D ** -0.5, q.dtype)  # [B, G, R, T, D]
    if T == 1 and not defer_write:
        out = _attend_cache(qg, k_layer, v_layer, positions[:, None, None, :, None], inclusive=True)
    else:
        out = _prefill_attention(qg, k, v, k_layer, v_layer, positions)
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq * D).astype(x.dtype)
    out = out * jax.nn.sigmoid(gate)
    out = linear(out, p["o_proj"])
    if "o_bias" in p:
        out = out + p["o_bias"]
    if defer_write:
        return out, k, v
    return out, k_cache, v_cache
