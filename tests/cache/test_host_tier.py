"""Host tier: read-only copies, LRU under a byte cap, demotion to the disk tier on eviction, mismatch reasons."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cache.disk_tier import DiskTier
from cache.host_tier import HostTier
from cache.tier_entry import EntryMeta, make_key

FP = "weights-fp-1"


def entry(seed: int, n: int = 64) -> tuple[dict, EntryMeta]:
    arrays = {"k": np.full((n,), seed, np.float32), "pos": np.arange(n, dtype=np.int32)}
    return arrays, EntryMeta.of(arrays, fingerprint=FP, abi="kv.v1", start=0, end=16)


def test_copies_are_read_only_and_isolated():
    t = HostTier(10**6, fingerprint=FP)
    arrays, meta = entry(1)
    key = make_key("a")
    assert t.put(key, arrays, meta)
    arrays["k"][0] = 99.0                          # the writer changing its buffer afterwards
    out, reason = t.get(key, meta)
    assert reason is None and out["k"][0] == 1.0
    with pytest.raises(ValueError):
        out["k"][0] = 5.0                          # a reader cannot change what others read


def test_lru_cap_and_demotion_to_disk(tmp_path):
    arrays, meta = entry(0)
    size = sum(a.nbytes for a in arrays.values())
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as disk:
        host = HostTier(2 * size, fingerprint=FP, on_evict=disk.put)
        k = [make_key(str(i)) for i in range(3)]
        host.put(k[0], *entry(0))
        host.put(k[1], *entry(1))
        host.get(k[0])                              # k1 becomes least recent
        host.put(k[2], *entry(2))
        assert host.keys() == [k[0], k[2]] and host.stats()["bytes"] == 2 * size
        assert host.stats()["evictions"] == 1
        out, reason = disk.get(k[1], entry(1)[1])   # HOST -> DISK on eviction
        assert reason is None and out["k"][0] == 1.0
        assert host.put(make_key("big"), *entry(9, n=10 * 64)) is False
        assert host.stats()["rejected_puts_by_reason"] == {"too_big": 1} and host.keys() == [k[0], k[2]]


@pytest.mark.parametrize("change,reason", [
    (dict(abi={"k": "kv.v2", "pos": "kv.v1"}), "host_abi_mismatch"),
    (dict(dtypes={"k": "bfloat16", "pos": "int32"}), "host_dtype_mismatch"),
    (dict(shapes={"k": (32,), "pos": (64,)}), "host_shape_mismatch"),
    (dict(start=8), "host_range_mismatch"),
    (dict(fingerprint="other"), "host_foreign_model"),
])
def test_mismatch_is_a_miss_and_drops_the_entry(change, reason):
    t = HostTier(10**6, fingerprint=FP)
    arrays, meta = entry(0)
    key = make_key("m")
    t.put(key, arrays, meta)
    assert t.get(key, dataclasses.replace(meta, **change)) == (None, reason)
    assert key not in t and t.get(key) == (None, "host_missing")
    assert t.stats()["misses_by_reason"] == {reason: 1, "host_missing": 1} and t.stats()["bytes"] == 0


def test_prefetch_is_ready_at_once_and_bad_keys_refused():
    t = HostTier(10**6, fingerprint=FP)
    key = make_key("p")
    t.put(key, *entry(3))
    out, reason = t.prefetch(key).result("best_effort")
    assert reason is None and out["k"][0] == 3.0
    assert t.prefetch(make_key("q")).result("best_effort") == (None, "host_missing")
    for bad in ("../x", "ABCDEF0123456789", ""):
        with pytest.raises(ValueError, match="lowercase hex"):
            t.get(bad)
