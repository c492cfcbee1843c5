"""DeepSeek-V3.2 sparse attention layer: MLA (q/kv low-rank, decoupled RoPE key) + the DSA indexer; and
Kimi-Linear's MLA without positional encoding (`nope_attention`, dense over the same latent pools, read
only as far as the step's rows reach).

Per layer and step, for the T new tokens of each row (positions lengths[b] + t, t < n_new[b]):
  q_resid = RMSNorm(x W_qa);   q = q_resid W_qb -> [H, nope | rope]      (interleaved RoPE on rope part)
  c, k_rope = split(x W_kva);  c = RMSNorm(c)                             (latent [R] + RoPE key [Dr])
  indexer: qi = q_resid W_iq -> [Hi, Di], ki = LayerNorm(x W_ik)          (RoPE on the first Dr: half-split
                                                                           for DeepSeek-V3.2, interleaved for GLM-5)
           w = x W_iw * Hi^-0.5 * Di^-0.5;  idx = Top-K_j sum_h w_h relu(qi_h . ki_j)   (causal)
  attention in the absorbed form over idx: q_lat = q_nope W_uk,  o = softmax(...) c  then  o W_uv W_o.
c, k_rope and ki are written into their paged pools (cache/mla.py) before the ops read them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cache.mla import write_paged, write_paged_flat
from hybrid_jax.layers.attention import whole_pool
from hybrid_jax.layers.linear import dequantize, linear
from hybrid_jax.layers.rope import apply_rope
from hybrid_jax.parallel.context import MODEL, per_device, tensor_size
from pallas_kernels.sparse_attention import (
    dense_mla_attention,
    in_order_selection,
    indexer_topk,
    indexer_weights,
    quantize_fp8,
    sparse_hit_rate,
    sparse_mla_attention,
)
from pallas_kernels.sparse_attention.ragged import (
    dense_mla_attention_ragged,
    indexer_topk_ragged,
    sparse_hit_rate_ragged,
    sparse_mla_attention_ragged,
)


def rms_norm(x, w, eps):
    """DeepSeek's RMSNorm: w * normalise(x) (weight stored around 1). x: [..., D]; w: [D]."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y).astype(x.dtype)


