"""The prefix store's segment allocator (pure-functional): segment records, a weighted byte cap, eviction by kind.

It allocates *segments* (the records of what the prefix store holds: a block or a checkpoint, its
state, range, version and reference count); the pages and units those segments live in are handed
out by cache.block_manager.

The allocator's state is an immutable value (`AllocState`); every operation returns a new one and
leaves the old untouched, so a caller can keep the state it checked a hit against and compare it
with the state at use (see cache.validation). Nothing here touches device memory: the engine
mirrors each record onto its pools.

Admission: the *weighted* bytes of all device-resident segments (WRITING and DEVICE) never exceed
`AllocConfig.cap_bytes`, where a segment weighs `weights[kind] * nbytes`. A request over the cap
evicts unheld DEVICE segments in EVICTION_PRIORITY order (LRU within a kind) until it fits; if even
evicting every candidate would not make room, it is refused with AdmissionRefused and nothing is
evicted. Segments with ref_count > 0 and segments being written are never evicted. Host and disk
tiers are not capped here. Eviction only drops records: the caller frees the pages of
`evicted_ids(before, after)` and prunes its prefix index (a dangling entry is harmless: validation
treats a freed segment as absent, but pruning keeps the index small).
"""
from __future__ import annotations

import dataclasses
import types
from typing import Mapping

from cache.segments import (DEVICE_STATES, IllegalTransition, Kind, SegState, Segment, bump_version,
                            close_tail as seg_close_tail, transition as seg_transition, with_counters)

# Eviction priority, lowest first: the cost of getting the object back, and how much a wrong or
# missing one costs. ONE table; the allocator reads nothing else.
EVICTION_PRIORITY: dict[Kind, tuple[int, str]] = {
    Kind.FULL_KV: (0, "recomputed from the tokens by one prefill of its blocks; any prefix of it stays usable"),
    Kind.SWA_WINDOW: (0, "only the last window is ever read; older blocks are dead weight, cheap to rebuild"),
    Kind.COMPRESSED_KV: (1, "rebuilt by re-running prefill and compression over the history"),
    Kind.UNCOMPRESSED_TAIL: (2, "small, and without it the whole compressed group is unusable"),
    Kind.INDEXER_KEYS: (2, "small; a missing or stale indexer routes the sparse layer wrongly"),
    Kind.CSA_OVERLAP: (2, "one window per row, and without it the next CSA entry cannot be formed"),
    Kind.RECURRENT_STATE: (3, "a checkpoint summarises the whole prefix: losing it means recomputing"
                              " everything before it, not one block"),
}

DEFAULT_WEIGHTS: dict[Kind, float] = {k: 1.0 for k in Kind}


class AdmissionRefused(ValueError):
    """The weighted byte cap cannot be met even after evicting every evictable segment."""


class UnknownSegment(KeyError):
    """A segment id that the allocator does not hold (never allocated, or already freed)."""


def _frozen(d: dict) -> Mapping:
    return types.MappingProxyType(d)


@dataclasses.dataclass(frozen=True)
class AllocConfig:
    """cap_bytes: limit on weighted device-resident bytes; weights: Kind -> weight (> 0)."""
    cap_bytes: int
    weights: Mapping[Kind, float] = dataclasses.field(default_factory=lambda: _frozen(dict(DEFAULT_WEIGHTS)))

    def __post_init__(self):
        if self.cap_bytes <= 0:
            raise ValueError(f"cap_bytes must be positive, got {self.cap_bytes}")
        missing = [k.value for k in Kind if k not in self.weights]
        if missing:
            raise ValueError(f"weights lack kinds {missing}")
        bad = {k.value: w for k, w in self.weights.items() if not w > 0}
        if bad:
            raise ValueError(f"weights must be > 0, got {bad}")
        object.__setattr__(self, "weights", _frozen(dict(self.weights)))

    def weighted(self, seg: Segment) -> float:
        return self.weights[seg.kind] * seg.nbytes


@dataclasses.dataclass(frozen=True)
class AllocState:
    """segments: id -> Segment (live ones only; freed ids are gone); clock: logical time of the last op;
    device_bytes: Kind -> unweighted bytes of the device-resident segments (WRITING and DEVICE), kept
    by `_put` as segments change, so the cap check costs the number of kinds, not of segments."""
    config: AllocConfig
    segments: Mapping[int, Segment] = dataclasses.field(default_factory=lambda: _frozen({}))
    next_id: int = 1
    clock: int = 0
    device_bytes: Mapping[Kind, int] = dataclasses.field(default_factory=lambda: _frozen({}))

    def get(self, seg_id: int) -> Segment:
        try:
            return self.segments[seg_id]
        except KeyError:
            raise UnknownSegment(f"no live segment {seg_id} (never allocated, or freed)") from None

    def state_of(self, seg_id: int) -> SegState:
        """FREE for ids the allocator does not hold."""
        seg = self.segments.get(seg_id)
        return SegState.FREE if seg is None else seg.state

    @property
    def device_weighted_bytes(self) -> float:
        return sum(self.config.weights[k] * n for k, n in self.device_bytes.items())


