"""DeepSeek-V4 attention: shared K=V multi-query attention over a sliding window plus compressed entries.

Per layer and step, for the T new tokens of each row (positions lengths[b] + t, t < n_new[b]):
  q_res = RMSNorm(x W_qa);  q = unweighted_rms(q_res W_qb) -> [H, D];  kv = RMSNorm(x W_kv) -> [D]
  RoPE (interleaved pairs, on the trailing rope_dim channels) on q and kv at their positions.
  keys = values = { window: the last W positions <= p (ring + this step's tokens) }
                ∪ { compressed entries j with (j + 1) * rate <= p + 1 }   (HCA: all; CSA: indexer's Top-K)
  o = softmax([q.k * D^-0.5, sink_h]) without the sink column, times the values; the rope slice of o is
  rotated back by -p; then the grouped output projection: G groups of H*D/G -> o_lora each, then W_ob.
Compressor (per closed window w of `rate` tokens, entry position w * rate):
  HCA  e_w = RMSNorm(sum_s softmax_s(Z_s + B_s) * C_s),  C = x W_c, Z = x W_z       [rate slots]
  CSA  C, Z have two series (a | b): e_w blends window w-1's a-series with window w's b-series over
       2 * rate slots (window 0 has no a-half); then RoPE ("compress") at w * rate.
The indexer compresses its own keys the same way (CSA layout, index_head_dim) and scores
sum_h w_h relu(q_h . k_j) through the shared DSA indexer op (pallas_kernels.sparse_attention).

On a mesh (`hybrid_jax.parallel`): the query heads, sinks and output groups split over the tensor axis
(the read runs per device on its heads), the indexer on its heads (`mla.indexer_per_head`: partial
scores all-reduced before the Top-K); the shared K = V, the window ring and every compressor and its
entries are whole on every device (the compressor kernel runs whole on each).
"""
from __future__ import annotations

import jax.numpy as jnp

from cache.compressed import write_entries
from hybrid_jax.layers.hyper_connections import unweighted_rms
from hybrid_jax.layers.linear import dequantize, linear
from hybrid_jax.layers.mla import indexer_per_head, rms_norm
from hybrid_jax.layers.rope import frequencies
from hybrid_jax.parallel.context import per_device
from pallas_kernels.compressed_attention import compress_windows, compressed_sparse_read
from pallas_kernels.sparse_attention import indexer_topk, indexer_weights


def inv_freq(spec, rope_dim: int):
    """Inverse frequencies [rope_dim // 2] of a RopeSpec (`layers.rope.frequencies`; V4's types need no
    per-row length)."""
    return frequencies(spec, rope_dim)


def rope_tables(positions, freqs, scale: float = 1.0):
    """positions [...] int -> cos, sin [..., R/2] fp32 (times YaRN's attention factor)."""
    f = positions.astype(jnp.float32)[..., None] * freqs
    return jnp.cos(f) * scale, jnp.sin(f) * scale


def rope_trailing(x, cos, sin):
    """Interleaved-pair RoPE on the last 2 * cos.shape[-1] channels of x, layout kept.
    x: [B, T, ..., D]; cos, sin: [B, T, R/2] (broadcast over the middle axes)."""
    r = 2 * cos.shape[-1]
    if r == 0:
        return x
    c = cos.reshape(cos.shape[:2] + (1,) * (x.ndim - 3) + cos.shape[2:])
    s = sin.reshape(c.shape)
    head, rot = x[..., :-r], x[..., -r:].astype(jnp.float32)
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    return jnp.concatenate([head, out.astype(x.dtype)], axis=-1)


def compress(kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate,
             bias, norm_w, freqs, *, rate: int, overlap: bool, eps: float, rope_scale: float = 1.0, impl: str = "auto"):
    """One step of a compressor (pallas_kernels.compressed_attention.compress_windows; impl passed through).

    kv_new, gate_new [B, T, C]; tail_kv, tail_gate [B, rate, C] (raw gates), tail_count, n_new,
    entry_count [B]; overlap_kv, overlap_gate [B, rate, C/2] (CSA, else None); bias [rate, C];
    norm_w [D] (D = C/2 with overlap, else C).
    Returns (entries [B, NW, D], entry_index [B, NW] (NE-safe: -1 where no window closed),
    tail (kv, gate, count), overlap (kv, gate) or None). NW = (rate - 1 + T) // rate static."""
    def op(*a):
        return compress_windows(*a, rate=rate, overlap=overlap, eps=eps, rope_scale=rope_scale, impl=impl)
    args = (kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate, bias,
            norm_w, freqs)
    return per_device(op, (None,) * len(args), None)(*args)        # whole on every device


