"""Disk tier under faults: entries moved into another entry's place (each names its own key), a
directory that cannot be written (at open and mid-serve: read-only, full, a file where a directory
belongs), and two processes sharing one directory while both write, read and evict under its cap.

The suite runs as root, for whom chmod does not make a directory read-only: an unwritable directory
is either a real one (a regular file where a directory belongs) or the module's `os` seen through
`ReadOnlyOS`, which fails every write call with the errno a read-only (or full) file system gives.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import shutil
import time

import numpy as np
import pytest

import cache.disk_directory as disk_directory
import cache.disk_entry as disk_entry
import cache.disk_tier as disk_tier
from cache.disk_tier import DISK_REASONS, DiskTier
from cache.tier_entry import EntryMeta, make_key
from tests.cache.test_disk_tier import FP, data_file, disk_bytes, entry, run_py, same


def twin(seed: int, like: EntryMeta) -> dict:
    """Arrays other than entry(0)'s with exactly its meta (same names, dtypes, shapes; the meta's
    token range is entry(0)'s too): two prefixes of the same length that differ in their tokens."""
    arrays, _ = entry(seed)
    return {n: a.astype(np.dtype(like.dtypes[n])).reshape(like.shapes[n]) for n, a in arrays.items()}


def swap(a: pathlib.Path, b: pathlib.Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


# ---- 1. entries name themselves ------------------------------------------------------------------

@pytest.mark.parametrize("what", ["directories", "meta_and_arrays"])
def test_swapped_entries_are_refused_under_either_key(tmp_path, what):
    a0, meta = entry(0)
    a1 = twin(1, meta)
    k0, k1 = make_key("prefix", "a"), make_key("prefix", "b")
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as t:
        assert t.put(k0, a0, meta) and t.put(k1, a1, meta)
        assert not same(a0, a1) and t.get(k0, meta)[1] is None and t.get(k1, meta)[1] is None
        e0, e1 = pathlib.Path(t.directory, "entries", k0), pathlib.Path(t.directory, "entries", k1)
        if what == "directories":
            swap(e0, e1)
        else:
            for part in ("meta.json", "arrays"):
                swap(e0 / part, e1 / part)
        assert t.get(k0, meta) == (None, "disk_key_mismatch")      # today: k1's arrays, served as k0's
        assert t.get(k1, meta) == (None, "disk_key_mismatch")
        s = t.stats()
        assert s["misses_by_reason"] == {"disk_key_mismatch": 2} and s["quarantined"] == 2
        assert k0 not in t and k1 not in t                          # deleted: recomputed, never served
        assert t.prefetch(k0, meta).result("wait") == (None, "disk_missing")
    assert "disk_key_mismatch" in DISK_REASONS


def test_an_entry_copied_into_a_free_key_is_refused(tmp_path):
    arrays, meta = entry(0)
    k0, k2 = make_key("copied", "from"), make_key("copied", "to")
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as t:
        assert t.put(k0, arrays, meta)
        shutil.copytree(pathlib.Path(t.directory, "entries", k0), pathlib.Path(t.directory, "entries", k2))
        assert t.get(k2, meta) == (None, "disk_key_mismatch") and k2 not in t
        out, reason = t.get(k0, meta)                               # the original is untouched
        assert reason is None and same(out, arrays)


def test_the_key_is_inside_the_seal(tmp_path):
    """Rewriting the key in meta.json without resealing it is corrupt, not a way to rename."""
    arrays, meta = entry(0)
    k0, k1 = make_key("sealed", "0"), make_key("sealed", "1")
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as t:
        assert t.put(k0, arrays, meta)
        src = pathlib.Path(t.directory, "entries", k0)
        raw = json.loads((src / "meta.json").read_bytes())
        assert raw["body"]["key"] == k0
        raw["body"]["key"] = k1
        (src / "meta.json").write_text(json.dumps(raw, sort_keys=True))
        os.rename(src, pathlib.Path(t.directory, "entries", k1))
        assert t.get(k1, meta) == (None, "disk_corrupt")


# ---- 2. a directory that cannot be written -------------------------------------------------------

def use_os(monkeypatch, fake) -> None:
    """Every module of the disk tier (cache.disk_tier, disk_directory, disk_entry) sees `fake` as `os`."""
    for m in (disk_tier, disk_directory, disk_entry):
        monkeypatch.setattr(m, "os", fake)


class ReadOnlyOS:
    """The `os` module as a read-only (code=EROFS) or full (code=ENOSPC) file system shows it: every
    call that would write raises OSError(code); reads pass through."""

    def __init__(self, code: int = errno.EROFS):
        self.code, self.calls = code, 0

    def _fail(self, *args):
        self.calls += 1
        raise OSError(self.code, os.strerror(self.code), *(str(a) for a in args[:1]))

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, *a, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            self._fail(path)
        return os.open(path, flags, *a, **kw)

    def makedirs(self, path, mode=0o777, exist_ok=False):
        if not (exist_ok and os.path.isdir(path)):
            self._fail(path)

    def mkdir(self, path, *a, **kw):
        self._fail(path)

    def rename(self, src, dst, *a, **kw):
        self._fail(src)

    def utime(self, path, *a, **kw):
        self._fail(path)

    def unlink(self, path, *a, **kw):
        self._fail(path)


@pytest.fixture
def warnings_(caplog):
    caplog.set_level(logging.WARNING, logger="cache.disk_tier")
    return lambda: [r for r in caplog.records if r.name == "cache.disk_tier" and r.levelno == logging.WARNING]


def test_a_read_only_directory_at_open_serves_what_it_holds_and_writes_nothing(tmp_path, monkeypatch, warnings_):
    arrays, meta = entry(0, n=4096)
    k0, k1, bad = make_key("ro", "0"), make_key("ro", "1"), make_key("ro", "bad")
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as t:
        assert t.put(k0, arrays, meta) and t.put(bad, arrays, meta)
        os.truncate(data_file(t, bad), 10)
    ro = ReadOnlyOS(errno.EROFS)
    use_os(monkeypatch, ro)
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as t:               # today: OSError out of open
        assert [r.getMessage() for r in warnings_()] == [
            f"prefix cache disk tier {t.directory}: open: EROFS: Read-only file system; writes to it are off; "
            f"requests go on, and valid entries already there are still read (tried again in 60 s)"]
        out, reason = t.get(k0, meta)                                   # a hit touches: no write, no error
        assert reason is None and same(out, arrays)
        assert t.get(bad, meta) == (None, "disk_truncated")             # refused; cannot be deleted
        assert t.prefetch(bad, meta).result("wait") == (None, "disk_truncated")
        calls = ro.calls
        assert t.put(k1, arrays, meta) is False and k1 not in t         # refused without touching the disk
        assert ro.calls == calls
        s = t.stats()
        assert s["writable"] is False and s["write_fault"] == "open: EROFS: Read-only file system"
        assert s["write_faults_by_op"] == {"open": 1} and s["rejected_puts_by_reason"] == {"writes_off": 1}
        assert s["hits"] == 1 and s["misses_by_reason"] == {"disk_truncated": 2} and s["entries"] == 2
        assert len(warnings_()) == 1


@pytest.mark.parametrize("where", ["root", "tmp"])
def test_a_file_where_a_directory_belongs(tmp_path, warnings_, where):
    """root: the tier's own path is a regular file (nothing can be read or written: the engine runs
    as without a tier); tmp: .tmp is a file (entries already there are read, nothing is written)."""
    arrays, meta = entry(0)
    k0 = make_key("file", "0")
    root = tmp_path / "kv"
    if where == "root":
        root.write_text("not a directory")
    else:
        with DiskTier(root, 10**8, fingerprint=FP) as t:
            assert t.put(k0, arrays, meta)
        shutil.rmtree(root / ".tmp")
        (root / ".tmp").write_text("not a directory")
    with DiskTier(root, 10**8, fingerprint=FP, retry_s=0.05) as t:          # today: FileExistsError
        (msg,) = [r.getMessage() for r in warnings_()]
        assert msg.startswith(f"prefix cache disk tier {root}: open: ENOTDIR: Not a directory")
        assert ("the engine runs without a disk tier" in msg) == (where == "root")
        assert t.put(make_key("file", "1"), arrays, meta) is False
        time.sleep(0.06)                                                    # due again: tried, fails, no new warning
        assert t.put(make_key("file", "2"), arrays, meta) is False
        s = t.stats()
        assert s["writable"] is False and s["write_faults"] == 2 and len(warnings_()) == 1
        assert s["rejected_puts_by_reason"] == {"writes_off": 1, "io_error": 1}
        got = t.get(k0, meta)
        if where == "root":
            assert got == (None, "disk_missing") and t.keys() == [] and s["entries"] == 0
        else:
            assert got[1] is None and same(got[0], arrays) and t.keys() == [k0]
        assert t.warm() == (where == "tmp")


def test_a_full_disk_mid_serve_turns_writes_off_then_back_on(tmp_path, monkeypatch, warnings_, caplog):
    """ENOSPC as Orbax reports it (tensorstore's ValueError with os_error_code 28): the put is refused,
    writes go off with one warning, later puts do not write until retry_s has passed, reads go on."""
    caplog.set_level(logging.INFO, logger="cache.disk_tier")
    arrays, meta = entry(0)
    keys = [make_key("full", str(i)) for i in range(6)]
    with DiskTier(tmp_path, 10**8, fingerprint=FP, retry_s=0.3) as t:
        assert t.put(keys[0], arrays, meta)
        real, writes = t._write, []

        def full(*a):
            writes.append(a[1])
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "k/0": Failed to write 919690 bytes to file 20: '
                             "No space left on device [os_error_code='28']")
        monkeypatch.setattr(t, "_write", full)
        assert t.put(keys[1], arrays, meta) is False
        assert t.put(keys[2], arrays, meta) is False and t.put(keys[3], arrays, meta) is False
        assert writes == [keys[1]]                        # today: every put writes (and fails) again
        s = t.stats()
        assert s["writable"] is False and s["write_fault"] == "write: ENOSPC: No space left on device"
        assert t.health() == {"writable": False, "write_faults": 1, "write_fault": s["write_fault"]}
        assert s["rejected_puts_by_reason"] == {"io_error": 1, "writes_off": 2}
        (msg,) = [r.getMessage() for r in warnings_()]
        assert t.directory in msg and "ENOSPC" in msg and "writes to it are off" in msg
        out, reason = t.get(keys[0], meta)
        assert reason is None and same(out, arrays)
        assert not os.listdir(os.path.join(t.directory, ".tmp"))
        time.sleep(0.35)
        monkeypatch.setattr(t, "_write", real)            # room again
        assert t.put(keys[4], arrays, meta) and t.stats()["writable"] is True and t.health()["writable"] is True
        assert t.get(keys[4], meta)[1] is None
        assert any("writes resumed" in r.getMessage() for r in caplog.records)
        assert len(warnings_()) == 1


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EDQUOT, errno.ENOSPC])
def test_every_write_path_failing_mid_serve_never_raises(tmp_path, monkeypatch, code):
    """The directory turns unwritable while the tier is open. With retry_s tiny, every operation tries
    its write again and fails: deleting a rejected entry, the touch on a hit, a put (its temp lock),
    delete. Nothing raises; valid entries are served, bad ones refused; once the directory can be
    written again, a put succeeds and the rejected entry is deleted."""
    a0, meta = entry(0, n=4096)
    k = [make_key("mid", str(i)) for i in range(4)]
    with DiskTier(tmp_path, 10**8, fingerprint=FP, retry_s=1e-3) as t:
        assert t.put(k[0], a0, meta) and t.put(k[1], a0, meta)
        os.truncate(data_file(t, k[1]), 10)
        use_os(monkeypatch, ReadOnlyOS(code))
        assert t.get(k[1], meta) == (None, "disk_truncated")   # today: OSError out of the delete's lock
        time.sleep(0.002)
        assert t.get(k[1], meta) == (None, "disk_truncated")   # still there, still refused
        time.sleep(0.002)
        out, reason = t.get(k[0], meta)                         # the touch fails
        assert reason is None and same(out, a0)
        time.sleep(0.002)
        assert t.put(k[2], a0, meta) is False and k[2] not in t
        time.sleep(0.002)
        assert t.delete(k[0]) is False and k[0] in t
        s = t.stats()
        assert s["write_faults_by_op"] == {"delete": 3, "touch": 1, "lock": 1}, s
        assert s["writable"] is False and s["write_fault"] == f"delete: {errno.errorcode[code]}: {os.strerror(code)}"
        assert s["hits"] == 1 and s["misses_by_reason"] == {"disk_truncated": 2}
        use_os(monkeypatch, os)
        time.sleep(0.002)
        assert t.put(k[3], a0, meta) and t.stats()["writable"] is True
        assert t.get(k[1], meta) == (None, "disk_truncated") and k[1] not in t   # now deleted
        assert t.get(k[0], meta)[1] is None and t.get(k[3], meta)[1] is None


