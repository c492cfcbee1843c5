"""The disk tier of the prefix cache: Orbax-written entries named by prefix-chain hash, byte-capped, fail-closed.

The tier is in three rooms: this module (`DiskTier`: put, get, prefetch, the cap, writes off / on),
cache.disk_entry (an entry's on-disk format, written and read back fail-closed) and
cache.disk_directory (the directory's layout, its cross-process lock, writers' temp directories,
the cleaner of dead writers' leftovers, the trash).

Atomic publish. `put` writes the entry (cache.disk_entry.write_entry) into a private temp directory,
fsyncs every file, then renames the directory to entries/<key> (one rename(2): readers see the
whole entry or nothing) and fsyncs entries/. A writer killed at any point leaves only a temp
directory whose lock is no longer held; `DiskTier(...)` deletes such leftovers on open. Deletion is
the reverse: rename into .trash/, then remove.

Integrity, fail-closed. `get` checks that the entry exists ("disk_missing"), then every check of
cache.disk_entry.read_entry (seal, key, sizes, fingerprint, the reader's expected EntryMeta,
checksums). Every rejection except "disk_missing" deletes the entry, so it is recomputed and never
served (where the directory cannot be written, the rejected entry stays, and is refused again at
every read).

Cap and LRU. The tier's bytes (sizes of all files of published entries) never exceed cap_bytes
after a put: older entries are evicted by last access, which is the entry directory's mtime
(touched on every hit), so the order survives restarts. A tier's stamps are strictly increasing,
start above every entry's mtime at open, and are also kept in memory, so that a wall clock stepped
backwards or a file system with coarse timestamps cannot reorder the accesses made through it.
An entry whose raw array bytes or written size exceed the cap is refused: `put` returns False and
counts it; it never raises for I/O.

A directory that cannot be written (read-only file system, full disk, quota, permissions, a file
where a directory belongs) never fails a request. Every write (the probe at open, the temp lock,
the entry's files, publish, eviction, the touch on a hit, deleting a rejected entry) that fails
with an OSError turns writes off: one warning names the directory, the operation and the error,
`stats()` counts it ("writable", "write_faults", "write_faults_by_op", "write_fault"), puts are
refused as "writes_off" without touching the disk, and reads of valid entries go on. Writes are
tried again after `retry_s` seconds (a full disk may get room); a put that then succeeds logs that
writes resumed. A directory that cannot even be created or listed is a tier with nothing in it and
writes off: the engine runs as without a tier, with the warning. (Only a vanished file, ENOENT, is
not a fault: another process may have evicted what this one was touching.)

Several processes (servers) may share one directory, and do so safely; none needs to be told of the
others. A reader needs no lock: publish and delete are renames, and every read validates the entry
against the key it was read under, its seal, sizes and checksums, so an entry another process
evicts or replaces mid-read is a miss ("disk_missing"), never a mixture. Writers serialise publish +
eviction with the flock on .lock and re-read entries/ under it (sizes by inode), so the cap holds
over everything every process wrote. A writer that cannot take .lock within `lock_timeout_s` (a
holder stopped, not dead: the kernel frees a dead holder's flock) skips that write ("lock_timeout").
Servers of different models may share it too: their keys differ (keys hash the weights'
fingerprint), and warm-up reads an entry without counting or deleting it. This needs a local file
system (flock, atomic rename(2)); tests/cache/test_disk_tier_faults.py runs two processes writing,
reading and evicting the same directory under its cap.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import errno
import logging
import os
import shutil
import threading
import time
import uuid
from typing import Mapping

import numpy as np

from cache.disk_directory import (NOT_A_FAULT, clean_leftovers, describe, dir_lock, make_dirs, os_errno, temp_dir,
                                  trash)
from cache.disk_entry import Reject, dir_bytes, fsync_path, read_entry, write_entry
from cache.tier_entry import Arrays, EntryMeta, Outcome, PrefetchHandle, validate_key

log = logging.getLogger(__name__)

__all__ = ["DISK_REASONS", "DiskTier", "os_errno"]

DISK_REASONS = ("disk_missing", "disk_corrupt", "disk_key_mismatch", "disk_truncated", "disk_foreign_model",
                "disk_abi_mismatch", "disk_dtype_mismatch", "disk_shape_mismatch", "disk_range_mismatch",
                "disk_not_ready", "disk_timeout")
WRITE_RETRY_S = 60.0          # writes off after a fault: tried again after this long
LOCK_TIMEOUT_S = 10.0         # longest wait for the directory lock before a write is skipped


class DiskTier:
    """Byte-capped, Orbax-backed store of prefix-cache entries for one model (weights `fingerprint`).

    put(key, arrays, meta) -> bool; get(key, expect) -> (arrays, None) | (None, reason);
    prefetch(key, expect) -> PrefetchHandle; stats() -> dict; writable() -> bool. Thread-safe;
    several processes may share a directory (see the module docstring). Never raises for I/O: an
    unwritable directory turns writes off (`retry_s`: when they are tried again).
    """

    def __init__(self, directory: str | os.PathLike, cap_bytes: int, *, fingerprint: str, prefetch_workers: int = 2,
                 durable: bool = True, retry_s: float = WRITE_RETRY_S, lock_timeout_s: float = LOCK_TIMEOUT_S):
        if not isinstance(cap_bytes, int) or cap_bytes <= 0:
            raise ValueError(f"DiskTier cap_bytes must be a positive int, got {cap_bytes!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"DiskTier fingerprint must be a non-empty string, got {fingerprint!r}")
        if not retry_s > 0 or not lock_timeout_s > 0:
            raise ValueError(f"DiskTier retry_s and lock_timeout_s must be positive, got {retry_s!r}, {lock_timeout_s!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.cap_bytes = cap_bytes
        self.fingerprint = fingerprint
        self.durable = durable
        self.retry_s = float(retry_s)
        self.lock_timeout_s = float(lock_timeout_s)
        self._entries = os.path.join(self.directory, "entries")
        self._tmp = os.path.join(self.directory, ".tmp")
        self._trash = os.path.join(self.directory, ".trash")
        self._lock = threading.Lock()          # guards _sizes, _inos, _stamps, _bad, the fault state and the counters
        self._sizes: dict[str, int] = {}       # published key -> bytes on disk (this process's view)
        self._inos: dict[str, int] = {}        # published key -> inode its size was taken from
        self._stamps: dict[str, int] = {}      # key -> this process's last access stamp (ns)
        self._bad: dict[str, tuple[int, str]] = {}   # key -> (inode, reason): rejected, could not be deleted
        self._last_stamp = 0
        self._hits = 0
        self._misses: collections.Counter[str] = collections.Counter()
        self._rejected: collections.Counter[str] = collections.Counter()
        self._faults: collections.Counter[str] = collections.Counter()
        self._fault: str | None = None         # what turned writes off (None: writes on)
        self._retry_at = 0.0                   # monotonic time from which writes are tried again
        self._puts = self._evictions = self._quarantined = self._prefetches = 0
        self._hidden_s = self._wait_s = 0.0
        self._pool = cf.ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="disk-prefetch")
        self._open()
        with self._lock:
            known = list(self._sizes)
        self._last_stamp = max((self._mtime(k) for k in known), default=0)   # new accesses sort above old ones

    # ---- public API -----------------------------------------------------------------------------

    def put(self, key: str, arrays: Mapping[str, np.ndarray], meta: EntryMeta, raw: bool = False) -> bool:
        """Store `arrays` (name -> numpy array, as `meta` describes them) under `key` (raw: in the raw
        format, cache.disk_entry); replaces an existing entry. False if refused (bigger than the cap, writes off, the directory lock not had
        in time, an I/O error), counted per reason. ValueError for a bad key, arrays that `meta` does
        not describe, or a foreign fingerprint."""
        validate_key(key)
        meta.check_arrays(arrays)
        if meta.fingerprint != self.fingerprint:
            raise ValueError(f"put: meta fingerprint {meta.fingerprint!r} is not this tier's {self.fingerprint!r}")
        if sum(a.nbytes for a in arrays.values()) > self.cap_bytes:
            return self._refuse("too_big")
        if not self.writable():
            return self._refuse("writes_off")
        tmp = lock_path = lock_fd = None
        op = "lock"
        try:
            make_dirs(self._entries, self._tmp, self._trash)
            tmp, lock_path, lock_fd = temp_dir(self._tmp, key)
            op = "write"
            os.mkdir(tmp)
            size = self._write(tmp, key, dict(arrays), meta, raw)
            if size > self.cap_bytes:
                return self._refuse("too_big")
            op = "publish"
            with self._dir_lock():
                self._refresh()
                dest = os.path.join(self._entries, key)
                op = "evict"
                if os.path.isdir(dest):
                    self._unpublish(key)
                self._evict_for(size, keep=key)
                op = "publish"
                os.rename(tmp, dest)
                if self.durable:
                    fsync_path(self._entries, directory=True)
                ino = os.stat(dest).st_ino
                with self._lock:
                    self._sizes[key], self._inos[key] = size, ino
                    self._bad.pop(key, None)
                    self._puts += 1
                self._resumed()
                self._touch(key, dest)
            return True
        except TimeoutError:
            return self._refuse("lock_timeout")
        except Exception as e:  # noqa: BLE001 - a failed write is a refused put, never an error for the caller
            self._write_fault(op, e)
            return self._refuse("io_error")
        finally:
            if tmp is not None:
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
        """Keys of the published entries (valid or not: validity is checked by `get`); [] when
        entries/ cannot be listed."""
        try:
            names = os.listdir(self._entries)
        except OSError:
            return []
        return sorted(k for k in names if not k.startswith("."))

    def delete(self, key: str) -> bool:
        """Remove the entry under `key`; False if there was none (or it could not be removed)."""
        validate_key(key)
        try:
            with self._dir_lock():
                return self._unpublish(key)
        except TimeoutError:
            return False
        except OSError as e:
            self._write_fault("delete", e)
            return False

    def writable(self) -> bool:
        """Whether a put would try to write now: writes are on, or off and due to be tried again."""
        with self._lock:
            return self._fault is None or time.monotonic() >= self._retry_at

    def health(self) -> dict:
        """writable, write_faults, write_fault: the fault figures of `stats()` without reading the
        directory (cheap enough for every metrics scrape)."""
        with self._lock:
            return {"writable": self._fault is None, "write_faults": sum(self._faults.values()),
                    "write_fault": self._fault}

    def warm(self, tries: int = 4) -> bool:
        """Reads one entry of this model (of the first `tries`) and throws it away, so the first real
        hit does not pay Orbax's start-up. Counts nothing and deletes nothing (another model sharing
        the directory keeps its entries). Whether an entry was read."""
        for k in self.keys()[:tries]:
            try:
                self._read(os.path.join(self._entries, k), k, None)
                return True
            except Exception:  # noqa: BLE001 - a bad or foreign entry: try the next; `get` deals with it
                continue
        return False

    def stats(self) -> dict:
        """entries, bytes, cap_bytes, hits, misses, misses_by_reason, evictions, puts, rejected_puts,
        rejected_puts_by_reason, quarantined, prefetches, prefetch_hidden_s, prefetch_wait_s, writable,
        write_faults, write_faults_by_op, write_fault.
        entries / bytes are what entries/ holds now (other processes publish and evict too);
        prefetch_hidden_s: load time that overlapped other work before `result` was called;
        prefetch_wait_s: time callers blocked in `result`; writable: whether writes are on;
        write_fault: what turned them off ("<op>: <ERRNO>: <message>"), None while they are on."""
        self._refresh()
        with self._lock:
            return {"entries": len(self._sizes), "bytes": sum(self._sizes.values()), "cap_bytes": self.cap_bytes,
                    "hits": self._hits, "misses": sum(self._misses.values()), "misses_by_reason": dict(self._misses),
                    "evictions": self._evictions, "puts": self._puts, "rejected_puts": sum(self._rejected.values()),
                    "rejected_puts_by_reason": dict(self._rejected), "quarantined": self._quarantined,
                    "prefetches": self._prefetches, "prefetch_hidden_s": self._hidden_s,
                    "prefetch_wait_s": self._wait_s, "writable": self._fault is None,
                    "write_faults": sum(self._faults.values()), "write_faults_by_op": dict(self._faults),
                    "write_fault": self._fault}

    def close(self) -> None:
        """Stop the prefetch pool (waits for running loads)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writes off / on ------------------------------------------------------------------------

    def _write_fault(self, op: str, exc: BaseException,
                     effect: str = "writes to it are off; requests go on, and valid entries already there are "
                                   "still read") -> bool:
        """An OSError in a write (`op`): writes off until retry_s from now, counted; the first fault
        of a run of them logs one warning (what failed, and `effect`). Other errors (and ENOENT
        races) change nothing: False."""
        n = os_errno(exc)
        if n is None or n in NOT_A_FAULT:
            return False
        what = f"{op}: {describe(exc)}"
        with self._lock:
            self._faults[op] += 1
            first = self._fault is None
            self._fault = what
            self._retry_at = time.monotonic() + self.retry_s
        if first:
            log.warning("prefix cache disk tier %s: %s; %s (tried again in %g s)", self.directory, what, effect,
                        self.retry_s)
        return True

    def _resumed(self) -> None:
        with self._lock:
            was, self._fault = self._fault, None
        if was is not None:
            log.info("prefix cache disk tier %s: writes resumed (they were off after %s)", self.directory, was)

    def _open(self) -> None:
        """Creates the directories, probes that they can be written (or turns writes off, with the
        warning), deletes dead writers' leftovers and reads what entries/ holds."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            os.listdir(self.directory)
        except OSError as e:
            if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
                e = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), self.directory)
            self._write_fault("open", e if os_errno(e) not in (None, *NOT_A_FAULT) else OSError(errno.EIO, str(e)),
                              effect="it cannot be used: the engine runs without a disk tier")
            return
        try:
            make_dirs(self._entries, self._tmp, self._trash)
            probe = os.path.join(self._tmp, f"probe.{uuid.uuid4().hex}")
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            os.unlink(probe)
            os.close(os.open(os.path.join(self.directory, ".lock"), os.O_CREAT | os.O_RDWR, 0o644))
        except OSError as e:
            self._write_fault("open", e if os_errno(e) not in (None, *NOT_A_FAULT) else OSError(errno.EIO, str(e)))
        if self.writable():
            clean_leftovers(self._tmp, self._trash)
        self._refresh()

    # ---- writing --------------------------------------------------------------------------------

    def _write(self, tmp: str, key: str, arrays: Arrays, meta: EntryMeta, raw: bool = False) -> int:
        """Write the entry into `tmp` (cache.disk_entry.write_entry); its size in bytes."""
        return write_entry(tmp, key, arrays, meta, self.durable, raw)

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
        with self._lock:
            bad = self._bad.get(key)
        if bad is not None and bad[0] == ino:      # rejected before and could not be deleted then
            if self._quarantine(key, ino):
                with self._lock:
                    self._bad.pop(key, None)
            return None, bad[1]
        try:
            arrays = self._read(path, key, expect)
        except Reject as r:
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
        if not self._quarantine(key, ino):
            with self._lock:
                self._bad[key] = (ino, reason)
        return None, reason

    def _read(self, path: str, key: str, expect: EntryMeta | None) -> Arrays:
        """The checked arrays of the entry at `path` (cache.disk_entry.read_entry; Reject on a failed check)."""
        return read_entry(path, key, expect, self.fingerprint)

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

    def _dir_lock(self, timeout_s: float | None = None):
        """The flock on .lock; TimeoutError after timeout_s (default lock_timeout_s: its holder is
        alive but stuck)."""
        return dir_lock(self.directory, self.lock_timeout_s if timeout_s is None else timeout_s, self.lock_timeout_s)

    def _refresh(self) -> None:
        """Sync this process's size table with entries/ (other processes publish, replace and evict
        too: a size is taken again when its entry's inode changed)."""
        on_disk = {}
        for k in self.keys():
            try:
                on_disk[k] = os.stat(os.path.join(self._entries, k)).st_ino
            except OSError:
                continue
        with self._lock:
            known = {k: (self._inos.get(k), s) for k, s in self._sizes.items()}
        sizes = {k: known[k][1] if k in known and known[k][0] == ino else dir_bytes(os.path.join(self._entries, k))
                 for k, ino in on_disk.items()}
        with self._lock:
            self._sizes, self._inos = sizes, on_disk
            self._stamps = {k: v for k, v in self._stamps.items() if k in sizes}   # gone: evicted elsewhere
            self._bad = {k: v for k, v in self._bad.items() if on_disk.get(k) == v[0]}

    def _mtime(self, key: str) -> int:
        try:
            return os.stat(os.path.join(self._entries, key)).st_mtime_ns
        except OSError:
            return -1

    def _touch(self, key: str, path: str) -> None:
        """Mark `key` as used now: a stamp strictly above this process's previous one, kept in memory
        and written as the entry directory's mtime (for other processes and after a restart) while
        the directory can be written."""
        with self._lock:
            stamp = self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            self._stamps[key] = stamp
        if self.writable():
            try:
                os.utime(path, ns=(stamp, stamp))
            except OSError as e:
                self._write_fault("touch", e)

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
        """Move entries/<key> into .trash (atomic: readers see it gone) and delete it. OSError if it
        is there and cannot be moved."""
        try:
            dest = trash(os.path.join(self._entries, key), self._trash, key)
        finally:
            with self._lock:
                self._sizes.pop(key, None)
                self._inos.pop(key, None)
                self._stamps.pop(key, None)
        if dest is None:
            return False
        shutil.rmtree(dest, ignore_errors=True)
        return True

    def _quarantine(self, key: str, ino: int) -> bool:
        """Delete a rejected entry, unless it was replaced since it was read (different inode).
        False if it is still there (the directory cannot be written, or its lock was not had)."""
        if not self.writable():
            return False
        try:
            with self._dir_lock(min(1.0, self.lock_timeout_s)):       # a reader does not wait long
                try:
                    if os.stat(os.path.join(self._entries, key)).st_ino != ino:
                        return True
                except OSError:
                    return True
                if self._unpublish(key):
                    with self._lock:
                        self._quarantined += 1
                return True
        except TimeoutError:
            return False
        except OSError as e:
            self._write_fault("delete", e)
            return False
