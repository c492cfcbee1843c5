"""Shared pieces of the DeepSeek-V4 compressed-attention ops: input checks, the tail stream, RMSNorm and RoPE.

Compressor layouts (one layer, one step of T new tokens per row; m = rate, C = the compressor width):
  kv_new, gate_new         [B, T, C]    this step's compressor projections (gates raw, no bias)
  tail_kv, tail_gate       [B, m, C]    tokens of the still-open window (raw gates), tail_count [B] of them
  overlap_kv, overlap_gate [B, m, C/2]  CSA only: the a-half of the last closed window, gates *with* bias
  bias                     [m, C]       per-slot gate bias;  norm_w [D] (D = C/2 with overlap, else C)
  entries                  [B, NW, D]   one per closed window, NW = (m - 1 + T) // m (static), RMS-normed
                                        and RoPE'd (interleaved pairs on the trailing 2 * len(freqs)
                                        channels) at position w * m
The *stream* of a row is its tail followed by its valid new tokens; window w is stream rows
w * m .. (w + 1) * m - 1 and closes iff it is full.

Attention layouts: see ops.compressed_sparse_read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def n_windows(T: int, rate: int) -> int:
    """Windows a step of T tokens can close (static): the tail holds at most rate - 1 tokens."""
    return (rate - 1 + T) // rate


def check_compress(kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate,
                   bias, norm_w, freqs, rate: int, overlap: bool):
    """Validates the compressor's inputs (layouts above); returns (B, T, C, D). Raises ValueError naming the problem."""
    if rate < 1:
        raise ValueError(f"rate must be >= 1; got {rate}")
    if kv_new.ndim != 3 or gate_new.shape != kv_new.shape:
        raise ValueError(f"kv_new and gate_new must both be [B, T, C]; got {kv_new.shape}, {gate_new.shape}")
    B, T, C = kv_new.shape
    for name, a in (("tail_kv", tail_kv), ("tail_gate", tail_gate)):
        if a.shape != (B, rate, C):
            raise ValueError(f"{name} must be [B, rate, C] = {(B, rate, C)}; got {a.shape}")
    for name, a in (("tail_count", tail_count), ("n_new", n_new), ("entry_count", entry_count)):
        if a.shape != (B,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer [B] = ({B},); got {a.shape} {a.dtype}")
    if overlap:
        if C % 2:
            raise ValueError(f"a CSA (overlap) compressor needs an even width C; got {C}")
        D = C // 2
        for name, a in (("overlap_kv", overlap_kv), ("overlap_gate", overlap_gate)):
            if a is None or a.shape != (B, rate, D):
                raise ValueError(f"{name} must be [B, rate, C/2] = {(B, rate, D)}; got "
                                 f"{None if a is None else a.shape}")
    else:
        D = C
    if bias.shape != (rate, C):
        raise ValueError(f"bias must be [rate, C] = {(rate, C)}; got {bias.shape}")
    if norm_w.shape != (D,):
        raise ValueError(f"norm_w must be [D] = ({D},); got {norm_w.shape}")
    if freqs.ndim != 1 or 2 * freqs.shape[0] > D:
        raise ValueError(f"freqs must be [R/2] with R <= D = {D}; got {freqs.shape}")
    return B, T, C, D


def stream(tail, new, tail_count, n_new, rate: int):
    """tail [B, m, C], new [B, T, C] -> the row's stream [B, (NW + 1) * m, C] in tail.dtype: the tail's
    tail_count tokens, then the n_new valid new tokens, zeros after."""
    B, T, _ = new.shape
    Ls = (n_windows(T, rate) + 1) * rate
    j = jnp.arange(Ls, dtype=jnp.int32)[None, :]
    c = tail_count[:, None]
    src = jnp.clip(jnp.where(j < c, j, rate + j - c), 0, rate + T - 1)
    ok = (j < c + n_new[:, None])[..., None]
    both = jnp.concatenate([tail, new.astype(tail.dtype)], axis=1)
    return jnp.where(ok, jnp.take_along_axis(both, src[..., None], axis=1), 0)


def close_tail(tail_count, n_new, rate: int):
    """(windows closed [B], tokens left in the tail [B]) after n_new [B] tokens join tail_count [B]."""
    total = tail_count + n_new
    return total // rate, total % rate


def finish(pooled, s_kv, s_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate, bias, norm_w, freqs,
           *, rate: int, overlap: bool, eps: float, rope_scale: float, out_dtype):
    """Everything after the pooling, shared by the xla and pallas compressors.

    pooled [B, NW, D] f32 (normed when norm_w is None, else raw); s_kv, s_gate [B, (NW + 1) m, C] (the
    stream) -> (entries [B, NW, D] out_dtype, index [B, NW] (-1: window not closed), (tail_kv, tail_gate,
    tail_count), (overlap_kv, overlap_gate) or None)."""
    B, NW, D = pooled.shape
    m = rate
    comp = pooled if norm_w is None else rms_norm(pooled, norm_w, eps)
    k = jnp.arange(NW, dtype=jnp.int32)[None, :]
    comp = rope_interleaved(comp, (entry_count[:, None] + k) * m, freqs, rope_scale)
    closed, new_count = close_tail(tail_count, n_new, m)
    idx = jnp.where(k < closed[:, None], entry_count[:, None] + k, -1)
    t = closed[:, None] * m + jnp.arange(m, dtype=jnp.int32)[None, :]
    keep = (jnp.arange(m)[None, :] < new_count[:, None])[..., None]
    tail = (jnp.where(keep, jnp.take_along_axis(s_kv, t[..., None], axis=1), 0),
            jnp.where(keep, jnp.take_along_axis(s_gate, t[..., None], axis=1), 0), new_count)
    new_overlap = None
    if overlap:
        # the a-half of the last window that closed (gates with their bias), else the old state
        rows = jnp.maximum(closed - 1, 0)[:, None] * m + jnp.arange(m, dtype=jnp.int32)[None, :]
        last_kv = jnp.take_along_axis(s_kv[..., :D], rows[..., None], axis=1).astype(jnp.float32)
        last_g = (jnp.take_along_axis(s_gate[..., :D], rows[..., None], axis=1).astype(jnp.float32)
                  + bias[:, :D].astype(jnp.float32))
        any_closed = (closed > 0)[:, None, None]
        new_overlap = tuple(jnp.where(any_closed, a, old).astype(old.dtype)
                            for a, old in ((last_kv, overlap_kv), (last_g, overlap_gate)))
    return comp.astype(out_dtype), idx, tail, new_overlap


def rms_norm(x, w, eps: float):
    """DeepSeek's RMSNorm in f32: x [..., D], w [D] -> w * x / sqrt(mean(x^2) + eps)."""
    xf = x.astype(jnp.float32)
    return w.astype(jnp.float32) * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps))


