"""Cache state for hybrid models: pytrees carried through jit-compiled steps.

Imports point one way: hybrid_jax -> cache -> pallas_kernels. This package knows no model class.
"""
from cache.mla import IndexerKeyGroup, MLALatentGroup, contiguous_page_table, init_mla_groups, write_paged
from cache.compressed import CompressedKVGroup, OverlapGroup, SlidingWindowGroup, TailGroup, close_tail, init_compressed_groups  # noqa: E501,F401
from cache.pools import put_rows, take_rows
from cache.state import (
    KVGroup,
    ModelCache,
    RecurrentGroup,
    bytes_per_token,
    init_cache,
    nbytes_by_group,
)
from cache.segments import (CHECKPOINT_KINDS, EVENTS, Kind, SegState, Segment, IllegalTransition, TRANSITIONS,
                            VERSION_BUMPING)
from cache.segment_allocator import (AdmissionRefused, AllocConfig, AllocState, EVICTION_PRIORITY, UnknownSegment,
                                     eviction_order, init_state)
from cache.prefix_index import (BlockGeometry, IndexEntry, KeyContext, PrefixIndex, block_geometry, chain_keys,
                                checkpoint_boundaries, droppable_checkpoints, keep_checkpoint)
from cache.validation import CacheStats, GroupSpec, HitResult, check_hit, confirm_at_use, validate_hit

__all__ = ["IndexerKeyGroup", "MLALatentGroup", "contiguous_page_table", "init_mla_groups", "write_paged",
           "put_rows", "take_rows", "KVGroup", "ModelCache", "RecurrentGroup", "bytes_per_token", "init_cache", "nbytes_by_group",
           "CHECKPOINT_KINDS", "EVENTS", "Kind", "SegState", "Segment", "IllegalTransition", "TRANSITIONS",
           "VERSION_BUMPING",
           "AdmissionRefused", "AllocConfig", "AllocState", "EVICTION_PRIORITY", "UnknownSegment", "eviction_order",
           "init_state", "BlockGeometry", "IndexEntry", "KeyContext", "PrefixIndex", "block_geometry", "chain_keys",
           "checkpoint_boundaries", "droppable_checkpoints", "keep_checkpoint", "CacheStats", "GroupSpec",
           "HitResult", "check_hit", "confirm_at_use", "validate_hit"]

# The disk tier of the prefix cache (entries of numpy arrays keyed by prefix-chain hash).
from cache.tier_entry import EntryMeta, PrefetchHandle, make_key, validate_key
from cache.disk_tier import DISK_REASONS, DiskTier

__all__ += ["EntryMeta", "PrefetchHandle", "make_key", "validate_key", "DISK_REASONS", "DiskTier"]