def layer_norm(x, w, b, eps=1e-6):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean((xf - mu) ** 2, axis=-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def rope_interleaved(x, cos, sin):
    """DeepSeek MLA RoPE on pairs (x0, x1), (x2, x3), ...; output de-interleaved [evens' | odds'] as in
    transformers (q and k use the same layout, so dot products are those of the paired rotation).
    x: [B, T, N, Dr]; cos, sin: [B, T, Dr] (cat(freqs, freqs))."""
    half = x.shape[-1] // 2
    c, s = cos[:, :, None, :half].astype(x.dtype), sin[:, :, None, :half].astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def index_rope(x, cos, sin, interleaved: bool):
    """The indexer's RoPE on the first Dr = cos.shape[-1] channels of x [B, T, N, Di] (the rest pass):
    half-split (DeepSeek-V3.2) or on interleaved pairs like the MLA's (GLM-5's `indexer_rope_interleave`)."""
    if not interleaved:
        return apply_rope(x, cos, sin)
    dr = cos.shape[-1]
    return jnp.concatenate([rope_interleaved(x[..., :dr], cos, sin), x[..., dr:]], axis=-1)


def to_pool_width(x: jax.Array, width: int) -> jax.Array:
    """x [..., Dr] with zero channels appended to `width` (the rope pool's, cache.mla.rope_width): the
    RoPE keys written and the queries that score them alike, so q . k is unchanged."""
    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def indexer_per_head(op, qi, w, *rest):
    """op(qi, w, *rest, head_axis=...) (the indexer's Top-K) on each device's indexer heads when the heads
    are split: qi [..., Hi, Di] and w [..., Hi] split by heads, the keys and tables whole; the op sums the
    devices' partial scores over the tensor axis before it selects, so every device gets the same
    indices (the global Top-K)."""
    split = tensor_size() > 1
    h = qi.ndim - 2
    q_axes = tuple("heads" if d == h else None for d in range(qi.ndim))
    w_axes = tuple("heads" if d == h else None for d in range(w.ndim))
    return per_device(lambda *a: op(*a, head_axis=MODEL if split else None),
                      (q_axes, w_axes) + (None,) * len(rest), None)(qi, w, *rest)


def _per_head(op, head_axis: int, q_lat, q_rot, *rest):
    """op(q_lat, q_rot, *rest) (a sparse MLA kernel) on each device's heads when the heads are split:
    the queries [..., H, ...] split at `head_axis`, the pools, tables and selections whole; the output
    [..., H, R] split like the queries."""
    q_axes = tuple("heads" if d == head_axis else None for d in range(q_lat.ndim))
    return per_device(op, (q_axes, q_axes) + (None,) * len(rest), q_axes, out_like=q_lat)(q_lat, q_rot, *rest)


def sparse_attention(p: dict, x, cos, sin, positions, valid, lengths, n_new, lat, rope, ikeys, iscale,
                     page_table, index_table, page_resident, *, num_heads: int, nope: int, rope_dim: int,
                     v_dim: int, kv_lora_rank: int, index_heads: int, index_dim: int, index_topk: int,
                     eps: float, impl: str = "auto", layer: int | None = None, scale: float | None = None,
                     ragged=None, index_rope_interleaved: bool = False, index_layer: int | None = None,
                     selected: jax.Array | None = None):
    """x [B, T, Hd]; cos, sin [B, T, Dr]; positions, valid [B, T]; lengths, n_new [B];
    lat [P, ps, R], rope [P, ps, Wr] (one layer's latent pools; Wr = cache.mla.rope_width(Dr), the
    queries and keys zero-padded to it), ikeys [P2, ps2, Di], iscale [P2, ps2] | None,
    or with `layer` the groups' stacks of them ([L, ...]), written in place at that layer (`write_paged`;
    the indexer stacks at `index_layer` when it differs, as when some layers run no indexer).
    scale: the attention softmax scale (default (nope + rope_dim)^-0.5; DeepSeek's YaRN corrects it).
    eps: the q / latent norms' (1e-6 in transformers' DeepSeek-V3.2 and GLM-5, whatever rms_norm_eps).
    index_rope_interleaved: the indexer's RoPE layout (`index_rope`).
    selected: a previous layer's Top-K (what this function returns as `idx`) to attend over instead of
    running the indexer (GLM's "shared" layers: no indexer weights, no indexer keys written).
    When index_topk is at least the tables' span (max_model_len <= index_topk), the Top-K is every causal
    position: the indexer then only writes its keys, `idx` is every position in order
    (`in_order_selection`), and the read takes it in runs of rows, each row once (a gathered 16-bit row
    moves its aligned group of 8: the read was 8x the latent cache at such lengths).
    ragged: a hybrid_jax.models.ragged.RaggedBatch of S sequences; x is then [1, N, Hd] (cos, sin, positions,
    valid [1, N, ...]), lengths, n_new and the tables [S, ...]: the entries are written token-major and the
    ops run on the batch's tiles (pallas_kernels.sparse_attention.ragged).
    Returns (out [B, T, Hd], lat, rope, ikeys, iscale, hit_rate [B] (ragged: [S]), idx (the Top-K used)),
    the pools as they came in."""
    B, T, _ = x.shape
    H, R = num_heads, kv_lora_rank
    q_resid = rms_norm(linear(x, p["q_a"]) + p.get("q_a_bias", 0.0), p["q_a_norm"], eps)
    q = linear(q_resid, p["q_b"]).reshape(B, T, H, nope + rope_dim)
    q_nope, q_rot = q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)
    kv = linear(x, p["kv_a"]) + p.get("kv_a_bias", 0.0)
    c = rms_norm(kv[..., :R], p["kv_a_norm"], eps)                                     # [B, T, R]
    k_rot = rope_interleaved(kv[..., None, R:], cos, sin)[:, :, 0]                      # [B, T, Dr]
    q_rot, k_rot = to_pool_width(q_rot, rope.shape[-1]), to_pool_width(k_rot, rope.shape[-1])  # [.., Wr]

    def writer(at):
        if ragged is None:
            return lambda pool, new, table: write_paged(pool, new, table, positions, valid, at)
        return lambda pool, new, table: write_paged_flat(pool, new[0], table, ragged.seq, positions[0], valid[0], at)
    write = writer(layer)
    lat = whole_pool(write(lat, c, page_table))
    rope = whole_pool(write(rope, k_rot, page_table))
    kv_len = lengths + n_new
    # a Top-K as wide as the table selects every causal position: the read takes them in order (each
    # row once, not a gathered row group per selection) and the indexer only writes its keys
    span = page_table.shape[1] * lat.shape[-2]
    in_order = ragged is None and index_topk >= min(span, index_table.shape[1] * ikeys.shape[-2])
    if selected is None:
        il = layer if index_layer is None else index_layer
        idx, ikeys, iscale = _index_select(p, x, q_resid, cos, sin, positions, valid, kv_len, ikeys, iscale,
                                           index_table, writer(il), index_heads=index_heads, index_dim=index_dim,
                                           index_topk=index_topk, impl=impl, layer=il, ragged=ragged,
                                           interleaved=index_rope_interleaved, score=not in_order)
        if in_order:
            idx = in_order_selection(jnp.where(valid, positions, -1), span)
    else:
        idx = selected
    q_lat = jnp.einsum("bthn,hnr->bthr", q_nope, dequantize(p["w_uk"], q_nope.dtype))        # [B, T, H, R]
    scale = scale or (nope + rope_dim) ** -0.5
    # the ops read layer `layer` of the stacks in place (a slice handed to a kernel is a copy of the pool)
    if ragged is None:
        o_lat = _per_head(lambda ql, qr, la, ro, tb, ix, kl: sparse_mla_attention(
            ql, qr, la, ro, tb, ix, kl, layer=layer, scale=scale, impl=impl, in_order=in_order),
            2, q_lat, q_rot, lat, rope, page_table, idx, kv_len)                                 # [B, T, H, R] f32
        hit = sparse_hit_rate(idx, page_table, page_resident, lat.shape[-2], kv_len)
    else:
        o_lat = _per_head(lambda ql, qr, la, ro, tb, c, ix, kl: sparse_mla_attention_ragged(
            ql, qr, la, ro, tb, c, ix, kl, scale=scale, impl=impl, layer=layer),
            1, q_lat[0], q_rot[0], lat, rope, page_table, ragged.cu_seqlens, idx, kv_len)[None]
        hit = sparse_hit_rate_ragged(idx, page_table, ragged.seq, ragged.valid, page_resident, lat.shape[-2], kv_len)
    o = jnp.einsum("bthr,hvr->bthv", o_lat.astype(x.dtype), dequantize(p["w_uv"], x.dtype)).reshape(B, T, H * v_dim)
    out = linear(o, p["o_proj"]) + p.get("o_bias", 0.0)
    return out.astype(x.dtype), lat, rope, ikeys, iscale, hit, idx


