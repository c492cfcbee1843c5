"""Qwen4-Exp's indexed attention: Qwen3.5's gated attention (layers.attention's projections, norms, RoPE
and output gate) over the tokens a QSA indexer selects for each query.

The indexer, for a query at position p (p + 1 visible tokens, blocks of C = indexer_compress_ratio from 0):
  qi = RoPE(norm_q(x Wq)) [Hi, Di];  raw key ki = x Wk [Di] (kept per position, cache.mla.IndexerKeyGroup)
  block j (complete when (j + 1) C <= p + 1): kb_j = RoPE_{jC}(norm_k(mean of ki over the block))
  score_j = sum_h relu(qi_h . kb_j) / sqrt(Di);  the Top-(budget / C) complete blocks are selected
  the query attends to the selected blocks' tokens and to the incomplete block's tokens (the tail).
Here the row's keys are read whole (every position up to the step's end) and the selection is a mask over
them; the attention is a masked softmax over the row's K / V pages (an XLA form: no kernel yet).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cache.mla import write_paged
from hybrid_jax.layers.attention import _gated_output, _qkv, write_kv
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.norms import rms_norm_zero_centered
from hybrid_jax.layers.rope import apply_rope


def dense_rows(pool: jax.Array, layer: int, page_table: jax.Array, new: jax.Array, positions: jax.Array,
               valid: jax.Array) -> jax.Array:
    """A row's entries at every position its table reaches, [B, NP * ps, ...], with the step's new entries
    new [B, T, ...] at positions [B, T] (where valid) over what the pool [L, P, ps, ...] holds."""
    B = page_table.shape[0]
    rows = pool[layer][page_table]
    rows = rows.reshape((B, -1) + rows.shape[3:])
    at = jnp.where(valid, positions, rows.shape[1])
    return rows.at[jnp.arange(B)[:, None], at].set(new.astype(rows.dtype), mode="drop")


def block_scores(p: dict, qi: jax.Array, keys: jax.Array, block_cos: jax.Array, block_sin: jax.Array, C: int,
                 eps: float) -> jax.Array:
    """qi [B, T, Hi, Di] (normed, rotated); keys [B, S, Di] raw (S a multiple of C); block_cos / sin
    [1, S / C, R] at each block's first position. Returns the blocks' scores [B, T, S / C] f32."""
    B, S, Di = keys.shape
    pooled = jnp.mean(keys.reshape(B, S // C, C, Di).astype(jnp.float32), axis=2).astype(keys.dtype)
    kb = apply_rope(rms_norm_zero_centered(pooled, p["k_norm"], eps)[:, :, None], block_cos, block_sin)[:, :, 0]
    s = jnp.einsum("bthd,bjd->btjh", qi.astype(jnp.float32), kb.astype(jnp.float32))
    return jnp.sum(jax.nn.relu(s), axis=-1) / math.sqrt(Di)


def selection_mask(scores: jax.Array, positions: jax.Array, C: int, block_topk: int) -> jax.Array:
    """Which positions [B, T, S] each query reads: the Top-block_topk complete blocks and the tail."""
    B, T, nb = scores.shape
    complete = (positions[..., None] + 1) // C                                   # [B, T, 1]
    blk = jnp.arange(nb)[None, None, :]
    masked = jnp.where(blk < complete, scores, -jnp.inf)
    top, idx = jax.lax.top_k(masked, min(block_topk, nb))
    chosen = jnp.zeros((B, T, nb), bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], idx].max(
        jnp.isfinite(top))
    s = jnp.arange(nb * C)[None, None, :]
    tail = s >= complete * C
    return (jnp.repeat(chosen, C, axis=-1) | tail) & (s <= positions[..., None])


def _fit(allowed: jax.Array, n: int) -> jax.Array:
    """The mask [B, T, S] over the key group's reach cut or padded (unreachable: False) to the KV rows' n."""
    S = allowed.shape[-1]
    return allowed[..., :n] if S >= n else jnp.pad(allowed, ((0, 0), (0, 0), (0, n - S)))


def _masked_attention(q, k, v, allowed):
    """q [B, T, Hq, D]; k, v [B, S, Hkv, D]; allowed [B, T, S] -> [B, T, Hq, D] f32 (GQA, scaled by D^-0.5)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D).astype(jnp.float32)
    s = jnp.einsum("btgrd,bsgd->bgrts", qg, k.astype(jnp.float32)) / math.sqrt(D)
    s = jnp.where(allowed[:, None, None], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    w = jnp.where(jnp.isfinite(s).any(axis=-1, keepdims=True), w, 0.0)
    return jnp.einsum("bgrts,bsgd->btgrd", w, v.astype(jnp.float32)).reshape(B, T, Hq, D)


def indexed_attention(p: dict, x: jax.Array, cos, sin, block_cos, block_sin, positions, valid, kv, ikeys, *,
                      layer: int, ilayer: int, num_heads: int, num_kv_heads: int, head_dim: int, index_heads: int,
                      index_dim: int, compress_ratio: int, block_topk: int, eps: float, defer_write: bool = False):
    """x [B, T, Hd] at positions / valid [B, T]; kv: the KV group (k, v [L, P, ps, Hkv, D], page_table), ikeys:
    the indexer key group (keys [L, P2, ps2, Di]); layer / ilayer: this layer's slot in each. p: the gated
    attention's weights (layers.attention) and indexer {qk [Hd, (Hi + 1) Di], q_norm, k_norm [Di]}.
    Returns (out [B, T, Hd], k pool, v pool, key pool) -- with defer_write the pools as they came and the
    new entries instead: (out, k [B, T, Hkv, D], v, raw keys [B, T, Di])."""
    B, T, _ = x.shape
    q, gate, k, v = _qkv(p, x, cos, sin, num_heads, num_kv_heads, head_dim, eps)
    ip = p["indexer"]
    qk = linear(x, ip["qk"]).reshape(B, T, index_heads + 1, index_dim)
    qi = apply_rope(rms_norm_zero_centered(qk[:, :, :index_heads], ip["q_norm"], eps), cos, sin)
    ki = qk[:, :, index_heads]
    keys = dense_rows(ikeys.keys, ilayer, ikeys.page_table, ki, positions, valid)
    S = keys.shape[1] - keys.shape[1] % compress_ratio
    scores = block_scores(ip, qi, keys[:, :S], block_cos[:, :S // compress_ratio], block_sin[:, :S // compress_ratio],
                          compress_ratio, eps)
    allowed = selection_mask(scores, positions, compress_ratio, block_topk)
    allowed = jnp.pad(allowed, ((0, 0), (0, 0), (0, keys.shape[1] - S)), constant_values=True)
    allowed = allowed & (jnp.arange(keys.shape[1])[None, None] <= positions[..., None])
    k_rows = dense_rows(kv.k, layer, kv.page_table, k, positions, valid)
    v_rows = dense_rows(kv.v, layer, kv.page_table, v, positions, valid)
    o = _masked_attention(q, k_rows, v_rows, _fit(allowed, k_rows.shape[1]))
    out = _gated_output(p, o.reshape(B, T, -1).astype(x.dtype), gate)
    if defer_write:
        return out, k, v, ki
    return (out, write_kv(kv.k, k, kv.page_table, positions, valid, layer),
            write_kv(kv.v, v, kv.page_table, positions, valid, layer),
            write_paged(ikeys.keys, ki.astype(ikeys.keys.dtype), ikeys.page_table, positions, valid, layer=ilayer))
