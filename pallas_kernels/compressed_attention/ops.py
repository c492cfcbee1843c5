"""Public DeepSeek-V4 compressed-attention ops: one signature each, implementations chosen by `impl`.

  impl="reference"  token-level: a scan over each row's tokens / one query at a time (naive.py)
  impl="xla"        vectorised XLA: all windows pooled at once / query blocks (xla.py)
  impl="pallas"     Pallas kernels (interpret mode on CPU)
  impl="auto"       Pallas on GPU/TPU, XLA on CPU
chosen by the platform the program is lowered for (pallas_kernels.dispatch).

Layouts are in common.py. Every implementation writes the same entry / tail / overlap layout, so they share
one kernel ABI id (`pallas_kernels.abi.V4_COMPRESSOR`).
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import dispatch
from pallas_kernels.compressed_attention import naive, xla
from pallas_kernels.compressed_attention.common import check_attention, check_compress


def _pallas_compressor():
    from pallas_kernels.compressed_attention import pallas_compressor  # noqa: PLC0415
    return pallas_compressor.compress_pallas


def _pallas_attention():
    from pallas_kernels.compressed_attention import pallas_attention  # noqa: PLC0415
    return pallas_attention.attention_pallas


def compress_windows(
    kv_new: jax.Array,        # [B, T, C]
    gate_new: jax.Array,      # [B, T, C]  raw gates (no bias)
    tail_kv: jax.Array,       # [B, m, C]
    tail_gate: jax.Array,     # [B, m, C]  raw gates
    tail_count: jax.Array,    # [B] int32  tokens in the tail
    n_new: jax.Array,         # [B] int32  valid new tokens (t < n_new[b])
    entry_count: jax.Array,   # [B] int32  entries the row already has
    overlap_kv: jax.Array | None,    # [B, m, C/2]  CSA only
    overlap_gate: jax.Array | None,  # [B, m, C/2]  CSA only, gates with bias
    bias: jax.Array,          # [m, C]
    norm_w: jax.Array,        # [D]
    freqs: jax.Array,         # [R/2] f32  RoPE inverse frequencies (trailing R channels)
    *,
    rate: int,
    overlap: bool,
    eps: float,
    rope_scale: float = 1.0,
    impl: str = "auto",
):
    """One step of a V4 compressor: every window that closes is pooled into an entry.

    Returns (entries [B, NW, D] in kv_new.dtype, index [B, NW] int32 (the entry's global number, -1 where
    no window closed: that row of entries is unspecified), (tail_kv, tail_gate, tail_count) and, with
    overlap, (overlap_kv, overlap_gate), else None). NW = (rate - 1 + T) // rate, D = C/2 with overlap
    (CSA), else C (HCA)."""
    check_compress(kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate,
                   bias, norm_w, freqs, rate, overlap)
    kw = dict(rate=rate, overlap=overlap, eps=float(eps), rope_scale=float(rope_scale))
    args = (kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate, bias,
            norm_w, freqs)
    return dispatch.run("compress_windows", impl, args,
                        reference=lambda *a: naive.compress_reference(*a, **kw),
                        xla=lambda *a: xla.compress_xla(*a, **kw),
                        pallas=lambda: functools.partial(_pallas_compressor(), **kw))


def compressed_sparse_read(
    q: jax.Array,                      # [B, T, H, D]
    kv: jax.Array,                     # [B, S, D]   window keys = values (e.g. the ring, then this step's tokens)
    kv_positions: jax.Array,           # [B, S] int32  position of each window key, -1 = empty
    q_positions: jax.Array,            # [B, T] int32
    entries: jax.Array | None,         # [P, ps, D]  compressed entries (a page pool)
    page_table: jax.Array | None,      # [B, NP] int32  row b's entry page i is pool page page_table[b, i]
    indices: jax.Array | None,         # [B, T, K] int32  logical entry ids per query, -1 = none (CSA)
    entry_counts: jax.Array | None,    # [B] int32  entries readable per row
    sinks: jax.Array,                  # [H]  per-head sink logits
    *,
    window: int,
    scale: float,
    rate: int | None = None,           # instead of indices: read every entry whose window closed (HCA)
    impl: str = "auto",
) -> jax.Array:
    """V4 attention -> [B, T, H, D] f32: softmax over the visible keys and a per-head sink (whose value is zero).

    A window key s is visible to query t iff 0 <= kv_positions[b, s] <= q_positions[b, t] and
    kv_positions[b, s] > q_positions[b, t] - window. An entry id is read iff 0 <= id < entry_counts[b] and
    its page lies in the pool (DSA's contract, sparse_attention.common): anything else is masked, never
    read. With indices, their causality is the caller's (the CSA indexer's Top-K). With `rate` instead of
    indices (HCA) every readable entry j with (j + 1) * rate <= q_position + 1 is read, shared by the
    queries (no [B, T, NE] index list, no per-query gather in the xla / pallas paths).
    entries, page_table, indices / rate and entry_counts are all None for a pure sliding-window layer."""
    check_attention(q, kv, kv_positions, q_positions, entries, page_table, indices, entry_counts, sinks, rate)
    args = (q, kv, kv_positions, q_positions, entries, page_table, indices, entry_counts, sinks)
    kw = dict(window=int(window), scale=float(scale), rate=None if rate is None else int(rate))
    return dispatch.run("compressed_sparse_read", impl, args,
                        reference=lambda *a: naive.attention_reference(*a, **kw),
                        xla=lambda *a: xla.attention_xla(*a, **kw),
                        pallas=lambda: functools.partial(_pallas_attention(), **kw))
