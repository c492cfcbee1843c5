"""Hit validation: each of the five checks turns a hash hit into a miss with its reason, in order."""
from __future__ import annotations

import dataclasses

import pytest

from cache import segment_allocator as A
from cache.prefix_index import IndexEntry, KeyContext, PrefixIndex, block_geometry, chain_keys, checkpoint_boundaries, key_at
from cache.segments import Kind, SegState
from cache.validation import CacheStats, GroupSpec, check_hit, confirm_at_use, validate_hit

ATTN = GroupSpec("attn", Kind.FULL_KV, 4, KeyContext("w1", "bf16", "attn/v1"))
LIN = GroupSpec("lin", Kind.RECURRENT_STATE, 8, KeyContext("w1", "f32", "gdn/v1"))
SWA = GroupSpec("swa", Kind.SWA_WINDOW, 4, KeyContext("w1", "bf16", "swa/v1"), window=8)
MLA = GroupSpec("mla", Kind.COMPRESSED_KV, 8, KeyContext("w1", "bf16", "mla/v1"))
TOKENS = list(range(100, 133))      # 33 tokens: up to 32 reusable
# DeepSeek-V4's objects, each a group: paged entries (tail in its own group), indexer entries, and the
# per-boundary checkpoints of the tail (+count), the CSA overlap state and the sliding-window ring
_V4 = KeyContext("w1", "bf16", "v4/v1")
V4 = (GroupSpec("ent", Kind.COMPRESSED_KV, 8, _V4, tail=False), GroupSpec("idx", Kind.INDEXER_KEYS, 8, _V4),
      GroupSpec("tail", Kind.UNCOMPRESSED_TAIL, 8, _V4, closes_into="ent"), GroupSpec("ovl", Kind.CSA_OVERLAP, 8, _V4),
      GroupSpec("win", Kind.SWA_WINDOW, 8, _V4, checkpoint=True))


def store(state, index, tokens, groups, upto, *, interval=2, abi=None, layout=None, block_ranges=None):
    """Writes every object `groups` need for the first `upto` tokens; returns (state, index, {(group, kind, end): id})."""
    geo = block_geometry({g.name: g.block_size for g in groups})
    ids = {}
    for g in groups:
        keys = chain_keys(tokens, geo.gcd, g.ctx)
        items = []
        if g.is_checkpoint:
            items = [(g.kind, b, b, b) for b in checkpoint_boundaries(upto, geo.lcm, interval)]
        else:
            items = [(g.kind, b - g.block_size, b, b) for b in range(g.block_size, upto + 1, g.block_size)]
            if g.needs_tail and upto >= geo.lcm:
                last = upto // geo.lcm * geo.lcm
                items.append((Kind.UNCOMPRESSED_TAIL, last - 4, last, last))
        for kind, start, end, b in items:
            if block_ranges and (g.name, b) in block_ranges:
                start, end = block_ranges[(g.name, b)]
            state, sid = A.allocate(state, kind, g.name, 16, start=start, end=end, writer_abi=abi or g.ctx.abi_id,
                                    writer_layout=layout or g.ctx.sharding)
            state = A.commit(state, sid)
            index = index.insert(IndexEntry(g.name, kind, key_at(keys, geo.gcd, b), b, sid))
            ids[(g.name, kind, b)] = sid
    return state, index, ids


def _setup(groups=(ATTN, LIN), upto=32, **kw):
    return store(A.init_state(A.AllocConfig(cap_bytes=10_000)), PrefixIndex(), TOKENS, groups, upto, **kw)


def test_full_hit_leaves_one_token_for_the_logits():
    s, idx, ids = _setup()
    hit = validate_hit(TOKENS, [ATTN, LIN], idx, s)
    assert hit.ok and hit.boundary == 32 and hit.reason is None
    assert hit.segments["lin"] == (ids[("lin", Kind.RECURRENT_STATE, 32)],)
    assert len(hit.segments["attn"]) == 8
    assert all(hit.versions[i] == s.get(i).version for ids_ in hit.segments.values() for i in ids_)
    # the same 32 tokens as the whole prompt: 31 usable -> 24, but no checkpoint at 24 -> 16
    hit = validate_hit(TOKENS[:32], [ATTN, LIN], idx, s)
    assert hit.ok and hit.boundary == 16
    assert validate_hit(TOKENS[:32], [ATTN, LIN], idx, s, need_logits=False).boundary == 32


def test_no_hit():
    s, idx, _ = _setup()
    hit = validate_hit([1] + TOKENS[1:], [ATTN, LIN], idx, s)
    assert not hit.ok and hit.reason == "no_hit" and not hit.hash_hit


