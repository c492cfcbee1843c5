"""The prefix store's holdings: the pages and checkpoint units it holds, the segment records and the
index that name them, and the unit versions. One `SegmentStore` per prefix cache owns them all, and
every change to them goes through its methods:

  alloc      the segment records (cache.segment_allocator: states, ranges, versions, reference
             counts, LRU times, the weighted byte cap), an immutable value
  index      the prefix index: (group, kind, chain key) -> segment (cache.prefix_index), immutable
  units      segment -> (group, page or checkpoint unit) in the engine's pools; the store holds one
             block-manager reference to each (cache.block_manager)
  versions   the checkpoint units' versions on the device (checked inside the compiled load), mirrored
             on the host, and the compiled programs that write units or read them
             (cache.prefix_store: save / load a request row, read / write units for the disk tier)

Room: a publish's segments are allocated all or nothing (`allocate_all`, after `fits` checked it can
fit under the cap at all), each with its unit: the request's own page (one more reference) or a
fresh unit (`allocate`). Under the weighted cap, or when a group is out of units (`take_unit`),
victims leave the device in the retention policy's order (cache.prefix_retention.RetentionPolicy):
offloaded when a lower tier holds their bytes (`lower.durable`, the disk tier), else freed
(`drop_from_device`). Every segment freed releases its unit and leaves the index, taking the rest of
its checkpoint set along (the policy's `orphans`), and the policy forgets its marks (`free`). The
store is also the block manager's reclaimer's engine (`reclaimable`, `reclaim`: units only it holds,
let go of on demand) and brings segments back from a lower tier (`restore`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Iterable, Protocol

import jax
import numpy as np

from cache import segment_allocator as A
from cache.block_manager import BlockManager
from cache.kv_events import KVEventLog
from cache.prefix_index import IndexEntry, PrefixIndex, key_at
from cache.prefix_retention import RetentionPolicy
from cache.prefix_store import init_versions, load_checkpoints, read_units, save_checkpoints, write_units
from cache.segments import Kind, Segment, SegState
from cache.state import ModelCache
from cache.validation import GroupSpec

log = logging.getLogger("hybrid_jax.prefix_cache")


class Notes:
    """Warnings said once per reason (a server runs for months: a refused publish is not news twice)."""

    def __init__(self):
        self._noted: set[str] = set()

    def once(self, key: str, msg: str):
        if key not in self._noted:
            self._noted.add(key)
            log.warning("prefix caching: %s", msg)


class LowerTier(Protocol):
    """A tier below the device (the disk tier): whether it holds a segment's bytes."""

    def durable(self, sid: int) -> bool: ...


@dataclasses.dataclass(frozen=True)
class StoreLayout:
    """Per group: bytes of one stored object (a page or a unit), whether it is paged, the width of its
    fixed-size unit plans (a block table's pages, or 1); the checkpoint (slot) groups; the key grain."""
    nbytes: dict[str, int]
    paged: dict[str, bool]
    width: dict[str, int]
    ckpt_groups: tuple[str, ...]
    gcd: int


@dataclasses.dataclass
class StoreCounts:
    """evictions: segments freed under the store's cap; reclaimed: let go when a pool ran short;
    offloads: moved from the device to the disk tier; retired_checkpoints: checkpoints the retention
    policy let go; retired_pages: partial pages a longer copy of the same block replaced."""
    evictions: int = 0
    reclaimed: int = 0
    offloads: int = 0
    retired_checkpoints: int = 0
    retired_pages: int = 0


@dataclasses.dataclass(frozen=True)
class Wanted:
    """What a publish needs stored for one group: the block ends (or the checkpoint boundary) it has no
    live segment for, on the chain `keys`."""
    spec: GroupSpec
    keys: tuple[str, ...]
    ends: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Allocated:
    """A segment `allocate_all` took: `sid` holds the object of `spec` ending at `end` (chain key `key`)."""
    spec: GroupSpec
    sid: int
    end: int
    key: str