def window_update(ring, kv_new, positions, valid, new_lengths):
    """ring [B, W, D] holds position p at slot p % W; writes the valid new entries that stay in the window."""
    B, W = ring.shape[:2]
    keep = valid & (positions >= new_lengths[:, None] - W)
    slot = jnp.where(keep, positions % W, W)
    return ring.at[jnp.arange(B)[:, None], slot].set(kv_new.astype(ring.dtype), mode="drop")


def attend(q, kv_new, ring, positions, valid, lengths, entries, table, indices, count, sinks, *, window: int,
           scale: float, rate: int | None = None, impl: str = "auto"):
    """Softmax over window keys, compressed keys and a per-head sink, K = V
    (pallas_kernels.compressed_attention.compressed_sparse_read; impl passed through).
    q [B, T, H, D]; kv_new [B, T, D]; ring [B, W, D] (before this step's writes); positions, valid [B, T];
    lengths [B]; entries [P, ps, D] (this layer's page pool) with table [B, NP], count [B] (entries written) and
    either indices [B, T, K] (CSA: logical entry ids each query reads, -1 none) or rate (HCA: every entry whose
    window closed), or all None; sinks [H] -> [B, T, H, D] f32."""
    W = ring.shape[1]
    s = jnp.arange(W, dtype=jnp.int32)[None, :]
    rpos = lengths[:, None] - 1 - jnp.mod(lengths[:, None] - 1 - s, W)                  # [B, W] ring positions
    dt = jnp.promote_types(ring.dtype, kv_new.dtype)
    keys = jnp.concatenate([ring.astype(dt), kv_new.astype(dt)], axis=1)                # [B, W + T, D]
    kpos = jnp.concatenate([jnp.where(rpos >= 0, rpos, -1), jnp.where(valid, positions, -1)], axis=1)

    def op(q, sinks, *rest):
        k, kp, qp, e, t, i, c = rest
        return compressed_sparse_read(q, k, kp, qp, e, t, i, c, sinks, window=window, scale=scale, rate=rate,
                                      impl=impl)
    rest = (keys, kpos.astype(jnp.int32), positions.astype(jnp.int32), entries, table, indices, count)
    q_axes = (None, None, "heads", None)
    return per_device(op, (q_axes, ("heads",)) + (None,) * len(rest), q_axes, out_like=q)(q, sinks, *rest)


