"""The disk tier of the prefix cache: spans of prefix chains written behind publishes, found by hash,
prefetched when a request arrives, and restored into the device store through the state machine.

A span is what one publish adds to a chain, on a fixed grid: the span ending at boundary b covers
tokens [s(b), b) with s(b) = floor((b - 1) / S) * S and S = checkpoint_interval x LCM, and holds
every group's blocks in that range plus the recurrent checkpoint at b. Its key is a hash of every
group's chain key at b (so the weights fingerprint, dtype and kernel ABI are in it), and its parent
is the span ending at s(b): resuming at b needs the spans at S, 2S, ..., s(b) and b.

A span is stored in no mesh layout: its arrays are the logical cache values, gathered from the
devices (fields whose pools keep copies of each entry for the layout, `PrefixCacheConfig.copies`,
stored once), and its key is hashed without the layout. A restore places them in whatever layout the
reading engine's pools have, so a directory written at tensor size 2 serves an engine at tensor size
4 (the device store's keys and segments keep the layout: a device object is never read in another).
Because the grid is fixed, the exact shapes of every span are known before reading it, so each
read is checked against a full expectation (fingerprint, ABI, dtype, shape, range) on top of the
tier's checksums; a bad span is a miss with its reason and is recomputed, never served.

Residency moves through the allocator's transition table: a device segment evicted while a durable
span holds its bytes goes device -> host -> disk (keeping its index entries); a restore goes
disk -> host -> device into a fresh page or checkpoint unit of the engine's pools. A new process pointed at the same directory finds
spans by key alone, so every valid span is reused across restarts, and several engines (processes)
may use one directory at once (cache.disk_tier: atomic publish, validated reads, a shared cap).

The tier never fails a request: a directory that cannot be written turns its writes off with one
warning (`stats()["writable"]`, `write_faults`, `write_fault`), and spans are then not even copied to
the host (`skipped_writes`) until writes are tried again; a span that cannot be read is a miss,
recomputed. A directory that cannot be used at all is a tier with nothing in it.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cache.disk_tier import DiskTier
from cache.handoff import Handoffs
from cache.prefix_index import BlockGeometry, chain_keys, key_at
from cache.prefix_store import stored_fields
from cache.state import ModelCache
from cache.segment_store import Allocated, Notes, SegmentStore, Wanted
from cache.segments import SegState
from cache.tier_entry import EntryMeta, make_key
from cache.validation import GroupSpec

POLICIES = ("best_effort", "wait", "timeout")


@dataclasses.dataclass(frozen=True)
class DiskConfig:
    """directory: where spans live (created if missing); cap_bytes: the tier's own cap; policy: what
    admission does with a prefetch still running ("best_effort": use the spans that are ready,
    "wait": block, "timeout": block up to timeout_s)."""
    directory: str
    cap_bytes: int = 8 << 30
    policy: str = "wait"
    timeout_s: float = 1.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"prefetch policy must be one of {POLICIES}; got {self.policy!r}")
        if self.cap_bytes <= 0 or self.timeout_s <= 0:
            raise ValueError(f"disk cap_bytes and timeout_s must be positive; got {self.cap_bytes}, {self.timeout_s}")


@dataclasses.dataclass(frozen=True)
class SpanSetup:
    """What the disk tier knows of its prefix cache besides the store: the groups' specs and block
    geometry, the weights' fingerprint, the checkpoint interval (spans are interval x LCM tokens), the
    pool fields kept in copies (`PrefixCacheConfig.copies`), the chain keys of a token list for a group
    (the cache's memo), where warnings go and how restored segments are committed."""
    specs: tuple[GroupSpec, ...]
    geometry: BlockGeometry
    fingerprint: str
    checkpoint_interval: int
    copies: tuple[tuple[str, str, int, int], ...]
    keys: Callable[[list[int], GroupSpec], tuple[str, ...]]
    notes: Notes
    # makes restored segments servable as a publish does (index entries inside a partial page, KV events)
    commit: Callable[[list[int], list[Allocated]], None]


class DiskSpans:
    def __init__(self, store: SegmentStore, setup: SpanSetup, cache: ModelCache, config: DiskConfig):
        """store: the prefix store (the disk tier goes through its public methods only); cache: the
        engine's pools (for the shapes of what a span holds)."""
        self.store, self.setup, self.config = store, setup, config
        # group -> field -> (unit axis, shape, dtype) of the pool arrays a stored object is made of
        self._layout = {n: {f: (ax, getattr(g, f).shape, getattr(g, f).dtype) for f, ax in stored_fields(g).items()}
                        for n, g in cache.groups.items()}
        # group -> field -> (axis, r): the pool keeps r copies of each entry along axis; a span one
        self._copies = {n: {} for n in self._layout}
        for n, f, axis, r in setup.copies:
            self._copies[n][f] = (axis, r)
        # span keys: every group's chain without the layout (what a span holds is the same in all)
        self._ctx = {s.name: dataclasses.replace(s.ctx, sharding="") for s in setup.specs}
        self.tier = DiskTier(config.directory, config.cap_bytes, fingerprint=setup.fingerprint)
        self.span = setup.checkpoint_interval * setup.geometry.lcm
        self._writer = cf.ThreadPoolExecutor(1, thread_name_prefix="prefix-disk-writer")
        self._written: dict[str, cf.Future] = {}           # span key -> put future (True once durable)
        self._seg_spans: dict[int, set[str]] = collections.defaultdict(set)
        self._prefetched: dict[str, list[tuple[int, str, object]]] = {}
        self.reasons: collections.Counter[str] = collections.Counter()
        self.spans_restored = 0
        self.tokens_restored = 0
        self.skipped_writes = 0            # spans not written because the tier's writes were off
        self.handoffs = Handoffs(self)     # prefill/decode disaggregation's transfers (cache/handoff.py)

    # --- geometry ----------------------------------------------------------------------------------
    def start(self, b: int) -> int:
        return ((b - 1) // self.span) * self.span

    def chain(self, b: int) -> list[int]:
        """Ends of the spans needed to resume at b, ascending."""
        out = [b]
        while out[-1] > self.span:
            out.append(self.start(out[-1]))
        return out[::-1]

    def _group_keys(self, tokens: Sequence[int], copy: bool = True) -> dict[str, tuple[str, ...]]:
        """Every group's chain keys in the device store (with the layout). copy False: `tokens` is a
        list the caller keeps unchanged (the cache memoises keys per list)."""
        toks = list(tokens) if copy else tokens
        return {s.name: self.setup.keys(toks, s) for s in self.setup.specs}

    def _span_keys(self, tokens: Sequence[int]) -> dict[str, tuple[str, ...]]:
        """Every group's chain keys without the layout, which span keys are made of."""
        toks = list(tokens)
        return {n: chain_keys(toks, self.setup.geometry.gcd, ctx) for n, ctx in self._ctx.items()}

    def key(self, keys: dict[str, tuple[str, ...]], b: int, kind: str = "prefix-span") -> str:
        """The key of the span ending at b (kind "prefix-span"; a handoff's: "prefix-handoff"), from
        `_span_keys`."""
        gcd = self.setup.geometry.gcd
        return make_key(kind, *(key_at(keys[n], gcd, b) for n in sorted(keys)))

    def _logical(self, name: str, f: str, a: np.ndarray) -> np.ndarray:
        """A pool field's values (any unit axis) with one copy of each entry."""
        axis, r = self._copies[name].get(f, (0, 1))
        return a if r == 1 else np.take(a, np.arange(0, a.shape[axis], r), axis=axis)

    def _placed(self, name: str, f: str, a: np.ndarray) -> np.ndarray:
        """Logical values (any unit axis) with the copies this engine's pools keep."""
        axis, r = self._copies[name].get(f, (0, 1))
        return a if r == 1 else np.repeat(a, r, axis=axis)

    def expect(self, b: int, start: int | None = None) -> EntryMeta:
        """The exact meta of the span ending at b (of [start, b) when given: a handoff's): array
        '<group>-<field>' is the pool field with its unit axis holding the span's blocks (a block group:
        [L, blocks, ps, ...]) or without it (a checkpoint group: the checkpoint at b, e.g. [L, ...], a
        tail's count [])."""
        s = self.start(b) if start is None else start
        abi, dtypes, shapes = {}, {}, {}
        for spec in self.setup.specs:
            for f, (ax, shape, dtype) in self._layout[spec.name].items():
                n = f"{spec.name}-{f}"
                lead = () if spec.is_checkpoint else (len(self._objects(spec, b, s)),)
                shape = list(shape)
                if f in self._copies[spec.name]:
                    axis, r = self._copies[spec.name][f]
                    shape[axis] //= r
                shapes[n] = tuple(shape[:ax]) + lead + tuple(shape[ax + 1:])
                dtypes[n], abi[n] = np.dtype(dtype).name, spec.ctx.abi_id
        return EntryMeta(fingerprint=self.setup.fingerprint, abi=abi, dtypes=dtypes, shapes=shapes, start=s, end=b)

    def _objects(self, spec, b: int, start: int | None = None) -> list[int]:
        """Block ends (or the checkpoint boundary) a span ending at b (from `start` when given) holds
        for a group."""
        if spec.is_checkpoint:
            return [b]
        s = self.start(b) if start is None else start
        inner = b - b % spec.entry            # a handoff may end inside a page of a partial group
        ends = list(range(s + spec.block_size, inner + 1, spec.block_size))
        return ends + [inner] if inner % spec.block_size else ends

    # --- write behind ------------------------------------------------------------------------------
    def write(self, cache: ModelCache, tokens: Sequence[int], b: int):
        """After a publish at b: copies the span ending at b from the pools to the host and writes it
        on a background thread. Skipped when the span is already on disk or a block of it is not on
        the device."""
        k = self.key(self._span_keys(tokens), b)
        if k in self._written or k in self.tier:
            return
        if not self.tier.writable():       # an unwritable directory: not even the copy to the host
            self.skipped_writes += 1
            return
        got = self.read(cache, tokens, b)
        if got is None:
            return
        arrays, sids = got
        self._written[k] = self._writer.submit(self.tier.put, k, arrays, self.expect(b))
        for sid in sids:
            self._seg_spans[sid].add(k)

    def read(self, cache: ModelCache, tokens: Sequence[int], b: int, start: int | None = None
             ) -> tuple[dict[str, np.ndarray], list[int]] | None:
        """Copies to the host what the span ending at b (of [start, b) when given) holds, as `expect`
        names and shapes it: (arrays, the segments read), or None when an object of it is not on the
        device."""
        keys = self._group_keys(tokens)
        plan, cols, sids = {}, {}, []
        store, gcd = self.store, self.setup.geometry.gcd
        for spec in self.setup.specs:
            slots = []
            for e in self._objects(spec, b, start):
                seg = store.segment_at(spec, key_at(keys[spec.name], gcd, e))
                if seg is None or seg.state is not SegState.DEVICE:
                    return None
                slots.append(store.unit(seg.id))
                sids.append(seg.id)
            W = store.layout.width[spec.name]
            if len(slots) > W:
                return None
            p = np.full((W,), -1, np.int32)
            p[:len(slots)] = slots
            plan[spec.name], cols[spec.name] = jnp.asarray(p), len(slots)
        data = jax.device_get(store.read_units(cache, plan))
        arrays = {}
        for spec in self.setup.specs:
            for f, a in data[spec.name].items():
                ax = self._layout[spec.name][f][0]
                a = self._logical(spec.name, f, np.take(a, np.arange(cols[spec.name]), axis=ax))
                arrays[f"{spec.name}-{f}"] = np.array(np.take(a, 0, axis=ax) if spec.is_checkpoint else a)   # ndim 0 kept
        return arrays, sids

    def durable(self, sid: int) -> bool:
        """Whether a written span holds this segment's bytes."""
        for k in self._seg_spans.get(sid, ()):
            f = self._written.get(k)
            if f is not None and f.done() and f.exception() is None and f.result():
                return True
        return False

    def flush(self):
        """Waits for every pending write (tests, benchmarks, shutdown)."""
        for f in list(self._written.values()):
            f.result()

    def close(self):
        """Waits for every pending write, then stops the writer and the tier's prefetch threads (the
        store is dropped: a rebuilt store opens the directory anew)."""
        self.flush()
        self._writer.shutdown(wait=True)
        self.tier.close()

    # --- find, prefetch, restore -------------------------------------------------------------------
    def find(self, tokens: Sequence[int], above: int) -> tuple[dict, list[tuple[int, str]]]:
        """The longest chain of spans on disk resuming beyond `above` tokens, leaving a token to
        compute: (span chain keys, [(end, key)] ascending) or (keys, [])."""
        keys = self._span_keys(tokens)
        lcm = self.setup.geometry.lcm
        top = ((len(tokens) - 1) // lcm) * lcm
        for b in range(top, above, -lcm):
            if self.key(keys, b) not in self.tier:
                continue
            chain = [(e, self.key(keys, e)) for e in self.chain(b)]
            if all(k in self.tier for _, k in chain):
                return keys, chain
        return keys, []

    def prefetch(self, request_id: str, tokens: Sequence[int]):
        _, chain = self.find(tokens, 0)
        if chain:
            self._prefetched[request_id] = [(e, k, self.tier.prefetch(k, self.expect(e))) for e, k in chain]

    def restore(self, cache: ModelCache, tokens: Sequence[int], on_device: int, request_id: str | None,
                keep: frozenset[int] = frozenset()) -> tuple[ModelCache, bool]:
        """Installs in the pools the spans beyond `on_device` tokens of the longest chain on disk.
        keep: segments the hit needs that are already on the device; neither they nor the segments
        of spans installed earlier in this restore are evicted to make room for later spans.
        Returns (cache, whether anything was installed)."""
        handles = self._prefetched.pop(request_id, None) if request_id is not None else None
        policy = self.config.policy
        if handles is None:
            keys, chain = self.find(tokens, on_device)
            if not chain:
                return cache, False
            handles = [(e, k, self.tier.prefetch(k, self.expect(e))) for e, k in chain]
            policy = "wait"            # nothing was prefetched: the read is on the critical path anyway
        installed = False
        for e, k, h in handles:
            if e <= on_device:
                continue
            arrays, reason = h.result(policy, self.config.timeout_s if policy == "timeout" else None)
            if arrays is None:
                self.reasons[reason] += 1
                self.setup.notes.once(f"disk:{reason}", f"a span on disk was not used ({reason}); its tokens are"
                                                     f" recomputed")
                break
            cache, ok, held = self.install(cache, tokens, e, k, arrays, keep)
            if not ok:
                break
            keep = keep | held
            installed = True
            self.spans_restored += 1
            self.tokens_restored += e - self.start(e)
        return cache, installed

    def install(self, cache: ModelCache, tokens: Sequence[int], b: int, span: str, arrays: dict[str, np.ndarray],
                keep: frozenset[int] = frozenset(), start: int | None = None
                ) -> tuple[ModelCache, bool, frozenset[int]]:
        """Puts one span's objects (span: its key; [start, b) when given: a handoff's) into fresh pages /
        checkpoint units: objects already on the device are kept, ones the store knows on disk are
        restored (disk -> host -> device), others are allocated and committed as a publish commits
        them; nothing in `keep` is evicted for room. A span's segments are then known to be on disk
        (offloading them is free); a handoff's are not (it is not a span `find` can restore from).
        Returns (cache, ok, the span's segments)."""
        on_disk = start is None
        store, gcd = self.store, self.setup.geometry.gcd
        toks = list(tokens[:b])             # one list: the cache's key memo serves the commit too
        keys = self._group_keys(toks, copy=False)
        objects = {s.name: self._objects(s, b, start) for s in self.setup.specs}
        # each object is on the device (kept), known on disk or host (restored), or new (allocated)
        there, back, fresh = set(), {}, collections.defaultdict(list)
        for spec in self.setup.specs:
            for e in objects[spec.name]:
                seg = store.segment_at(spec, key_at(keys[spec.name], gcd, e))
                if seg is not None and seg.state is SegState.DEVICE:
                    there.add(seg.id)
                elif seg is not None and seg.state in (SegState.DISK, SegState.HOST) and seg.ref_count == 0:
                    back[spec.name, e] = seg.id
                else:
                    fresh[spec.name].append(e)
        if not back and not fresh:
            return cache, True, frozenset()
        keep, held = keep | there, set()
        for sid in back.values():
            if not store.restore(sid, keep | held):
                return cache, self._undo(held), frozenset()
            held.add(sid)
            store.retain([sid])
        got = store.allocate_all([Wanted(s, keys[s.name], tuple(fresh[s.name])) for s in self.setup.specs
                                  if fresh[s.name]], None, keep | held)
        if got is None:
            return cache, self._undo(held), frozenset()
        new = got[1]
        at = {**back, **{(a.spec.name, a.end): a.sid for a in new}}
        held |= set(at.values())
        plan, data = {}, {}
        for spec in self.setup.specs:
            W = store.layout.width[spec.name]
            slots = np.full((W,), -1, np.int32)
            layout = self._layout[spec.name]
            cols = {f: np.zeros(shape[:ax] + (W,) + shape[ax + 1:], dtype) for f, (ax, shape, dtype) in layout.items()}
            js = [j for j, e in enumerate(objects[spec.name]) if (spec.name, e) in at]
            for j in js:
                sid = at[spec.name, objects[spec.name][j]]
                slots[j] = store.unit(sid)
                if on_disk:
                    self._seg_spans[sid].add(span)
            for f, (ax, _, _) in layout.items():
                src = arrays[f"{spec.name}-{f}"]
                placed = self._placed(spec.name, f, np.expand_dims(src, ax) if spec.is_checkpoint else src)
                cols[f].swapaxes(0, ax)[js] = np.take(placed, js, axis=ax).swapaxes(0, ax)   # unit axis first (views)
            plan[spec.name], data[spec.name] = slots, cols
        cache = store.write_units(cache, plan, data)
        store.release([sid for sid in held if store.alloc.get(sid).ref_count])
        self.setup.commit(toks, new)
        if on_disk and span not in self._written:       # it is on disk: offloading these segments again is free
            f = cf.Future()
            f.set_result(True)
            self._written[span] = f
        return cache, True, frozenset(held)

    def _undo(self, held: set[int]) -> bool:
        """A span that cannot be installed: the segments it restored (their units hold nothing yet) are
        freed (a refused allocation allocated nothing). Returns False."""
        store = self.store
        for sid in held:
            if store.alloc.get(sid).ref_count:
                store.release([sid])
            store.evict([sid])
        return False

    def forget(self, request_id: str):
        """Drops a request's prefetch (aborted before admission), its handoff's included."""
        self._prefetched.pop(request_id, None)
        self.handoffs.forget(request_id)

    def stats(self) -> dict:
        st = self.tier.stats()
        return {"directory": self.config.directory, "entries": st["entries"], "bytes": st["bytes"],
                "cap_bytes": st["cap_bytes"], "spans_restored": self.spans_restored,
                "tokens_restored": self.tokens_restored, "writes": st["puts"], "rejected_writes": st["rejected_puts"],
                "evictions": st["evictions"], "prefetch_hidden_s": st["prefetch_hidden_s"],
                "prefetch_wait_s": st["prefetch_wait_s"], "writable": st["writable"],
                "write_faults": st["write_faults"], "write_fault": st["write_fault"],
                "skipped_writes": self.skipped_writes, "handoffs": self.handoffs.stats()}

    def health(self) -> dict:
        """writable, write_faults, write_fault, skipped_writes: whether the tier's directory takes
        writes, without reading it (for /metrics)."""
        return {**self.tier.health(), "skipped_writes": self.skipped_writes}

    def warmup(self, cache: ModelCache) -> ModelCache:
        """Compiles the unit read and write (all padding: nothing moves), and reads one stored span if
        there is any, so the first disk hit does not pay Orbax's start-up."""
        self.tier.warm()
        store = self.store
        width = store.layout.width
        plan = {n: jnp.full((w,), -1, jnp.int32) for n, w in width.items()}
        jax.block_until_ready(store.read_units(cache, plan))
        data = {n: {f: jnp.zeros(shape[:ax] + (width[n],) + shape[ax + 1:], dtype)
                    for f, (ax, shape, dtype) in self._layout[n].items()} for n in width}
        return store.write_units(cache, plan, data)
