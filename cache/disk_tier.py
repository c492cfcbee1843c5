"""The disk tier of the prefix cache: Orbax-written entries named by prefix-chain hash, byte-capped, fail-closed.

Layout under `directory`:

    entries/<key>/arrays/...   the entry's arrays, one Orbax PyTree checkpoint (any dtype numpy +
                               ml_dtypes know: float32, bfloat16, int32, float8_e4m3fn, ...)
    entries/<key>/meta.json    sealed JSON: EntryMeta, a blake2b checksum per array, the size of
                               every file under arrays/ (see cache.tier_entry.sealed_json)
    .tmp/<key>.<uuid>/         an entry being written; .tmp/<key>.<uuid>.lock is flock-ed by its writer
    .trash/                    unpublished entries being deleted
    .lock                      flock-ed around publish + eviction, so the cap holds across processes

Atomic publish. `put` writes the Orbax checkpoint and meta.json into a private temp directory,
fsyncs every file, then renames the directory to entries/<key> (one rename(2): readers see the
whole entry or nothing) and fsyncs entries/. A writer killed at any point leaves only a temp
directory whose lock is no longer held; `DiskTier(...)` deletes such leftovers on open.
Deletion is the reverse: rename into .trash/, then remove.

Integrity, fail-closed. `get` checks, in order: the entry exists ("disk_missing"); meta.json
reads and its seal matches ("disk_corrupt"); every listed file is there with its size (shorter or
missing: "disk_truncated", longer: "disk_corrupt"); the weights fingerprint is this tier's
("disk_foreign_model"); the reader's expected EntryMeta matches ("disk_abi_mismatch",
"disk_dtype_mismatch", "disk_shape_mismatch", "disk_range_mismatch"); Orbax restores it and every
array has the recorded dtype, shape and checksum ("disk_corrupt"). Every rejection except
"disk_missing" deletes the entry, so it is recomputed and never served.

Cap and LRU. The tier's bytes (sizes of all files of published entries) never exceed cap_bytes
after a put: older entries are evicted by last access, which is the entry directory's mtime
(touched on every hit), so the order survives restarts. A tier's stamps are strictly increasing,
start above every entry's mtime at open, and are also kept in memory, so that a wall clock stepped
backwards or a file system with coarse timestamps cannot reorder the accesses made through it.
An entry whose raw array bytes or written size exceed the cap is refused: `put` returns False and
counts it; it never raises for I/O.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import fcntl
import math
import os
import shutil
import threading
import time
import uuid
from typing import Mapping

import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 dtype names with numpy (zero-size arrays)
import numpy as np

from cache.tier_entry import (Arrays, EntryMeta, Outcome, PrefetchHandle, checksum, open_sealed_json, sealed_json,
                              validate_key)

META = "meta.json"
ARRAYS = "arrays"
DISK_REASONS = ("disk_missing", "disk_corrupt", "disk_truncated", "disk_foreign_model", "disk_abi_mismatch",
                "disk_dtype_mismatch", "disk_shape_mismatch", "disk_range_mismatch", "disk_not_ready", "disk_timeout")


class _Reject(Exception):
    """Internal: an entry failed a check; args[0] is the reason."""


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: str) -> dict[str, int]:
    """relative path -> size of every file under root."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


def _dir_bytes(path: str) -> int:
    try:
        return sum(_files(path).values())
    except OSError:
        return 0


