"""Kernels for hybrid-attention models. Each op has a token-level reference, a chunked XLA path and
a Pallas kernel behind one signature (`impl="auto"|"pallas"|"xla"|"reference"`).

This package knows neither `cache` nor `hybrid_jax`: it takes arrays and returns arrays.
"""
from pallas_kernels import abi
from pallas_kernels.compressed_attention import compress_windows, compressed_sparse_read
from pallas_kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    l2norm,
    state_after,
)
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda
from pallas_kernels.mamba2 import chunk_mamba2, fused_recurrent_mamba2
# The subpackage, not its op: binding the function `ragged_paged_attention` here would shadow the subpackage of the
# same name on this package (`import pallas_kernels.ragged_paged_attention.xla` would then fail). The op is
# pallas_kernels.ragged_paged_attention.ragged_paged_attention.
from pallas_kernels import ragged_paged_attention
from pallas_kernels.sparse_attention import (  # noqa: F401
    dense_mla_attention, indexer_topk, indexer_weights, quantize_fp8, sparse_hit_rate, sparse_mla_attention,
)

__all__ = ["abi", "chunk_gated_delta_rule", "chunk_kda", "chunk_mamba2", "compress_windows", "compressed_sparse_read",
           "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_mamba2", "l2norm",
           "ragged_paged_attention", "state_after"]