def _index_select(p: dict, x, q_resid, cos, sin, positions, valid, kv_len, ikeys, iscale, index_table, write, *,
                  index_heads: int, index_dim: int, index_topk: int, impl: str, layer: int | None, ragged,
                  interleaved: bool, score: bool = True):
    """The DSA indexer of `sparse_attention`: writes this step's indexer keys (before scoring, so a query
    sees its own key) and selects each query's Top-K positions. Returns (idx, ikeys, iscale); score=False:
    the keys written, no selection (idx None)."""
    B, T, _ = x.shape
    qi = index_rope(linear(q_resid, p["idx_q"]).reshape(B, T, index_heads, index_dim), cos, sin, interleaved)
    ki = layer_norm(linear(x, p["idx_k"]), p["idx_k_norm"], p["idx_k_norm_bias"])
    ki = index_rope(ki[:, :, None], cos, sin, interleaved)[:, :, 0]                     # [B, T, Di]
    if iscale is not None:
        k8, sc = quantize_fp8(ki)
        ikeys = whole_pool(write(ikeys, k8, index_table))
        iscale = whole_pool(write(iscale, sc, index_table))
    else:
        ikeys = whole_pool(write(ikeys, ki, index_table))
    if not score:
        return None, ikeys, iscale
    w = indexer_weights(x.astype(jnp.float32) @ p["idx_w"].astype(jnp.float32), index_heads, index_dim)
    topk = min(index_topk, index_table.shape[1] * ikeys.shape[-2])         # Top-K >= context: all causal keys
    if ragged is None:
        qpos = jnp.where(valid, positions, -1)
        idx = indexer_per_head(lambda *a, head_axis: indexer_topk(*a[:-1], topk=topk, k_scale=a[-1], impl=impl,
                                                                   layer=layer, head_axis=head_axis),
                               qi, w, ikeys, index_table, qpos, kv_len, iscale)
    else:
        idx = indexer_per_head(lambda *a, head_axis: indexer_topk_ragged(
            *a[:-1], topk=topk, k_scale=a[-1], impl=impl, layer=layer, head_axis=head_axis),
            qi[0], w[0], ikeys, index_table, ragged.cu_seqlens, kv_len, iscale)
    return idx, ikeys, iscale


