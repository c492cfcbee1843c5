"""The prefix cache an engine uses: lookup, five-check validation, zero-copy reuse, publish, eviction, stats.

One `PrefixCache` serves one engine. The stored objects live in the engine's own pools
(cache.pools). The cache is composed of
  store    a `cache.segment_store.SegmentStore`: what is held (segment records and their weighted
           byte cap, the prefix index, the pages and units, their versions) and every change to it
           (allocation, eviction, reclaim, restore)
  policy   a `cache.prefix_retention.RetentionPolicy`: which stored objects go first or leave, decided
           from read-only facts (it changes nothing itself)
  disk     the disk tier (cache.prefix_disk.DiskSpans, optional), through the store's public methods
and shares the pools' pages and units with the engine's requests through the block manager
(cache.block_manager):

  paged groups      a stored block is one page the store holds a reference to: publishing takes a
                    reference to the request's own page, a hit lists the stored pages in the new
                    request's block table. No KV, latent, indexer or entry byte is copied.
  checkpoint groups (fixed-size state) a checkpoint is a unit, an extra row of the group's pool:
                    publishing copies the request's row into it, a hit copies it back
                    (cache.prefix_store, two programs compiled once: plans are fixed-width).

Groups and their objects (the model is not known here, only its cache groups):
  KVGroup         full_kv          a page of `page_size` tokens
  MLALatentGroup  compressed_kv    a page (an MLA latent has no uncompressed tail)
  IndexerKeyGroup indexer_keys     a page
  RecurrentGroup  recurrent_state  checkpoints on the resume grid (retention: prefix_index)
  DeepSeek-V4 (cache.compressed):
  CompressedKVGroup  compressed_kv / indexer_keys   a page of entries (ps * rate tokens)
  SlidingWindowGroup swa_window       the ring, a checkpoint on the resume grid
  TailGroup          uncompressed_tail  tail + count, a checkpoint (superseded by `close_tail`)
  OverlapGroup       csa_overlap      CSA's overlap state, a checkpoint
A boundary is usable only where every group has its object there (blocks up to it, checkpoints at
it), live and resident on the device (or restorable from the disk tier when there is one).

A request's life with the cache:
  reuse(cache, row, rid, tokens)  lookup -> checks 1-4 (validation.check_hit) -> check 5 on the host
                              (confirm_at_use) -> retain -> the hit's pages into the request's block
                              tables, its checkpoints copied into its row with the unit versions
                              re-checked inside the compiled load -> release. Returns the boundary
                              the request now holds (0: compute from scratch).
  publish_boundaries(n)       where a prompt of n tokens should stop its prefill chunks so its
                              state can be published (the retained checkpoints, and a spare).
  publish(cache, row, rid, tokens, b)  the request holds exactly tokens[:b]: the store takes a
                              reference to each of its pages not yet stored and copies its row into
                              checkpoints at b (the units of the chain's checkpoints it supersedes
                              first); checkpoints of the chain the retention policy no longer keeps
                              are retired, a shorter copy of a page it stores further along leaves,
                              and a tail checkpoint whose window closed into a now stored entry block
                              leaves by the named `close_tail` event.

Eviction (cache/segment_store.py; what is kept: cache/prefix_retention.py): under the store's
weighted cap (by kind, then least recently used with a credit for each hit an object served:
cache.segment_allocator.eviction_order; a chain's tail first), and on demand when the engine's block
manager runs out of pages or units (`reclaim`): the store lets go of what only it
holds. A page a running request also lists stays in the pool until that request ends. A checkpoint
leaves with every group's checkpoint at its boundary (a resume point needs them all).
"""
from __future__ import annotations

import collections
import math
import time
from typing import Callable, Sequence

import numpy as np

