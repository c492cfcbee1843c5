"""DeepSeek-V4 compressed attention: the compressor (gated-softmax pooling of closed windows into entries, HCA and
CSA) and the sparse read (K=V multi-query attention over a sliding window + selected entries + sinks); reference,
vectorised XLA and Pallas implementations behind `impl=`."""
from pallas_kernels.compressed_attention.ops import compress_windows, compressed_sparse_read

__all__ = ["compress_windows", "compressed_sparse_read"]