def init_state(config: AllocConfig) -> AllocState:
    return AllocState(config=config)


def _put(state: AllocState, *segs: Segment, drop: tuple[int, ...] = (), next_id: int | None = None) -> AllocState:
    """The state with `segs` written (a FREE one leaves the record) and `drop` removed; device_bytes
    follows every change of a segment's state or size."""
    d = dict(state.segments)
    dev = dict(state.device_bytes)

    def count(seg: Segment | None, sign: int):
        if seg is not None and seg.state in DEVICE_STATES:
            dev[seg.kind] = dev.get(seg.kind, 0) + sign * seg.nbytes

    for sid in drop:
        count(d.pop(sid, None), -1)
    for s in segs:
        count(d.get(s.id), -1)
        if s.state is SegState.FREE:
            d.pop(s.id, None)
        else:
            d[s.id] = s
            count(s, +1)
    return dataclasses.replace(state, segments=_frozen(d), clock=state.clock + 1, device_bytes=_frozen(dev),
                               next_id=state.next_id if next_id is None else next_id)


def evictable(state: AllocState):
    """The evictable segments (DEVICE, unheld), in no particular order."""
    return (s for s in state.segments.values() if s.state is SegState.DEVICE and s.ref_count == 0)


HIT_CREDIT_CAP = 4     # hits that count toward retention
HIT_CREDIT_TICKS = 16  # a hit's credit, in clock ticks per segment the store holds


def eviction_order(state: AllocState) -> list[Segment]:
    """Evictable segments, first victim first: by kind priority, then by last use plus a credit for
    each prefix hit that read the segment (up to HIT_CREDIT_CAP), then id. A hit's credit is
    HIT_CREDIT_TICKS clock ticks per segment the store holds: an object that served several requests
    (a shared system prompt's pages, a branch point's checkpoint) outlives one-off objects published
    after it, yet ages out once nobody reads it for a while. The clock ticks once per segment touched,
    and every publish and hit touches its whole chain, so a request moves it by a few times its
    chain's segments: with one store's worth of ticks per hit (HIT_CREDIT_TICKS 1) a branch point
    outlived only about two requests, fewer than the checkpoint units take to turn over, and the
    DeepSeek-V4 tree workload of benchmarks/prefix_workloads.py lost its branch points to one-off
    leaves (0.85 of the ideal at 4; 0.89 at 16, the rest lost where a branch is first shared)."""
    credit = HIT_CREDIT_TICKS * len(state.segments)
    return sorted(evictable(state), key=lambda s: (EVICTION_PRIORITY[s.kind][0],
                                                   s.last_access + credit * min(s.hits, HIT_CREDIT_CAP), s.id))


def _make_room(state: AllocState, extra: float, what: str, protect: frozenset[int] = frozenset()) -> AllocState:
    """State after evicting just enough, in policy order, for `extra` more weighted device bytes."""
    cap = state.config.cap_bytes
    used = state.device_weighted_bytes
    if used + extra <= cap:
        return state
    victims, freed = [], 0.0
    for s in eviction_order(state):
        if s.id in protect:
            continue
        victims.append(s)
        freed += state.config.weighted(s)
        if used - freed + extra <= cap:
            break
    else:
        raise AdmissionRefused(
            f"cannot admit {what}: needs {extra:.0f} weighted bytes, {used:.0f} of cap {cap} in use and only"
            f" {freed:.0f} evictable (held or being written segments are never evicted)")
    return _put(state, *(seg_transition(v, SegState.FREE) for v in victims))


@dataclasses.dataclass(frozen=True)
class NewSegment:
    """What `allocate_many` is asked for: a segment of `kind` in `group` holding `nbytes` device bytes for
    tokens [start, end), written by kernel ABI `writer_abi` in mesh layout `writer_layout`."""
    kind: Kind
    group: str
    nbytes: int
    start: int
    end: int
    writer_abi: str
    writer_layout: str = "replicated"

    def __post_init__(self):
        if not isinstance(self.kind, Kind):
            raise TypeError(f"kind must be a Kind, got {self.kind!r}")
        if self.nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {self.nbytes}")


