"""What the prefix store keeps when room or units run short: the retention rules of `PrefixCache`.

Checkpoints are the expensive objects per reused token, and a slot group has few units for them. The
rules (the `PrefixCache` methods below, a mixin over its allocator state, index and units):

  superseded first    a publish takes the units and bytes of the checkpoints its own chain no longer
                      keeps before another chain's (`_superseded`, `_victims`); with every unit in
                      use, plain LRU would take the conversation that comes back next
  whole sets          a resume point needs every group's checkpoint: one leaving takes the others at
                      its boundary along (`_free_orphans`)
  branch points       pinned against retention and credited one hit at publish (`_pin_branch`)
  spares              a prompt's last LCM point, when not otherwise kept, is published as a spare that
                      a prompt sharing only part of it resumes at (`spare_point`), and a prompt's
                      end stays as one once its answer's checkpoints pass it (`_keep_as_spare`: a
                      regenerate resumes there); the first victims after superseded checkpoints
                      until hit, never dropped by retention
  partial pages       a longer copy of a block replaces the shorter one (`_drop_superseded_page`)
  tails               a tail checkpoint whose window closed into a stored entry block leaves by the
                      named `close_tail` event (`_closing_entry`)
"""
from __future__ import annotations

import dataclasses

from cache import segment_allocator as A
from cache.prefix_index import checkpoint_boundaries, key_at
from cache.segments import Segment, SegState
from cache.validation import GroupSpec


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


