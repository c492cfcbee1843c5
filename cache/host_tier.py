"""The host-RAM tier of the prefix cache: the disk tier's interface over a byte-capped LRU dict in memory.

Entries are dicts of numpy arrays with an EntryMeta (cache.tier_entry), keyed by prefix-chain hash.
`put` copies the arrays and marks the copies read-only, so neither the writer nor a reader can
change what later readers get; `get` returns those read-only arrays without copying. The cap is on
the arrays' bytes; least recently used entries are evicted first, and each evicted entry is handed
to `on_evict(key, arrays, meta)` if given, which is how an entry moves HOST -> DISK (pass
`disk_tier.put`). Miss reasons: "host_missing", "host_foreign_model", "host_abi_mismatch",
"host_dtype_mismatch", "host_shape_mismatch", "host_range_mismatch"; a mismatching entry is
dropped. `prefetch` exists for symmetry with the disk tier: a host load is a dict lookup, so the
handle is ready at once.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from typing import Callable, Mapping

import numpy as np

from cache.tier_entry import Arrays, EntryMeta, Outcome, PrefetchHandle, validate_key

HOST_REASONS = ("host_missing", "host_foreign_model", "host_abi_mismatch", "host_dtype_mismatch",
                "host_shape_mismatch", "host_range_mismatch", "host_not_ready", "host_timeout")


class HostTier:
    """Byte-capped LRU store of prefix-cache entries in host RAM for one model (weights `fingerprint`).

    put(key, arrays, meta) -> bool; get(key, expect) -> (arrays, None) | (None, reason);
    prefetch(key, expect) -> PrefetchHandle; stats() -> dict. Thread-safe.
    """

    def __init__(self, cap_bytes: int, *, fingerprint: str,
                 on_evict: Callable[[str, Arrays, EntryMeta], object] | None = None):
        if not isinstance(cap_bytes, int) or cap_bytes <= 0:
            raise ValueError(f"HostTier cap_bytes must be a positive int, got {cap_bytes!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"HostTier fingerprint must be a non-empty string, got {fingerprint!r}")
        self.cap_bytes = cap_bytes
        self.fingerprint = fingerprint
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, tuple[Arrays, EntryMeta, int]] = collections.OrderedDict()
        self._bytes = self._hits = self._puts = self._evictions = self._dropped = self._prefetches = 0
        self._misses: collections.Counter[str] = collections.Counter()
        self._rejected: collections.Counter[str] = collections.Counter()

    def put(self, key: str, arrays: Mapping[str, np.ndarray], meta: EntryMeta) -> bool:
        """Store a read-only copy of `arrays` under `key` (replacing one there), evicting LRU entries;
        False (counted as "too_big") if the arrays alone exceed the cap. ValueError as DiskTier.put."""
        validate_key(key)
        meta.check_arrays(arrays)
        if meta.fingerprint != self.fingerprint:
            raise ValueError(f"put: meta fingerprint {meta.fingerprint!r} is not this tier's {self.fingerprint!r}")
        size = sum(a.nbytes for a in arrays.values())
        if size > self.cap_bytes:
            with self._lock:
                self._rejected["too_big"] += 1
            return False
        copies = {}
        for n, a in arrays.items():
            c = np.array(a, copy=True)
            c.flags.writeable = False
            copies[n] = c
        evicted = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            while self._bytes + size > self.cap_bytes:
                k, (arrs, m, s) = self._entries.popitem(last=False)
                self._bytes -= s
                self._evictions += 1
                evicted.append((k, arrs, m))
            self._entries[key] = (copies, meta, size)
            self._bytes += size
            self._puts += 1
        if self.on_evict is not None:
            for k, arrs, m in evicted:
                self.on_evict(k, arrs, m)
        return True

    def get(self, key: str, expect: EntryMeta | None = None) -> Outcome:
        """(read-only arrays, None) or (None, reason) with reason in HOST_REASONS."""
        validate_key(key)
        outcome = self._load(key, expect)
        self._record(outcome)
        return outcome

    def prefetch(self, key: str, expect: EntryMeta | None = None) -> PrefetchHandle:
        """A handle that is ready at once (a host load is a lookup); same policies as the disk tier."""
        validate_key(key)
        fut: cf.Future = cf.Future()
        fut.set_result(self._load(key, expect))
        with self._lock:
            self._prefetches += 1
        return PrefetchHandle(key, fut, "host", lambda o, h, w: self._record(o))

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return validate_key(key) in self._entries

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def delete(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
        return old is not None

    def stats(self) -> dict:
        """entries, bytes, cap_bytes, hits, misses, misses_by_reason, evictions, puts, rejected_puts,
        rejected_puts_by_reason, quarantined (entries dropped for a mismatch), prefetches."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "cap_bytes": self.cap_bytes,
                    "hits": self._hits, "misses": sum(self._misses.values()), "misses_by_reason": dict(self._misses),
                    "evictions": self._evictions, "puts": self._puts, "rejected_puts": sum(self._rejected.values()),
                    "rejected_puts_by_reason": dict(self._rejected), "quarantined": self._dropped,
                    "prefetches": self._prefetches}

    def close(self) -> None:
        """Nothing to stop (no threads); present for symmetry with DiskTier."""

    def _load(self, key: str, expect: EntryMeta | None) -> Outcome:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None, "host_missing"
            arrays, meta, size = found
            reason = "host_foreign_model" if meta.fingerprint != self.fingerprint else (
                meta.mismatch(expect, "host") if expect is not None else None)
            if reason is not None:
                del self._entries[key]
                self._bytes -= size
                self._dropped += 1
                return None, reason
            self._entries.move_to_end(key)
            return dict(arrays), None

    def _record(self, outcome: Outcome) -> None:
        with self._lock:
            if outcome[1] is None:
                self._hits += 1
            else:
                self._misses[outcome[1]] += 1
