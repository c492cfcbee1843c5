"""Disk tier: round trips of every dtype, fault injection (truncation, flipped bytes, kill -9 mid-write,
foreign model, wrong ABI, full disk via a tiny cap), concurrent readers, restarts, bad keys, prefetch."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from cache.disk_tier import DiskTier
from cache.tier_entry import EntryMeta, make_key

REPO = str(pathlib.Path(__file__).resolve().parents[2])
FP = "weights-fp-1"


def entry(seed: int, n: int = 256) -> tuple[dict, EntryMeta]:
    """A small entry of four dtypes; n: elements per array."""
    rng = np.random.default_rng(seed)
    arrays = {
        "k": rng.standard_normal((2, n // 2)).astype(np.float32),
        "v": rng.standard_normal((n,)).astype(ml_dtypes.bfloat16),
        "pos": np.arange(seed, seed + n, dtype=np.int32),
        "lat": rng.uniform(-4, 4, (n // 4, 4)).astype(ml_dtypes.float8_e4m3fn),
    }
    return arrays, EntryMeta.of(arrays, fingerprint=FP, abi="gdn.v1", start=0, end=64 * (seed + 1))


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
                                    and a[n].tobytes() == b[n].tobytes() for n in a)


def data_file(tier: DiskTier, key: str) -> pathlib.Path:
    """The largest file of an entry's arrays (holds array bytes; Orbax's or the raw format's)."""
    files = [p for p in pathlib.Path(tier.directory, "entries", key, "arrays").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def disk_bytes(tier: DiskTier) -> int:
    return sum(p.stat().st_size for p in pathlib.Path(tier.directory, "entries").rglob("*") if p.is_file())


def run_py(code: str, *args: str) -> subprocess.Popen:
    """A Python subprocess running `code` with sys.argv[1:] = args and the repository importable."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "kv", 10**8, fingerprint=FP)
    yield t
    t.close()


@pytest.mark.parametrize("raw", [False, True])
def test_round_trip_every_dtype(tier, raw):
    arrays, meta = entry(0)
    key = make_key("chain", "full_0")
    assert tier.put(key, arrays, meta, raw)
    out, reason = tier.get(key, meta)
    assert reason is None and same(out, arrays)
    assert {a.dtype.name for a in out.values()} == {"float32", "bfloat16", "int32", "float8_e4m3fn"}
    out, reason = tier.get(key)              # without an expectation: the entry's own checks only
    assert reason is None and same(out, arrays)
    s = tier.stats()
    assert (s["entries"], s["hits"], s["puts"], s["misses"]) == (1, 2, 1, 0)
    assert s["bytes"] == disk_bytes(tier) > 0


@pytest.mark.parametrize("raw", [False, True])
def test_zero_size_and_scalar_arrays(tier, raw):
    arrays = {"empty": np.zeros((0, 8), ml_dtypes.bfloat16), "scalar": np.array(7, np.int32),
              "f": np.asfortranarray(np.arange(12.0).reshape(3, 4))}
    meta = EntryMeta.of(arrays, fingerprint=FP, abi="a", start=0, end=1)
    assert tier.put(make_key("z"), arrays, meta, raw)
    out, reason = tier.get(make_key("z"), meta)
    assert reason is None and same(out, arrays)
    only_empty = {"empty": arrays["empty"]}
    assert tier.put(make_key("e"), only_empty, EntryMeta.of(only_empty, fingerprint=FP, abi="a", start=0, end=1))
    out, reason = tier.get(make_key("e"))
    assert reason is None and same(out, only_empty)


def test_replacing_an_entry_serves_the_new_one(tier):
    key = make_key("x")
    a0, m0 = entry(0)
    a1, m1 = entry(1)
    assert tier.put(key, a0, m0) and tier.put(key, a1, m1)
    out, reason = tier.get(key, m1)
    assert reason is None and same(out, a1)
    assert tier.stats()["entries"] == 1 and tier.stats()["bytes"] == disk_bytes(tier)


def test_missing_entry(tier):
    assert tier.get(make_key("nothing")) == (None, "disk_missing")
    assert tier.stats()["misses_by_reason"] == {"disk_missing": 1}


@pytest.mark.parametrize("raw", [False, True])
def test_truncated_file_is_rejected_and_deleted(tier, raw):
    arrays, meta = entry(0, n=4096)
    key = make_key("t")
    tier.put(key, arrays, meta, raw)
    f = data_file(tier, key)
    os.truncate(f, f.stat().st_size // 2)
    assert tier.get(key, meta) == (None, "disk_truncated")
    assert key not in tier and tier.get(key, meta) == (None, "disk_missing")
    s = tier.stats()
    assert s["misses_by_reason"] == {"disk_truncated": 1, "disk_missing": 1} and s["quarantined"] == 1


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("target", ["data", "meta"])
def test_flipped_bytes_are_rejected(tier, target, raw):
    arrays, meta = entry(0, n=4096)
    key = make_key("f")
    tier.put(key, arrays, meta, raw)
    f = data_file(tier, key) if target == "data" else pathlib.Path(tier.directory, "entries", key, "meta.json")
    raw = bytearray(f.read_bytes())
    for i in (len(raw) // 3, len(raw) // 2):       # same size: only the checksum / seal can tell
        raw[i] ^= 0x5A
    f.write_bytes(bytes(raw))
    assert tier.get(key, meta) == (None, "disk_corrupt")
    assert key not in tier


def test_corrupt_array_bytes_caught_by_checksum(tier, monkeypatch):
    """Bytes that decode cleanly but differ from what was written (e.g. a bit flip inside an
    uncompressed chunk) are caught by the per-array checksum."""
    arrays, meta = entry(0)
    key = make_key("c")
    tier.put(key, arrays, meta)
    import orbax.checkpoint as ocp
    real = ocp.PyTreeCheckpointer.restore

    def flipped(self, *a, **kw):
        out = real(self, *a, **kw)
        out["pos"] = out["pos"].copy()
        out["pos"][3] ^= 1
        return out
    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", flipped)
    assert tier.get(key, meta) == (None, "disk_corrupt")


def test_entry_from_another_model_is_rejected(tmp_path):
    arrays, meta = entry(0)
    key = make_key("shared prompt")
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as a:
        assert a.put(key, arrays, meta)
    with DiskTier(tmp_path, 10**8, fingerprint="other-model") as b:
        assert b.get(key) == (None, "disk_foreign_model")
        assert b.stats()["misses_by_reason"] == {"disk_foreign_model": 1}
        assert key not in b
        with pytest.raises(ValueError, match="fingerprint"):
            b.put(key, arrays, meta)          # a tier only stores its own model's entries


@pytest.mark.parametrize("change,reason", [
    (dict(abi={"k": "gdn.v2", "v": "gdn.v1", "pos": "gdn.v1", "lat": "gdn.v1"}), "disk_abi_mismatch"),
    (dict(dtypes={"k": "float16", "v": "bfloat16", "pos": "int32", "lat": "float8_e4m3fn"}), "disk_dtype_mismatch"),
    (dict(shapes={"k": (4, 64), "v": (256,), "pos": (256,), "lat": (64, 4)}), "disk_shape_mismatch"),
    (dict(end=128), "disk_range_mismatch"),
    (dict(fingerprint="other"), "disk_foreign_model"),
])
def test_expectation_mismatch_is_a_miss_with_its_reason(tier, change, reason):
    import dataclasses
    arrays, meta = entry(0)
    key = make_key("e")
    tier.put(key, arrays, meta)
    expect = dataclasses.replace(meta, **change)
    assert tier.get(key, expect) == (None, reason)
    assert tier.stats()["misses_by_reason"] == {reason: 1} and key not in tier


# Elements per array of the entries that fill a tier: Orbax's files of one entry vary from write to
# write (OCDBT writes 10 to 12 files of a few KB), so the arrays must outweigh that by far for "room
# for two entries but not three" to hold for every write (with 256 elements, the metadata was most
# of an entry and three small writes sometimes fitted under the cap).
FILL_N = 1 << 16


def _tier_full_with_two(path, k) -> int:
    """Stores k[0] and k[1] (entries 0 and 1 of FILL_N elements) in a roomy tier at `path`; returns a cap
    with room for them but not for a third entry, from the stored sizes (not from a probe entry)."""
    with DiskTier(path, 10**8, fingerprint=FP) as roomy:
        assert roomy.put(k[0], *entry(0, FILL_N))
        s0 = roomy.stats()["bytes"]
        assert roomy.put(k[1], *entry(1, FILL_N))
        s1 = roomy.stats()["bytes"] - s0
    return s0 + s1 + min(s0, s1) * 2 // 3


def test_tiny_cap_evicts_lru_and_refuses_oversized(tmp_path):
    k = [make_key(str(i)) for i in range(4)]
    cap = _tier_full_with_two(tmp_path / "kv", k)
    with DiskTier(tmp_path / "kv", cap, fingerprint=FP) as t:
        assert k[0] in t and k[1] in t
        time.sleep(0.01)
        assert t.get(k[0])[1] is None                       # k0 is now more recent than k1
        assert t.put(k[2], *entry(2, FILL_N))
        assert k[1] not in t and k[0] in t and k[2] in t
        assert t.stats()["evictions"] == 1 and disk_bytes(t) <= cap
        big, big_meta = entry(3, n=cap)                     # raw bytes alone exceed the cap
        assert t.put(k[3], big, big_meta) is False
        assert k[3] not in t and k[0] in t and k[2] in t    # a refused put evicts nothing
        s = t.stats()
        assert s["rejected_puts"] == 1 and s["rejected_puts_by_reason"] == {"too_big": 1}
        assert s["bytes"] == disk_bytes(t) <= cap
    with DiskTier(tmp_path / "full", 64, fingerprint=FP) as full:  # a full disk: nothing fits, nothing raises
        assert full.put(k[0], *entry(0)) is False and full.stats()["entries"] == 0


@pytest.mark.parametrize("clock", ["frozen", "backwards"])
def test_lru_follows_access_order_under_a_bad_wall_clock(tmp_path, monkeypatch, clock):
    """A wall clock that stands still (coarse timestamps) or steps backwards must not reorder the
    accesses: the least recently used entry is still the one evicted, also right after a reopen."""
    ticks = iter(range(10**18, 0, -10**9))                  # one second earlier at every call
    fake = (lambda: 10**18) if clock == "frozen" else (lambda: next(ticks))
    monkeypatch.setattr(time, "time_ns", fake)
    k = [make_key(f"c{i}") for i in range(3)]
    cap = _tier_full_with_two(tmp_path / "kv", k)
    with DiskTier(tmp_path / "kv", cap, fingerprint=FP) as t:
        assert t.get(k[0])[1] is None                       # k1 is now the least recently used
        assert t.put(k[2], *entry(2, FILL_N))
        assert k[1] not in t and k[0] in t and k[2] in t
        assert t.get(k[2])[1] is None and t.get(k[0])[1] is None
        assert t.put(k[1], *entry(1, FILL_N))                       # k2 is now the least recently used
        assert k[2] not in t and k[0] in t and k[1] in t


def test_failed_write_is_a_refused_put(tier, monkeypatch):
    def no_space(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tier, "_write", no_space)
    assert tier.put(make_key("n"), *entry(0)) is False
    assert tier.stats()["rejected_puts_by_reason"] == {"io_error": 1}
    assert not os.listdir(os.path.join(tier.directory, ".tmp"))   # the temp dir is cleaned up


def test_reuse_across_restart_keeps_entries_and_lru_order(tmp_path):
    keys = [make_key("r", str(i)) for i in range(3)]
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as a:
        for i, k in enumerate(keys):
            assert a.put(k, *entry(i))
            time.sleep(0.01)
        before = a.stats()
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as b:
        assert b.keys() == sorted(keys)
        assert (b.stats()["entries"], b.stats()["bytes"]) == (3, before["bytes"])
        for i in (1, 2, 0):                                  # reading touches: LRU order 1, 2, 0
            out, reason = b.get(keys[i], entry(i)[1])
            assert reason is None and same(out, entry(i)[0])
            time.sleep(0.01)
    one = before["bytes"] // 3
    with DiskTier(tmp_path, before["bytes"] + one // 2, fingerprint=FP) as c:   # room for 3.5 entries
        assert c.put(make_key("new"), *entry(5))
        assert keys[1] not in c and keys[2] in c             # the restart kept "1 is least recent"


@pytest.mark.parametrize("bad", ["../x", "..", "/etc/passwd", "", "ABCDEF0123456789ABCDEF", "abc",
                                 "0123456789abcdef/../x", "g" * 32, "a" * 200, None, 12345])
def test_bad_keys_are_refused(tier, bad):
    arrays, meta = entry(0)
    with pytest.raises(ValueError, match="lowercase hex"):
        tier.put(bad, arrays, meta)
    with pytest.raises(ValueError, match="lowercase hex"):
        tier.get(bad)
    with pytest.raises(ValueError, match="lowercase hex"):
        tier.prefetch(bad)
    assert os.listdir(os.path.join(tier.directory, "entries")) == []


def test_arrays_must_match_their_meta(tier):
    arrays, meta = entry(0)
    with pytest.raises(ValueError, match="'k' is float16"):
        tier.put(make_key("m"), {**arrays, "k": arrays["k"].astype(np.float16)}, meta)
    with pytest.raises(ValueError, match="do not match"):
        tier.put(make_key("m"), {"k": arrays["k"]}, meta)
    with pytest.raises(ValueError, match="array names"):
        EntryMeta.of({"../k": arrays["k"]}, fingerprint=FP, abi="a", start=0, end=1)


def gate_loads(tier, monkeypatch) -> threading.Event:
    """Make the tier's reads wait for the returned event (a slow disk)."""
    gate, real = threading.Event(), tier._read

    def slow(*a, **kw):
        assert gate.wait(10), "test gate never opened"
        return real(*a, **kw)
    monkeypatch.setattr(tier, "_read", slow)
    return gate


def test_prefetch_policies(tier, monkeypatch):
    arrays, meta = entry(0)
    key = make_key("p")
    tier.put(key, arrays, meta)
    gate = gate_loads(tier, monkeypatch)
    h = tier.prefetch(key, meta)
    assert h.result("best_effort") == (None, "disk_not_ready")
    t0 = time.perf_counter()
    assert h.result("timeout", timeout_s=0.05) == (None, "disk_timeout")
    assert time.perf_counter() - t0 >= 0.045
    threading.Timer(0.05, gate.set).start()
    out, reason = h.result("wait")
    assert reason is None and same(out, arrays)
    h2 = tier.prefetch(key, meta)                     # gate open: a load that finishes before it is asked for
    while not h2.done():
        time.sleep(0.005)
    time.sleep(0.02)
    assert h2.result("best_effort")[1] is None
    s = tier.stats()
    assert s["misses_by_reason"] == {"disk_not_ready": 1, "disk_timeout": 1} and s["hits"] == 2
    assert s["prefetches"] == 2 and s["prefetch_hidden_s"] > 0.02
    with pytest.raises(ValueError, match="timeout_s"):
        h2.result("timeout")
    with pytest.raises(ValueError, match="policy"):
        h2.result("eventually")


def test_prefetch_of_a_bad_entry_fails_closed(tier):
    arrays, meta = entry(0, n=4096)
    key = make_key("pb")
    tier.put(key, arrays, meta)
    os.truncate(data_file(tier, key), 10)
    assert tier.prefetch(key, meta).result("wait") == (None, "disk_truncated")
    assert tier.prefetch(make_key("none")).result("timeout", timeout_s=5) == (None, "disk_missing")


READER = """
import sys, numpy as np
from cache.disk_tier import DiskTier
from cache.tier_entry import make_key
t = DiskTier(sys.argv[1], 10**8, fingerprint=sys.argv[2])
bad = 0
for rnd in range(40):
    for i in range(4):
        out, reason = t.get(make_key("c", str(i)))
        if reason is not None or int(out["pos"][0]) != i:
            bad += 1
print("OK", bad, t.stats()["hits"], flush=True)
"""


def test_concurrent_readers_threads_and_a_process(tier):
    keys = [make_key("c", str(i)) for i in range(4)]
    for i, k in enumerate(keys):
        assert tier.put(k, *entry(i))
    proc = run_py(READER, tier.directory, FP)
    errors: list[str] = []

    def reader(r: int) -> None:
        for rnd in range(15):
            i = (r + rnd) % 4
            out, reason = tier.get(keys[i], entry(i)[1])
            if reason is not None or not same(out, entry(i)[0]):
                errors.append(f"thread {r} key {i}: {reason}")
    threads = [threading.Thread(target=reader, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for j in range(5):                     # a writer publishing other keys meanwhile
        assert tier.put(make_key("w", str(j)), *entry(10 + j))
    for t in threads:
        t.join()
    stdout, stderr = proc.communicate(timeout=60)
    assert errors == []
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.split()[:3] == ["OK", "0", "160"], stdout
    assert tier.stats()["hits"] == 90 and tier.stats()["misses"] == 0


KILLED_WRITER = """
import sys, time
from cache.disk_tier import DiskTier
from cache.tier_entry import make_key
from tests.cache.test_disk_tier import entry
t = DiskTier(sys.argv[1], 10**9, fingerprint=sys.argv[2])
if sys.argv[3] == "pause":            # stop after the Orbax write, before the publishing rename
    real = t._write
    def write_then_hang(*a):
        size = real(*a)
        print("WRITTEN", flush=True)
        time.sleep(600)
    t._write = write_then_hang
    t.put(make_key("killed"), *entry(0, n=1 << 16))
else:                                 # write big entries back to back until killed at a random point
    arrays, meta = entry(0, n=1 << 20)
    for i in range(1000):
        t.put(make_key("loop", str(i)), arrays, meta)
        print("PUT", i, flush=True)
"""


def killed_writer(directory, mode: str) -> subprocess.Popen:
    return run_py(KILLED_WRITER, str(directory), FP, mode)


def test_kill9_before_publish_leaves_nothing_readable(tmp_path):
    proc = killed_writer(tmp_path, "pause")
    line = proc.stdout.readline()
    assert line.strip() == "WRITTEN", proc.stderr.read()[-2000:]
    assert len(os.listdir(tmp_path / ".tmp")) == 2          # the written temp dir and its lock
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    with DiskTier(tmp_path, 10**9, fingerprint=FP) as t:
        assert os.listdir(tmp_path / ".tmp") == []          # leftovers of the dead writer are gone
        assert t.keys() == [] and t.get(make_key("killed")) == (None, "disk_missing")
        assert t.put(make_key("killed"), *entry(0)) and t.get(make_key("killed"))[1] is None


def test_kill9_at_a_random_point_mid_write(tmp_path):
    proc = killed_writer(tmp_path, "loop")
    assert proc.stdout.readline().startswith("PUT 0"), proc.stderr.read()[-2000:]
    time.sleep(np.random.default_rng().uniform(0.05, 0.4))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    with DiskTier(tmp_path, 10**9, fingerprint=FP) as t:
        assert os.listdir(tmp_path / ".tmp") == []
        keys = t.keys()
        assert keys, "at least the first put was published"
        for k in keys:                                      # every published entry is whole and valid
            out, reason = t.get(k)
            assert reason is None, (k, reason)
        assert t.stats()["hits"] == len(keys)
