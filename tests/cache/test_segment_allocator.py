"""The pure-functional segment allocator (cache.segment_allocator): immutability, the weighted byte cap, eviction order, ref counts."""
from __future__ import annotations

import pytest

from cache import segment_allocator as A
from cache.segments import IllegalTransition, Kind, SegState

S = SegState


def _live(state, kind=Kind.FULL_KV, nbytes=10, group="g", abi="abi/v1"):
    state, sid = A.allocate(state, kind, group, nbytes, start=0, end=4, writer_abi=abi)
    return A.commit(state, sid), sid


def test_operations_return_new_states_and_leave_old_ones():
    s0 = A.init_state(A.AllocConfig(cap_bytes=100))
    s1, sid = A.allocate(s0, Kind.FULL_KV, "g", 10, start=0, end=4, writer_abi="x")
    assert len(s0.segments) == 0 and s1.get(sid).state is S.WRITING
    s2 = A.commit(s1, sid)
    assert s1.get(sid).version == 0 and s2.get(sid).version == 1 and s2.get(sid).state is S.DEVICE
    with pytest.raises(TypeError):
        s2.segments[sid] = None


def test_weighted_cap_and_refusal():
    w = dict(A.DEFAULT_WEIGHTS)
    w[Kind.RECURRENT_STATE] = 2.0
    s = A.init_state(A.AllocConfig(cap_bytes=100, weights=w))
    s, a = _live(s, Kind.RECURRENT_STATE, 30)          # weighs 60
    s = A.retain(s, a)
    s, b = _live(s, Kind.FULL_KV, 40)                  # 100 in all
    assert s.device_weighted_bytes == 100
    s2, c = _live(s, Kind.FULL_KV, 30)                 # evicts b (a is held)
    assert s2.state_of(b) is S.FREE and s2.state_of(a) is S.DEVICE and s2.device_weighted_bytes == 90
    assert A.evicted_ids(s, s2) == (b,)
    with pytest.raises(A.AdmissionRefused, match="cannot admit .* evictable"):
        A.allocate(s, Kind.FULL_KV, "g", 50, start=0, end=4, writer_abi="x")
    # refusal evicted nothing
    assert s.state_of(b) is S.DEVICE


def test_eviction_order_by_kind_then_lru():
    s = A.init_state(A.AllocConfig(cap_bytes=1000))
    ids = {}
    for kind in (Kind.RECURRENT_STATE, Kind.UNCOMPRESSED_TAIL, Kind.COMPRESSED_KV, Kind.FULL_KV, Kind.SWA_WINDOW,
                 Kind.INDEXER_KEYS):
        s, ids[kind] = _live(s, kind)
    s, newer_kv = _live(s, Kind.FULL_KV)
    s = A.touch(s, ids[Kind.FULL_KV])                  # now the older full-KV block is the most recent
    order = [seg.id for seg in A.eviction_order(s)]
    assert order[:3] == [ids[Kind.SWA_WINDOW], newer_kv, ids[Kind.FULL_KV]]
    assert order[3] == ids[Kind.COMPRESSED_KV]
    assert order[-1] == ids[Kind.RECURRENT_STATE]
    assert set(A.EVICTION_PRIORITY) == set(Kind)
    assert all(reason for _, reason in A.EVICTION_PRIORITY.values())


def test_hits_earn_retention_that_ages_out():
    """A checkpoint that served hits outlives checkpoints published after it that served none, for
    HIT_CREDIT_TICKS clock ticks per segment in the store per hit (at most HIT_CREDIT_CAP hits), then
    LRU takes it like any other."""
    s = A.init_state(A.AllocConfig(cap_bytes=10_000))
    s, hot = _live(s, Kind.RECURRENT_STATE)
    s = A.touch_many(s, [hot], hit=True)
    s = A.touch_many(s, [hot], hit=True)
    assert s.get(hot).hits == 2
    cold = []
    for _ in range(5):
        s, c = _live(s, Kind.RECURRENT_STATE)
        cold.append(c)
    order = [x.id for x in A.eviction_order(s)]
    assert order == cold + [hot]            # plain LRU would have taken `hot` first
    # the store turns over several times and nobody reads `hot` again: objects published since then
    # outlive it
    for _ in range(2 * A.HIT_CREDIT_TICKS * (len(s.segments) + 4) + 1):      # 4: the new ones below
        s = A.touch(s, cold[0])
    new = []
    for _ in range(4):
        s, c = _live(s, Kind.RECURRENT_STATE)
        new.append(c)
    order = [x.id for x in A.eviction_order(s)]
    assert order.index(hot) < min(order.index(c) for c in new)