class SegmentStore:
    def __init__(self, cache: ModelCache, layout: StoreLayout, cap_bytes: int, blocks: BlockManager,
                 policy: RetentionPolicy, notes: Notes):
        """cache: the engine's pools (the shapes of the unit versions); policy: who goes first when
        room or units are short (read only: the store carries its decisions out)."""
        self.layout, self.blocks, self.policy, self.notes = layout, blocks, policy, notes
        self.alloc = A.init_state(A.AllocConfig(cap_bytes=cap_bytes))
        self.index = PrefixIndex()
        self.units: dict[int, tuple[str, int]] = {}                      # seg id -> (group, page or unit)
        self.versions = init_versions(cache, layout.ckpt_groups)          # device versions of the units
        self.unit_version = {n: np.zeros(v.shape, np.int64) for n, v in self.versions.items()}   # host mirror
        self.counts = StoreCounts()
        self.lower: LowerTier | None = None
        self.watch: KVEventLog | None = None    # told of every page or unit let go (routers' KV events)
        self.save_program = jax.jit(save_checkpoints, donate_argnames=("pools", "versions"))
        self.load_program = jax.jit(load_checkpoints, donate_argnames=("pools",))
        self._read = jax.jit(read_units)
        self._write = jax.jit(write_units, donate_argnames=("pools", "versions"))

    # --- reading -----------------------------------------------------------------------------------
    def unit(self, sid: int) -> int:
        """The page or checkpoint unit segment `sid` lives in."""
        return self.units[sid][1]

    def segment_at(self, spec: GroupSpec, key: str) -> Segment | None:
        """The segment the index names for this object (any residency), if the record still has it."""
        e = self.index.find(spec.name, spec.kind, key)
        return None if e is None else self.alloc.segments.get(e.seg_id)

    def live(self, spec: GroupSpec, keys, b: int) -> int | None:
        """The segment holding this object on the device, if the store has one (a copy on disk is
        re-published)."""
        e = self.index.find(spec.name, spec.kind, key_at(keys, self.layout.gcd, b))
        ok = e is not None and self.alloc.state_of(e.seg_id) in (SegState.DEVICE, SegState.WRITING)
        return e.seg_id if ok else None

    def durable(self, sid: int) -> bool:
        return self.lower is not None and self.lower.durable(sid)

    # --- records -----------------------------------------------------------------------------------
    def retain(self, sids: Iterable[int]):
        self.alloc = A.retain_many(self.alloc, sids)

    def release(self, sids: Iterable[int]):
        self.alloc = A.release_many(self.alloc, sids)

    def touch(self, sids: Iterable[int], hit: bool = False):
        self.alloc = A.touch_many(self.alloc, sids, hit=hit)

    def commit_many(self, new: list[Allocated]):
        """A publish's or an install's written segments become servable and the index points at them;
        copies they replace (left on disk) are dropped. One new record and one new index for all."""
        if not new:
            return
        self.alloc = A.commit_many(self.alloc, [a.sid for a in new])
        stale = []
        for a in new:
            old = self.index.find(a.spec.name, a.spec.kind, a.key)
            if old is not None and old.seg_id != a.sid and old.seg_id in self.alloc.segments:
                seg = self.alloc.get(old.seg_id)
                if seg.state in (SegState.HOST, SegState.DISK) and seg.ref_count == 0:
                    stale.append(seg.id)
        if stale:
            self.alloc = A.evict_many(self.alloc, stale)
        self.index = self.index.insert_many(IndexEntry(a.spec.name, a.spec.kind, a.key, a.end, a.sid) for a in new)

    def mark(self, entries: list[IndexEntry]):
        """Index entries for interior points of stored blocks (a later prefix may end there)."""
        self.index = self.index.insert_many(entries)

    # --- device programs on units ------------------------------------------------------------------
    def _bump(self, plan: dict):
        for name, v in self.unit_version.items():
            for u in np.atleast_1d(np.asarray(plan[name])):
                if int(u) >= 0:
                    v[int(u)] += 1

    def save(self, cache: ModelCache, row: int, plan: dict) -> ModelCache:
        """Copies request row `row` into the checkpoint units of `plan` ({slot group: unit or -1})."""
        cache, self.versions = self.save_program(cache, self.versions, np.int32(row), plan)
        self._bump(plan)
        return cache

    def load(self, cache: ModelCache, row: int, plan: dict, boundary: int) -> tuple[ModelCache, bool]:
        """Copies the units of `plan` ({slot group: (unit or -1, expected version)}) into row `row`;
        ok False (nothing written) when a unit's version changed since the host checked it."""
        cache, ok = self.load_program(cache, self.versions, np.int32(row), plan, np.int32(boundary))
        return cache, bool(ok)

    def read_units(self, cache: ModelCache, plan: dict) -> dict:
        """The contents of the units of `plan` ({group: [width] unit or -1})."""
        return self._read(cache, plan)

    def write_units(self, cache: ModelCache, plan: dict, data: dict) -> ModelCache:
        """Writes `data` into the units of `plan` (versions bumped)."""
        cache, self.versions = self._write(cache, self.versions, plan, data)
        self._bump(plan)
        return cache

    def num_compiled(self) -> int:
        return sum(p._cache_size() for p in (self.save_program, self.load_program, self._read, self._write))

    # --- room --------------------------------------------------------------------------------------
    def fits(self, todo: list[Wanted], protect: frozenset[int]) -> bool:
        """Whether a publish of `todo` can fit under the cap at all, counting what can never be evicted
        for it (held, being written, or in `protect`: the chain's own stored prefix). One that cannot
        is refused before anything is evicted for it: evicting first would empty the store and then
        refuse anyway."""
        cfg = self.alloc.config
        need = sum(cfg.weights[w.spec.kind] * self.layout.nbytes[w.spec.name] * len(w.ends) for w in todo)
        if not need:
            return True
        fixed = self.alloc.device_weighted_bytes - sum(cfg.weighted(s) for s in A.evictable(self.alloc)
                                                       if s.id not in protect)
        if fixed + need <= cfg.cap_bytes:
            return True
        self.notes.once("too_big", f"a prefix was not stored: it needs {need:.0f} weighted bytes, and the cap of"
                                   f" {cfg.cap_bytes} leaves {cfg.cap_bytes - fixed:.0f} beside what is held"
                                   f" (raise prefix_cache_bytes)")
        return False

    def allocate_all(self, todo: list[Wanted], request_id: str | None, protect: frozenset[int]
                     ) -> tuple[dict, list[Allocated]] | None:
        """Segments for every block and checkpoint of `todo`, all or nothing (a chain missing a block or
        its checkpoint is dead weight), one per block (eviction takes blocks, not whole prompts), each
        with its unit: the request's own page holding that block (one more reference), a fresh
        checkpoint unit, or (request_id None: an install) a fresh page. Room under the cap is made for
        all of them at once, and their records are one new allocator state. Returns (checkpoint save
        plan {slot group: unit or -1}, the segments), or None when one cannot be had (nothing is then
        allocated)."""
        objects = [(w, b) for w in todo for b in w.ends]
        need = collections.Counter()
        for w, _ in objects:
            need[w.spec.kind] += self.layout.nbytes[w.spec.name]
        if not self.make_room_for(need, protect):
            self.notes.once("refused:room", f"a prefix was not stored: no room for {dict(need)} bytes under the cap of"
                                            f" {self.alloc.config.cap_bytes} (held and in-flight segments are never"
                                            f" evicted)")
            return None
        units = []
        for w, b in objects:
            unit = self._unit_for(w.spec, b, request_id, protect)
            if unit is None:
                for (v, _), u in zip(objects, units):
                    self.blocks.release(v.spec.name, u)
                return None
            units.append(unit)
        self.alloc, sids = A.allocate_many(self.alloc, [
            A.NewSegment(w.spec.kind, w.spec.name, self.layout.nbytes[w.spec.name],
                         0 if w.spec.is_checkpoint else (b - 1) // w.spec.block_size * w.spec.block_size, b,
                         w.spec.ctx.abi_id, w.spec.ctx.sharding) for w, b in objects])
        plan, new = {n: np.int32(-1) for n in self.layout.ckpt_groups}, []
        for (w, b), sid, unit in zip(objects, sids, units):
            self.units[sid] = (w.spec.name, unit)
            if w.spec.is_checkpoint:
                plan[w.spec.name] = np.int32(unit)
            new.append(Allocated(w.spec, sid, b, key_at(w.keys, self.layout.gcd, b)))
        return plan, new

    def _unit_for(self, spec: GroupSpec, end: int, request_id: str | None, protect: frozenset[int]) -> int | None:
        """The unit a new segment for the block ending at `end` (or a checkpoint there) lives in, with one
        reference; None (said once) when the group has none to give."""
        if request_id is not None and not spec.is_checkpoint:
            unit = self.blocks.table(request_id, spec.name)[(end - 1) // spec.block_size]   # the page ending
            self.blocks.retain(spec.name, unit)                                         # at or holding `end`
            return unit
        unit = self.take_unit(spec.name, protect)
        if unit is None:
            self.notes.once(f"full:{spec.name}", f"a prefix was not stored: group {spec.name!r} has no free"
                                                 f" {'page' if self.layout.paged[spec.name] else 'checkpoint unit'}")
        return unit

    def take_unit(self, group: str, protect: frozenset[int]) -> int | None:
        """A free page or checkpoint unit of `group`, evicting the group's least recently used
        store-only segment (not in `protect`) when none is free."""
        unit = self.blocks.alloc_unit(group) if self.blocks.free_units(group) else None
        while unit is None:
            victim = next((v for v in self.policy.victims(self.alloc)
                           if v.group == group and v.id not in protect and self.sole(v.id)), None)
            if victim is None:
                return None
            self.drop_from_device(victim.id, reclaimed=True, retired=victim.id in self.policy.prefer)
            unit = self.blocks.alloc_unit(group) if self.blocks.free_units(group) else None
        return unit

    def sole(self, sid: int) -> bool:
        """Whether only the store references the segment's unit (dropping it frees the unit)."""
        group, unit = self.units[sid]
        return self.blocks.refcount(group, unit) == 1

    def make_room_for(self, need: dict[Kind, int], protect: frozenset[int] = frozenset()) -> bool:
        """Room under the weighted cap for `need` ({kind: bytes}) more: victims in the policy's order,
        found in one pass and let go together (each eviction prunes the whole index, and a handoff or
        a long publish evicts dozens). False, with nothing let go, when even every victim would not
        make room."""
        cfg = self.alloc.config
        extra = sum(cfg.weights[k] * n for k, n in need.items())
        over = self.alloc.device_weighted_bytes + extra - cfg.cap_bytes
        if over <= 0:
            return True
        take, counted = [], set()
        for v in self.policy.victims(self.alloc):
            if v.id in protect or v.id in counted:
                continue
            take.append(v.id)
            along = () if self.durable(v.id) else self.policy.orphans([v.id], self.alloc)   # an evicted checkpoint
            for sid in (v.id, *along):                                                      # takes its set along
                if sid not in counted and self.alloc.state_of(sid) in A.DEVICE_STATES:
                    counted.add(sid)
                    over -= cfg.weighted(self.alloc.get(sid))
            if over <= 0:
                break
        else:
            return False
        retired = frozenset(sid for sid in take if sid in self.policy.prefer)
        for sid in take:
            if self.durable(sid):
                self.drop_from_device(sid)                  # offloaded: keeps its index entries
        self.evict([sid for sid in take if self.alloc.state_of(sid) is SegState.DEVICE], retired=retired)
        while self.alloc.device_weighted_bytes + extra > cfg.cap_bytes:      # (had the count above been short)
            victim = next((v for v in self.policy.victims(self.alloc) if v.id not in protect), None)
            if victim is None:
                return False
            self.drop_from_device(victim.id, retired=victim.id in self.policy.prefer)
        return True

    def restore(self, sid: int, protect: frozenset[int]) -> bool:
        """A DISK (or HOST) segment back to the device: room and a fresh unit, then disk -> host ->
        device. The caller uploads its bytes into `unit(sid)`."""
        seg = self.alloc.get(sid)
        if not self.make_room_for({seg.kind: seg.nbytes}, protect | {sid}):
            return False
        unit = self.take_unit(seg.group, protect | {sid})
        if unit is None:
            return False
        if seg.state is SegState.DISK:
            self.alloc = A.transition(self.alloc, sid, SegState.HOST)
        self.alloc = A.transition(self.alloc, sid, SegState.DEVICE)
        self.units[sid] = (seg.group, unit)
        return True

    # --- the block manager's reclaimer -------------------------------------------------------------
    def reclaimable(self, group: str) -> int:
        """Units of `group` only the store holds and could let go of now."""
        return sum(1 for v in A.evictable(self.alloc) if v.group == group and self.sole(v.id))

    def reclaim(self, group: str, n: int) -> int:
        """Lets go of up to n units of `group` only the store holds, in the policy's order (a chain's
        tail before its head). Returns how many units were freed."""
        # one pass over the eviction order: dropping a victim neither reorders the others nor changes
        # who else holds their units
        victims = [v.id for v in self.policy.victims(self.alloc) if v.group == group and self.sole(v.id)][:max(n, 0)]
        freed = []
        for sid in victims:
            if self.durable(sid):
                self.drop_from_device(sid, reclaimed=True)     # offloaded: keeps its index entries
            else:
                freed.append(sid)
        if freed:                # one new allocator state and one index prune for all of them
            before = self.alloc
            self.alloc = A.evict_many(self.alloc, freed)
            self.free(before, reclaimed=True)
        return len(victims)

    # --- leaving -----------------------------------------------------------------------------------
    def drop_from_device(self, sid: int, reclaimed: bool = False, retired: bool = False):
        """The segment leaves the device: offloaded when a lower tier holds its bytes, else freed.
        reclaimed: for the engine's pools (counted apart from evictions under the cap); retired: one the
        publish in progress supersedes (counted with the retention policy's)."""
        if self.durable(sid):
            self.alloc = A.transition(self.alloc, sid, SegState.HOST)
            self.alloc = A.transition(self.alloc, sid, SegState.DISK)
            self.release_unit(sid)
            self.counts.offloads += 1
            return
        self.evict([sid], retired=retired, reclaimed=reclaimed)

    def evict(self, sids: Iterable[int], retired: bool | frozenset[int] = False, reclaimed: bool = False,
              orphans: bool = True):
        """Frees these segments (wherever they are), with their units, index entries and (orphans) the
        rest of their checkpoint sets. retired: as `free`'s."""
        before = self.alloc
        self.alloc = A.evict_many(self.alloc, sids)
        self.free(before, retired=retired, reclaimed=reclaimed, orphans=orphans)

    def close_tail(self, sid: int, entry_id: int):
        """A tail checkpoint leaves by the `close_tail` event: its window closed into entry block `entry_id`."""
        before = self.alloc
        self.alloc = A.close_tail(self.alloc, sid, entry_id)
        self.free(before, retired=True, orphans=False)

    def retire_page(self, sid: int):
        """A partial page a longer copy of its block replaced leaves (its index entries with it)."""
        self.alloc = A.evict(self.alloc, sid)
        self.counts.retired_pages += 1
        self.release_unit(sid)
        self.index = self.index.remove_segment(sid)

    def release_unit(self, sid: int):
        """The store lets go of the segment's page or unit (the record stays as the caller left it)."""
        self.policy.forget(sid)
        group, unit = self.units.pop(sid)
        self.blocks.release(group, unit)
        if self.watch is not None:
            self.watch.released(sid)

    def free(self, before: A.AllocState, retired: bool | frozenset[int] = False, reclaimed: bool = False,
             orphans: bool = True):
        """Releases the units of segments freed since `before` and drops their index entries.
        retired: freed by the retention policy (counted apart from evictions under pressure), all of
        them (True) or those of a set of ids. orphans: a freed checkpoint takes the rest of its set
        (the policy's `orphans`)."""
        gone = A.evicted_ids(before, self.alloc)
        if orphans:
            more = self.policy.orphans(gone, self.alloc)
            self.alloc = A.evict_many(self.alloc, more)
            gone += more
        n_retired = len(gone) if retired is True else len(set(gone) & retired) if retired else 0
        self.counts.retired_checkpoints += n_retired
        if reclaimed:
            self.counts.reclaimed += len(gone) - n_retired
        else:
            self.counts.evictions += len(gone) - n_retired
        for sid in gone:
            if sid in self.units:
                self.release_unit(sid)
        if gone:
            self.index = self.index.prune(self.alloc.segments)

    def clear(self):
        """Lets go of every page and unit (the engine drops the store); pages requests list stay theirs."""
        watch, self.watch = self.watch, None          # one AllBlocksCleared, not a removal per block
        for sid in list(self.units):
            self.release_unit(sid)
        if watch is not None:
            watch.cleared()
        self.policy.clear()
        self.alloc = A.init_state(self.alloc.config)
        self.index = PrefixIndex()