def rope_interleaved(x, positions, freqs, scale: float = 1.0):
    """Interleaved-pair RoPE on the trailing 2 * len(freqs) channels, in f32.
    x [B, N, D]; positions [B, N] int; freqs [R/2] -> [B, N, D] f32 (cos and sin times `scale`)."""
    x = x.astype(jnp.float32)
    r = 2 * freqs.shape[0]
    if r == 0:
        return x
    f = positions.astype(jnp.float32)[..., None] * freqs.astype(jnp.float32)
    c, s = jnp.cos(f) * scale, jnp.sin(f) * scale
    head, rot = x[..., :-r], x[..., -r:]
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    return jnp.concatenate([head, out], axis=-1)


def check_attention(q, kv, kv_positions, q_positions, entries, page_table, indices, entry_counts, sinks,
                    rate=None):
    """Validates the sparse read's inputs (see ops.compressed_sparse_read); returns (B, T, H, D, S, mode) with
    mode "window" (no entries), "gather" (per-query indices) or "dense" (every entry, HCA's rule)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D]; got shape {q.shape}")
    B, T, H, D = q.shape
    if kv.ndim != 3 or kv.shape[0] != B or kv.shape[2] != D:
        raise ValueError(f"kv must be [B, S, D] with B={B}, D={D}; got {kv.shape}")
    S = kv.shape[1]
    if kv_positions.shape != (B, S):
        raise ValueError(f"kv_positions must be [B, S] = {(B, S)}; got {kv_positions.shape}")
    if q_positions.shape != (B, T):
        raise ValueError(f"q_positions must be [B, T] = {(B, T)}; got {q_positions.shape}")
    if sinks.shape != (H,):
        raise ValueError(f"sinks must be [H] = ({H},); got {sinks.shape}")
    if entries is None:
        if indices is not None or rate is not None:
            raise ValueError("indices / rate were given without entries: pass the entry pool [P, ps, D]")
        return B, T, H, D, S, "window"
    if entries.ndim != 3 or entries.shape[2] != D:
        raise ValueError(f"entries must be a page pool [P, ps, D] with D={D}; got {entries.shape}")
    if page_table is None or page_table.ndim != 2 or page_table.shape[0] != B:
        got = None if page_table is None else page_table.shape
        raise ValueError(f"page_table must be [B, NP] with B={B}; got {got}")
    if entry_counts is None or entry_counts.shape != (B,):
        got = None if entry_counts is None else entry_counts.shape
        raise ValueError(f"entry_counts must be [B] = ({B},); got {got}")
    if (indices is None) == (rate is None):
        raise ValueError("entries need exactly one of indices [B, T, K] (per-query ids) or rate (read every "
                         "entry whose window closed, HCA)")
    if indices is None:
        if rate < 1:
            raise ValueError(f"rate must be >= 1; got {rate}")
        return B, T, H, D, S, "dense"
    if indices.ndim != 3 or indices.shape[:2] != (B, T) or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be integer [B, T, K] with B, T = {(B, T)}; got {indices.shape} "
                         f"{indices.dtype}")
    return B, T, H, D, S, "gather"


def dense_indices(q_positions, num_entries: int, rate: int):
    """HCA's rule as index lists: [B, T, NE] int32, entry j if its window closed at or before the query
    ((j + 1) * rate <= p + 1), else -1. (The reference reads dense entries this way.)"""
    j = jnp.arange(num_entries, dtype=jnp.int32)[None, None, :]
    return jnp.where((j + 1) * rate <= q_positions[:, :, None] + 1, j, -1)


def hca_reach(count, p, rate: int):
    """How many of a row's HCA entries a query at position p reads: j < min(count, (p + 1) // rate), 0 for a
    padding query (p = -1). Walking stops there: the work follows the context, not the page table's span.
    lax.div on non-negative values (Mosaic lowers a floor division through `sign`, which needs the chip)."""
    return jnp.minimum(count, jax.lax.div(p + 1, jnp.asarray(rate, jnp.int32)))


def window_mask(kv_positions, q_positions, window: int):
    """[B, T, S] bool: key s is in query t's sliding window, 0 <= kpos <= p and kpos > p - window."""
    k = kv_positions[:, None, :]
    p = q_positions[:, :, None]
    return (k >= 0) & (k <= p) & (k > p - window)