def test_held_and_writing_never_evicted():
    s = A.init_state(A.AllocConfig(cap_bytes=30))
    s, a = _live(s)
    s = A.retain(s, a)
    s, w = A.allocate(s, Kind.FULL_KV, "g", 10, start=0, end=4, writer_abi="x")   # WRITING
    assert [x.id for x in A.eviction_order(s)] == []
    with pytest.raises(A.AdmissionRefused):
        A.allocate(s, Kind.FULL_KV, "g", 20, start=0, end=4, writer_abi="x")
    with pytest.raises(IllegalTransition, match="held"):
        A.evict(s, a)
    with pytest.raises(IllegalTransition, match="writing -> free|writing"):
        A.retain(s, w)


def test_ref_counts_never_negative():
    s = A.init_state(A.AllocConfig(cap_bytes=100))
    s, a = _live(s)
    s = A.release(A.retain(s, a), a)
    with pytest.raises(ValueError, match="negative"):
        A.release(s, a)


def test_offload_restore_and_host_bytes_do_not_count():
    s = A.init_state(A.AllocConfig(cap_bytes=20))
    s, a = _live(s, nbytes=20)
    s = A.transition(A.transition(s, a, S.HOST), a, S.DISK)
    assert s.device_weighted_bytes == 0
    s, b = _live(s, nbytes=20)
    s = A.transition(s, a, S.HOST)
    s = A.transition(s, a, S.DEVICE)                   # restore evicts b to fit
    assert s.state_of(b) is S.FREE and s.get(a).state is S.DEVICE and s.get(a).version == 1
    s = A.retain(s, a)
    s = A.transition(s, a, S.HOST)
    s, c = _live(s, nbytes=20)
    s = A.retain(s, c)
    with pytest.raises(A.AdmissionRefused, match="restore"):
        A.transition(s, a, S.DEVICE)


def test_commit_growth_rollback_and_bytes():
    s = A.init_state(A.AllocConfig(cap_bytes=100))
    s, a = _live(s, Kind.FULL_KV, 10, group="attn")
    s = A.transition(s, a, S.WRITING)
    s = A.commit(s, a, end=8, nbytes=20)
    seg = s.get(a)
    assert (seg.end, seg.nbytes, seg.version) == (8, 20, 2)
    s = A.rollback(s, a, 4)
    assert (s.get(a).end, s.get(a).version) == (4, 3)
    s, b = _live(s, Kind.RECURRENT_STATE, 5, group="lin")
    assert A.bytes_by_kind(s)[Kind.FULL_KV] == 20 and A.bytes_by_kind(s)[Kind.RECURRENT_STATE] == 5
    assert A.bytes_by_group(s) == {"attn": 20, "lin": 5}
    s = A.evict(s, b)
    with pytest.raises(A.UnknownSegment, match=str(b)):
        s.get(b)
    assert s.state_of(b) is S.FREE


def test_bad_config():
    with pytest.raises(ValueError, match="cap_bytes"):
        A.AllocConfig(cap_bytes=0)
    with pytest.raises(ValueError, match="lack kinds"):
        A.AllocConfig(cap_bytes=10, weights={Kind.FULL_KV: 1.0})
    with pytest.raises(ValueError, match="> 0"):
        A.AllocConfig(cap_bytes=10, weights={**A.DEFAULT_WEIGHTS, Kind.FULL_KV: 0.0})


def test_every_kind_has_an_eviction_priority_and_close_tail_respects_holds():
    assert set(A.EVICTION_PRIORITY) == set(Kind)
    s = A.init_state(A.AllocConfig(cap_bytes=1000))
    s, tail = A.allocate(s, Kind.UNCOMPRESSED_TAIL, "t", 10, start=0, end=8, writer_abi="x")
    s, entry = A.allocate(s, Kind.COMPRESSED_KV, "e", 10, start=8, end=16, writer_abi="x")
    s = A.commit(A.commit(s, tail), entry)
    with pytest.raises(IllegalTransition, match="held"):
        A.close_tail(A.retain(s, tail), tail, entry)
    after = A.close_tail(s, tail, entry)
    assert tail not in after.segments and A.evicted_ids(s, after) == (tail,) and tail in s.segments


def test_commit_many_commits_each_in_order_and_refuses_one_not_being_written():
    s = A.init_state(A.AllocConfig(cap_bytes=100))
    s, a = A.allocate(s, Kind.FULL_KV, "g", 10, start=0, end=4, writer_abi="x")
    s, b = A.allocate(s, Kind.RECURRENT_STATE, "r", 10, start=0, end=4, writer_abi="x")
    both = A.commit_many(s, [a, b])
    assert s.get(a).state is S.WRITING                                    # the old state is left as it was
    assert [both.get(i).state for i in (a, b)] == [S.DEVICE, S.DEVICE]
    assert [both.get(i).version for i in (a, b)] == [1, 1]
    assert both.get(a).last_access < both.get(b).last_access == both.clock    # b is the most recent use
    assert both.device_bytes == s.device_bytes                            # still on the device, same bytes
    with pytest.raises(IllegalTransition, match="commit"):
        A.commit_many(both, [a])
