"""DeepSeek-V3.2 sparse attention (DSA): the indexer's fused score + Top-K and sparse absorbed MLA over
a paged latent cache; reference, blocked XLA and Pallas implementations behind `impl=`."""
from pallas_kernels.sparse_attention.common import indexer_weights, quantize_fp8
from pallas_kernels.sparse_attention.ops import (
    dense_mla_attention,
    in_order_selection,
    indexer_topk,
    sparse_hit_rate,
    sparse_mla_attention,
)

__all__ = ["dense_mla_attention", "in_order_selection", "indexer_topk", "indexer_weights", "quantize_fp8",
           "sparse_hit_rate", "sparse_mla_attention"]
