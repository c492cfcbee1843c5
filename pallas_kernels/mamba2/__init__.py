"""Mamba2's SSD rule (Nemotron-H's Mamba2 layers): the gated delta rule without the delta correction, built
from Gated DeltaNet's code (pallas_kernels.gated_delta_rule): reference, chunked XLA and Pallas implementations."""
from pallas_kernels.mamba2.common import NO_LIMIT, TimeStep
from pallas_kernels.mamba2.ops import chunk_mamba2, fused_recurrent_mamba2

__all__ = ["NO_LIMIT", "TimeStep", "chunk_mamba2", "fused_recurrent_mamba2"]