class Retention:
    """Retention rules of `PrefixCache` (see the module docstring); it provides the state they read."""

    def spare_point(self, num_tokens: int) -> int:
        """A prompt's last LCM point when the retention policy would not keep it (0: none). Published
        as a spare: a later prompt that shares only part of this one (a tree's second branch off
        the trunk) resumes there rather than at 0, while the checkpoint at its end (which the
        answer's supersedes) does not reach back so far. Spares are the first victims when room or
        units are short, unless they have been hit, and retention does not drop them."""
        b = num_tokens // self.geometry.lcm * self.geometry.lcm
        keep = checkpoint_boundaries(num_tokens, self.geometry.lcm, self.config.checkpoint_interval,
                                     self.geometry.resume)
        return b if b and b not in keep else 0

    def _pin_branch(self, tokens: list[int], boundary: int, new: list[int]):
        """Marks the checkpoints at a branch point (those this publish writes, or already stored)."""
        self.branch_points += 1
        self._branch_segs.update(new)
        for spec in self.specs:
            if spec.is_checkpoint:
                e = self.index.find(spec.name, spec.kind, key_at(self._keys(tokens, spec), self.geometry.gcd, boundary))
                if e is not None:
                    self._branch_segs.add(e.seg_id)

    def _victims(self) -> list:
        """Evictable segments, first victim first: what the publish in progress supersedes, then the
        allocator's eviction order, with spares not hit yet in between."""
        order = A.eviction_order(self.alloc)
        rank = {**{i: 1 for i in self._spare}, **{i: 0 for i in self._prefer}}
        return sorted(order, key=lambda v: rank.get(v.id, 2) if v.hits == 0 or v.id in self._prefer else 2)

    def _free_orphans(self, gone) -> tuple[int, ...]:
        """A resume point needs every group's checkpoint: when one leaves the record, the others at
        its boundary are dead weight and leave with it (when nobody holds them). Returns their ids."""
        out = []
        for sid in gone:
            for other in self._sets.get(sid, ()):
                seg = self.alloc.segments.get(other)
                if seg is not None and not seg.ref_count and seg.state is not SegState.WRITING:
                    self.alloc = A.evict(self.alloc, other)
                    out.append(other)
        return tuple(out)

    def _drop_superseded_checkpoints(self, tokens: list[int], superseded):
        """Retention: the checkpoints of this chain a publish superseded (`_superseded`, found before
        it allocated; those its allocation took are gone already) leave the device. A tail
        checkpoint whose window closed into a stored entry block leaves by the `close_tail` event."""
        for spec, seg, b in superseded:
            if seg.id in self.alloc.segments:       # (not gone with its set)
                before = self.alloc
                entry = self._closing_entry(spec, tokens, b) if spec.closes_into else None
                if entry is not None:
                    self.alloc = A.close_tail(self.alloc, seg.id, entry.id)
                    self.tail_closes += 1
                    self.events.append(TailClose(spec.name, seg.id, b, entry.group, entry.id, entry.start, entry.end))
                else:
                    self.alloc = A.evict(self.alloc, seg.id)
                self._reclaim(before, retired=True, orphans=False)     # the whole set is on the list

    def _keep_as_spare(self, tokens: list[int], keep: int):
        """The chain's checkpoints at `keep` (the prompt's end, which a decoding request's publish
        would supersede) stay, as spares: a regenerated prompt resumes there. Marked before the
        publish allocates, so that when units are short they go before another chain's."""
        if keep <= 0:
            return
        for spec in self.specs:
            if spec.is_checkpoint:
                e = self.index.find(spec.name, spec.kind, key_at(self._keys(tokens, spec), self.geometry.gcd, keep))
                if e is not None and e.seg_id in self.alloc.segments and e.seg_id not in self._branch_segs:
                    self._spare.add(e.seg_id)

    def _superseded(self, tokens: list[int], boundary: int, keep: int = 0) -> list[tuple[GroupSpec, Segment, int]]:
        """Checkpoints on this chain below `boundary` that the retention policy no longer keeps once it
        holds one at `boundary`, unheld on the device and not at a branch point: [(spec, segment, b)]."""
        lcm, gcd, grid = self.geometry.lcm, self.geometry.gcd, self.geometry.resume
        kept = set(checkpoint_boundaries(boundary, lcm, self.config.checkpoint_interval, grid))
        out = []
        for spec in self.specs:
            if not spec.is_checkpoint:
                continue
            keys = self._keys(tokens, spec)
            for b in range(grid, boundary, grid):
                if b in kept or b == keep:
                    continue
                e = self.index.find(spec.name, spec.kind, key_at(keys, gcd, b))
                seg = None if e is None else self.alloc.segments.get(e.seg_id)
                if (seg is None or seg.ref_count or seg.state is not SegState.DEVICE or seg.end != b
                        or seg.id in self._branch_segs or seg.id in self._spare):
                    continue
                out.append((spec, seg, b))
        return out

    def _drop_superseded_page(self, spec: GroupSpec, keys, start: int, end: int):
        """Retention of partial pages: a stored block of this chain that starts at `start` and ends
        before `end` (an earlier publish inside the page, since copied and written further by its
        request) holds a prefix of what the new block [start, end) holds; it leaves when nobody holds
        it, and the new block's interior entries take its place."""
        for m in range(start + self.geometry.gcd, end, self.geometry.gcd):
            e = self.index.find(spec.name, spec.kind, key_at(keys, self.geometry.gcd, m))
            seg = None if e is None else self.alloc.segments.get(e.seg_id)
            if (seg is None or seg.start != start or seg.end != m or seg.ref_count
                    or seg.state is not SegState.DEVICE):
                continue
            self.alloc = A.evict(self.alloc, seg.id)
            self.retired_pages += 1
            self._release_unit(seg.id)
            self.index = self.index.remove_segment(seg.id)

    def _closing_entry(self, tail: GroupSpec, tokens: list[int], b: int):
        """The committed entry block of the group `tail` closes into that holds the entry its window
        starting at token b closed into (the block starting at b), or None."""
        spec = next(s for s in self.specs if s.name == tail.closes_into)
        end = b + spec.block_size
        if end > len(tokens):
            return None
        e = self.index.find(spec.name, spec.kind, key_at(self._keys(tokens, spec), self.geometry.gcd, end))
        seg = None if e is None else self.alloc.segments.get(e.seg_id)
        return seg if seg is not None and seg.state is SegState.DEVICE and seg.start <= b < seg.end else None
