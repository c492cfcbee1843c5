"""Cache state for hybrid models: pytrees carried through jit-compiled steps.

Imports point one way: hybrid_jax -> cache -> pallas_kernels. This package knows no model class.
"""
from cache.mla import IndexerKeyGroup, MLALatentGroup, contiguous_page_table, init_mla_groups, write_paged
from cache.state import (
    put_rows,
    take_rows,
    KVGroup,
    ModelCache,
    RecurrentGroup,
    bytes_per_token,
    init_cache,
    nbytes_by_group,
)

__all__ = ["IndexerKeyGroup", "MLALatentGroup", "contiguous_page_table", "init_mla_groups", "write_paged",
           "put_rows", "take_rows", "KVGroup", "ModelCache", "RecurrentGroup", "bytes_per_token", "init_cache", "nbytes_by_group"]
