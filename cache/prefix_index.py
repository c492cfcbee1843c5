"""Prefix index of the heterogeneous cache: chained block keys, per-group block geometry, checkpoint retention.

Keys. Tokens are hashed in blocks of G = GCD of the groups' block sizes; the key of block i is
    key_i = H(key_{i-1}, tokens[i*G:(i+1)*G], model fingerprint, dtype, kernel ABI id, sharding)
with key_{-1} = ROOT_KEY. Everything that makes a cached object valid is in the key, so weights,
dtype, layout or sharding changes cannot hit (vLLM / SGLang stamp none of these). The ABI id is per
group, so each group has its own chain over the same tokens.

Geometry. A group with block size b stores an entry at every boundary that is a multiple of b; a
request can only resume at a boundary every group can resume at, a multiple of L = LCM of the block
sizes. Hashing at G (not L) keeps small blocks hittable for short prompts: forcing one page size
across groups blew blocks up to hundreds or thousands of tokens in vLLM.

Recurrent checkpoints (retention policy). A checkpoint of a recurrent group is the whole state at a
boundary, so one per block can swallow ~80% of a pool. We keep, for each stored prefix of E tokens,
the checkpoints at multiples of `interval * L`, plus the last L-boundary <= E. Why: the last one
serves the common case exactly (the same conversation continues: all E tokens reused); the periodic
ones serve branching prefixes (a shared system prompt, an edited turn) at a recompute cost below
`interval * L` tokens; a prefix of E tokens costs at most E / (interval * L) + 1 checkpoints instead
of E / L. When a prefix is extended, its previous "last" checkpoint stops being last and, unless on
the interval, becomes droppable (`droppable_checkpoints`).

Resume grid. A paged group whose pages hold one entry per token (full KV, an MLA latent, indexer
keys) can be resumed inside a stored page: the hit lists the page and the request copies it on its
first write into it. For such a group the store also indexes the block's interior points (every G
tokens, `IndexEntry.end` inside the block's segment), so a prompt that shares 300 tokens with a
cached sequence matches all 300 of them, not only its whole pages, and recurrent checkpoints can sit
on a grid finer than the pages (BlockGeometry.resume).

Index entries map (group, kind, key) -> IndexEntry(end boundary, segment id). The index holds no
segment state: whether an entry's segment is still live, resident and unchanged is decided by
cache.validation against the allocator's state at check and at use.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import types
from typing import Mapping, Sequence

import numpy as np

from cache.segments import Kind

ROOT_KEY = "root"


@dataclasses.dataclass(frozen=True)
class BlockGeometry:
    """gcd: hashing granularity (tokens); lcm: the grid on which a request publishes its own prefix
    (every group's blocks end there); resume: the grid a hit may resume on (tokens), finer than lcm
    when paged groups can resume inside a stored page (`partial`); sizes: group -> block size."""
    gcd: int
    lcm: int
    sizes: Mapping[str, int]
    resume: int = 0
    partial: frozenset = frozenset()

    def __post_init__(self):
        if not self.resume:
            object.__setattr__(self, "resume", self.lcm)


def block_geometry(block_sizes: Mapping[str, int], partial=()) -> BlockGeometry:
    """GCD, LCM and resume grid of the groups' block sizes (group name -> tokens per block, each > 0).
    partial: groups whose blocks a prefix may end inside (a hit shares the stored page and the request
    copies it on its first write); the resume grid is the LCM of the other groups' sizes (the GCD when
    every group is such a group)."""
    if not block_sizes:
        raise ValueError("block_geometry needs at least one group")
    bad = {g: b for g, b in block_sizes.items() if not isinstance(b, int) or b <= 0}
    if bad:
        raise ValueError(f"block sizes must be positive ints, got {bad}")
    vals = list(block_sizes.values())
    gcd = math.gcd(*vals)
    whole = [b for g, b in block_sizes.items() if g not in partial]
    return BlockGeometry(gcd=gcd, lcm=math.lcm(*vals), sizes=types.MappingProxyType(dict(block_sizes)),
                         resume=math.lcm(gcd, *whole), partial=frozenset(partial) & frozenset(block_sizes))


@dataclasses.dataclass(frozen=True)
class KeyContext:
    """What, beside the tokens, makes a group's cached object valid."""
    model_fingerprint: str
    dtype: str
    abi_id: str
    sharding: str = "replicated"


@functools.lru_cache(maxsize=256)
def _ctx_hasher(ctx: KeyContext):
    """A blake2b state that has absorbed the context fields (length-prefixed); copied per block."""
    h = hashlib.blake2b(digest_size=16)
    for part in (ctx.model_fingerprint, ctx.dtype, ctx.abi_id, ctx.sharding):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h