class DiskTier:
    """Byte-capped, Orbax-backed store of prefix-cache entries for one model (weights `fingerprint`).

    put(key, arrays, meta) -> bool; get(key, expect) -> (arrays, None) | (None, reason);
    prefetch(key, expect) -> PrefetchHandle; stats() -> dict. Thread-safe; several processes may
    share a directory (readers freely; writers serialise publish + eviction with a file lock).
    """

    def __init__(self, directory: str | os.PathLike, cap_bytes: int, *, fingerprint: str, prefetch_workers: int = 2,
                 durable: bool = True):
        if not isinstance(cap_bytes, int) or cap_bytes <= 0:
            raise ValueError(f"DiskTier cap_bytes must be a positive int, got {cap_bytes!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"DiskTier fingerprint must be a non-empty string, got {fingerprint!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.cap_bytes = cap_bytes
        self.fingerprint = fingerprint
        self.durable = durable
        self._entries = os.path.join(self.directory, "entries")
        self._tmp = os.path.join(self.directory, ".tmp")
        self._trash = os.path.join(self.directory, ".trash")
        for d in (self._entries, self._tmp, self._trash):
            os.makedirs(d, exist_ok=True)
        self._lock = threading.Lock()          # guards _sizes and the counters
        self._sizes: dict[str, int] = {}       # published key -> bytes on disk (this process's view)
        self._stamps: dict[str, int] = {}      # key -> this process's last access stamp (ns)
        self._last_stamp = 0
        self._hits = 0
        self._misses: collections.Counter[str] = collections.Counter()
        self._rejected: collections.Counter[str] = collections.Counter()
        self._puts = self._evictions = self._quarantined = self._prefetches = 0
        self._hidden_s = self._wait_s = 0.0
        self._pool = cf.ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="disk-prefetch")
        self._clean_leftovers()
        with self._dir_lock():
            self._refresh()
        with self._lock:
            known = list(self._sizes)
        self._last_stamp = max((self._mtime(k) for k in known), default=0)   # new accesses sort above old ones

    # ---- public API -----------------------------------------------------------------------------

    def put(self, key: str, arrays: Mapping[str, np.ndarray], meta: EntryMeta) -> bool:
        """Store `arrays` (name -> numpy array, as `meta` describes them) under `key`; replaces an
        existing entry. False if refused (bigger than the cap, or an I/O error), counted per reason.
        ValueError for a bad key, arrays that `meta` does not describe, or a foreign fingerprint."""
        validate_key(key)
        meta.check_arrays(arrays)
        if meta.fingerprint != self.fingerprint:
            raise ValueError(f"put: meta fingerprint {meta.fingerprint!r} is not this tier's {self.fingerprint!r}")
        if sum(a.nbytes for a in arrays.values()) > self.cap_bytes:
            return self._refuse("too_big")
        name = f"{key}.{uuid.uuid4().hex}"
        tmp, lock_path = os.path.join(self._tmp, name), os.path.join(self._tmp, name + ".lock")
        lock_fd = None
        try:
            lock_fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            os.mkdir(tmp)
            size = self._write(tmp, dict(arrays), meta)
            if size > self.cap_bytes:
                return self._refuse("too_big")
            with self._dir_lock():
                self._refresh()
                dest = os.path.join(self._entries, key)
                if os.path.isdir(dest):
                    self._unpublish(key)
                self._evict_for(size, keep=key)
                os.rename(tmp, dest)
                self._touch(key, dest)
                if self.durable:
                    _fsync_path(self._entries, directory=True)
                with self._lock:
                    self._sizes[key] = size
                    self._puts += 1
            return True
        except Exception:  # noqa: BLE001 - a failed write is a refused put, never an error for the caller
            return self._refuse("io_error")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(lock_path)
                os.close(lock_fd)

    def get(self, key: str, expect: EntryMeta | None = None) -> Outcome:
        """(arrays, None) if a valid entry is stored under `key` (and matches `expect` if given), else
        (None, reason) with reason in DISK_REASONS. A rejected entry is deleted."""
        validate_key(key)
        outcome = self._load(key, expect)
        self._record(outcome, 0.0, 0.0, prefetch=False)
        return outcome

    def prefetch(self, key: str, expect: EntryMeta | None = None) -> PrefetchHandle:
        """Start loading `key` on the thread pool now; see PrefetchHandle.result for the policies."""
        validate_key(key)
        fut = self._pool.submit(self._load, key, expect)
        with self._lock:
            self._prefetches += 1
        return PrefetchHandle(key, fut, "disk", lambda o, h, w: self._record(o, h, w, prefetch=True))

    def __contains__(self, key: str) -> bool:
        return os.path.isdir(os.path.join(self._entries, validate_key(key)))

    def keys(self) -> list[str]:
        """Keys of the published entries (valid or not: validity is checked by `get`)."""
        return sorted(k for k in os.listdir(self._entries) if not k.startswith("."))

    def delete(self, key: str) -> bool:
        """Remove the entry under `key`; False if there was none."""
        validate_key(key)
        with self._dir_lock():
            return self._unpublish(key)

    def stats(self) -> dict:
        """entries, bytes, cap_bytes, hits, misses, misses_by_reason, evictions, puts, rejected_puts,
        rejected_puts_by_reason, quarantined, prefetches, prefetch_hidden_s, prefetch_wait_s.
        entries / bytes are what entries/ holds now (other processes publish and evict too);
        prefetch_hidden_s: load time that overlapped other work before `result` was called;
        prefetch_wait_s: time callers blocked in `result`."""
        self._refresh()
        with self._lock:
            return {"entries": len(self._sizes), "bytes": sum(self._sizes.values()), "cap_bytes": self.cap_bytes,
                    "hits": self._hits, "misses": sum(self._misses.values()), "misses_by_reason": dict(self._misses),
                    "evictions": self._evictions, "puts": self._puts, "rejected_puts": sum(self._rejected.values()),
                    "rejected_puts_by_reason": dict(self._rejected), "quarantined": self._quarantined,
                    "prefetches": self._prefetches, "prefetch_hidden_s": self._hidden_s,
                    "prefetch_wait_s": self._wait_s}

    def close(self) -> None:
        """Stop the prefetch pool (waits for running loads)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writing --------------------------------------------------------------------------------

    def _write(self, tmp: str, arrays: Arrays, meta: EntryMeta) -> int:
        """Write the entry into `tmp` (Orbax checkpoint + sealed meta), fsync it; its size in bytes."""
        import orbax.checkpoint as ocp  # noqa: PLC0415 - keeps `import cache` light
        arrays_dir = os.path.join(tmp, ARRAYS)
        stored = {n: a for n, a in arrays.items() if a.size}   # Orbax cannot write zero-size arrays; the
        if stored:                                             # meta alone rebuilds them
            ocp.PyTreeCheckpointer().save(arrays_dir, args=ocp.args.PyTreeSave(stored))
        files = _files(arrays_dir) if stored else {}
        body = {"meta": meta.to_json(), "checksums": {n: checksum(a) for n, a in arrays.items()}, "files": files}
        raw = sealed_json(body)
        with open(os.path.join(tmp, META), "wb") as f:
            f.write(raw)
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        if self.durable:
            for d, _, names in os.walk(tmp):
                for n in names:
                    _fsync_path(os.path.join(d, n))
                _fsync_path(d, directory=True)
        return sum(files.values()) + len(raw)

    def _refuse(self, reason: str) -> bool:
        with self._lock:
            self._rejected[reason] += 1
        return False

    # ---- reading --------------------------------------------------------------------------------

    def _load(self, key: str, expect: EntryMeta | None) -> Outcome:
        """The checks of the module docstring; deletes a rejected entry. Never raises."""
        path = os.path.join(self._entries, key)
        try:
            ino = os.stat(path).st_ino
        except OSError:
            return None, "disk_missing"
        try:
            arrays = self._read(path, expect)
        except _Reject as r:
            reason = r.args[0]
        except Exception:  # noqa: BLE001 - anything unreadable is corrupt (fail closed)
            reason = "disk_corrupt"
        else:
            self._touch(key, path)
            return arrays, None
        try:  # concurrently evicted or replaced while we read: a miss, not a corrupt entry
            if os.stat(path).st_ino != ino:
                return None, "disk_missing"
        except OSError:
            return None, "disk_missing"
        self._quarantine(key, ino)
        return None, reason

    def _read(self, path: str, expect: EntryMeta | None) -> Arrays:
        try:
            with open(os.path.join(path, META), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise _Reject("disk_truncated") from None
        try:
            body = open_sealed_json(raw)
            meta = EntryMeta.from_json(body["meta"])
            sums, files = dict(body["checksums"]), dict(body["files"])
        except (ValueError, KeyError, TypeError):
            raise _Reject("disk_corrupt") from None
        arrays_dir = os.path.join(path, ARRAYS)
        for rel, size in files.items():
            try:
                actual = os.path.getsize(os.path.join(arrays_dir, rel))
            except FileNotFoundError:
                raise _Reject("disk_truncated") from None
            if actual != size:
                raise _Reject("disk_truncated" if actual < size else "disk_corrupt")
        if meta.fingerprint != self.fingerprint:
            raise _Reject("disk_foreign_model")
        if expect is not None:
            reason = meta.mismatch(expect, "disk")
            if reason is not None:
                raise _Reject(reason)
        import orbax.checkpoint as ocp  # noqa: PLC0415
        names = [n for n, s in meta.shapes.items() if math.prod(s)]
        out = {}
        if names:
            restore = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
            out = ocp.PyTreeCheckpointer().restore(arrays_dir, args=ocp.args.PyTreeRestore(restore_args=restore))
        if not isinstance(out, dict) or set(out) != set(names) or set(sums) != set(meta.dtypes):
            raise _Reject("disk_corrupt")
        arrays = {n: np.asarray(out[n]) if n in out else np.empty(meta.shapes[n], np.dtype(meta.dtypes[n]))
                  for n in meta.dtypes}
        for n, a in arrays.items():
            if a.dtype.name != meta.dtypes[n] or a.shape != meta.shapes[n] or checksum(a) != sums[n]:
                raise _Reject("disk_corrupt")
        return arrays

    def _record(self, outcome: Outcome, hidden_s: float, wait_s: float, *, prefetch: bool) -> None:
        with self._lock:
            if outcome[1] is None:
                self._hits += 1
            else:
                self._misses[outcome[1]] += 1
            if prefetch:
                self._hidden_s += hidden_s
                self._wait_s += wait_s

    # ---- directory maintenance ------------------------------------------------------------------

    @contextlib.contextmanager
    def _dir_lock(self):
        fd = os.open(os.path.join(self.directory, ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)   # closing releases the flock

    def _refresh(self) -> None:
        """Sync this process's size table with entries/ (other processes publish and evict too)."""
        on_disk = set(self.keys())
        with self._lock:
            known = dict(self._sizes)
        sizes = {k: known[k] if k in known else _dir_bytes(os.path.join(self._entries, k)) for k in on_disk}
        with self._lock:
            self._sizes = sizes
            self._stamps = {k: v for k, v in self._stamps.items() if k in sizes}   # gone: evicted elsewhere

    def _mtime(self, key: str) -> int:
        try:
            return os.stat(os.path.join(self._entries, key)).st_mtime_ns
        except OSError:
            return -1

    def _touch(self, key: str, path: str) -> None:
        """Mark `key` as used now: a stamp strictly above this process's previous one, kept in memory
        and written as the entry directory's mtime (for other processes and after a restart)."""
        with self._lock:
            stamp = self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            self._stamps[key] = stamp
        with contextlib.suppress(OSError):
            os.utime(path, ns=(stamp, stamp))

    def _evict_for(self, size: int, keep: str) -> None:
        """Evict least recently used entries until `size` more bytes fit under the cap."""
        with self._lock:
            total = sum(self._sizes.values())
            cands = [k for k in self._sizes if k != keep]
        if total + size <= self.cap_bytes:
            return
        def atime(k: str) -> int:
            mtime = self._mtime(k)
            with self._lock:
                return max(mtime, self._stamps.get(k, -1))
        for k in sorted(cands, key=lambda k: (atime(k), k)):
            if total + size <= self.cap_bytes:
                break
            with self._lock:
                total -= self._sizes.get(k, 0)
                self._evictions += 1
            self._unpublish(k)

    def _unpublish(self, key: str) -> bool:
        """Move entries/<key> into .trash (atomic: readers see it gone) and delete it."""
        dest = os.path.join(self._trash, f"{key}.{uuid.uuid4().hex}")
        try:
            os.rename(os.path.join(self._entries, key), dest)
        except FileNotFoundError:
            return False
        finally:
            with self._lock:
                self._sizes.pop(key, None)
                self._stamps.pop(key, None)
        shutil.rmtree(dest, ignore_errors=True)
        return True

    def _quarantine(self, key: str, ino: int) -> None:
        """Delete a rejected entry, unless it was replaced since it was read (different inode)."""
        with self._dir_lock():
            try:
                if os.stat(os.path.join(self._entries, key)).st_ino != ino:
                    return
            except OSError:
                return
            if self._unpublish(key):
                with self._lock:
                    self._quarantined += 1

    def _clean_leftovers(self) -> None:
        """Delete temp dirs of dead writers (their lock is free or gone) and everything in .trash."""
        for n in os.listdir(self._trash):
            shutil.rmtree(os.path.join(self._trash, n), ignore_errors=True)
        names = os.listdir(self._tmp)
        for n in names:
            if not n.endswith(".lock"):
                continue
            p = os.path.join(self._tmp, n)
            try:
                fd = os.open(p, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue        # a live writer holds it
            shutil.rmtree(p[:-len(".lock")], ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(p)
            os.close(fd)
        for n in names:
            p = os.path.join(self._tmp, n)
            if not n.endswith(".lock") and not os.path.exists(p + ".lock"):
                shutil.rmtree(p, ignore_errors=True)
