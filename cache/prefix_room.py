"""Room in the prefix store: the units and bytes a publish or a restore takes, and what leaves for them.

`PrefixCache`'s allocation side, a mixin over its allocator state (`alloc`), unit map (`_units`:
segment -> (group, page or checkpoint unit)), block manager and disk tier:

  allocate      a publish's segments, all or nothing (`_allocate_all`), each with its unit: the
                request's own page (one more reference) or a fresh checkpoint unit (`_allocate`),
                after a check that it can fit under the cap at all (`_fits`)
  make room     under the weighted cap, victims in eviction order leave the device: offloaded when
                a disk span holds their bytes, else freed (`_make_room`, `_drop_from_device`); a
                group out of units gives up its least recently used store-only unit (`_take_unit`)
  reclaim       the block manager's reclaimer: units only the store holds, let go of on demand when
                the engine's requests need pages or units (`reclaimable`, `reclaim`)
  restore       a segment back from the disk tier (`restore_segment`)
Every segment freed releases its unit and leaves the index (`_reclaim`), taking the rest of its
checkpoint set along (`Retention._free_orphans`). The victims' order is the retention rules'
(`Retention._victims`, cache/prefix_retention.py).
"""
from __future__ import annotations

import numpy as np

from cache import segment_allocator as A
from cache.prefix_index import key_at
from cache.segments import Kind, SegState
from cache.validation import GroupSpec


