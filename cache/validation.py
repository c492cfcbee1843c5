"""Validation of prefix-cache hits: a hash hit is only a first signal; five checks decide if it is usable.

`validate_hit` runs, in this order, and turns the first failure into a miss with a reason:

  1. "coverage"      the hashed hit, capped so at least one token is left to compute (for the
                     logits), covers at least one whole LCM block;
  2. "abi_mismatch"  every found object was written by the ABI its group's reader uses, and
     "sharding"      in the reader's mesh layout (its bytes on the devices are split the reader's
                     way; a layout change is a miss unless resharded, as the disk tier does);
  3. "intersection"  the longest LCM boundary every group can resume from: a full-KV / indexer
                     group needs all its blocks up to it, a checkpoint group (recurrent state, an
                     uncompressed tail kept as its own group, CSA overlap state, an SWA ring) a
                     stored checkpoint exactly there, an SWA group of blocks the blocks of its last
                     window, a compressed group its compressed blocks and an uncompressed tail ending
                     there; every object must be live and resident where the caller can read it
                     (`servable`). The miss names the group and the object it lacks;
  4. "alignment"     the boundary is a multiple of every group's block size, every chosen segment
                     covers whole blocks of its group (checkpoints and tails end exactly at the
                     boundary) and is servable: on the device, or restorable from host / disk;
  5. "version"       at use, every chosen segment is still live with the version recorded at check.

A lookup that finds no key at all is a miss with reason "no_hit" and is not a hash hit.
`CacheStats` counts lookups, hash hits and validation passes; effective reuse = hit rate *
validation pass rate (the seed article's composite metric), with misses per reason and per group.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Mapping, Sequence

from cache.segment_allocator import AllocState, bytes_by_group, bytes_by_kind
from cache.prefix_index import BlockGeometry, IndexEntry, KeyContext, PrefixIndex, block_geometry, chain_keys, key_at
from cache.segments import CHECKPOINT_KINDS, SERVABLE_STATES, Kind, SegState

REASONS = ("no_hit", "coverage", "abi_mismatch", "sharding", "intersection", "alignment", "version")
GROUP_KINDS = (Kind.FULL_KV, Kind.SWA_WINDOW, Kind.COMPRESSED_KV, Kind.INDEXER_KEYS, Kind.RECURRENT_STATE,
               Kind.UNCOMPRESSED_TAIL, Kind.CSA_OVERLAP)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One cache group of the reading model. kind: the group's object kind (one of GROUP_KINDS; a
    COMPRESSED_KV group also needs UNCOMPRESSED_TAIL objects, in the same group unless tail=False);
    block_size: tokens per block (a checkpoint group: its grid); ctx: key context (its abi_id is the
    reader's ABI); window: SWA window in tokens (blocks of an SWA group); checkpoint: an SWA group
    stored as one ring per boundary (RECURRENT_STATE, UNCOMPRESSED_TAIL and CSA_OVERLAP groups always
    are checkpoints); closes_into: the compressed group an UNCOMPRESSED_TAIL group's windows close
    into (the `close_tail` event supersedes its checkpoints by that group's entry blocks); partial: a
    group of per-token (or per-`entry`-tokens) blocks, indexed at their interior points too, so a hit
    may end inside a stored block (the reader copies it before writing into it)."""
    name: str
    kind: Kind
    block_size: int
    ctx: KeyContext
    window: int = 0
    tail: bool | None = None     # a COMPRESSED_KV group also needs its uncompressed tail (default:
                                 # yes; an MLA latent, one entry per token, has none; a DeepSeek-V4
                                 # compressed group keeps its tail in a group of its own)
    checkpoint: bool = False
    closes_into: str | None = None
    partial: bool = False        # a prefix may end inside one of its blocks (BlockGeometry.resume)
    entry: int = 1               # tokens per entry of a partial group (a compressed group: its rate)

    @property
    def needs_tail(self) -> bool:
        return self.kind is Kind.COMPRESSED_KV and self.tail is not False

    @property
    def is_checkpoint(self) -> bool:
        """Whether the group stores one whole per-row state at each boundary (not blocks of tokens)."""
        return self.checkpoint or self.kind in CHECKPOINT_KINDS

    def __post_init__(self):
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"group {self.name!r}: kind {self.kind} is not a group kind {[k.value for k in GROUP_KINDS]}")
        if self.block_size <= 0:
            raise ValueError(f"group {self.name!r}: block_size must be positive, got {self.block_size}")
        if self.kind is Kind.SWA_WINDOW and self.window <= 0 and not self.checkpoint:
            raise ValueError(f"group {self.name!r}: an SWA group of blocks needs window > 0, got {self.window}")
        if self.checkpoint and self.kind not in CHECKPOINT_KINDS | {Kind.SWA_WINDOW}:
            raise ValueError(f"group {self.name!r}: a {self.kind.value} group cannot be stored as checkpoints")
        if self.partial and (self.is_checkpoint or self.kind is Kind.SWA_WINDOW or self.needs_tail):
            raise ValueError(f"group {self.name!r}: only a group of per-token blocks can be resumed inside a block")
        if self.closes_into is not None and self.kind is not Kind.UNCOMPRESSED_TAIL:
            raise ValueError(f"group {self.name!r}: only an uncompressed tail closes into entries; got {self.kind.value}")


