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
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cache.compressed import close_tail, dense_entries, gather_entries, write_entries
from hybrid_jax.layers.hyper_connections import unweighted_rms
from hybrid_jax.layers.mla import rms_norm
from pallas_kernels.sparse_attention import indexer_topk, indexer_weights


def inv_freq(spec, rope_dim: int):
    """Inverse frequencies [rope_dim // 2] of a RopeSpec ('default' or YaRN as transformers computes it)."""
    base = spec.theta
    exps = jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim
    extra = 1.0 / (base ** exps)
    if spec.rope_type != "yarn":
        return extra
    inter = 1.0 / (spec.factor * base ** exps)

    def corr(rot):
        return rope_dim * math.log(spec.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))
    # transformers reads `truncate` from the top-level rope dict, which V4 nests: always truncated
    low, high = max(math.floor(corr(spec.beta_fast)), 0), min(math.ceil(corr(spec.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(rope_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp
    return inter * (1.0 - keep) + extra * keep


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
             bias, norm_w, freqs, *, rate: int, overlap: bool, eps: float, rope_scale: float = 1.0):
    """One step of a compressor.

    kv_new, gate_new [B, T, C]; tail_kv, tail_gate [B, rate, C] (raw gates), tail_count, n_new,
    entry_count [B]; overlap_kv, overlap_gate [B, rate, C/2] (CSA, else None); bias [rate, C];
    norm_w [D] (D = C/2 with overlap, else C).
    Returns (entries [B, NW, D], entry_index [B, NW] (NE-safe: -1 where no window closed),
    tail (kv, gate, count), overlap (kv, gate) or None). NW = (rate - 1 + T) // rate static."""
    B, T, C = kv_new.shape
    m = rate
    NW = (m - 1 + T) // m
    Ls = (NW + 1) * m
    j = jnp.arange(Ls, dtype=jnp.int32)[None, :]
    c = tail_count[:, None]
    src = jnp.clip(jnp.where(j < c, j, m + j - c), 0, m + T - 1)
    ok = (j < c + n_new[:, None])[..., None]
    s_kv = jnp.where(ok, jnp.take_along_axis(jnp.concatenate([tail_kv, kv_new.astype(tail_kv.dtype)], 1),
                                             src[..., None], axis=1), 0)
    s_gate = jnp.where(ok, jnp.take_along_axis(jnp.concatenate([tail_gate, gate_new.astype(tail_gate.dtype)], 1),
                                               src[..., None], axis=1), 0)
    closed, new_count = close_tail(tail_count, n_new, m)     # [B] windows that close, tokens left in the tail
    w_kv = s_kv[:, :NW * m].reshape(B, NW, m, C).astype(jnp.float32)
    w_gate = s_gate[:, :NW * m].reshape(B, NW, m, C).astype(jnp.float32) + bias.astype(jnp.float32)
    k = jnp.arange(NW, dtype=jnp.int32)[None, :]
    new_overlap = None
    if overlap:
        D = C // 2
        ca_kv, ca_g = w_kv[..., :D], w_gate[..., :D]
        prev_kv = jnp.concatenate([overlap_kv[:, None].astype(jnp.float32), ca_kv[:, :-1]], axis=1)
        prev_g = jnp.concatenate([overlap_gate[:, None].astype(jnp.float32), ca_g[:, :-1]], axis=1)
        has_prev = (entry_count[:, None] + k > 0)[..., None, None]
        kvs = jnp.concatenate([prev_kv, w_kv[..., D:]], axis=2)                       # [B, NW, 2m, D]
        gates = jnp.concatenate([jnp.where(has_prev, prev_g, -jnp.inf), w_gate[..., D:]], axis=2)
        last = jnp.maximum(closed - 1, 0)[:, None, None, None]
        any_closed = (closed > 0)[:, None, None]
        new_overlap = tuple(jnp.where(any_closed, jnp.take_along_axis(a, last, axis=1)[:, 0], old).astype(old.dtype)
                            for a, old in ((ca_kv, overlap_kv), (ca_g, overlap_gate)))
    else:
        kvs, gates = w_kv, w_gate
    comp = jnp.sum(kvs * jax.nn.softmax(gates, axis=2), axis=2)                     # [B, NW, D]
    comp = rms_norm(comp, norm_w, eps)
    cos, sin = rope_tables((entry_count[:, None] + k) * m, freqs, rope_scale)
    comp = rope_trailing(comp[:, :, None], cos, sin)[:, :, 0]
    idx = jnp.where(k < closed[:, None], entry_count[:, None] + k, -1)
    t = closed[:, None] * m + jnp.arange(m, dtype=jnp.int32)[None, :]
    keep = (jnp.arange(m)[None, :] < new_count[:, None])[..., None]
    tail = (jnp.where(keep, jnp.take_along_axis(s_kv, t[..., None], axis=1), 0),
            jnp.where(keep, jnp.take_along_axis(s_gate, t[..., None], axis=1), 0), new_count)
    return comp.astype(kv_new.dtype), idx, tail, new_overlap


def window_update(ring, kv_new, positions, valid, new_lengths):
    """ring [B, W, D] holds position p at slot p % W; writes the valid new entries that stay in the window."""
    B, W = ring.shape[:2]
    keep = valid & (positions >= new_lengths[:, None] - W)
    slot = jnp.where(keep, positions % W, W)
    return ring.at[jnp.arange(B)[:, None], slot].set(kv_new.astype(ring.dtype), mode="drop")


def attend(q, kv_new, ring, positions, valid, lengths, extra, extra_ok, sinks, *, window: int, scale: float):
    """Softmax over window keys, compressed keys and a per-head sink, K = V.
    q [B, T, H, D]; kv_new [B, T, D]; ring [B, W, D] (before this step's writes); positions, valid [B, T];
    lengths [B]; extra [B, K, D] (shared by the queries), [B, T, K, D] (per query) or None;
    extra_ok [B, T, K]; sinks [H] -> [B, T, H, D] f32."""
    B, T, H, _ = q.shape
    W = ring.shape[1]
    p = positions[:, :, None]
    s = jnp.arange(W, dtype=jnp.int32)[None, :]
    rpos = lengths[:, None] - 1 - jnp.mod(lengths[:, None] - 1 - s, W)                  # [B, W] ring positions
    tt = jnp.arange(T)
    ok = jnp.concatenate([(rpos[:, None, :] >= 0) & (rpos[:, None, :] > p - window),
                          (tt[None, None, :] <= tt[None, :, None]) & valid[:, None, :]
                          & (positions[:, None, :] > p - window)], axis=-1)            # [B, T, W + T]
    keys = [ring.astype(jnp.float32), kv_new.astype(jnp.float32)]
    per_query = extra is not None and extra.ndim == 4
    if extra is not None and not per_query:
        keys.append(extra.astype(jnp.float32))
        ok = jnp.concatenate([ok, extra_ok], axis=-1)
    keys = jnp.concatenate(keys, axis=1)                                                 # [B, S, D]
    qf = q.astype(jnp.float32)
    logits = [jnp.where(ok[:, :, None], jnp.einsum("bthd,bsd->bths", qf, keys) * scale, -jnp.inf)]
    if per_query:
        ex = extra.astype(jnp.float32)
        logits.append(jnp.where(extra_ok[:, :, None], jnp.einsum("bthd,btkd->bthk", qf, ex) * scale, -jnp.inf))
    S = keys.shape[1]
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None], (B, T, H, 1))
    probs = jax.nn.softmax(jnp.concatenate(logits + [sink], axis=-1), axis=-1)
    out = jnp.einsum("bths,bsd->bthd", probs[..., :S], keys)
    if per_query:
        out = out + jnp.einsum("bthk,btkd->bthd", probs[..., S:-1], ex)
    return out


def compressed_attention(p: dict, x, layer_type: str, positions, valid, lengths, n_new, ring, comp_state: dict,
                         freqs_main, freqs_comp, *, cfg, impl: str = "auto"):
    """One V4 attention layer. x [B, T, Hd] (normed block input); positions, valid [B, T]; lengths, n_new [B];
    ring [B, W, D] (this layer's window); comp_state: this layer's slices of the compressed groups
    ({} for sliding_attention): entries [P, ps, D] (this layer's page pool), table [B, NP] (the group's
    page table: every entry read and write goes through it), count [B], tail_kv / tail_gate [B, m, C],
    tail_count [B], overlap_kv / overlap_gate [B, m, D], and idx_* the same for the CSA indexer.
    Returns (out [B, T, Hd], new ring, new comp_state)."""
    B, T, _ = x.shape
    H, D, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    main = layer_type == "sliding_attention"
    spec = cfg.rope_main if main else cfg.rope_compress
    cos, sin = rope_tables(positions, freqs_main if main else freqs_comp, spec.attention_factor)
    q_res = rms_norm(x @ p["q_a"], p["q_a_norm"], eps)
    q = unweighted_rms((q_res @ p["q_b"]).reshape(B, T, H, D), eps).astype(x.dtype)
    q = rope_trailing(q, cos, sin)
    kv = rope_trailing(rms_norm(x @ p["kv"], p["kv_norm"], eps)[:, :, None], cos, sin)[:, :, 0]     # [B, T, D]
    new_len = lengths + n_new
    new_state = dict(comp_state)
    if main:
        extra, extra_ok = None, None
    else:
        m = cfg.rate_of(layer_type)
        csa = layer_type == "compressed_sparse_attention"
        cs = comp_state
        ents, idx, tail, ov = compress(
            x @ p["c_kv"], x @ p["c_gate"], cs["tail_kv"], cs["tail_gate"], cs["tail_count"], n_new, cs["count"],
            cs.get("overlap_kv"), cs.get("overlap_gate"), p["c_bias"], p["c_norm"], freqs_comp, rate=m,
            overlap=csa, eps=eps, rope_scale=cfg.rope_compress.attention_factor)
        entries = write_entries(cs["entries"], cs["table"], ents, idx)
        count = cs["count"] + jnp.sum(idx >= 0, axis=1).astype(jnp.int32)
        new_state.update(entries=entries, count=count, tail_kv=tail[0], tail_gate=tail[1], tail_count=tail[2])
        if csa:
            new_state.update(overlap_kv=ov[0], overlap_gate=ov[1])
            sel = _index(p, x, q_res, positions, valid, n_new, cs, new_state, freqs_comp, cfg=cfg, rate=m, impl=impl)
            extra = gather_entries(entries, cs["table"], sel)                                      # [B, T, K, D]
            extra_ok = sel >= 0
        else:
            extra = dense_entries(entries, cs["table"])                                            # [B, NE, D]
            NE = extra.shape[1]
            extra_ok = jnp.arange(NE)[None, None, :] < ((positions + 1) // m)[:, :, None]
            extra_ok = extra_ok & (jnp.arange(NE)[None, None, :] < count[:, None, None])
    o = attend(q, kv, ring, positions, valid, lengths, extra, extra_ok, p["sinks"], window=cfg.sliding_window,
               scale=D ** -0.5)
    o = rope_trailing(o, cos, -sin).astype(x.dtype)
    G = cfg.o_groups
    g = jnp.einsum("btgi,gir->btgr", o.reshape(B, T, G, H * D // G), p["o_a"]).reshape(B, T, -1)
    out = g @ p["o_b"]
    return out.astype(x.dtype), window_update(ring, kv, positions, valid, new_len), new_state


def _index(p, x, q_res, positions, valid, n_new, cs, new_state, freqs_comp, *, cfg, rate, impl):
    """CSA's indexer: compresses its keys (new_state gets idx_*), returns the selected entries [B, T, K] (-1 pad)."""
    B, T, _ = x.shape
    Hi, Di, eps = cfg.index_n_heads, cfg.index_head_dim, cfg.rms_norm_eps
    ents, idx, tail, ov = compress(
        x @ p["i_kv"], x @ p["i_gate"], cs["idx_tail_kv"], cs["idx_tail_gate"], cs["idx_tail_count"], n_new,
        cs["idx_count"], cs["idx_overlap_kv"], cs["idx_overlap_gate"], p["i_bias"], p["i_norm"], freqs_comp,
        rate=rate, overlap=True, eps=eps, rope_scale=cfg.rope_compress.attention_factor)
    keys = write_entries(cs["idx_entries"], cs["idx_table"], ents, idx)
    count = cs["idx_count"] + jnp.sum(idx >= 0, axis=1).astype(jnp.int32)
    new_state.update(idx_entries=keys, idx_count=count, idx_tail_kv=tail[0], idx_tail_gate=tail[1],
                     idx_tail_count=tail[2], idx_overlap_kv=ov[0], idx_overlap_gate=ov[1])
    cos, sin = rope_tables(positions, freqs_comp, cfg.rope_compress.attention_factor)
    qi = rope_trailing((q_res @ p["i_q"]).reshape(B, T, Hi, Di), cos, sin)
    w = indexer_weights(x.astype(jnp.float32) @ p["i_w"].astype(jnp.float32), Hi, Di)
    table = cs["idx_table"]                                      # [B, NP]: keys [P, ps, Di] are paged
    NE = table.shape[1] * keys.shape[1]
    # entry j is visible to position p once its window closed: j <= (p + 1) // rate - 1
    qpos = jnp.where(valid, (positions + 1) // rate - 1, -1)
    return indexer_topk(qi, w, keys, table, qpos, count, topk=min(cfg.index_topk, NE), impl=impl)
