"""Segment types of the heterogeneous cache: object kinds, segment states and the one transition table.

A Segment is the host-side record of one cached object (a block of full KV, a recurrent-state
checkpoint, an SWA window block, ...): which group and token range [start, end) it holds, where it
lives (device / host / disk), which kernel ABI wrote it, how many requests hold it, and a version
that changes with every event that changes its contents. Segments are frozen values; every change
makes a new one through `transition`, `bump_version`, `with_counters` or `dataclasses.replace` in the
allocator.

States and the life of a segment:

    FREE --allocate--> WRITING --commit (version+1)--> DEVICE --offload--> HOST --offload--> DISK
                         ^                              |  ^                |  ^               |
                         +--overwrite/extend------------+  +----restore-----+  +----restore----+
    any live state --evict/abort (version+1)--> FREE

WRITING is the transitional state of a segment whose contents a kernel is writing: it holds device
bytes but is never served and never evicted (the writer owns it). Restores (HOST -> DEVICE,
DISK -> HOST) copy bytes and keep the version; offloads likewise.

Named events. Some moves mean more than their (from, to) pair: EVENTS names them, with the kind they
apply to and the move they make. `close_tail` is the host-side record of a compressed group's tail
closing into a compressed entry: a stored tail checkpoint at boundary b is superseded once the entry
block its next window closed into (the block starting at b) is committed; the tail segment leaves
the device (DEVICE -> FREE, version bump) by that event, not by an eviction.
"""
from __future__ import annotations

import dataclasses
import enum


class Kind(enum.Enum):
    """The kinds of cached object a hybrid model produces."""
    FULL_KV = "full_kv"                      # full-attention K/V blocks
    COMPRESSED_KV = "compressed_kv"          # compressed history (e.g. an MLA latent)
    UNCOMPRESSED_TAIL = "uncompressed_tail"  # full-precision KV of the newest tokens of a compressed group
    SWA_WINDOW = "swa_window"                # sliding-window KV blocks
    INDEXER_KEYS = "indexer_keys"            # sparse-attention indexer keys (DSA keys, V4 CSA indexer entries)
    RECURRENT_STATE = "recurrent_state"      # linear-attention state checkpoint at a block boundary
    CSA_OVERLAP = "csa_overlap"              # CSA's overlap state (the last closed window's first series)


# Kinds whose objects are whole per-row states at one boundary (checkpoints), not blocks of tokens.
CHECKPOINT_KINDS = frozenset({Kind.RECURRENT_STATE, Kind.UNCOMPRESSED_TAIL, Kind.CSA_OVERLAP})


class SegState(enum.Enum):
    """Where a segment is. FREE is terminal for a segment id (ids are never reused)."""
    FREE = "free"
    WRITING = "writing"   # transitional: being written on the device, not servable, not evictable
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


F, W, D, H, K = SegState.FREE, SegState.WRITING, SegState.DEVICE, SegState.HOST, SegState.DISK

# THE transition table: (from, to) -> the event's name. Nothing else moves a segment.
TRANSITIONS: dict[tuple[SegState, SegState], str] = {
    (F, W): "allocate",
    (W, D): "commit",       # the write finished: contents changed, version bumps
    (W, F): "abort",        # the write failed or was cancelled
    (D, W): "overwrite",    # extend / overwrite in place; the commit after it bumps the version
    (D, H): "offload",
    (H, K): "offload",
    (K, H): "restore",
    (H, D): "restore",
    (D, F): "evict",
    (H, F): "evict",
    (K, F): "evict",
}

# Transitions that change what a reader would see: each bumps the version. Freeing bumps too, so a
# version recorded at check time can never match a segment that was reclaimed before use.
VERSION_BUMPING = frozenset({(W, D), (W, F), (D, F), (H, F), (K, F)})

# States whose bytes count against the device cap.
DEVICE_STATES = frozenset({W, D})
# States from which a segment may be served (after a restore for HOST / DISK).
SERVABLE_STATES = frozenset({D, H, K})


# Named events: name -> (the kind it applies to, from, to). Each is also a legal TRANSITIONS move.
EVENTS: dict[str, tuple[Kind, SegState, SegState]] = {
    "close_tail": (Kind.UNCOMPRESSED_TAIL, D, F),
}