def test_eviction_failing_is_a_refused_put_and_keeps_the_cap(tmp_path, monkeypatch):
    k = [make_key("ev", str(i)) for i in range(3)]
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as t:
        assert t.put(k[0], *entry(0, 1 << 14))
        one = t.stats()["bytes"]
    with DiskTier(tmp_path, one * 3 // 2, fingerprint=FP) as t:
        real = os.rename

        def rename(src, dst, *a, **kw):
            if os.path.basename(os.path.dirname(dst)) == ".trash":
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), src)
            return real(src, dst, *a, **kw)
        monkeypatch.setattr(os, "rename", rename)
        assert t.put(k[1], *entry(1, 1 << 14)) is False                   # k0 must go first and cannot
        monkeypatch.setattr(os, "rename", real)
        assert t.stats()["write_faults_by_op"] == {"evict": 1} and k[0] in t and k[1] not in t
        assert disk_bytes(t) <= one * 3 // 2


def test_a_prefetch_cancelled_by_close_is_a_miss(tmp_path, monkeypatch):
    """A store dropped while loads are queued (the engine rebuilds its prefix store) closes its tier:
    a queued load is cancelled, and its handle answers "disk_not_ready" instead of raising
    CancelledError into the request that waits on it."""
    import threading
    from tests.cache.test_disk_tier import gate_loads
    arrays, meta = entry(0)
    t = DiskTier(tmp_path, 10**8, fingerprint=FP, prefetch_workers=1)
    k0, k1 = make_key("c", "0"), make_key("c", "1")
    assert t.put(k0, arrays, meta) and t.put(k1, arrays, meta)
    gate = gate_loads(t, monkeypatch)
    h0, h1 = t.prefetch(k0, meta), t.prefetch(k1, meta)      # h0 runs (held at the gate), h1 waits in the queue
    closer = threading.Thread(target=t.close)
    closer.start()
    time.sleep(0.05)
    gate.set()
    closer.join(30)
    assert h1.result("wait") == (None, "disk_not_ready")     # today: CancelledError
    out, reason = h0.result("wait")
    assert reason is None and same(out, arrays)


