"""Kimi Delta Attention (the gated delta rule with a decay per key channel): reference, chunked XLA and
Pallas implementations, beside and sharing Gated DeltaNet's (pallas_kernels.gated_delta_rule)."""
from pallas_kernels.kda.ops import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
