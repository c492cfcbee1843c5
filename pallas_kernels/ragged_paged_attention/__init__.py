"""Ragged paged attention: causal attention of a token-major ragged batch (prefill chunks and decodes mixed)
over a paged KV pool; reference, XLA and Pallas (TPU, GPU) implementations behind `impl=`."""
from pallas_kernels.ragged_paged_attention.common import validate_metadata
from pallas_kernels.ragged_paged_attention.ops import ragged_paged_attention

__all__ = ["ragged_paged_attention", "validate_metadata"]
