"""What the prefix store keeps when room or units run short: the retention policy of `PrefixCache`.

A pure policy: `RetentionPolicy` decides, from read-only facts (the allocator state and the prefix
index, both immutable values, and a chain's keys), which stored objects go first or leave; it never
changes the store. The store (cache.segment_store.SegmentStore) and the prefix cache carry its
decisions out. Its own state is its marks on segments (branch points, spares, checkpoint sets, the
publish in progress's first victims), which the store clears through `forget` when a segment leaves.

Checkpoints are the expensive objects per reused token, and a slot group has few units for them. The
rules:

  superseded first    a publish takes the units and bytes of the checkpoints its own chain no longer
                      keeps before another chain's (`superseded`, `victims`); with every unit in
                      use, plain LRU would take the conversation that comes back next
  whole sets          a resume point needs every group's checkpoint: one leaving takes the others at
                      its boundary along (`orphans`)
  branch points       pinned against retention and credited one hit at publish (`pin_branch`)
  spares              a prompt's last LCM point, when not otherwise kept, is published as a spare that
                      a prompt sharing only part of it resumes at (`spare_point`), and a prompt's
                      end stays as one once its answer's checkpoints pass it (`keep_as_spare`: a
                      regenerate resumes there); the first victims after superseded checkpoints
                      until hit, never dropped by retention
  partial pages       a longer copy of a block replaces the shorter one (`superseded_pages`)
  tails               a tail checkpoint whose window closed into a stored entry block leaves by the
                      named `close_tail` event (`closing_entry`)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from cache import segment_allocator as A
from cache.prefix_index import BlockGeometry, PrefixIndex, checkpoint_boundaries, key_at
from cache.segments import Segment, SegState
from cache.validation import GroupSpec

KeysOf = Callable[[GroupSpec], tuple[str, ...]]     # a chain's keys for one group (memoised by the caller)


@dataclasses.dataclass(frozen=True)
class TailClose:
    """A `close_tail` event: the tail checkpoint `tail_seg` of group `tail_group` at token `boundary`
    was superseded by entry block `entry_seg` of `entry_group` (tokens [entry_start, entry_end))."""
    tail_group: str
    tail_seg: int
    boundary: int
    entry_group: str
    entry_seg: int
    entry_start: int
    entry_end: int


@dataclasses.dataclass(frozen=True)
class Superseded:
    """A checkpoint `seg` of group `spec` at token `boundary` that a publish of its chain supersedes."""
    spec: GroupSpec
    seg: Segment
    boundary: int


class RetentionPolicy:
    """The retention rules (module docstring) over a store of `specs` on `geometry`."""

    def __init__(self, specs: tuple[GroupSpec, ...], geometry: BlockGeometry, checkpoint_interval: int):
        self.specs, self.geometry, self.interval = specs, geometry, checkpoint_interval
        self.branch: set[int] = set()               # checkpoints at branch points (kept as their chain grows)
        self.sets: dict[int, frozenset[int]] = {}   # checkpoint -> every group's checkpoint at its boundary
        self.prefer: frozenset[int] = frozenset()   # first victims of the publish in progress
        self.spare: set[int] = set()                # checkpoints at spare points (`spare_point`)

    # --- marks (the policy's own state) ------------------------------------------------------------
    def forget(self, sid: int):
        """A segment left the store: its marks go."""
        self.branch.discard(sid)
        self.sets.pop(sid, None)
        self.spare.discard(sid)

    def clear(self):
        self.branch.clear()
        self.sets.clear()
        self.spare.clear()

    def mark_set(self, ckpts: Iterable[int]):
        """Every group's checkpoint at one boundary: they leave together (`orphans`)."""
        group = frozenset(ckpts)
        for sid in group:
            self.sets[sid] = group

    def pin_branch(self, keys_of: KeysOf, boundary: int, new: list[int], index: PrefixIndex):
        """Marks the checkpoints at a branch point (those this publish writes, or already stored)."""
        self.branch.update(new)
        for spec in self.specs:
            if spec.is_checkpoint:
                e = index.find(spec.name, spec.kind, key_at(keys_of(spec), self.geometry.gcd, boundary))
                if e is not None:
                    self.branch.add(e.seg_id)

    def keep_as_spare(self, keys_of: KeysOf, keep: int, index: PrefixIndex, alloc: A.AllocState):
        """The chain's checkpoints at `keep` (the prompt's end, which a decoding request's publish
        would supersede) stay, as spares: a regenerated prompt resumes there. Marked before the
        publish allocates, so that when units are short they go before another chain's."""
        if keep <= 0:
            return
        for spec in self.specs:
            if spec.is_checkpoint:
                e = index.find(spec.name, spec.kind, key_at(keys_of(spec), self.geometry.gcd, keep))
                if e is not None and e.seg_id in alloc.segments and e.seg_id not in self.branch:
                    self.spare.add(e.seg_id)

    # --- decisions (read-only) ---------------------------------------------------------------------
    def spare_point(self, num_tokens: int) -> int:
        """A prompt's last LCM point when the retention policy would not keep it (0: none). Published
        as a spare: a later prompt that shares only part of this one (a tree's second branch off
        the trunk) resumes there rather than at 0, while the checkpoint at its end (which the
        answer's supersedes) does not reach back so far. Spares are the first victims when room or
        units are short, unless they have been hit, and retention does not drop them."""
        b = num_tokens // self.geometry.lcm * self.geometry.lcm
        keep = checkpoint_boundaries(num_tokens, self.geometry.lcm, self.interval, self.geometry.resume)
        return b if b and b not in keep else 0

    def victims(self, alloc: A.AllocState) -> list[Segment]:
        """Evictable segments, first victim first: what the publish in progress supersedes, then the
        allocator's eviction order, with spares not hit yet in between."""
        order = A.eviction_order(alloc)
        rank = {**{i: 1 for i in self.spare}, **{i: 0 for i in self.prefer}}
        return sorted(order, key=lambda v: rank.get(v.id, 2) if v.hits == 0 or v.id in self.prefer else 2)

    def orphans(self, gone: Iterable[int], alloc: A.AllocState) -> tuple[int, ...]:
        """A resume point needs every group's checkpoint: when one leaves the record (`gone`), the
        others at its boundary are dead weight and should leave with it (when nobody holds them).
        Returns their ids."""
        out: list[int] = []
        for sid in gone:
            for other in self.sets.get(sid, ()):
                seg = alloc.segments.get(other)
                if seg is not None and not seg.ref_count and seg.state is not SegState.WRITING and other not in out:
                    out.append(other)
        return tuple(out)

    def superseded(self, keys_of: KeysOf, boundary: int, keep: int, index: PrefixIndex,
                   alloc: A.AllocState) -> list[Superseded]:
        """Checkpoints on this chain below `boundary` that the policy no longer keeps once it holds
        one at `boundary`, unheld on the device and not at a branch point, a spare or `keep`."""
        lcm, gcd, grid = self.geometry.lcm, self.geometry.gcd, self.geometry.resume
        kept = set(checkpoint_boundaries(boundary, lcm, self.interval, grid))
        out = []
        for spec in self.specs:
            if not spec.is_checkpoint:
                continue
            keys = keys_of(spec)
            for b in range(grid, boundary, grid):
                if b in kept or b == keep:
                    continue
                e = index.find(spec.name, spec.kind, key_at(keys, gcd, b))
                seg = None if e is None else alloc.segments.get(e.seg_id)
                if (seg is None or seg.ref_count or seg.state is not SegState.DEVICE or seg.end != b
                        or seg.id in self.branch or seg.id in self.spare):
                    continue
                out.append(Superseded(spec, seg, b))
        return out

    def superseded_pages(self, spec: GroupSpec, keys, start: int, end: int, index: PrefixIndex,
                         alloc: A.AllocState) -> list[Segment]:
        """Partial pages: stored blocks of this chain that start at `start` and end before `end` (an
        earlier publish inside the page, since copied and written further by its request) hold a
        prefix of what the new block [start, end) holds; unheld, they should leave, and the new
        block's interior entries take their place."""
        out = []
        for m in range(start + self.geometry.gcd, end, self.geometry.gcd):
            e = index.find(spec.name, spec.kind, key_at(keys, self.geometry.gcd, m))
            seg = None if e is None else alloc.segments.get(e.seg_id)
            if (seg is None or seg.start != start or seg.end != m or seg.ref_count
                    or seg.state is not SegState.DEVICE):
                continue
            out.append(seg)
        return out

    def closing_entry(self, tail: GroupSpec, keys_of: KeysOf, num_tokens: int, b: int, index: PrefixIndex,
                      alloc: A.AllocState) -> Segment | None:
        """The committed entry block of the group `tail` closes into that holds the entry its window
        starting at token b closed into (the block starting at b), or None. num_tokens: the chain's."""
        spec = next(s for s in self.specs if s.name == tail.closes_into)
        end = b + spec.block_size
        if end > num_tokens:
            return None
        e = index.find(spec.name, spec.kind, key_at(keys_of(spec), self.geometry.gcd, end))
        seg = None if e is None else alloc.segments.get(e.seg_id)
        return seg if seg is not None and seg.state is SegState.DEVICE and seg.start <= b < seg.end else None