def compressed_attention(p: dict, x, layer_type: str, positions, valid, lengths, n_new, ring, comp_state: dict,
                         freqs_main, freqs_comp, *, cfg, impl: str = "auto", pools_in_place: bool = False):
    """One V4 attention layer. x [B, T, Hd] (normed block input); positions, valid [B, T]; lengths, n_new [B];
    ring [B, W, D] (this layer's window); comp_state: this layer's slices of the compressed groups
    ({} for sliding_attention): entries [P, ps, D] (this layer's page pool), table [B, NP] (the group's
    page table: every entry read and write goes through it), count [B], tail_kv / tail_gate [B, m, C],
    tail_count [B], overlap_kv / overlap_gate [B, m, D], and idx_* the same for the CSA indexer.
    With pools_in_place, comp_state holds the groups' whole stacks of page pools ([L, P, ps, D]) with
    this layer's slots in them (`slot`, `idx_slot`): the compressed entries are written in place (no
    copy of a pool per step) and the stacks come back in new_state.
    Returns (out [B, T, Hd], new ring, new comp_state)."""
    B, T, _ = x.shape
    H, D, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    main = layer_type == "sliding_attention"
    spec = cfg.rope_main if main else cfg.rope_compress
    cos, sin = rope_tables(positions, freqs_main if main else freqs_comp, spec.attention_factor)
    q_res = rms_norm(linear(x, p["q_a"]), p["q_a_norm"], eps)
    q = unweighted_rms(linear(q_res, p["q_b"]).reshape(B, T, H, D), eps).astype(x.dtype)
    q = rope_trailing(q, cos, sin)
    kv = rope_trailing(rms_norm(linear(x, p["kv"]), p["kv_norm"], eps)[:, :, None], cos, sin)[:, :, 0]     # [B, T, D]
    new_len = lengths + n_new
    new_state = dict(comp_state)
    pool = table = sel = count = hca_rate = None
    if not main:
        m = cfg.rate_of(layer_type)
        csa = layer_type == "compressed_sparse_attention"
        cs = comp_state
        ents, idx, tail, ov = compress(
            linear(x, p["c_kv"]), linear(x, p["c_gate"]), cs["tail_kv"], cs["tail_gate"], cs["tail_count"], n_new,
            cs["count"],
            cs.get("overlap_kv"), cs.get("overlap_gate"), p["c_bias"], p["c_norm"], freqs_comp, rate=m,
            overlap=csa, eps=eps, rope_scale=cfg.rope_compress.attention_factor, impl=impl)
        slot = cs["slot"] if pools_in_place else None
        pool, table = write_entries(cs["entries"], cs["table"], ents, idx, slot), cs["table"]
        count = cs["count"] + jnp.sum(idx >= 0, axis=1).astype(jnp.int32)
        new_state.update(entries=pool, count=count, tail_kv=tail[0], tail_gate=tail[1], tail_count=tail[2])
        pool = pool if slot is None else pool[slot]                     # this layer's pool, to read
        if csa:
            new_state.update(overlap_kv=ov[0], overlap_gate=ov[1])
            sel = _index(p, x, q_res, positions, valid, n_new, cs, new_state, freqs_comp, cfg=cfg, rate=m, impl=impl,
                         slot=cs["idx_slot"] if pools_in_place else None)
        else:   # HCA reads every entry whose window closed at or before the query: j < (p + 1) // m
            sel, hca_rate = None, m
    o = attend(q, kv, ring, positions, valid, lengths, pool, table, sel, count, p["sinks"],
               window=cfg.sliding_window, scale=D ** -0.5, rate=hca_rate, impl=impl)
    o = rope_trailing(o, cos, -sin).astype(x.dtype)
    G = cfg.o_groups
    g = jnp.einsum("btgi,gir->btgr", o.reshape(B, T, G, H * D // G), dequantize(p["o_a"], o.dtype)).reshape(B, T, -1)
    out = linear(g, p["o_b"])
    return out.astype(x.dtype), window_update(ring, kv, positions, valid, new_len), new_state


def _index(p, x, q_res, positions, valid, n_new, cs, new_state, freqs_comp, *, cfg, rate, impl, slot=None):
    """CSA's indexer: compresses its keys (new_state gets idx_*), returns the selected entries [B, T, K] (-1 pad)."""
    B, T, _ = x.shape
    Hi, Di, eps = cfg.index_n_heads, cfg.index_head_dim, cfg.rms_norm_eps
    ents, idx, tail, ov = compress(
        linear(x, p["i_kv"]), linear(x, p["i_gate"]), cs["idx_tail_kv"], cs["idx_tail_gate"], cs["idx_tail_count"],
        n_new,
        cs["idx_count"], cs["idx_overlap_kv"], cs["idx_overlap_gate"], p["i_bias"], p["i_norm"], freqs_comp,
        rate=rate, overlap=True, eps=eps, rope_scale=cfg.rope_compress.attention_factor, impl=impl)
    keys = write_entries(cs["idx_entries"], cs["idx_table"], ents, idx, slot)
    count = cs["idx_count"] + jnp.sum(idx >= 0, axis=1).astype(jnp.int32)
    new_state.update(idx_entries=keys, idx_count=count, idx_tail_kv=tail[0], idx_tail_gate=tail[1],
                     idx_tail_count=tail[2], idx_overlap_kv=ov[0], idx_overlap_gate=ov[1])
    keys = keys if slot is None else keys[slot]                        # this layer's keys, to read
    cos, sin = rope_tables(positions, freqs_comp, cfg.rope_compress.attention_factor)
    qi = rope_trailing(linear(q_res, p["i_q"]).reshape(B, T, Hi, Di), cos, sin)
    w = indexer_weights(x.astype(jnp.float32) @ p["i_w"].astype(jnp.float32), Hi, Di)
    table = cs["idx_table"]                                      # [B, NP]: keys [P, ps, Di] are paged
    NE = table.shape[1] * keys.shape[1]
    # entry j is visible to position p once its window closed: j <= (p + 1) // rate - 1
    qpos = jnp.where(valid, (positions + 1) // rate - 1, -1)
    return indexer_per_head(lambda *a, head_axis: indexer_topk(*a, topk=min(cfg.index_topk, NE), impl=impl,
                                                               head_axis=head_axis), qi, w, keys, table, qpos, count)