def nope_attention(p: dict, x, positions, valid, lengths, n_new, lat, rope, page_table, *, num_heads: int, nope: int,
                   rope_dim: int, v_dim: int, kv_lora_rank: int, scale: float, eps: float = 1e-6,
                   layer: int | None = None, ragged=None):
    """MLA without positional encoding or indexer (Kimi-Linear's `mla_use_nope`): q = x W_q [H, nope | Dr];
    c, k_r = split(x W_kva), c = RMSNorm(c); the `Dr` channels are a key part every head shares, never
    rotated. Dense absorbed attention over every cached position <= the query's: q_lat = q_nope W_uk,
    o = softmax(q_lat c + q_r k_r) c, then o W_uv W_o. The read (`dense_mla_attention`) walks each row's
    pages only as far as the step's furthest query, never the whole page table. eps: the latent norm's,
    1e-6 whatever the model's rms_norm_eps (its norm is built with the norm's default, as in DeepSeek-V3's
    MLA). Shapes as `sparse_attention`'s (lat, rope one layer's pools or, with `layer`, the group's stacks
    written and read in place); ragged: as `sparse_attention`'s (x [1, N, Hd], the entries written
    token-major, the read on the batch's tiles). Returns (out [B, T, Hd], lat, rope)."""
    B, T, _ = x.shape
    H, R = num_heads, kv_lora_rank
    q = linear(x, p["q"]).reshape(B, T, H, nope + rope_dim)
    kv = linear(x, p["kv_a"])
    c = rms_norm(kv[..., :R], p["kv_a_norm"], eps)                                      # [B, T, R]
    k_r = to_pool_width(kv[..., R:], rope.shape[-1])
    if ragged is None:
        def write(pool, new):
            return write_paged(pool, new, page_table, positions, valid, layer)
    else:
        def write(pool, new):
            return write_paged_flat(pool, new[0], page_table, ragged.seq, positions[0], valid[0], layer)
    lat, rope = whole_pool(write(lat, c)), whole_pool(write(rope, k_r))
    q_lat = jnp.einsum("bthn,hnr->bthr", q[..., :nope], dequantize(p["w_uk"], x.dtype))   # [B, T, H, R]
    q_r = to_pool_width(q[..., nope:], rope.shape[-1])
    kv_len = lengths + n_new
    if ragged is None:
        o_lat = _per_head(lambda ql, qr, la, ro, tb, qp, kl: dense_mla_attention(ql, qr, la, ro, tb, qp, kl,
                                                                                  scale=scale, layer=layer),
                          2, q_lat, q_r, lat, rope, page_table, jnp.where(valid, positions, -1), kv_len)
    else:
        o_lat = _per_head(lambda ql, qr, la, ro, tb, cu, kl: dense_mla_attention_ragged(
            ql, qr, la, ro, tb, cu, kl, scale=scale, layer=layer),
            1, q_lat[0], q_r[0], lat, rope, page_table, ragged.cu_seqlens, kv_len)[None]
    o = jnp.einsum("bthr,hvr->bthv", o_lat.astype(x.dtype), dequantize(p["w_uv"], x.dtype)).reshape(B, T, H * v_dim)
    return linear(o, p["o_proj"]).astype(x.dtype), lat, rope
