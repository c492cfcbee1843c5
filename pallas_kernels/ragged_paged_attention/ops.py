"""Public ragged paged attention op: one signature, implementations chosen by `impl`.

  impl="reference"  one query row at a time against its sequence's masked page row (naive.py)
  impl="xla"        tiles walked over their own key blocks with an online softmax (xla.py)
  impl="pallas"     the Pallas kernel: Mosaic TPU (page DMAs from HBM, double-buffered) or Triton on GPU;
                    interpret mode on CPU (pallas_tpu.py, pallas_gpu.py)
  impl="auto"       Pallas on GPU/TPU, XLA on CPU
The kernel follows the platform the program is lowered for (pallas_kernels.dispatch), not the host's.

Layouts and the masking contract are in common.py. The op only reads the KV pool, in the layout named by the
kernel ABI `pallas_kernels.abi.RAGGED_PAGED_ATTENTION`: the full-attention KV group that writes pages for it
records that id as its writer.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import abi, dispatch
from pallas_kernels.ragged_paged_attention import naive, xla
from pallas_kernels.ragged_paged_attention.common import check_inputs

ABI = abi.RAGGED_PAGED_ATTENTION


def _kernel(**kw):
    """The Pallas kernel as `pallas_kernels.dispatch.run` calls it: backend "tpu" (Mosaic; interpreted on
    the CPU) or "gpu" (Triton)."""
    def run(*args, backend: str, interpret: bool):
        if backend == "gpu":
            from pallas_kernels.ragged_paged_attention import pallas_gpu  # noqa: PLC0415
            return pallas_gpu.ragged_paged_attention_gpu(*args, **kw, interpret=interpret)
        from pallas_kernels.ragged_paged_attention import pallas_tpu  # noqa: PLC0415
        return pallas_tpu.ragged_paged_attention_tpu(*args, **kw, interpret=interpret)
    return run


def ragged_paged_attention(
    q: jax.Array,              # [N, Hq, D]       token-major queries
    k_pages: jax.Array,        # [P, ps, Hkv, D]  key pool (one layer)
    v_pages: jax.Array,        # [P, ps, Hkv, D]  value pool
    kv_lens: jax.Array,        # [R] int32        cached tokens per sequence, this step's included
    page_indices: jax.Array,   # [R, NP] int32    each sequence's pages in order
    cu_q_lens: jax.Array,      # [R + 1] int32    query row offsets, non-decreasing from 0
    num_seqs: jax.Array,       # [] or [1] int32  sequences in use
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str = "auto",
    max_q_len: int | None = None,
    decode_only: bool = False,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    decode_queries_per_block: int | None = None,
) -> jax.Array:
    """Causal attention of every sequence's new queries over its paged KV -> o [N, Hq, D] in q.dtype.

    max_q_len: a static hint, the longest q_len of the decode-like sequences (1 for decode, k + 1 for a
    speculative verify window): their queries are handled as one small tile each; longer sequences are still
    served, as prefill tiles. decode_only: the caller's promise that no sequence has more than max_q_len
    queries (a decode step): the prefill tiles are not built, so a static cost (`pl.CostEstimate`) counts
    the decode tiles alone; a longer sequence would go unserved. num_kv_pages_per_block /
    num_queries_per_block / decode_queries_per_block tune the Pallas kernel (defaults from its table, pallas_tpu.tuned_block_sizes); they are ignored by the
    reference and XLA paths."""
    check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                 sliding_window=sliding_window, soft_cap=soft_cap, max_q_len=max_q_len)
    if decode_only and max_q_len is None:
        raise ValueError("decode_only promises that no sequence has more than max_q_len queries: give max_q_len")
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    kw = dict(sm_scale=float(sm_scale), sliding_window=sliding_window,
              soft_cap=None if soft_cap is None else float(soft_cap))
    blocks = dict(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block,
                  decode_queries_per_block=decode_queries_per_block)
    return dispatch.run("ragged_paged_attention", impl, args,
                        reference=functools.partial(naive.ragged_paged_attention_reference, **kw),
                        xla=functools.partial(xla.ragged_paged_attention_xla, **kw, max_q_len=max_q_len,
                                              decode_only=decode_only),
                        pallas=lambda: _kernel(**kw, max_q_len=max_q_len, decode_only=decode_only, **blocks))