@dataclasses.dataclass(frozen=True)
class HitResult:
    """ok: usable; boundary: tokens reusable (0 on a miss); segments: group -> segment ids to read;
    versions: seg id -> version at check; reason / detail / group: why not (None when ok);
    hashed: tokens the first-level hash signal covered; matched: tokens every group of blocks holds
    contiguously from 0 (how far the prompt runs along cached sequences: where it branches off them,
    to the block; 0 when the model has no such group)."""
    ok: bool
    boundary: int = 0
    segments: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    versions: Mapping[int, int] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    reason: str | None = None
    detail: str = ""
    group: str | None = None
    hashed: int = 0
    matched: int = 0


    @property
    def hash_hit(self) -> bool:
        return self.reason != "no_hit"


def _miss(reason: str, detail: str, hashed: int, group: str | None = None, matched: int = 0) -> HitResult:
    return HitResult(ok=False, reason=reason, detail=detail, group=group, hashed=hashed, matched=matched)


def _entries(spec: GroupSpec, keys: Sequence[str], geo: BlockGeometry, index: PrefixIndex, limit: int):
    """{(kind, boundary): IndexEntry} found for the group at its boundaries <= limit."""
    out: dict[tuple[Kind, int], IndexEntry] = {}
    kinds = [spec.kind] + ([Kind.UNCOMPRESSED_TAIL] if spec.needs_tail else [])
    for kind in kinds:
        step = (geo.resume if spec.is_checkpoint or kind is Kind.UNCOMPRESSED_TAIL
                else geo.gcd if spec.partial else spec.block_size)
        for b in range(step, limit + 1, step):
            e = index.find(spec.name, kind, key_at(keys, geo.gcd, b))
            if e is not None:
                out[(kind, b)] = e
    return out


def _hashed_len(spec: GroupSpec, found, geo: BlockGeometry) -> int:
    """Tokens of the group's first-level hit: the contiguous run of blocks from 0 (block kinds; a
    partial group's run goes on through a block's interior points), or the furthest checkpoint
    (checkpoint groups) or window block (SWA)."""
    if spec.is_checkpoint or spec.kind is Kind.SWA_WINDOW:   # old SWA blocks may be gone by design
        return max((b for (k, b) in found if k is spec.kind), default=0)
    step = geo.gcd if spec.partial else spec.block_size
    b = 0
    while (spec.kind, b + step) in found:
        b += step
    return b


def _needed(spec: GroupSpec, boundary: int, geo: BlockGeometry) -> list[tuple[Kind, int]]:
    """(kind, block end) of every object the group must have to resume at `boundary`."""
    bs = spec.block_size
    if spec.is_checkpoint:
        return [(spec.kind, boundary)]
    if spec.kind is Kind.SWA_WINDOW:
        return [(spec.kind, b) for b in range(bs, boundary + 1, bs) if b > boundary - spec.window]
    if spec.partial:       # entries up to the last whole one: whole blocks, then the block it ends inside
        entries_end = boundary - boundary % spec.entry
        need = [(spec.kind, b) for b in range(bs, entries_end + 1, bs)]
        if entries_end % bs:
            need.append((spec.kind, entries_end))
        return need
    need = [(spec.kind, b) for b in range(bs, boundary + 1, bs)]
    if spec.needs_tail:
        need.append((Kind.UNCOMPRESSED_TAIL, boundary))
    return need