def _key(base, parent: str, token_bytes: bytes, count: int) -> str:
    """The key: blake2b over the context (`base`), the parent key and the block's little-endian int64
    token ids, each length-prefixed."""
    h = base.copy()
    b = parent.encode()
    h.update(len(b).to_bytes(4, "little"))
    h.update(b)
    h.update(count.to_bytes(4, "little"))
    h.update(token_bytes)
    return h.hexdigest()


def block_key(parent: str, tokens: Sequence[int], ctx: KeyContext) -> str:
    """Key of one block given its parent's key. tokens: the block's token ids (ints)."""
    tok = np.asarray(tokens, dtype="<i8")
    return _key(_ctx_hasher(ctx), parent, tok.tobytes(), len(tok))


def chain_keys(tokens: Sequence[int], block: int, ctx: KeyContext) -> tuple[str, ...]:
    """Keys of every whole block of `block` tokens: result[i] is the key of the prefix ending at
    (i + 1) * block. A trailing partial block gets no key. The tokens are converted to bytes once (a
    cache hit hashes every block of the prompt, for each group)."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    buf = np.asarray(tokens, dtype="<i8").tobytes()
    step, base = 8 * block, _ctx_hasher(ctx)
    keys, parent = [], ROOT_KEY
    for i in range(len(buf) // step):
        parent = _key(base, parent, buf[i * step:(i + 1) * step], block)
        keys.append(parent)
    return tuple(keys)


def key_at(keys: Sequence[str], gcd: int, boundary: int) -> str:
    """The chain key of the prefix ending at `boundary` (a positive multiple of gcd)."""
    if boundary <= 0 or boundary % gcd:
        raise ValueError(f"boundary {boundary} is not a positive multiple of the hash block {gcd}")
    return keys[boundary // gcd - 1]


# ---- recurrent checkpoint retention -------------------------------------------------------------

def keep_checkpoint(boundary: int, prefix_end: int, lcm: int, interval: int) -> bool:
    """Whether a checkpoint at `boundary` is retained for a stored prefix of `prefix_end` tokens."""
    if lcm <= 0 or interval <= 0:
        raise ValueError(f"lcm and interval must be positive, got {lcm}, {interval}")
    if boundary <= 0 or boundary % lcm or boundary > prefix_end:
        return False
    return boundary % (interval * lcm) == 0 or boundary == (prefix_end // lcm) * lcm


def checkpoint_boundaries(prefix_end: int, lcm: int, interval: int, grid: int | None = None) -> tuple[int, ...]:
    """The retained checkpoint boundaries of a prefix of `prefix_end` tokens, ascending: every
    `interval * lcm`, and the last multiple of `grid` (a divisor of lcm; default lcm)."""
    grid = grid or lcm
    last = (prefix_end // grid) * grid
    out = list(range(interval * lcm, last + 1, interval * lcm))
    if last > 0 and (not out or out[-1] != last):
        out.append(last)
    return tuple(out)


def droppable_checkpoints(old_end: int, new_end: int, lcm: int, interval: int) -> tuple[int, ...]:
    """Boundaries retained for a prefix of `old_end` tokens but not once it grows to `new_end`."""
    new = set(checkpoint_boundaries(new_end, lcm, interval))
    return tuple(b for b in checkpoint_boundaries(old_end, lcm, interval) if b not in new)


# ---- the index ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class IndexEntry:
    """A cached object of `group` holding the prefix block that ends at token `end`."""
    group: str
    kind: Kind
    key: str
    end: int
    seg_id: int


@dataclasses.dataclass(frozen=True)
class PrefixIndex:
    """entries: (group, kind, key) -> IndexEntry. Immutable; insert / remove return new indexes."""
    entries: Mapping[tuple[str, Kind, str], IndexEntry] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))

    def find(self, group: str, kind: Kind, key: str) -> IndexEntry | None:
        return self.entries.get((group, kind, key))

    def insert(self, entry: IndexEntry) -> "PrefixIndex":
        return self.insert_many((entry,))

    def insert_many(self, entries) -> "PrefixIndex":
        d = dict(self.entries)
        for e in entries:
            d[(e.group, e.kind, e.key)] = e
        return PrefixIndex(types.MappingProxyType(d))

    def remove_segment(self, seg_id: int) -> "PrefixIndex":
        """The index without entries pointing at `seg_id` (call when it is freed)."""
        d = {k: e for k, e in self.entries.items() if e.seg_id != seg_id}
        return PrefixIndex(types.MappingProxyType(d))

    def prune(self, live_ids) -> "PrefixIndex":
        """The index without entries whose segment id is not in `live_ids` (a container of ints)."""
        d = {k: e for k, e in self.entries.items() if e.seg_id in live_ids}
        return PrefixIndex(types.MappingProxyType(d))

    def remove(self, group: str, kind: Kind, key: str) -> "PrefixIndex":
        d = dict(self.entries)
        d.pop((group, kind, key), None)
        return PrefixIndex(types.MappingProxyType(d))

    def __len__(self) -> int:
        return len(self.entries)