def allocate_many(state: AllocState, wanted) -> tuple[AllocState, list[int]]:
    """(new state, ids) of new segments in WRITING, one per NewSegment of `wanted`, in one new state.

    Evicts by policy when over the cap, for all of them at once; raises AdmissionRefused when it
    cannot make room (nothing is then allocated or evicted).
    """
    wanted = list(wanted)
    extra = sum(state.config.weights[w.kind] * w.nbytes for w in wanted)
    state = _make_room(state, extra, ", ".join(f"{w.kind.value} segment of {w.nbytes} bytes for group {w.group!r}"
                                               for w in wanted[:3]) + (" ..." if len(wanted) > 3 else ""))
    first = state.next_id
    segs = [seg_transition(Segment(id=first + i, kind=w.kind, group=w.group, state=SegState.FREE, start=w.start,
                                   end=w.end, last_access=state.clock + 1, writer_abi=w.writer_abi,
                                   writer_layout=w.writer_layout, nbytes=w.nbytes), SegState.WRITING)
            for i, w in enumerate(wanted)]
    return _put(state, *segs, next_id=first + len(wanted)), [s.id for s in segs]


def allocate(state: AllocState, kind: Kind, group: str, nbytes: int, *, start: int, end: int,
             writer_abi: str, writer_layout: str = "replicated") -> tuple[AllocState, int]:
    """(new state, id) of a new segment in WRITING (`allocate_many` for one)."""
    state, ids = allocate_many(state, [NewSegment(kind, group, nbytes, start, end, writer_abi, writer_layout)])
    return state, ids[0]


def transition(state: AllocState, seg_id: int, to: SegState) -> AllocState:
    """Moves one segment along the transition table. A restore to DEVICE goes through admission
    (and may evict others, never this one); moving to FREE drops the record."""
    seg = state.get(seg_id)
    if to is SegState.DEVICE and seg.state is SegState.HOST:
        state = _make_room(state, state.config.weighted(seg), f"restore of {seg.describe()}",
                           protect=frozenset({seg_id}))
        seg = state.get(seg_id)
    new = seg_transition(seg, to)
    return _put(state, dataclasses.replace(new, last_access=state.clock + 1))


def commit(state: AllocState, seg_id: int, *, end: int | None = None, nbytes: int | None = None) -> AllocState:
    """WRITING -> DEVICE (version bump), optionally with the range's new end and the new size."""
    seg = state.get(seg_id)
    if seg.state is not SegState.WRITING:
        raise IllegalTransition(f"illegal transition {seg.state.value} -> device (commit) for {seg.describe()}")
    nb = seg.nbytes if nbytes is None else nbytes
    grow = state.config.weights[seg.kind] * (nb - seg.nbytes)
    if grow > 0:
        state = _make_room(state, grow, f"growth of {seg.describe()} to {nb} bytes", protect=frozenset({seg_id}))
    seg = dataclasses.replace(state.get(seg_id), end=seg.end if end is None else end, nbytes=nb)
    new = seg_transition(seg, SegState.DEVICE)
    return _put(state, dataclasses.replace(new, last_access=state.clock + 1))


def commit_many(state: AllocState, seg_ids) -> AllocState:
    """`commit` (no new end or size) for several segments at once (one new state; each gets its own
    tick of the clock, in the given order)."""
    d = dict(state.segments)
    clock = state.clock
    for sid in seg_ids:
        seg = d.get(sid) or state.get(sid)
        if seg.state is not SegState.WRITING:
            raise IllegalTransition(f"illegal transition {seg.state.value} -> device (commit) for {seg.describe()}")
        clock += 1
        d[sid] = dataclasses.replace(seg_transition(seg, SegState.DEVICE), last_access=clock)
    return dataclasses.replace(state, segments=_frozen(d), clock=clock)


def rollback(state: AllocState, seg_id: int, end: int) -> AllocState:
    """Shrinks a DEVICE segment's range to [start, end) (e.g. rejected draft tokens); bumps the version."""
    return _put(state, bump_version(state.get(seg_id), end=end))


def retain(state: AllocState, seg_id: int) -> AllocState:
    """One more reader holds the segment (it can no longer be evicted or overwritten)."""
    seg = state.get(seg_id)
    if seg.state not in (SegState.DEVICE, SegState.HOST, SegState.DISK):
        raise IllegalTransition(f"cannot retain {seg.describe()} in state {seg.state.value}")
    return _put(state, dataclasses.replace(seg, ref_count=seg.ref_count + 1, last_access=state.clock + 1))