def _what(kind: Kind, b: int, geo: BlockGeometry, spec: GroupSpec) -> str:
    if spec.is_checkpoint or kind is Kind.UNCOMPRESSED_TAIL:
        return f"its {kind.value} checkpoint at {b}"
    return f"its {kind.value} block ending at {b}"


def _check_writers(groups: Sequence[GroupSpec], found: dict, state: AllocState, top: int, hashed: int,
                   matched: int) -> HitResult | None:
    """Check 2: the miss of the first object up to `top` written by another ABI or mesh layout than the
    reader's, or None."""
    for g in groups:
        for (kind, b), e in sorted(found[g.name].items(), key=lambda kv: kv[0][1]):
            seg = state.segments.get(e.seg_id)
            if b <= top and seg is not None and seg.writer_abi != g.ctx.abi_id:
                return _miss("abi_mismatch", f"group {g.name!r}: {seg.describe()} was written by ABI"
                                             f" {seg.writer_abi!r}, reader uses {g.ctx.abi_id!r}", hashed, g.name,
                             matched)
            if b <= top and seg is not None and seg.writer_layout != g.ctx.sharding:
                return _miss("sharding", f"group {g.name!r}: {seg.describe()} was written in layout"
                                         f" {seg.writer_layout!r}, reader uses {g.ctx.sharding!r}", hashed, g.name,
                             matched)
    return None