def test_1_coverage_partial_lcm_block():
    s, idx, _ = _setup(groups=(ATTN,), upto=4)
    hit = validate_hit(TOKENS, [ATTN, LIN], idx, s)
    assert (hit.ok, hit.reason, hit.hashed) == (False, "coverage", 4) and "8-token resume grid" in hit.detail


def test_2_abi_mismatch_before_intersection():
    s, idx, _ = _setup(groups=(ATTN,), abi="attn/v0")
    hit = validate_hit(TOKENS, [ATTN, LIN], idx, s)       # LIN has nothing: ABI still reported first
    assert hit.reason == "abi_mismatch" and hit.group == "attn" and "attn/v0" in hit.detail


def test_2_objects_written_in_another_mesh_layout_are_a_sharding_miss():
    """A device object split another way (written under tensor size 2, read under 4) is never read as
    if it were the reader's: a miss naming both layouts."""
    s, idx, _ = _setup(groups=(ATTN, LIN), layout="dp1.tp2")
    hit = validate_hit(TOKENS, [ATTN, LIN], idx, s)
    assert (hit.ok, hit.reason, hit.group) == (False, "sharding", "attn")
    assert "'dp1.tp2'" in hit.detail and "'replicated'" in hit.detail
    s, idx, _ = _setup(groups=(ATTN, LIN), layout="replicated")
    assert validate_hit(TOKENS, [ATTN, LIN], idx, s).ok


def test_3_intersection_recurrent_needs_a_checkpoint():
    s, idx, ids = _setup()
    for b in (16, 32):
        s = A.evict(s, ids[("lin", Kind.RECURRENT_STATE, b)])
    hit = validate_hit(TOKENS, [ATTN, LIN], idx, s)
    assert hit.reason == "intersection" and hit.group == "lin"
    # with the 32 checkpoint gone, the 16 one is still a common boundary
    s, idx, ids = _setup()
    s = A.evict(s, ids[("lin", Kind.RECURRENT_STATE, 32)])
    assert validate_hit(TOKENS, [ATTN, LIN], idx, s).boundary == 16
    # an attention block missing in the middle cuts the hit below it
    s, idx, ids = _setup()
    s = A.evict(s, ids[("attn", Kind.FULL_KV, 24)])
    assert validate_hit(TOKENS, [ATTN, LIN], idx, s).boundary == 16


def test_3_intersection_swa_needs_only_the_last_window():
    s, idx, ids = _setup(groups=(ATTN, SWA, LIN))
    for b in (4, 8, 12, 16, 20, 24):
        s = A.evict(s, ids[("swa", Kind.SWA_WINDOW, b)])
    hit = validate_hit(TOKENS, [ATTN, SWA, LIN], idx, s)
    assert hit.ok and hit.boundary == 32 and len(hit.segments["swa"]) == 2
    s = A.evict(s, ids[("swa", Kind.SWA_WINDOW, 28)])
    hit = validate_hit(TOKENS, [ATTN, SWA, LIN], idx, s)
    assert hit.reason == "intersection" and hit.group == "swa"


def test_3_intersection_compressed_needs_its_tail():
    s, idx, ids = _setup(groups=(MLA, LIN))
    assert validate_hit(TOKENS, [MLA, LIN], idx, s).boundary == 32
    s = A.evict(s, ids[("mla", Kind.UNCOMPRESSED_TAIL, 32)])
    hit = validate_hit(TOKENS, [MLA, LIN], idx, s)
    assert hit.reason == "intersection" and hit.group == "mla"


@pytest.mark.parametrize("group,kind", [("tail", Kind.UNCOMPRESSED_TAIL), ("ovl", Kind.CSA_OVERLAP),
                                        ("win", Kind.SWA_WINDOW)])
def test_3_intersection_v4_needs_every_checkpoint(group, kind):
    """Checkpoints at 16 and 32 (interval 2 x LCM 8): without the one at 32 the hit falls back to 16,
    without both it is a miss naming the group and the object it lacks."""
    s, idx, ids = _setup(groups=V4)
    hit = validate_hit(TOKENS, V4, idx, s)
    assert hit.ok and hit.boundary == 32 and all(len(hit.segments[g.name]) == (4 if g.block_size and not
                                                                                 g.is_checkpoint else 1) for g in V4)
    s = A.evict(s, ids[(group, kind, 32)])
    assert validate_hit(TOKENS, V4, idx, s).boundary == 16
    s = A.evict(s, ids[(group, kind, 16)])
    hit = validate_hit(TOKENS, V4, idx, s)
    assert not hit.ok and hit.hash_hit and hit.reason == "intersection" and hit.group == group
    assert f"{kind.value} checkpoint at 32 is freed" in hit.detail


