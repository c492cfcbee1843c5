"""Random walks over the cache: nothing freed, stale or unchecked is ever served, and the caps hold.

A hypothesis RuleBasedStateMachine drives the allocator, the prefix index and hit validation through
random sequences of store / lookup (with and without a concurrent version bump between check and
use) / extend / rollback / evict / offload (DEVICE -> HOST -> DISK) / restore / release, under a
tight weighted byte cap, on two models: a three-group hybrid (full attention, SWA blocks, recurrent
checkpoints) and DeepSeek-V4's five objects (paged compressed entries, indexer entries, and the
per-boundary checkpoints of the uncompressed tail, the CSA overlap state and the sliding-window
ring), where a tail checkpoint may also leave by the named `close_tail` event once the entry block
its window closed into is stored.
"""
from __future__ import annotations

import collections

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from cache import segment_allocator as A
from cache.prefix_index import IndexEntry, KeyContext, PrefixIndex, block_geometry, chain_keys, checkpoint_boundaries, key_at
from cache.segments import SERVABLE_STATES, Kind, SegState
from cache.validation import CacheStats, GroupSpec, check_hit, confirm_at_use

GROUPS = (GroupSpec("attn", Kind.FULL_KV, 4, KeyContext("w", "bf16", "attn/v1")),
          GroupSpec("swa", Kind.SWA_WINDOW, 4, KeyContext("w", "bf16", "swa/v1"), window=8),
          GroupSpec("lin", Kind.RECURRENT_STATE, 8, KeyContext("w", "f32", "gdn/v1")))
_V4 = KeyContext("w", "bf16", "v4/v1")
V4_GROUPS = (GroupSpec("ent", Kind.COMPRESSED_KV, 8, _V4, tail=False), GroupSpec("idx", Kind.INDEXER_KEYS, 8, _V4),
             GroupSpec("tail", Kind.UNCOMPRESSED_TAIL, 4, _V4, closes_into="ent"),
             GroupSpec("ovl", Kind.CSA_OVERLAP, 4, _V4), GroupSpec("win", Kind.SWA_WINDOW, 4, _V4, checkpoint=True))
GEO = block_geometry({g.name: g.block_size for g in GROUPS})
assert block_geometry({g.name: g.block_size for g in V4_GROUPS}).lcm == GEO.lcm == 8
BASES = (tuple(range(1, 41)), tuple(range(1, 17)) + tuple(range(500, 524)), tuple(range(900, 940)))
NBYTES = {Kind.FULL_KV: 16, Kind.SWA_WINDOW: 16, Kind.RECURRENT_STATE: 40, Kind.COMPRESSED_KV: 12,
          Kind.INDEXER_KEYS: 8, Kind.UNCOMPRESSED_TAIL: 20, Kind.CSA_OVERLAP: 12}
WEIGHTS = {**A.DEFAULT_WEIGHTS, Kind.RECURRENT_STATE: 1.5, Kind.UNCOMPRESSED_TAIL: 1.25}
CAP = 1200
MIN_STEPS = 10_000
SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None, derandomize=True)


