"""Prefix keys, block geometry and the recurrent checkpoint retention policy."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from cache.prefix_index import (IndexEntry, KeyContext, PrefixIndex, block_geometry, chain_keys,
                                checkpoint_boundaries, droppable_checkpoints, keep_checkpoint, key_at)
from cache.segments import Kind

CTX = KeyContext(model_fingerprint="w:abc", dtype="bfloat16", abi_id="attention_kv/kv/v1", sharding="tp1")


def test_geometry_gcd_lcm():
    g = block_geometry({"attn": 16, "lin": 64, "swa": 24})
    assert (g.gcd, g.lcm) == (8, 192)
    g = block_geometry({"only": 32})
    assert (g.gcd, g.lcm) == (32, 32)
    with pytest.raises(ValueError, match="positive"):
        block_geometry({"a": 0})
    with pytest.raises(ValueError, match="at least one"):
        block_geometry({})


def test_keys_chain_and_carry_every_validity_field():
    toks = list(range(20))
    keys = chain_keys(toks, 4, CTX)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert chain_keys(toks[:12], 4, CTX) == keys[:3]           # a prefix has the prefix's keys
    other = toks.copy()
    other[1] = 99                                              # a change early changes every later key
    assert all(a != b for a, b in zip(keys, chain_keys(other, 4, CTX)))
    for field in ("model_fingerprint", "dtype", "abi_id", "sharding"):
        ctx = dataclasses.replace(CTX, **{field: "changed"})
        assert set(chain_keys(toks, 4, ctx)).isdisjoint(keys), field
    assert key_at(keys, 4, 8) == keys[1]
    with pytest.raises(ValueError, match="multiple"):
        key_at(keys, 4, 6)


def test_index_insert_find_remove():
    idx = PrefixIndex()
    e = IndexEntry("attn", Kind.FULL_KV, "k1", 4, 11)
    idx2 = idx.insert(e)
    assert len(idx) == 0 and idx2.find("attn", Kind.FULL_KV, "k1") == e
    assert idx2.find("attn", Kind.RECURRENT_STATE, "k1") is None
    assert len(idx2.prune({11})) == 1 and len(idx2.prune(set())) == 0
    assert len(idx2.remove_segment(11)) == 0 and len(idx2.remove("attn", Kind.FULL_KV, "k1")) == 0


def test_retention_policy_examples():
    assert checkpoint_boundaries(100, 8, 4) == (32, 64, 96)
    assert checkpoint_boundaries(90, 8, 4) == (32, 64, 88)
    assert checkpoint_boundaries(7, 8, 4) == ()
    assert checkpoint_boundaries(8, 8, 4) == (8,)
    assert droppable_checkpoints(90, 120, 8, 4) == (88,)
    assert droppable_checkpoints(64, 120, 8, 4) == ()
    with pytest.raises(ValueError, match="positive"):
        keep_checkpoint(8, 8, 8, 0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(end=st.integers(0, 4000), lcm=st.integers(1, 64), interval=st.integers(1, 16))
def test_retention_policy_properties(end, lcm, interval):
    kept = checkpoint_boundaries(end, lcm, interval)
    assert list(kept) == sorted(set(kept))
    assert all(b % lcm == 0 and 0 < b <= end and keep_checkpoint(b, end, lcm, interval) for b in kept)
    assert len(kept) <= end // (interval * lcm) + 1                       # bounded pool share
    if end >= lcm:
        assert kept[-1] == (end // lcm) * lcm                             # exact resume for a continuation
    # any LCM boundary has a checkpoint no more than interval * lcm tokens before it
    for b in range(lcm, (end // lcm) * lcm + 1, lcm):
        assert b - max([0] + [k for k in kept if k <= b]) < interval * lcm