def test_errno_of_an_orbax_error():
    assert disk_tier.os_errno(ValueError("x: No space left on device [os_error_code='28']")) == errno.ENOSPC
    try:
        try:
            raise OSError(errno.EROFS, "ro")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as e:
        assert disk_tier.os_errno(e) == errno.EROFS
    assert disk_tier.os_errno(ValueError("no code")) is None


# ---- 3. two processes on one directory -----------------------------------------------------------

WORKER = r"""
import json, sys, time
import numpy as np
from cache.disk_tier import DiskTier
from cache.tier_entry import make_key
from tests.cache.test_disk_tier import entry, same
directory, fp, cap, me, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
N = 12                                            # keys in play; the cap holds about 4 entries
want = {i: entry(i, 1 << 12) for i in range(N)}   # what key i must hold (both processes agree)
t = DiskTier(directory, cap, fingerprint=fp)
rng = np.random.default_rng(me)
out = {"hits": 0, "misses": 0, "wrong": 0, "puts": 0, "errors": []}
for r in range(rounds):
    i = int(rng.integers(N))
    try:
        out["puts"] += bool(t.put(make_key("shared", str(i)), *want[i]))
        for j in rng.integers(N, size=3):
            got, reason = t.get(make_key("shared", str(int(j))), want[int(j)][1])
            if reason is None:
                out["hits"] += 1
                out["wrong"] += not same(got, want[int(j)][0])
            else:
                out["misses"] += 1
                if reason != "disk_missing":
                    out["errors"].append(reason)
        if r % 10 == 0:                              # a server (re)starting on the directory meanwhile
            DiskTier(directory, cap, fingerprint=fp).close()
    except Exception as e:
        out["errors"].append(repr(e))
s = t.stats()
out.update(evictions=s["evictions"], writable=s["writable"], rejected=s["rejected_puts_by_reason"])
print(json.dumps(out), flush=True)
"""