class IllegalTransition(ValueError):
    """A transition not in TRANSITIONS was requested."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """One cached object. Token range [start, end); nbytes: its unweighted size in bytes."""
    id: int
    kind: Kind
    group: str
    state: SegState
    start: int
    end: int
    version: int = 0
    ref_count: int = 0
    last_access: int = 0
    writer_abi: str = ""
    writer_layout: str = "replicated"   # the mesh layout its bytes were written in (parallel.Layout.key)
    nbytes: int = 0
    hits: int = 0                # prefix hits that read it (retention: cache.segment_allocator.eviction_order)

    def __post_init__(self):
        if not isinstance(self.kind, Kind):
            raise TypeError(f"segment {self.id}: kind must be a Kind, got {self.kind!r}")
        if not isinstance(self.state, SegState):
            raise TypeError(f"segment {self.id}: state must be a SegState, got {self.state!r}")
        if not 0 <= self.start <= self.end:
            raise ValueError(f"segment {self.id}: token range [{self.start}, {self.end}) is not a range")
        if self.nbytes < 0:
            raise ValueError(f"segment {self.id}: nbytes must be >= 0, got {self.nbytes}")
        if self.ref_count < 0:
            raise ValueError(f"segment {self.id}: ref_count went negative ({self.ref_count})")

    def describe(self) -> str:
        return (f"segment {self.id} ({self.kind.value}, group {self.group!r}, tokens [{self.start}, {self.end}),"
                f" v{self.version}, refs {self.ref_count})")


def with_counters(seg: Segment, *, ref_count: int | None = None, last_access: int | None = None,
                  hits: int | None = None) -> Segment:
    """The segment with a new reference count and / or LRU time: a copy that skips `__post_init__` (these
    two fields are all a cache hit's bookkeeping changes, for every block of a long prefix, and
    `dataclasses.replace` re-validating every field costs 4x the copy). ValueError on a negative count."""
    if ref_count is not None and ref_count < 0:
        raise ValueError(f"segment {seg.id}: ref_count went negative ({ref_count})")
    new = object.__new__(Segment)
    d = new.__dict__
    d.update(seg.__dict__)
    if ref_count is not None:
        d["ref_count"] = ref_count
    if last_access is not None:
        d["last_access"] = last_access
    if hits is not None:
        d["hits"] = hits
    return new


def transition(seg: Segment, to: SegState) -> Segment:
    """The segment after moving it to state `to`; bumps the version on VERSION_BUMPING moves.

    Raises IllegalTransition naming both states and the segment if (seg.state, to) is not in
    TRANSITIONS, and when a held segment (ref_count > 0) would be freed or overwritten.
    """
    key = (seg.state, to)
    if key not in TRANSITIONS:
        allowed = sorted(t.value for (f, t) in TRANSITIONS if f == seg.state)
        raise IllegalTransition(f"illegal transition {seg.state.value} -> {to.value} for {seg.describe()};"
                                f" from {seg.state.value} allowed: {allowed}")
    if seg.ref_count > 0 and to in (F, W):
        raise IllegalTransition(f"illegal transition {seg.state.value} -> {to.value} for {seg.describe()}:"
                                f" it is held by {seg.ref_count} reader(s)")
    version = seg.version + 1 if key in VERSION_BUMPING else seg.version
    return dataclasses.replace(seg, state=to, version=version)


def bump_version(seg: Segment, *, end: int | None = None) -> Segment:
    """A rollback (or any in-place change of a DEVICE segment's contents): new version, optional new end.

    Raises IllegalTransition unless the segment is on the device and not held.
    """
    if seg.state is not D:
        raise IllegalTransition(f"illegal rollback in state {seg.state.value} (needs {D.value}) for {seg.describe()}")
    if seg.ref_count > 0:
        raise IllegalTransition(f"illegal rollback of {seg.describe()}: it is held by {seg.ref_count} reader(s)")
    new_end = seg.end if end is None else end
    if not seg.start <= new_end <= seg.end:
        raise ValueError(f"rollback of {seg.describe()} to end {new_end}: must lie in [{seg.start}, {seg.end}]")
    return dataclasses.replace(seg, end=new_end, version=seg.version + 1)


def close_tail(tail: Segment, entry: Segment) -> Segment:
    """The `close_tail` event: tail (an UNCOMPRESSED_TAIL checkpoint ending at b) is superseded by
    entry (a committed compressed / indexer entry block that starts at or before b and ends after
    it: the block its next window closed into). Returns the tail segment freed (version bumped).

    Raises IllegalTransition naming both segments when the tail is not a device-resident, unheld tail,
    or the entry block is not a committed entry block covering the token right after the tail.
    """
    kind, frm, to = EVENTS["close_tail"]
    if tail.kind is not kind or tail.state is not frm:
        raise IllegalTransition(f"close_tail needs a {kind.value} segment in state {frm.value}; got {tail.describe()}"
                                f" in state {tail.state.value}")
    if entry.kind not in (Kind.COMPRESSED_KV, Kind.INDEXER_KEYS) or entry.state is not D:
        raise IllegalTransition(f"close_tail of {tail.describe()}: {entry.describe()} is not a committed entry block"
                                f" (state {entry.state.value})")
    if not entry.start <= tail.end < entry.end:
        raise IllegalTransition(f"close_tail of {tail.describe()}: {entry.describe()} does not hold the entry its"
                                f" window closes into (token {tail.end})")
    return transition(tail, to)
