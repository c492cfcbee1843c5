"""KV-cache events for routers: which blocks of which prefixes this server's device holds, as they change.

A prefix-aware router (Dynamo's KV router, llm-d's KV-cache indexer) keeps an index of which replica
holds which blocks, fed by events: `BlockStored` when blocks are stored, `BlockRemoved` when they
leave, `AllBlocksCleared` when the cache is dropped. The events follow vLLM's (their fields, their
names); the wire format is the publisher's (hybrid_jax/engine/kv_event_publisher.py).

What a block is here: `block_size` tokens of a prefix, the pages of the *event group* (the first paged
full-attention or latent group whose pages hold `block_size` tokens), stored when a publish commits
them whole. A partly filled page (a prefix that ends inside a block) is no event; the block is stored
when a longer publish fills it. A block leaves when the store lets go of its page (evicted, reclaimed
for running requests, moved to the disk tier, or the store cleared). For a hybrid model a block's page
is necessary for a hit but not sufficient (the recurrent state must have a checkpoint at or after the
point resumed): a router's longest match is an upper bound, and the server validates every hit before
it serves it.

Block hashes (`block_hash`) are public and a router recomputes them from token ids alone: the hash of
block i is the first 8 bytes, big-endian signed, of SHA-256(parent || tokens), parent the previous
block's hash as 8 bytes big-endian signed (empty for the first block), tokens the block's token ids as
little-endian int64. They do not name the model: a router keeps one index per served model.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from cache.segments import Kind


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The public hash of a block of token ids after the block whose hash is `parent` (None: the first)."""
    return _hash(parent, np.asarray(tokens, dtype="<i8").tobytes())


def _hash(parent: int | None, body: bytes) -> int:
    head = b"" if parent is None else int(parent).to_bytes(8, "big", signed=True)
    return int.from_bytes(hashlib.sha256(head + body).digest()[:8], "big", signed=True)


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """`block_hash` of every whole block of `tokens`, each chained to the one before (the tokens turned
    into bytes once)."""
    buf, step = np.asarray(tokens, dtype="<i8").tobytes(), 8 * block_size
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = _hash(parent, buf[i * step:(i + 1) * step])
        out.append(parent)
    return out


@dataclasses.dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = "GPU"          # vLLM's name for the device tier (a TPU's HBM here too)


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_KINDS = frozenset({Kind.FULL_KV, Kind.COMPRESSED_KV})


class KVEventLog:
    """The events of an engine's prefix cache since they were last taken (`take`), across the stores a
    reset replaces. A store binds it to its groups (`bind`), then reports what it stores (`stored`: a
    segment of the event group, its tokens) and lets go of (`released`, `cleared`); the log keeps each
    stored block's hash by segment, so a release names what it removes."""

    def __init__(self):
        self.group: str | None = None
        self.block_size = 0
        self._hash: dict[int, int] = {}          # segment id -> its block's public hash
        self._events: list[KVEvent] = []

    def bind(self, specs):
        """The store's groups (its GroupSpecs): which one's pages are the events' blocks (`event_group`;
        with none, the log records nothing)."""
        g = event_group(specs)
        self.group, self.block_size = g if g is not None else (None, 0)

    def stored(self, sid: int, tokens: Sequence[int], start: int, end: int, hashes: Sequence[int]):
        """Segment `sid` holds tokens[start:end] of the chain `tokens`, whose block hashes are `hashes`
        (`chain_hashes`, computed once per publish); a whole aligned block is an event."""
        b = self.block_size
        if self.group is None or end - start != b or start % b:
            return
        parent, h = (hashes[start // b - 1] if start else None), hashes[start // b]
        self._hash[sid] = h
        self._events.append(BlockStored((h,), parent, tuple(int(t) for t in tokens[start:end]), b))

    def released(self, sid: int):
        h = self._hash.pop(sid, None)
        if h is not None:
            self._events.append(BlockRemoved((h,)))

    def cleared(self):
        self._hash.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first (consecutive stores of one chain merged)."""
        out, self._events = merge(self._events), []
        return out


def merge(events: list[KVEvent]) -> list[KVEvent]:
    """Consecutive BlockStored events that continue one another (the next one's parent is the last
    one's final hash) become one event, as vLLM sends a request's new blocks."""
    out: list[KVEvent] = []
    for e in events:
        last = out[-1] if out else None
        if (isinstance(e, BlockStored) and isinstance(last, BlockStored)
                and e.parent_block_hash == last.block_hashes[-1] and e.block_size == last.block_size):
            out[-1] = BlockStored(last.block_hashes + e.block_hashes, last.parent_block_hash,
                                  last.token_ids + e.token_ids, e.block_size)
        else:
            out.append(e)
    return out


def event_group(specs) -> tuple[str, int] | None:
    """(name, block size) of the group whose pages are the events' blocks: the first paged full-KV or
    latent group whose entries are single tokens (specs: the prefix cache's GroupSpecs); None when the
    model has none (DeepSeek-V4's compressed groups hold an entry per several tokens)."""
    for s in specs:
        if s.kind in EVENT_KINDS and not s.is_checkpoint and s.entry == 1:
            return s.name, s.block_size
    return None