def test_3_intersection_v4_window_must_be_resident_where_it_is_read():
    """A ring offloaded to the host: a reader with a disk / host tier restores it; a device-only reader
    falls back to the boundary whose ring is on the device, or misses naming the window."""
    s, idx, ids = _setup(groups=V4)
    s = A.transition(s, ids[("win", Kind.SWA_WINDOW, 32)], SegState.HOST)
    device = frozenset({SegState.DEVICE})
    assert check_hit(TOKENS, V4, idx, s).boundary == 32
    assert check_hit(TOKENS, V4, idx, s, servable=device).boundary == 16
    s = A.transition(s, ids[("win", Kind.SWA_WINDOW, 16)], SegState.HOST)
    hit = check_hit(TOKENS, V4, idx, s, servable=device)
    assert hit.reason == "intersection" and hit.group == "win" and "checkpoint at 32 is host, not resident" in hit.detail


def test_4_alignment_writing_segment_and_misaligned_range():
    s, idx, ids = _setup()
    s = A.transition(s, ids[("attn", Kind.FULL_KV, 8)], SegState.WRITING)
    hit = validate_hit(TOKENS, [ATTN, LIN], idx, s)
    assert hit.reason == "alignment" and "writing" in hit.detail
    s, idx, _ = _setup(block_ranges={("attn", 8): (2, 8)})
    hit = validate_hit(TOKENS, [ATTN, LIN], idx, s)
    assert hit.reason == "alignment" and "line up" in hit.detail


def test_4_host_and_disk_segments_are_restorable_hits():
    s, idx, ids = _setup()
    sid = ids[("lin", Kind.RECURRENT_STATE, 32)]
    s = A.transition(A.transition(s, sid, SegState.HOST), sid, SegState.DISK)
    assert validate_hit(TOKENS, [ATTN, LIN], idx, s).ok


def test_5_version_time_of_check_vs_use():
    s, idx, ids = _setup()
    hit = check_hit(TOKENS, [ATTN, LIN], idx, s)
    sid = ids[("attn", Kind.FULL_KV, 12)]
    overwritten = A.commit(A.transition(s, sid, SegState.WRITING), sid)
    late = confirm_at_use(hit, overwritten)
    assert late.reason == "version" and f"segment {sid}" in late.detail
    assert validate_hit(TOKENS, [ATTN, LIN], idx, s, A.evict(s, sid)).reason == "version"
    assert validate_hit(TOKENS, [ATTN, LIN], idx, s, A.rollback(s, sid, 10)).reason == "version"
    assert confirm_at_use(hit, A.touch(s, sid)).ok     # a use without a write keeps the version


def test_stats_rates_and_reasons():
    s, idx, ids = _setup()
    stats = CacheStats()
    stats = stats.record(validate_hit(TOKENS, [ATTN, LIN], idx, s))
    stats = stats.record(validate_hit([0] * 33, [ATTN, LIN], idx, s))
    s2 = A.evict(A.evict(s, ids[("lin", Kind.RECURRENT_STATE, 32)]), ids[("lin", Kind.RECURRENT_STATE, 16)])
    stats = stats.record(validate_hit(TOKENS, [ATTN, LIN], idx, s2))
    stats = stats.record(validate_hit(TOKENS, [ATTN, LIN], idx, s2))
    assert (stats.lookups, stats.hits, stats.passes, stats.tokens_reused) == (4, 3, 1, 32)
    assert dict(stats.misses_by_reason) == {"no_hit": 1, "intersection": 2}
    assert dict(stats.misses_by_group) == {("lin", "intersection"): 2}
    assert stats.hit_rate == pytest.approx(0.75) and stats.validation_pass_rate == pytest.approx(1 / 3)
    assert stats.effective_reuse == pytest.approx(0.25)
    stats = stats.with_bytes(s2)
    assert stats.bytes_by_group == {"attn": 8 * 16} and stats.bytes_by_kind[Kind.RECURRENT_STATE] == 0
    assert CacheStats().effective_reuse == 0.0


def test_bad_specs():
    with pytest.raises(ValueError, match="window"):
        GroupSpec("s", Kind.SWA_WINDOW, 4, ATTN.ctx)
    with pytest.raises(ValueError, match="not a group kind"):
        GroupSpec("t", "uncompressed_tail", 4, ATTN.ctx)
    with pytest.raises(ValueError, match="cannot be stored as checkpoints"):
        GroupSpec("t", Kind.FULL_KV, 4, ATTN.ctx, checkpoint=True)
    with pytest.raises(ValueError, match="only an uncompressed tail closes"):
        GroupSpec("t", Kind.COMPRESSED_KV, 4, ATTN.ctx, closes_into="c")
    with pytest.raises(ValueError, match="unique"):
        check_hit(TOKENS, [ATTN, dataclasses.replace(LIN, name="attn")], PrefixIndex(), _setup()[0])