class Room:
    """Allocation, eviction and reclaim of `PrefixCache` (module docstring)."""

    def _allocate_all(self, todo, request_id: str | None, protect: frozenset[int]):
        """Segments for every block and checkpoint of `todo` [(spec, keys, block ends)], all or nothing
        (a chain missing a block or its checkpoint is dead weight). Returns (checkpoint save plan
        {slot group: unit or -1}, [(spec, seg id, end, key)]), or (None, None) when one cannot be had."""
        plan, new = {n: np.int32(-1) for n in self._ckpt_groups}, []
        for spec, keys, ends in todo:
            for b in ends:            # one segment per block: eviction takes blocks, not whole prompts
                sid = self._allocate(spec, b, request_id, protect)
                if sid is None:
                    self._abort([n[1] for n in new])
                    return None, None
                if spec.is_checkpoint:
                    plan[spec.name] = np.int32(self._units[sid][1])
                new.append((spec, sid, b, key_at(keys, self.geometry.gcd, b)))
        return plan, new

    def _fits(self, todo, protect: frozenset[int]) -> bool:
        """Whether a publish of `todo` [(spec, keys, block ends)] can fit under the cap at all, counting
        what can never be evicted for it (held, being written, or in `protect`: the chain's own stored
        prefix). One that cannot is refused before anything is evicted for it: evicting first would
        empty the store and then refuse anyway."""
        cfg = self.alloc.config
        need = sum(cfg.weights[spec.kind] * self._nbytes[spec.name] * len(ends) for spec, _, ends in todo)
        if not need:
            return True
        fixed = self.alloc.device_weighted_bytes - sum(cfg.weighted(s) for s in A.evictable(self.alloc)
                                                       if s.id not in protect)
        if fixed + need <= cfg.cap_bytes:
            return True
        self._note_once("too_big", f"a prefix was not stored: it needs {need:.0f} weighted bytes, and the cap of"
                                   f" {cfg.cap_bytes} leaves {cfg.cap_bytes - fixed:.0f} beside what is held"
                                   f" (raise prefix_cache_bytes)")
        return False

    def _allocate(self, spec: GroupSpec, end: int, request_id: str | None = None,
                  protect: frozenset[int] = frozenset()) -> int | None:
        """A WRITING segment for the block ending at `end` (or a checkpoint there), with its unit: the
        request's own page holding that block (one more reference), a fresh checkpoint unit, or
        (request_id None: a restore) a fresh page."""
        nbytes = self._nbytes[spec.name]
        if not self._make_room(spec.name, spec.kind, nbytes, protect):
            self._note_once(f"refused:{spec.name}", f"a prefix was not stored: group {spec.name!r} cannot make room"
                                                    f" for {nbytes} bytes under the cap of {self.config.cap_bytes}"
                                                    f" (held and in-flight segments are never evicted)")
            return None
        if request_id is not None and not spec.is_checkpoint:
            unit = self.blocks.table(request_id, spec.name)[(end - 1) // spec.block_size]   # the page ending
            self.blocks.retain(spec.name, unit)                                         # at or holding `end`
        else:
            unit = self._take_unit(spec.name, protect)
            if unit is None:
                self._note_once(f"full:{spec.name}", f"a prefix was not stored: group {spec.name!r} has no free"
                                                     f" {'page' if self._paged[spec.name] else 'checkpoint unit'}")
                return None
        start = 0 if spec.is_checkpoint else (end - 1) // spec.block_size * spec.block_size
        self.alloc, sid = A.allocate(self.alloc, spec.kind, spec.name, nbytes, start=start, end=end,
                                     writer_abi=spec.ctx.abi_id, writer_layout=spec.ctx.sharding)
        self._units[sid] = (spec.name, unit)
        return sid

    def _take_unit(self, group: str, protect: frozenset[int]) -> int | None:
        """A free page or checkpoint unit of `group`, evicting the group's least recently used
        store-only segment (not in `protect`) when none is free."""
        unit = self.blocks.alloc_unit(group) if self.blocks.free_units(group) else None
        while unit is None:
            victim = next((v for v in self._victims()
                           if v.group == group and v.id not in protect and self._sole(v.id)), None)
            if victim is None:
                return None
            self._drop_from_device(victim.id, reclaimed=True, retired=victim.id in self._prefer)
            unit = self.blocks.alloc_unit(group) if self.blocks.free_units(group) else None
        return unit

    def _sole(self, sid: int) -> bool:
        """Whether only the store references the segment's unit (dropping it frees the unit)."""
        group, unit = self._units[sid]
        return self.blocks.refcount(group, unit) == 1

    def _make_room(self, group: str, kind: Kind, nbytes: int, protect: frozenset[int] = frozenset()) -> bool:
        """Room under the weighted cap for `nbytes` more, taking victims in eviction order. A victim
        whose bytes a lower tier holds moves there (device -> host -> disk) and keeps its index
        entries; others are freed."""
        cap, w = self.alloc.config.cap_bytes, self.alloc.config.weights[kind]
        while self.alloc.device_weighted_bytes + w * nbytes > cap:
            victim = next((v for v in self._victims() if v.id not in protect), None)
            if victim is None:
                return False
            self._drop_from_device(victim.id, retired=victim.id in self._prefer)
        return True

    # --- the block manager's reclaimer -------------------------------------------------------------
    def reclaimable(self, group: str) -> int:
        """Units of `group` only the store holds and could let go of now."""
        return sum(1 for v in A.evictable(self.alloc) if v.group == group and self._sole(v.id))

    def reclaim(self, group: str, n: int) -> int:
        """Lets go of up to n units of `group` only the store holds, least recently used first (a
        chain's tail before its head). Returns how many units were freed."""
        # one pass over the eviction order: dropping a victim neither reorders the others nor changes
        # who else holds their units
        victims = [v.id for v in self._victims() if v.group == group and self._sole(v.id)][:max(n, 0)]
        freed = []
        for sid in victims:
            if self.disk is not None and self.disk.durable(sid):
                self._drop_from_device(sid, reclaimed=True)     # offloaded: keeps its index entries
            else:
                freed.append(sid)
        if freed:                # one new allocator state and one index prune for all of them
            before = self.alloc
            self.alloc = A.evict_many(self.alloc, freed)
            self._reclaim(before, reclaimed=True)
        return len(victims)

    def _drop_from_device(self, sid: int, reclaimed: bool = False, retired: bool = False):
        """The segment leaves the device: offloaded when a disk span holds its bytes, else freed.
        reclaimed: for the engine's pools (counted apart from evictions under the cap); retired: one the
        publish in progress supersedes (counted with the retention policy's)."""
        before = self.alloc
        if self.disk is not None and self.disk.durable(sid):
            self.alloc = A.transition(self.alloc, sid, SegState.HOST)
            self.alloc = A.transition(self.alloc, sid, SegState.DISK)
            self._release_unit(sid)
            self.offloads += 1
            return
        self.alloc = A.evict(self.alloc, sid)
        self._reclaim(before, retired=retired, reclaimed=reclaimed)

    def _release_unit(self, sid: int):
        self._branch_segs.discard(sid)
        self._sets.pop(sid, None)
        self._spare.discard(sid)
        group, unit = self._units.pop(sid)
        self.blocks.release(group, unit)

    def restore_segment(self, sid: int, protect: frozenset[int]) -> bool:
        """A DISK (or HOST) segment back to the device: room and a fresh unit, then disk -> host ->
        device. The caller uploads its bytes into the returned unit (self._units[sid])."""
        seg = self.alloc.get(sid)
        if not self._make_room(seg.group, seg.kind, seg.nbytes, protect | {sid}):
            return False
        unit = self._take_unit(seg.group, protect | {sid})
        if unit is None:
            return False
        if seg.state is SegState.DISK:
            self.alloc = A.transition(self.alloc, sid, SegState.HOST)
        self.alloc = A.transition(self.alloc, sid, SegState.DEVICE)
        self._units[sid] = (seg.group, unit)
        return True

    def _abort(self, sids: list[int]):
        """Frees segments allocated (WRITING) by a publish that cannot complete, with their units."""
        for sid in sids:
            self.alloc = A.transition(self.alloc, sid, SegState.FREE)
            self._release_unit(sid)

    def _reclaim(self, before: A.AllocState, retired: bool = False, reclaimed: bool = False, orphans: bool = True):
        """Releases the units of segments freed since `before` and drops their index entries.
        retired: freed by the retention policy (counted apart from evictions under pressure). orphans:
        a freed checkpoint takes the rest of its set (`_free_orphans`)."""
        gone = A.evicted_ids(before, self.alloc)
        if orphans:
            gone += self._free_orphans(gone)
        if retired:
            self.retired_checkpoints += len(gone)
        elif reclaimed:
            self.reclaimed += len(gone)
        else:
            self.evictions += len(gone)
        for sid in gone:
            if sid in self._units:
                self._release_unit(sid)
        if gone:
            self.index = self.index.prune(self.alloc.segments)