def test_two_processes_write_read_and_evict_one_directory(tmp_path):
    """Two servers' tiers on one directory, each publishing, replacing, reading and evicting under a
    cap that holds about four of the twelve entries in play, and opening the directory anew (which
    cleans leftovers) every ten rounds: no entry is ever served wrong, nothing raises, every miss is
    an entry the other evicted, and the cap holds over both."""
    with DiskTier(tmp_path / "probe", 10**8, fingerprint=FP) as t:
        assert t.put(make_key("probe"), *entry(0, 1 << 12))
        one = t.stats()["bytes"]
    cap = one * 4 + one // 2
    procs = [run_py(WORKER, str(tmp_path / "kv"), FP, str(cap), str(me), "60") for me in (1, 2)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for r in results:
        assert r["wrong"] == 0 and r["errors"] == [] and r["writable"], r
        assert r["hits"] > 0 and r["misses"] > 0 and r["puts"] > 30 and r["evictions"] > 0, r
        assert set(r["rejected"]) <= {"lock_timeout"}, r
    with DiskTier(tmp_path / "kv", cap, fingerprint=FP) as t:
        assert disk_bytes(t) <= cap and t.stats()["bytes"] == disk_bytes(t)
        assert os.listdir(tmp_path / "kv" / ".tmp") == [] and os.listdir(tmp_path / "kv" / ".trash") == []
        for k in t.keys():
            i = next(i for i in range(12) if make_key("shared", str(i)) == k)
            out, reason = t.get(k, entry(i, 1 << 12)[1])
            assert reason is None and same(out, entry(i, 1 << 12)[0])


def test_an_entry_replaced_by_another_process_counts_at_its_new_size(tmp_path):
    """Process A knows entry k at its size; process B replaces k with a bigger one. A's next put must
    see k's new size (its inode changed), or it evicts too little and the directory passes the cap."""
    k, k2 = make_key("replaced"), make_key("next")
    sizes = {}
    for name, n in (("small", 1 << 12), ("big", 1 << 16), ("next", 1 << 16)):
        with DiskTier(tmp_path / name, 10**9, fingerprint=FP) as t:
            assert t.put(k, *entry(0, n))
            sizes[name] = t.stats()["bytes"]
    margin = sizes["small"] // 2                        # Orbax's files vary by a few KB from write to write
    cap = sizes["big"] + sizes["next"] - margin         # k (big) and k2 do not fit together; k (small) and k2 do
    with DiskTier(tmp_path / "kv", cap, fingerprint=FP) as a, DiskTier(tmp_path / "kv", cap, fingerprint=FP) as b:
        assert a.put(k, *entry(0, 1 << 12))
        assert b.put(k, *entry(0, 1 << 16))                     # b replaces it: a still knows the small one
        assert a.put(k2, *entry(2, 1 << 16))
        assert disk_bytes(a) <= cap, (disk_bytes(a), cap)       # today: over the cap by about the difference
        assert k not in a and a.stats()["evictions"] == 1


def test_a_cleaner_racing_a_writer_never_deletes_its_temp_directory(tmp_path, monkeypatch):
    """Another process opens the directory (and cleans dead writers' leftovers) between this writer's
    creating its temp lock and locking it. The writer notices its lock was removed and takes a new
    one, so a later cleaner cannot mistake its live temp directory for a dead writer's."""
    import fcntl
    arrays, meta = entry(0)
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as t:
        real, raced = fcntl.flock, []

        def flock(fd, op):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if op == fcntl.LOCK_EX and path.endswith(".lock") and "/.tmp/" in path and not raced:
                raced.append(path)
                DiskTier(tmp_path, 10**8, fingerprint=FP).close()       # the other process's open
            return real(fd, op)
        monkeypatch.setattr(fcntl, "flock", flock)
        seen = []
        real_write = t._write

        def write(tmp, *a):
            seen.append((tmp, os.path.exists(tmp + ".lock")))
            DiskTier(tmp_path, 10**8, fingerprint=FP).close()           # and again, mid-write
            return real_write(tmp, *a)
        monkeypatch.setattr(t, "_write", write)
        assert t.put(make_key("race"), arrays, meta)
        assert raced and seen == [(seen[0][0], True)]                   # today: the lock file is gone
        out, reason = t.get(make_key("race"), meta)
        assert reason is None and same(out, arrays)


def test_a_stuck_lock_holder_skips_the_write(tmp_path):
    """A process holding .lock and stopped (not dead) does not hang this one's writes: the put is
    refused as "lock_timeout" after lock_timeout_s; reads need no lock."""
    import fcntl
    import threading
    arrays, meta = entry(0)
    with DiskTier(tmp_path, 10**8, fingerprint=FP, lock_timeout_s=0.2) as t:
        assert t.put(make_key("s", "0"), arrays, meta)
        fd = os.open(tmp_path / ".lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)                      # the stuck holder
        got = []
        try:
            t0 = time.monotonic()
            th = threading.Thread(target=lambda: got.append(t.put(make_key("s", "1"), arrays, meta)))
            th.start()
            th.join(5)
            assert not th.is_alive(), "the put waits for the lock for ever"   # today
            assert got == [False] and 0.2 <= time.monotonic() - t0 < 5
            assert t.get(make_key("s", "0"), meta)[1] is None
        finally:
            os.close(fd)
            th.join(30)
        s = t.stats()
        assert s["rejected_puts_by_reason"] == {"lock_timeout": 1} and s["writable"] is True
        assert t.put(make_key("s", "1"), arrays, meta)


def test_warm_up_leaves_another_models_entries_alone(tmp_path):
    """Servers of two models on one directory: warming up reads an entry without counting or
    deleting it, so one server's start does not delete the other's entries."""
    arrays, meta = entry(0)
    with DiskTier(tmp_path, 10**8, fingerprint=FP) as a:
        assert a.put(make_key("model a"), arrays, meta)
    with DiskTier(tmp_path, 10**8, fingerprint="model-b") as b:
        assert b.warm() is False
        assert b.keys() == [make_key("model a")] and b.stats()["misses"] == 0