class CacheMachine(RuleBasedStateMachine):
    step_counter: list = [0]
    close_counter: list = [0]                          # close_tail events over all runs
    groups: tuple = GROUPS

    def __init__(self):
        super().__init__()
        self.alloc = A.init_state(A.AllocConfig(cap_bytes=CAP, weights=WEIGHTS))
        self.index = PrefixIndex()
        self.held: list[tuple[int, ...]] = []          # segment ids of each served hit still in use
        self.stats = CacheStats()
        self.stored: list[int] = []                    # bases stored so far (lookups favour them)
        self.written: dict[int, tuple[int, ...]] = {}  # segment id -> the token prefix it was written for

    # -- helpers ------------------------------------------------------------------------------------
    def _pick(self, i, pred):
        segs = sorted((s for s in self.alloc.segments.values() if pred(s)), key=lambda s: s.id)
        return segs[i % len(segs)] if segs else None

    def _holds(self) -> collections.Counter:
        return collections.Counter(sid for ids in self.held for sid in ids)

    # -- rules --------------------------------------------------------------------------------------
    @rule(base=st.integers(0, len(BASES) - 1), upto=st.integers(1, 40), wrong_abi=st.integers(0, 9),
          interval=st.sampled_from([1, 2]))
    def store(self, base, upto, wrong_abi, interval):
        tokens = BASES[base]
        self.stored.append(base)
        for g in self.groups:
            keys = chain_keys(tokens, GEO.gcd, g.ctx)
            if g.is_checkpoint:
                items = [(b, b) for b in checkpoint_boundaries(upto, GEO.lcm, interval)]
            else:
                items = [(b - g.block_size, b) for b in range(g.block_size, upto + 1, g.block_size)]
            for start, end in items:
                key = key_at(keys, GEO.gcd, end)
                e = self.index.find(g.name, g.kind, key)
                if e is not None and self.alloc.state_of(e.seg_id) is not SegState.FREE:
                    continue
                abi = "old/v0" if wrong_abi == 0 and end == items[-1][1] else g.ctx.abi_id
                try:
                    state, sid = A.allocate(self.alloc, g.kind, g.name, NBYTES[g.kind], start=start, end=end,
                                            writer_abi=abi)
                except A.AdmissionRefused:
                    return
                self.alloc = A.commit(state, sid)
                self.written[sid] = tokens[:end]
                self.index = self.index.insert(IndexEntry(g.name, g.kind, key, end, sid))

    @rule(base=st.integers(0, len(BASES) - 1), length=st.integers(6, 40), race=st.booleans(), pick=st.integers(0, 99),
          seen=st.booleans())
    def lookup(self, base, length, race, pick, seen):
        if seen and self.stored:
            base = self.stored[pick % len(self.stored)]
        tokens = BASES[base][:length]
        checked = self.alloc
        hit = check_hit(tokens, self.groups, self.index, checked)
        raced = False
        if race and hit.ok:
            ids = sorted(hit.versions)
            sid = ids[pick % len(ids)]
            seg = self.alloc.get(sid)
            if seg.ref_count == 0 and seg.state is SegState.DEVICE:
                self.alloc = A.commit(A.transition(self.alloc, sid, SegState.WRITING), sid)   # concurrent overwrite
                raced = True
            elif seg.ref_count == 0:
                self.alloc = A.evict(self.alloc, sid)                                        # concurrent eviction
                raced = True
        hit = confirm_at_use(hit, self.alloc)
        self.stats = self.stats.record(hit)
        if raced:
            assert not hit.ok and hit.reason == "version", hit
        if not hit.ok:
            assert hit.reason in ("no_hit", "coverage", "abi_mismatch", "intersection", "alignment", "version")
            return
        # serve: every segment passed every check; it is live, servable and at its checked version
        assert hit.reason is None and 0 < hit.boundary < len(tokens) and hit.boundary % GEO.lcm == 0
        ids = tuple(sid for g in self.groups for sid in hit.segments[g.name])
        assert set(ids) == set(hit.versions)
        for sid in ids:
            seg = self.alloc.segments.get(sid)
            assert seg is not None and seg.state in SERVABLE_STATES, f"served a freed segment {sid}"
            assert seg.version == hit.versions[sid], f"served stale segment {sid}"
            assert seg.version == checked.get(sid).version
            assert seg.writer_abi == {g.name: g.ctx.abi_id for g in self.groups}[seg.group]
            assert self.written[sid] == tokens[:seg.end], "served a segment written for other tokens"
        # an oracle independent of validation: what each group must read to resume at the boundary
        rng = {g.name: sorted((self.alloc.get(i).start, self.alloc.get(i).end) for i in hit.segments[g.name])
               for g in self.groups}
        b = hit.boundary
        for g in self.groups:
            if g.is_checkpoint:
                assert rng[g.name] == [(b, b)], g.name
            elif g.kind is Kind.SWA_WINDOW:
                assert rng[g.name] == [(e - 4, e) for e in range(4, b + 1, 4) if e > b - 8]
            else:
                bs = g.block_size
                assert rng[g.name] == [(e - bs, e) for e in range(bs, b + 1, bs)], g.name
        state = self.alloc
        for sid in ids:
            state = A.retain(state, sid)
        try:
            for sid in ids:                               # bring host / disk segments back before the read
                if state.get(sid).state is SegState.DISK:
                    state = A.transition(state, sid, SegState.HOST)
                if state.get(sid).state is SegState.HOST:
                    state = A.transition(state, sid, SegState.DEVICE)
        except A.AdmissionRefused:
            for sid in ids:
                self.alloc = A.release(A.retain(self.alloc, sid), sid)   # nothing held, nothing changed
            return
        assert all(state.get(sid).state is SegState.DEVICE for sid in ids)
        self.alloc = state
        self.held.append(ids)

    @rule(i=st.integers(0, 99))
    def release(self, i):
        if self.held:
            ids = self.held.pop(i % len(self.held))
            for sid in ids:
                self.alloc = A.release(self.alloc, sid)

    @rule(i=st.integers(0, 99))
    def extend(self, i):
        seg = self._pick(i, lambda s: s.state is SegState.DEVICE and s.ref_count == 0)
        if seg is not None:
            state = A.transition(self.alloc, seg.id, SegState.WRITING)
            self.alloc = A.commit(state, seg.id)
            assert self.alloc.get(seg.id).version == seg.version + 1

    @rule(i=st.integers(0, 99))
    def rollback(self, i):
        seg = self._pick(i, lambda s: s.state is SegState.DEVICE and s.ref_count == 0)
        if seg is not None:
            self.alloc = A.rollback(self.alloc, seg.id, seg.end)

    @rule(i=st.integers(0, 99), drop_entry=st.booleans())
    def evict(self, i, drop_entry):
        seg = self._pick(i, lambda s: s.state is not SegState.WRITING and s.ref_count == 0)
        if seg is not None:
            self.alloc = A.evict(self.alloc, seg.id)
            if drop_entry:                                 # otherwise leave a dangling index entry
                self.index = self.index.remove_segment(seg.id)

    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def close_tail(self, i, j):
        """A tail checkpoint superseded by the entry block its window closed into (a V4 publish that
        extends the chain); a block that does not hold that entry is refused and changes nothing."""
        tail = self._pick(i, lambda s: s.kind is Kind.UNCOMPRESSED_TAIL and s.state is SegState.DEVICE
                          and s.ref_count == 0)
        if tail is None:
            return
        closes_into = {g.name: g.closes_into for g in self.groups}[tail.group]
        entry = self._pick(j, lambda s: s.group == closes_into and s.state is SegState.DEVICE)
        if entry is None:
            return
        if not entry.start <= tail.end < entry.end:
            with pytest.raises(A.IllegalTransition, match="does not hold the entry"):
                A.close_tail(self.alloc, tail.id, entry.id)
            return
        before = self.alloc
        self.alloc = A.close_tail(self.alloc, tail.id, entry.id)
        assert A.evicted_ids(before, self.alloc) == (tail.id,)
        self.close_counter[0] += 1

    @rule(i=st.integers(0, 99))
    def offload(self, i):
        seg = self._pick(i, lambda s: s.state in (SegState.DEVICE, SegState.HOST))
        if seg is not None:
            to = SegState.HOST if seg.state is SegState.DEVICE else SegState.DISK
            self.alloc = A.transition(self.alloc, seg.id, to)
            assert self.alloc.get(seg.id).version == seg.version

    @rule(i=st.integers(0, 99))
    def restore(self, i):
        seg = self._pick(i, lambda s: s.state in (SegState.HOST, SegState.DISK))
        if seg is not None:
            to = SegState.HOST if seg.state is SegState.DISK else SegState.DEVICE
            try:
                self.alloc = A.transition(self.alloc, seg.id, to)
            except A.AdmissionRefused:
                pass

    # -- invariants ---------------------------------------------------------------------------------
    @invariant()
    def caps_and_counts(self):
        self.step_counter[0] += 1
        assert self.alloc.device_weighted_bytes <= CAP
        # the per-kind device totals the allocator keeps equal a recount of its segments
        recount = {}
        for seg in self.alloc.segments.values():
            if seg.state in (SegState.WRITING, SegState.DEVICE):
                recount[seg.kind] = recount.get(seg.kind, 0) + seg.nbytes
        assert {k: n for k, n in self.alloc.device_bytes.items() if n} == recount
        holds = self._holds()
        for seg in self.alloc.segments.values():
            assert seg.ref_count >= 0
            assert seg.state is not SegState.FREE
            assert seg.ref_count == holds.get(seg.id, 0)
        for sid in holds:
            assert sid in self.alloc.segments, f"a held segment {sid} was freed"
        assert self.stats.passes <= self.stats.hits <= self.stats.lookups


@pytest.mark.parametrize("groups", [GROUPS, V4_GROUPS], ids=["hybrid", "deepseek_v4"])
def test_random_walks_never_serve_bad_cache(groups):
    counter, closes = [0], [0]
    machine = type("Machine", (CacheMachine,), {"step_counter": counter, "close_counter": closes, "groups": groups})
    run_state_machine_as_test(machine, settings=SETTINGS)
    # invariants run once after init and once per step
    assert counter[0] >= MIN_STEPS, f"only {counter[0]} checks ran"
    if groups is V4_GROUPS:
        assert closes[0] >= 50, f"only {closes[0]} close_tail events"