def check_hit(tokens: Sequence[int], groups: Sequence[GroupSpec], index: PrefixIndex, state: AllocState, *,
              need_logits: bool = True, servable: frozenset[SegState] = SERVABLE_STATES) -> HitResult:
    """Checks 1-4 against the allocator state at check time. tokens: the request's prompt ids;
    servable: the states a chosen object may be in (a cache without lower tiers: the device only)."""
    if not groups:
        raise ValueError("check_hit needs at least one group")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"group names must be unique, got {names}")
    geo = block_geometry({g.name: g.block_size for g in groups}, partial=[g.name for g in groups if g.partial])
    limit = max(len(tokens) - 1 if need_logits else len(tokens), 0)
    found = {}
    for g in groups:
        keys = chain_keys(tokens, geo.gcd, g.ctx)
        found[g.name] = _entries(g, keys, geo, index, (len(keys) * geo.gcd))
    hashed = max(_hashed_len(g, found[g.name], geo) for g in groups)
    if hashed == 0:
        return _miss("no_hit", "no group has a cached first block for this prompt", 0)
    blocks = [_hashed_len(g, found[g.name], geo) for g in groups
              if not g.is_checkpoint and g.kind is not Kind.SWA_WINDOW]
    matched = min(blocks, default=0)
    # 1. whole-block coverage on the resume grid
    top = (min(hashed, limit) // geo.resume) * geo.resume
    if top == 0:
        return _miss("coverage", f"hashed hit of {hashed} tokens (usable {min(hashed, limit)}) covers no whole"
                                 f" block of the {geo.resume}-token resume grid", hashed, matched=matched)
    # 2. ABI and mesh layout of the writer == the reader's, for every object the hit would draw on
    refused = _check_writers(groups, found, state, top, hashed, matched)
    if refused is not None:
        return refused
    # 3. multi-group intersection: the longest boundary every group can resume from
    def lacking(g: GroupSpec, boundary: int) -> str | None:
        """Why the group cannot resume at `boundary` (None: it can)."""
        for kind, b in _needed(g, boundary, geo):
            e = found[g.name].get((kind, b))
            st = SegState.FREE if e is None else state.state_of(e.seg_id)
            if st is SegState.FREE:
                return f"{_what(kind, b, geo, g)} is {'missing' if e is None else 'freed'}"
            if st in SERVABLE_STATES and st not in servable:     # on a tier the caller cannot read
                return f"{_what(kind, b, geo, g)} is {st.value}, not resident"
        return None

    boundary, blocker, why = 0, None, ""
    for cand in range(top, 0, -geo.resume):
        bad = [(g.name, w) for g in groups if (w := lacking(g, cand)) is not None]
        if not bad:
            boundary = cand
            break
        if blocker is None:
            blocker, why = bad[0]
    if boundary == 0:
        return _miss("intersection", f"no boundary <= {top} that every group can resume from; group"
                                     f" {blocker!r} cannot resume at {top}: {why}", hashed, blocker, matched)
    # 4. alignment and residency of the chosen segments
    segs: dict[str, tuple[int, ...]] = {}
    versions: dict[int, int] = {}
    for g in groups:
        if boundary % g.block_size and not g.partial:
            return _miss("alignment", f"boundary {boundary} is not a multiple of group {g.name!r}'s block size"
                                      f" {g.block_size}", hashed, g.name, matched)
        ids: list[int] = []
        for kind, b in _needed(g, boundary, geo):
            seg = state.get(found[g.name][(kind, b)].seg_id)
            exact = g.is_checkpoint or kind is Kind.UNCOMPRESSED_TAIL
            inside = g.partial and b % g.block_size      # a stored block the prefix ends inside
            covers = ((seg.end == b) if exact
                      else (seg.start == b - b % g.block_size and seg.end >= b) if inside
                      else (seg.start <= b - g.block_size and seg.end >= b and seg.start % g.block_size == 0))
            if not covers:
                return _miss("alignment", f"group {g.name!r}: {seg.describe()} does not line up with the block"
                                          f" ending at {b}", hashed, g.name, matched)
            if seg.state not in servable:
                return _miss("alignment", f"group {g.name!r}: {seg.describe()} is {seg.state.value}, neither on"
                                          f" the device nor restorable", hashed, g.name, matched)
            if seg.id not in versions:
                ids.append(seg.id)
                versions[seg.id] = seg.version
        segs[g.name] = tuple(ids)
    return HitResult(ok=True, boundary=boundary, segments=types.MappingProxyType(segs),
                     versions=types.MappingProxyType(versions), hashed=hashed, matched=matched)


def confirm_at_use(hit: HitResult, state: AllocState) -> HitResult:
    """Check 5: every segment of a checked hit is still live, servable and at its checked version."""
    if not hit.ok:
        return hit
    for group, ids in hit.segments.items():
        for sid in ids:
            seg = state.segments.get(sid)
            if seg is None or seg.state not in SERVABLE_STATES or seg.version != hit.versions[sid]:
                now = "freed" if seg is None else f"{seg.state.value} v{seg.version}"
                return _miss("version", f"group {group!r}: segment {sid} was v{hit.versions[sid]} at check,"
                                        f" is {now} at use", hit.hashed, group, hit.matched)
    return hit


def validate_hit(tokens: Sequence[int], groups: Sequence[GroupSpec], index: PrefixIndex, state_at_check: AllocState,
                 state_at_use: AllocState | None = None, *, need_logits: bool = True) -> HitResult:
    """All five checks in order; state_at_use defaults to state_at_check (no time between them)."""
    hit = check_hit(tokens, groups, index, state_at_check, need_logits=need_logits)
    return confirm_at_use(hit, state_at_check if state_at_use is None else state_at_use)


def _inc(m: Mapping, k, n: int = 1) -> Mapping:
    d = dict(m)
    d[k] = d.get(k, 0) + n
    return types.MappingProxyType(d)


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Immutable counters; `record` and `with_bytes` return updated copies."""
    lookups: int = 0
    hits: int = 0
    passes: int = 0
    tokens_reused: int = 0
    misses_by_reason: Mapping[str, int] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    misses_by_group: Mapping[tuple[str, str], int] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    bytes_by_kind: Mapping[Kind, int] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    bytes_by_group: Mapping[str, int] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    def record(self, hit: HitResult) -> "CacheStats":
        """Counts one lookup's outcome."""
        s = dataclasses.replace(self, lookups=self.lookups + 1, hits=self.hits + int(hit.hash_hit))
        if hit.ok:
            return dataclasses.replace(s, passes=s.passes + 1, tokens_reused=s.tokens_reused + hit.boundary)
        s = dataclasses.replace(s, misses_by_reason=_inc(s.misses_by_reason, hit.reason))
        if hit.group is not None:
            s = dataclasses.replace(s, misses_by_group=_inc(s.misses_by_group, (hit.group, hit.reason)))
        return s

    def with_bytes(self, state: AllocState) -> "CacheStats":
        """A copy with the device-resident bytes per kind and per group read off `state`."""
        return dataclasses.replace(self, bytes_by_kind=types.MappingProxyType(bytes_by_kind(state)),
                                   bytes_by_group=types.MappingProxyType(bytes_by_group(state)))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def validation_pass_rate(self) -> float:
        return self.passes / self.hits if self.hits else 0.0

    @property
    def effective_reuse(self) -> float:
        return self.hit_rate * self.validation_pass_rate
