"""Segment states: the one transition table, version bumps, and errors that name both states."""
from __future__ import annotations

import dataclasses

import pytest

from cache.segments import (CHECKPOINT_KINDS, EVENTS, TRANSITIONS, VERSION_BUMPING, IllegalTransition, Kind,
                            SegState, Segment, bump_version, close_tail, transition)

S = SegState


def _seg(state=S.FREE, **kw):
    return Segment(id=7, kind=Kind.FULL_KV, group="attn", state=state, start=0, end=16, nbytes=64, **kw)


def test_every_state_is_reachable_and_can_be_freed():
    targets = {t for (_, t) in TRANSITIONS}
    assert targets == set(SegState)
    for s in (S.WRITING, S.DEVICE, S.HOST, S.DISK):
        assert (s, S.FREE) in TRANSITIONS


def test_lifecycle_and_versions():
    seg = transition(_seg(), S.WRITING)
    assert seg.version == 0
    seg = transition(seg, S.DEVICE)            # write commits: version changes
    assert seg.version == 1
    for to in (S.HOST, S.DISK, S.HOST, S.DEVICE):   # offload / restore copy bytes, version stays
        seg = transition(seg, to)
        assert seg.version == 1
    seg = transition(transition(seg, S.WRITING), S.DEVICE)   # overwrite
    assert seg.version == 2
    seg = bump_version(seg, end=8)             # rollback
    assert (seg.version, seg.end) == (3, 8)
    assert transition(seg, S.FREE).version == 4


@pytest.mark.parametrize("frm,to", [(f, t) for f in SegState for t in SegState if (f, t) not in TRANSITIONS])
def test_illegal_transitions_name_both_states(frm, to):
    with pytest.raises(IllegalTransition) as e:
        transition(_seg(frm), to)
    msg = str(e.value)
    assert f"{frm.value} -> {to.value}" in msg and "segment 7" in msg
    assert isinstance(e.value, ValueError)


def test_version_bumping_moves_are_legal_moves():
    assert VERSION_BUMPING <= set(TRANSITIONS)


def test_held_segment_cannot_be_freed_or_overwritten():
    seg = _seg(S.DEVICE, ref_count=1)
    for to in (S.FREE, S.WRITING):
        with pytest.raises(IllegalTransition, match="held by 1"):
            transition(seg, to)
    with pytest.raises(IllegalTransition, match="held"):
        bump_version(seg)
    assert transition(seg, S.HOST).ref_count == 1    # offloading a held segment is fine


def test_rollback_rules():
    with pytest.raises(IllegalTransition, match="host"):
        bump_version(_seg(S.HOST))
    with pytest.raises(ValueError, match="must lie in"):
        bump_version(_seg(S.DEVICE), end=20)


def test_bad_segments_rejected():
    with pytest.raises(ValueError, match="not a range"):
        Segment(id=1, kind=Kind.FULL_KV, group="g", state=S.FREE, start=5, end=3)
    with pytest.raises(ValueError, match="negative"):
        Segment(id=1, kind=Kind.FULL_KV, group="g", state=S.FREE, start=0, end=3, ref_count=-1)
    with pytest.raises(TypeError, match="Kind"):
        Segment(id=1, kind="full_kv", group="g", state=S.FREE, start=0, end=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        _seg().version = 3


def test_close_tail_is_a_named_event_between_a_tail_and_its_entry_block():
    """The tail checkpoint at 32 is superseded by a committed entry block holding token 32 ([32, 64));
    the event is a legal table move that bumps the version; anything else is refused, naming both."""
    assert all((f, t) in TRANSITIONS for _, f, t in EVENTS.values())
    assert {Kind.UNCOMPRESSED_TAIL, Kind.CSA_OVERLAP, Kind.RECURRENT_STATE} <= CHECKPOINT_KINDS
    tail = Segment(id=1, kind=Kind.UNCOMPRESSED_TAIL, group="t", state=S.DEVICE, start=0, end=32, version=1)
    entry = Segment(id=2, kind=Kind.COMPRESSED_KV, group="e", state=S.DEVICE, start=32, end=64)
    gone = close_tail(tail, entry)
    assert (gone.state, gone.version) == (S.FREE, 2)
    assert close_tail(tail, dataclasses.replace(entry, kind=Kind.INDEXER_KEYS)).state is S.FREE
    with pytest.raises(IllegalTransition, match="does not hold the entry"):
        close_tail(tail, dataclasses.replace(entry, start=0, end=32))
    with pytest.raises(IllegalTransition, match="not a committed entry block"):
        close_tail(tail, dataclasses.replace(entry, state=S.WRITING))
    with pytest.raises(IllegalTransition, match="not a committed entry block"):
        close_tail(tail, dataclasses.replace(entry, kind=Kind.FULL_KV))
    with pytest.raises(IllegalTransition, match="needs a uncompressed_tail segment in state device"):
        close_tail(dataclasses.replace(tail, kind=Kind.CSA_OVERLAP), entry)
    with pytest.raises(IllegalTransition, match="held"):
        close_tail(dataclasses.replace(tail, ref_count=1), entry)