from cache.block_manager import BlockManager
from cache.kv_events import KVEventLog, chain_hashes
from cache.group import CacheGroup
from cache.handoff import KVTransfer
from cache.prefix_index import IndexEntry, KeyContext, block_geometry, chain_keys, checkpoint_boundaries, key_at
from cache.prefix_config import PrefixCacheConfig, Reuse
from cache.prefix_disk import DiskConfig, DiskSpans, SpanSetup
from cache.prefix_retention import RetentionPolicy, Superseded, TailClose
from cache.segment_allocator import AllocState
from cache.segment_store import Allocated, Notes, SegmentStore, StoreLayout, Wanted
from cache.segments import SERVABLE_STATES, Kind, SegState
from cache.state import ModelCache
from cache.validation import CacheStats, GroupSpec, HitResult, check_hit, confirm_at_use

LOOKUP_SAMPLES = 4096     # lookup timings kept (`PrefixCache.lookup_seconds`)

__all__ = ["PrefixCache", "PrefixCacheConfig", "Reuse", "LOOKUP_SAMPLES"]

class PrefixCache:
    def __init__(self, cache: ModelCache, config: PrefixCacheConfig, blocks: BlockManager,
                 disk: DiskConfig | None = None, events: KVEventLog | None = None):
        """cache: the engine's pools (for their shapes); blocks: the engine's block manager, whose
        reclaimer this cache becomes; events: where the blocks stored and let go of are logged for
        routers (cache/kv_events.py), or None."""
        self.config = config
        groups = dict(sorted(cache.groups.items()))    # a fixed order: span keys hash the groups in it
        unknown = [n for n, g in groups.items() if not isinstance(g, CacheGroup)]
        if unknown:
            raise ValueError(f"prefix caching needs cache groups that implement cache.group.CacheGroup; {unknown} "
                             f"do not")
        grid = config.checkpoint_grid or config.block_size
        block_sizes = {n: (g.page_tokens if g.paged else grid) for n, g in groups.items()}
        grain = math.gcd(*block_sizes.values())
        partial = [n for n, g in groups.items() if g.paged and g.PARTIAL_RESUME       # entries end on the keys' grid
                   and (grain % g.entry_tokens == 0 or g.entry_tokens % grain == 0)]
        self.geometry = block_geometry(block_sizes, partial=partial)
        # tail=False: an MLA latent has no tail; a V4 compressed group keeps its tail in its own group
        self.specs = tuple(GroupSpec(name=n, kind=g.store_kind(), block_size=block_sizes[n], tail=False,
                                     checkpoint=not g.paged and g.store_kind() is Kind.SWA_WINDOW,
                                     closes_into=g.closes_into or None,
                                     partial=n in self.geometry.partial, entry=g.entry_tokens,
                                     ctx=KeyContext(config.fingerprint, config.dtype, g.writer_abi, config.sharding))
                           for n, g in groups.items())
        missing = [s.closes_into for s in self.specs if s.closes_into and s.closes_into not in groups]
        if missing:
            raise ValueError(f"prefix caching: tails close into cache groups {missing} that the cache does not have")
        paged = {n: g.paged for n, g in groups.items()}
        layout = StoreLayout(nbytes={n: g.page_nbytes() if g.paged else g.row_nbytes() for n, g in groups.items()},
                             paged=paged, width={n: (g.page_table.shape[1] if g.paged else 1) for n, g in groups.items()},
                             ckpt_groups=tuple(n for n in groups if not paged[n]), gcd=self.geometry.gcd)
        self.notes = Notes()
        self.policy = RetentionPolicy(self.specs, self.geometry, config.checkpoint_interval)
        self.store = SegmentStore(cache, layout, config.cap_bytes, blocks, self.policy, self.notes)
        self.blocks = blocks
        blocks.reclaimer = self
        self.kv_events = events
        if events is not None:
            events.bind(self.specs)
            self.store.watch = events
        self.stats = CacheStats()
        self.between_check_and_use: Callable[[], None] | None = None    # test hook (a concurrent writer)
        # host time of the last reuses' lookup + validation (bounded: a server runs for months)
        self.lookup_seconds: collections.deque[float] = collections.deque(maxlen=LOOKUP_SAMPLES)
        self._key_memo: dict = {}
        self.refused_publishes = 0                # publishes that did not fit under the cap
        self.tail_closes = 0                      # tail checkpoints superseded by the `close_tail` event
        self.branch_points = 0                    # publishes at a branch point
        self.events: collections.deque[TailClose] = collections.deque(maxlen=1024)   # the latest close_tail events
        self.disk = None
        if disk is not None:
            setup = SpanSetup(specs=self.specs, geometry=self.geometry, fingerprint=config.fingerprint,
                              checkpoint_interval=config.checkpoint_interval, copies=config.copies,
                              keys=self.keys, notes=self.notes, commit=self._commit)
            self.disk = DiskSpans(self.store, setup, cache, disk)
            self.store.lower = self.disk

    # --- the store's state, read only (tests, notebooks, benchmarks) -------------------------------------
    @property
    def alloc(self) -> AllocState:
        """The segment records (an immutable value)."""
        return self.store.alloc

    @property
    def index(self):
        return self.store.index

    @property
    def versions(self) -> dict:
        return self.store.versions

    # --- the block manager's reclaimer ---------------------------------------------------------------
    def reclaimable(self, group: str) -> int:
        """Units of `group` only the store holds and could let go of now."""
        return self.store.reclaimable(group)

    def reclaim(self, group: str, n: int) -> int:
        """Lets go of up to n units of `group` only the store holds. Returns how many were freed."""
        return self.store.reclaim(group, n)

    # --- set-up ------------------------------------------------------------------------------------
    def publish_boundaries(self, num_tokens: int) -> tuple[int, ...]:
        """Boundaries at which a prompt of `num_tokens` publishes its prefix (ascending): the retained
        checkpoints (every interval x LCM, plus the last point of the resume grid: its pages up to
        there, the last one shared while the request goes on writing it, so the request copies it
        once) and its spare point (`spare_point`). A prompt whose length is on the grid is not also
        stopped one point earlier for an identical prompt to resume at: that would cost every such
        prompt an extra step, and a repeat still resumes at the previous retained boundary."""
        pts = checkpoint_boundaries(num_tokens, self.geometry.lcm, self.config.checkpoint_interval,
                                    self.geometry.resume)
        spare = self.spare_point(num_tokens)
        return tuple(sorted(set(pts) | {spare})) if spare else pts

    def spare_point(self, num_tokens: int) -> int:
        """A prompt's spare point (cache.prefix_retention.RetentionPolicy.spare_point; 0: none)."""
        return self.policy.spare_point(num_tokens)

    # --- reuse -------------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int]) -> HitResult:
        """Checks 1-4 against the current allocator state (no side effects). Without a disk tier only
        objects on the device can be read; with one, host and disk objects are restored first."""
        servable = SERVABLE_STATES if self.disk is not None else frozenset({SegState.DEVICE})
        return check_hit(tokens, self.specs, self.store.index, self.store.alloc, servable=servable)

    def reuse(self, cache: ModelCache, row: int, request_id: str, tokens: Sequence[int],
              transfer: KVTransfer | None = None) -> tuple[ModelCache, Reuse]:
        """Gives request `request_id` (row `row`, empty block tables) the longest validated cached
        prefix of `tokens`: the stored pages go into its block tables, the checkpoints into its row.
        transfer: a receiving request's handoff (cache.handoff), installed first when it reaches
        beyond the device's hit and passes every check. Returns (cache, Reuse): the request now holds
        tokens[:boundary] (0 = nothing reused), and its branch point, if any."""
        t0 = time.perf_counter()
        if transfer is not None and transfer.role == "receive" and self.disk is not None:
            cache = self._receive(cache, tokens, request_id, transfer)
        if len(tokens) <= self.geometry.resume:
            self.notes.once("short", f"prompts of at most {self.geometry.resume} tokens cannot reuse a prefix: every"
                                     f" group must resume at a multiple of {self.geometry.resume} tokens (the"
                                     f" resume grid of block sizes {dict(self.geometry.sizes)}) and one token must"
                                     f" be left to compute")
        hit = self.lookup(tokens)
        if self.disk is not None:
            cache, hit = self._with_disk(cache, hit, tokens, request_id)
        if self.between_check_and_use is not None:
            self.between_check_and_use()
        hit = confirm_at_use(hit, self.store.alloc)
        self.lookup_seconds.append(time.perf_counter() - t0)
        if not hit.ok:
            return cache, Reuse(self._miss(hit), self._branch(hit, len(tokens), 0))
        pages, plan, held = self._load_plan(hit)
        self.store.retain(held)
        try:
            for name, ids in pages.items():
                self.blocks.share(request_id, name, ids)
            cache, ok = self.store.load(cache, row, plan, hit.boundary)
        finally:
            self.store.release(held)
        if not ok:   # a unit changed between the host's check and the device's read
            self.blocks.unshare(request_id)
            return cache, Reuse(self._miss(HitResult(ok=False, reason="version", hashed=hit.hashed,
                                detail="a checkpoint unit's version changed before the load read it")))
        self.store.touch(reversed(held), hit=True)   # first blocks last: evicted last
        self.stats = self.stats.record(hit)
        return cache, Reuse(hit.boundary, self._branch(hit, len(tokens), hit.boundary))

    def _receive(self, cache: ModelCache, tokens: Sequence[int], request_id: str, t: KVTransfer) -> ModelCache:
        """Installs a receiving request's handoff (what the device holds of it already is kept, and
        nothing is written when it holds all of it: DiskSpans.install)."""
        cache, _ = self.disk.handoffs.receive(cache, tokens, request_id, t.room, t.end, t.key)
        return cache

    def handoff_point(self, num_tokens: int) -> int:
        """Where a sending request's prompt is handed over (cache.handoff.Handoffs.point; 0: nowhere)."""
        return self.disk.handoffs.point(num_tokens) if self.disk is not None else 0

    def hand_off(self, cache: ModelCache, tokens: Sequence[int], boundary: int, room: int):
        """A sending request holds tokens[:boundary], published: its handoff is written for `room`."""
        self.disk.handoffs.send(cache, list(tokens[:boundary]), boundary, room)

    def abandon_handoff(self, room: int, reason: str):
        if self.disk is not None:
            self.disk.handoffs.abandon(room, reason)

    def _branch(self, hit: HitResult, num_tokens: int, boundary: int) -> int:
        """The branch point of a prompt of `num_tokens` (see `Reuse`): the blocks it shares with cached
        sequences, rounded down to the resume grid, if beyond `boundary` and before its last token."""
        b = min(hit.matched, num_tokens - 1) // self.geometry.resume * self.geometry.resume
        return b if b > boundary else 0

    def _with_disk(self, cache: ModelCache, hit: HitResult, tokens: Sequence[int], request_id: str | None
                   ) -> tuple[ModelCache, HitResult]:
        """Restores from the disk tier what lies beyond the device's part of the hit (prefetched when
        the request arrived, per the prefetch policy), then checks again. A hit may only be read
        from the device: segments a failed restore left on disk are dropped and the check re-run."""
        alloc = self.store.alloc
        on_device = hit.ok and all(alloc.get(i).state is SegState.DEVICE for ids in hit.segments.values() for i in ids)
        keep = frozenset(i for ids in hit.segments.values() for i in ids) if on_device else frozenset()
        cache, restored = self.disk.restore(cache, tokens, hit.boundary if on_device else 0, request_id, keep)
        if restored:
            hit = self.lookup(tokens)
        stale = [i for ids in hit.segments.values() for i in ids
                 if self.store.alloc.get(i).state is not SegState.DEVICE]
        if hit.ok and stale:
            for sid in stale:
                self.store.evict([sid])
            hit = self.lookup(tokens)
        return cache, hit

    def prefetch(self, request_id: str, tokens: Sequence[int], transfer: KVTransfer | None = None):
        """On a request's arrival: starts loading its handoff (a receiving request's), else its longest
        prefix found in the disk tier."""
        if self.disk is None:
            return
        if transfer is not None and transfer.role == "receive" and transfer.end > 0:
            self.disk.handoffs.prefetch(request_id, tokens, transfer.room, transfer.end, transfer.key)
        elif len(tokens) > self.geometry.lcm:
            self.disk.prefetch(request_id, tokens)

    def _miss(self, hit: HitResult) -> int:
        self.stats = self.stats.record(hit)
        if hit.reason != "no_hit":
            self.notes.once(f"miss:{hit.reason}", f"a cached prefix was refused ({hit.reason}): {hit.detail}")
        return 0

    def _load_plan(self, hit: HitResult):
        """For a validated hit: the pages per paged group in block order (those ending at or before
        the boundary), the fixed-width load plan of the checkpoint groups ({group: (unit or -1,
        expected version)}) and the segment ids the load holds."""
        pages: dict[str, list[int]] = {}
        store = self.store
        plan = {n: (np.int32(-1), np.int32(0)) for n in store.layout.ckpt_groups}
        held = []
        for spec in self.specs:
            blocks = []
            for sid in hit.segments[spec.name]:
                held.append(sid)
                seg = store.alloc.get(sid)
                group, unit = store.units[sid]
                if spec.is_checkpoint:
                    plan[spec.name] = (np.int32(unit), np.int32(store.unit_version[group][unit]))
                elif seg.end <= hit.boundary or (spec.partial and seg.start < hit.boundary):
                    blocks.append((seg.start, unit))
            if not spec.is_checkpoint:
                pages[spec.name] = [u for _, u in sorted(blocks)]
        return pages, plan, held

    # --- publish -----------------------------------------------------------------------------------
    def publish(self, cache: ModelCache, row: int, request_id: str, tokens: Sequence[int], boundary: int,
                branch: bool = False, durable: bool = True, spare: bool = False, keep: int = 0) -> ModelCache:
        """Stores what request `request_id` (row `row`) holds of tokens[:boundary] (its state is exactly
        at `boundary`, on the resume grid) that the store does not hold yet: a reference to each of
        its pages, a copy of its row into a checkpoint unit. Admission refusals skip the publish
        (counted, never an error). branch: `boundary` is a branch point (`Reuse.branch`): its
        checkpoints are kept when the chain grows past them (the retention policy would drop them);
        eviction still may. durable: also write the span ending at `boundary` behind to the disk tier
        (a decode publishes on every grid point but writes only at span ends: a long answer would
        otherwise rewrite its last span each time). spare: the prompt's spare point (`spare_point`).
        keep: a point below `boundary` (a decoding request's prompt end, which it published itself)
        whose checkpoints stay, as spares, rather than being superseded. Returns the cache (its
        checkpoint units written)."""
        geo, store, policy = self.geometry, self.store, self.policy
        if boundary <= 0 or boundary % geo.resume:
            raise ValueError(f"publish boundary {boundary} is not a positive multiple of the resume grid {geo.resume}")
        tokens = list(tokens[:boundary])
        wanted = self._wanted(tokens, boundary, request_id)
        if wanted is None or not store.fits(wanted[0], wanted[1]):
            self.refused_publishes += 1
            return cache
        todo, protect, ckpts = wanted
        keys_of = self._keys_of(tokens)
        # the chain's checkpoints this one supersedes are the first victims when room or a unit is short,
        # before another chain's (with every unit in use, an in-flight request's transient extra
        # checkpoint would evict the least recently used conversation: the next one to come back)
        policy.keep_as_spare(keys_of, keep, store.index, store.alloc)
        superseded = policy.superseded(keys_of, boundary, keep, store.index, store.alloc)   # (allocating only evicts)
        policy.prefer = frozenset(x.seg.id for x in superseded)
        try:
            got = store.allocate_all(todo, request_id, protect)
        finally:
            policy.prefer = frozenset()
        if got is None:
            self.refused_publishes += 1
            return cache
        plan, new = got
        ckpts += [a.sid for a in new if a.spec.is_checkpoint]
        if branch:
            self.branch_points += 1
            policy.pin_branch(keys_of, boundary, ckpts, store.index)
        if not new:
            return cache
        if any(int(u) >= 0 for u in plan.values()):
            cache = store.save(cache, row, plan)
        if spare:
            policy.spare.update(a.sid for a in new if a.spec.is_checkpoint)
        policy.mark_set(ckpts)
        self._commit(tokens, new)
        self._touch_chain(tokens, boundary)
        if branch:      # two sequences share it already (this one and the one whose blocks it matched):
            store.touch(ckpts, hit=True)     # retention credits it one hit
        self._drop_superseded(keys_of, len(tokens), superseded)
        if self.disk is not None and durable and boundary % geo.lcm == 0:      # disk spans lie on the LCM grid
            self.disk.write(cache, tokens, boundary)
        return cache

    def _wanted(self, tokens: list[int], boundary: int, request_id: str | None
                ) -> tuple[list[Wanted], frozenset[int], list[int]] | None:
        """What a publish of tokens[:boundary] must store: (per group the objects the store has no
        live segment for, the stored objects the chain builds on (never evicted for it), every
        group's checkpoint already stored at `boundary`); None when it cannot be stored (a block
        ending inside a page with no request to take it from)."""
        todo, own, ckpts = [], set(), []
        for spec in self.specs:
            keys = self.keys(tokens, spec)
            ends = []
            inner = boundary - boundary % spec.entry       # where the group's whole entries end
            for b in ([boundary] if spec.is_checkpoint else range(spec.block_size, inner + 1, spec.block_size)):
                sid = self.store.live(spec, keys, b)
                if sid is None:
                    ends.append(b)
                else:
                    own.add(sid)
                    if spec.is_checkpoint:
                        ckpts.append(sid)
            if not spec.is_checkpoint and inner % spec.block_size:
                # the prefix ends inside a block: a stored block holding these tokens serves it (a
                # branch point inside a block another request stored), else the request's own page,
                # which it copies before its next write into it (copy-on-write)
                sid = self.store.live(spec, keys, inner)
                if sid is not None:
                    own.add(sid)
                elif request_id is not None:
                    ends.append(inner)
                else:
                    return None
            todo.append(Wanted(spec, keys, tuple(ends)))
        return todo, frozenset(own), ckpts

    def _commit(self, tokens: list[int], new: list[Allocated]):
        """The publish's new segments become servable; a partial block's interior points get index
        entries (an entry there already, e.g. a held shorter block's, stays) after the shorter copies
        of the same block the policy retires leave."""
        store, gcd, marks, log, hashes = self.store, self.geometry.gcd, [], self.kv_events, None
        store.commit_many(new)
        for a in new:
            if log is not None and a.spec.name == log.group:
                hashes = hashes or chain_hashes(tokens, log.block_size)
                log.stored(a.sid, tokens, store.alloc.get(a.sid).start, a.end, hashes)
            if a.spec.partial:
                keys = self.keys(tokens, a.spec)
                start = store.alloc.get(a.sid).start
                for seg in self.policy.superseded_pages(a.spec, keys, start, a.end, store.index, store.alloc):
                    store.retire_page(seg.id)
                marks += [IndexEntry(a.spec.name, a.spec.kind, k, m, a.sid) for m in range(start + gcd, a.end, gcd)
                          if store.live(a.spec, keys, m) is None and (k := key_at(keys, gcd, m))]
        if marks:
            store.mark(marks)

    def _drop_superseded(self, keys_of, num_tokens: int, superseded: list[Superseded]):
        """Retention: the checkpoints of this chain a publish superseded (found before it allocated;
        those its allocation took are gone already) leave the device. A tail checkpoint whose window
        closed into a stored entry block leaves by the `close_tail` event."""
        store = self.store
        for x in superseded:
            if x.seg.id not in store.alloc.segments:        # (gone with its set)
                continue
            entry = (self.policy.closing_entry(x.spec, keys_of, num_tokens, x.boundary, store.index, store.alloc)
                     if x.spec.closes_into else None)
            if entry is not None:
                store.close_tail(x.seg.id, entry.id)
                self.tail_closes += 1
                self.events.append(TailClose(x.spec.name, x.seg.id, x.boundary, entry.group, entry.id, entry.start,
                                             entry.end))
            else:
                store.evict([x.seg.id], retired=True, orphans=False)     # the whole set is on the list

    def _touch_chain(self, tokens: list[int], boundary: int):
        """Marks every stored object of this chain used, tail first, so LRU eviction takes a chain's
        last blocks before its first ones (without its first blocks a chain is unusable)."""
        geo, store = self.geometry, self.store
        ids = []
        for spec in self.specs:
            keys = self.keys(tokens, spec)
            step = geo.resume if spec.is_checkpoint else spec.block_size
            for b in range(boundary - boundary % step, 0, -step):
                e = store.index.find(spec.name, spec.kind, key_at(keys, geo.gcd, b))
                if e is not None and e.seg_id in store.alloc.segments:
                    ids.append(e.seg_id)
        store.touch(ids)

    def keys(self, tokens: list[int], spec: GroupSpec) -> tuple[str, ...]:
        """Chain keys of `tokens` for a group, memoised for the publish in progress."""
        k = (spec.name, len(tokens))
        if self._key_memo.get("tokens") is not tokens:
            self._key_memo = {"tokens": tokens}
        if k not in self._key_memo:
            self._key_memo[k] = chain_keys(tokens, self.geometry.gcd, spec.ctx)
        return self._key_memo[k]

    def _keys_of(self, tokens: list[int]):
        return lambda spec: self.keys(tokens, spec)

    def close(self):
        """Lets go of every page and unit the store holds (the engine drops this store); written-behind
        disk spans are waited for (and the disk tier's threads stopped). Pages running requests also
        list stay theirs."""
        if self.disk is not None:
            self.disk.close()
        self.store.clear()
        if self.blocks.reclaimer is self:
            self.blocks.reclaimer = None

    # --- figures -----------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        s, counts = self.stats.with_bytes(self.alloc), self.store.counts
        return {
            "lookups": s.lookups, "hits": s.hits, "passes": s.passes, "tokens_reused": s.tokens_reused,
            "hit_rate": s.hit_rate, "validation_pass_rate": s.validation_pass_rate,
            "effective_reuse": s.effective_reuse,
            "misses_by_reason": {**dict(s.misses_by_reason), **(dict(self.disk.reasons) if self.disk else {})},
            "misses_by_group": {f"{g}:{r}": n for (g, r), n in s.misses_by_group.items()},
            "bytes_by_kind": {k.value: v for k, v in s.bytes_by_kind.items()},
            "bytes_by_group": dict(s.bytes_by_group),
            "segments": len(self.alloc.segments), "evictions": counts.evictions,
            "reclaimed": counts.reclaimed, "offloads": counts.offloads,
            "retired_checkpoints": counts.retired_checkpoints, "retired_pages": counts.retired_pages,
            "refused_publishes": self.refused_publishes,
            "tail_closes": self.tail_closes, "branch_points": self.branch_points,
            "cap_bytes": self.config.cap_bytes,
            "block_sizes": dict(self.geometry.sizes), "lcm": self.geometry.lcm, "gcd": self.geometry.gcd,
            "resume_grid": self.geometry.resume,
            "disk": self.disk.stats() if self.disk else None,
        }

    def num_compiled(self) -> int:
        """Programs compiled for the store (checkpoint save / load, the disk tier's unit read / write)."""
        return self.store.num_compiled()

    def warmup(self, cache: ModelCache, row: int) -> ModelCache:
        """Compiles the checkpoint save and load programs. Every plan entry is padding, so nothing is
        stored or loaded; `row` (the engine's null row) keeps its content."""
        ckpt = self.store.layout.ckpt_groups
        cache = self.store.save(cache, row, {n: np.int32(-1) for n in ckpt})
        cache, _ = self.store.load(cache, row, {n: (np.int32(-1), np.int32(0)) for n in ckpt}, 0)
        if self.disk is not None:
            cache = self.disk.warmup(cache)
        return cache
