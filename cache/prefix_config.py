"""What a prefix cache is set up with (`PrefixCacheConfig`) and what an admission gets from it (`Reuse`):
the plain values the engine and cache.prefix_cache.PrefixCache exchange."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Reuse:
    """What an admission got from the cache. boundary: tokens the request now holds (0: none);
    branch: where its prompt leaves the cached sequences it shares blocks with, on the resume grid,
    when that lies beyond `boundary` (the blocks are there, a checkpoint is not): the request should
    stop its prefill there and publish, so the next request sharing the prefix resumes there (0: none)."""
    boundary: int
    branch: int = 0


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    """cap_bytes: weighted device bytes the store may hold; block_size: the grid of checkpoint groups
    (paged groups use their page size); checkpoint_interval: keep a recurrent checkpoint every
    `interval x LCM` tokens, plus the last; fingerprint: the weights'; checkpoint_grid: a finer grid for
    checkpoint groups (a divisor of block_size), on which hits resume inside the pages of groups that
    allow it (CacheGroup.PARTIAL_RESUME); None: block_size. sharding: the mesh layout the pools are split
    in (`parallel.Layout.key`); copies: (group, field, axis, r) for each pool field that holds r copies
    of every entry along `axis` under that layout (KV heads kept once per device, `parallel.kv_replicas`):
    the disk tier stores one copy, so its spans restore under any layout."""
    cap_bytes: int
    fingerprint: str
    dtype: str
    block_size: int = 64
    checkpoint_interval: int = 8
    sharding: str = "replicated"
    checkpoint_grid: int | None = None
    copies: tuple[tuple[str, str, int, int], ...] = ()

    def __post_init__(self):
        for f in ("cap_bytes", "block_size", "checkpoint_interval"):
            if getattr(self, f) <= 0:
                raise ValueError(f"prefix cache {f} must be positive; got {getattr(self, f)}")
        g = self.checkpoint_grid
        if g is not None and (g <= 0 or self.block_size % g):
            raise ValueError(f"prefix cache checkpoint_grid must divide block_size {self.block_size}; got {g}")