def release(state: AllocState, seg_id: int) -> AllocState:
    """One reader lets go. Raises ValueError when nobody held it (a ref count never goes negative)."""
    seg = state.get(seg_id)
    if seg.ref_count <= 0:
        raise ValueError(f"release of {seg.describe()}: ref count would go negative")
    return _put(state, dataclasses.replace(seg, ref_count=seg.ref_count - 1))


def evict(state: AllocState, seg_id: int) -> AllocState:
    """Frees one unheld segment (DEVICE, HOST or DISK). Raises IllegalTransition if held or WRITING."""
    return _put(state, seg_transition(state.get(seg_id), SegState.FREE))


def evict_many(state: AllocState, seg_ids) -> AllocState:
    """`evict` for several segments at once (one new state; none: the same state)."""
    ids = list(seg_ids)
    return _put(state, *(seg_transition(state.get(sid), SegState.FREE) for sid in ids)) if ids else state


def close_tail(state: AllocState, tail_id: int, entry_id: int) -> AllocState:
    """The named `close_tail` event (cache.segments.close_tail): the tail checkpoint `tail_id` is
    superseded by the committed entry block `entry_id` its window closed into, and leaves the record.
    Raises IllegalTransition (held, wrong kinds or states, or a block that does not hold that entry)."""
    tail = state.get(tail_id)
    if tail.ref_count > 0:
        raise IllegalTransition(f"close_tail of {tail.describe()}: it is held by {tail.ref_count} reader(s)")
    return _put(state, seg_close_tail(tail, state.get(entry_id)))


def touch(state: AllocState, seg_id: int) -> AllocState:
    """Marks a use of the segment for LRU."""
    seg = state.get(seg_id)
    return _put(state, dataclasses.replace(seg, last_access=state.clock + 1))


def retain_many(state: AllocState, seg_ids) -> AllocState:
    """`retain` for several segments at once (one new state)."""
    d = dict(state.segments)
    for sid in seg_ids:
        seg = d.get(sid) or state.get(sid)
        if seg.state not in (SegState.DEVICE, SegState.HOST, SegState.DISK):
            raise IllegalTransition(f"cannot retain {seg.describe()} in state {seg.state.value}")
        d[sid] = with_counters(seg, ref_count=seg.ref_count + 1, last_access=state.clock + 1)
    return dataclasses.replace(state, segments=_frozen(d), clock=state.clock + 1)


def release_many(state: AllocState, seg_ids) -> AllocState:
    """`release` for several segments at once; ValueError if a ref count would go negative."""
    d = dict(state.segments)
    for sid in seg_ids:
        seg = d.get(sid) or state.get(sid)
        if seg.ref_count <= 0:
            raise ValueError(f"release of {seg.describe()}: ref count would go negative")
        d[sid] = with_counters(seg, ref_count=seg.ref_count - 1)
    return dataclasses.replace(state, segments=_frozen(d), clock=state.clock + 1)


def touch_many(state: AllocState, seg_ids, hit: bool = False) -> AllocState:
    """Marks uses of several segments in the given order (the last one is the most recent); hit: the
    uses are a prefix hit reading them (each one's `hits` goes up)."""
    d = dict(state.segments)
    clock = state.clock
    for sid in seg_ids:
        clock += 1
        seg = state.get(sid)
        d[sid] = with_counters(seg, last_access=clock, hits=seg.hits + 1 if hit else None)
    return dataclasses.replace(state, segments=_frozen(d), clock=clock)


def evicted_ids(before: AllocState, after: AllocState) -> tuple[int, ...]:
    """Ids live in `before` and freed in `after` (by eviction, abort or pressure), ascending."""
    return tuple(sorted(set(before.segments) - set(after.segments)))


def bytes_by_kind(state: AllocState, states: frozenset[SegState] = DEVICE_STATES) -> dict[Kind, int]:
    """Unweighted bytes of segments in `states`, per kind (every kind present, 0 if none)."""
    if states == DEVICE_STATES:
        return {k: state.device_bytes.get(k, 0) for k in Kind}
    out = {k: 0 for k in Kind}
    for s in state.segments.values():
        if s.state in states:
            out[s.kind] += s.nbytes
    return out


def bytes_by_group(state: AllocState, states: frozenset[SegState] = DEVICE_STATES) -> dict[str, int]:
    """Unweighted bytes of segments in `states`, per group."""
    out: dict[str, int] = {}
    for s in state.segments.values():
        if s.state in states:
            out[s.group] = out.get(s.group, 0) + s.nbytes
    return out
