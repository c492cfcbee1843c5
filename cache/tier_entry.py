"""What the disk tier of the prefix cache stores: entry metadata, keys, checksums, prefetch handles.

A tier entry is one cached prefix object (a block of KV pages, an MLA latent, indexer keys, a
recurrent-state checkpoint, an SWA window, ...) as a flat dict of numpy arrays, name -> array, plus
an `EntryMeta` that says what makes it valid: the weights fingerprint of the model that wrote it,
the kernel ABI id of every array, each array's dtype name and shape, and the token range [start,
end) it covers (end is the boundary a reader resumes at).

Keys are prefix-chain hashes (lowercase hex, see cache.prefix_index.block_key). The disk tier
names directories by key, so `validate_key` is strict: nothing a request sends can become a path.
`make_key` turns several strings (a chain key, a group name, a kind) into one such key.

`PrefetchHandle` is what the disk tier's `prefetch` returns: the load runs on a thread pool; the
caller chooses at `result` time how long it is willing to wait (policy "best_effort" / "wait" /
"timeout").
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import re
import threading
import time
import types
from typing import Callable, Mapping

import numpy as np

KEY_RE = re.compile(r"[0-9a-f]{16,128}")
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
POLICIES = ("best_effort", "wait", "timeout")

Arrays = dict[str, np.ndarray]
Outcome = tuple[Arrays | None, str | None]   # (arrays, None) on a hit, (None, reason) on a miss


def validate_key(key: object) -> str:
    """`key` if it is 16..128 lowercase hex characters; ValueError naming the key otherwise."""
    if not isinstance(key, str) or KEY_RE.fullmatch(key) is None:
        raise ValueError(f"tier key must be 16..128 lowercase hex characters (a prefix-chain hash), got {key!r}")
    return key


def make_key(*parts: str) -> str:
    """A 32-character hex key for several strings (e.g. chain key, group, kind); order matters."""
    if not parts:
        raise ValueError("make_key needs at least one part")
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        b = str(p).encode()
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.hexdigest()


def checksum(a: np.ndarray) -> str:
    """blake2b-128 hex digest of an array's bytes in C order (dtype and shape are checked apart)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class EntryMeta:
    """What makes a tier entry valid. abi / dtypes / shapes: array name -> kernel ABI id / numpy dtype
    name (e.g. "bfloat16") / shape; [start, end): the token range, end the resume boundary."""
    fingerprint: str
    abi: Mapping[str, str]
    dtypes: Mapping[str, str]
    shapes: Mapping[str, tuple[int, ...]]
    start: int
    end: int

    def __post_init__(self):
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise ValueError(f"EntryMeta.fingerprint must be a non-empty string, got {self.fingerprint!r}")
        names = set(self.dtypes)
        if not names:
            raise ValueError("EntryMeta describes no arrays")
        if set(self.abi) != names or set(self.shapes) != names:
            raise ValueError(f"EntryMeta: abi, dtypes and shapes must name the same arrays, got abi {sorted(self.abi)},"
                             f" dtypes {sorted(self.dtypes)}, shapes {sorted(self.shapes)}")
        bad = sorted(n for n in names if not isinstance(n, str) or NAME_RE.fullmatch(n) is None)
        if bad:
            raise ValueError(f"EntryMeta: array names must match {NAME_RE.pattern}, got {bad}")
        if not 0 <= self.start <= self.end:
            raise ValueError(f"EntryMeta: token range [{self.start}, {self.end}) is not a range")
        shapes = {n: tuple(int(d) for d in s) for n, s in self.shapes.items()}
        if any(d < 0 for s in shapes.values() for d in s):
            raise ValueError(f"EntryMeta: negative dimension in shapes {shapes}")
        object.__setattr__(self, "abi", types.MappingProxyType(dict(self.abi)))
        object.__setattr__(self, "dtypes", types.MappingProxyType(dict(self.dtypes)))
        object.__setattr__(self, "shapes", types.MappingProxyType(shapes))

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray], *, fingerprint: str, abi: str | Mapping[str, str], start: int,
           end: int) -> "EntryMeta":
        """The meta describing `arrays`; abi: one ABI id for every array, or name -> ABI id."""
        abis = {n: abi for n in arrays} if isinstance(abi, str) else dict(abi)
        return cls(fingerprint=fingerprint, abi=abis, dtypes={n: np.asarray(a).dtype.name for n, a in arrays.items()},
                   shapes={n: np.shape(a) for n, a in arrays.items()}, start=start, end=end)

    def check_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """ValueError unless `arrays` has exactly the described names, dtypes and shapes."""
        if set(arrays) != set(self.dtypes):
            raise ValueError(f"arrays {sorted(arrays)} do not match the meta's names {sorted(self.dtypes)}")
        for n, a in arrays.items():
            if not isinstance(a, np.ndarray):
                raise ValueError(f"array {n!r} must be a numpy array, got {type(a).__name__}")
            if a.dtype.name != self.dtypes[n] or a.shape != self.shapes[n]:
                raise ValueError(f"array {n!r} is {a.dtype.name}{list(a.shape)}, the meta says"
                                 f" {self.dtypes[n]}{list(self.shapes[n])}")

    def mismatch(self, expect: "EntryMeta", prefix: str) -> str | None:
        """The reason (prefix + "_foreign_model" / "_abi_mismatch" / "_dtype_mismatch" /
        "_shape_mismatch" / "_range_mismatch") why a stored entry with this meta must not serve a
        reader expecting `expect`, or None. A differing set of array names is an ABI mismatch."""
        if self.fingerprint != expect.fingerprint:
            return prefix + "_foreign_model"
        if dict(self.abi) != dict(expect.abi):
            return prefix + "_abi_mismatch"
        if dict(self.dtypes) != dict(expect.dtypes):
            return prefix + "_dtype_mismatch"
        if dict(self.shapes) != dict(expect.shapes):
            return prefix + "_shape_mismatch"
        if (self.start, self.end) != (expect.start, expect.end):
            return prefix + "_range_mismatch"
        return None

    def to_json(self) -> dict:
        return {"fingerprint": self.fingerprint, "abi": dict(self.abi), "dtypes": dict(self.dtypes),
                "shapes": {n: list(s) for n, s in self.shapes.items()}, "start": self.start, "end": self.end}

    @classmethod
    def from_json(cls, d: Mapping) -> "EntryMeta":
        return cls(fingerprint=d["fingerprint"], abi=d["abi"], dtypes=d["dtypes"],
                   shapes={n: tuple(s) for n, s in d["shapes"].items()}, start=int(d["start"]), end=int(d["end"]))


def sealed_json(body: dict) -> bytes:
    """`body` as JSON with a blake2b seal over its canonical form (see `open_sealed_json`)."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    seal = hashlib.blake2b(canon.encode(), digest_size=16).hexdigest()
    return json.dumps({"body": body, "seal": seal}, sort_keys=True).encode()


def open_sealed_json(raw: bytes) -> dict:
    """The body of `sealed_json` output; ValueError if it does not parse or the seal does not match."""
    try:
        d = json.loads(raw.decode())
        body, seal = d["body"], d["seal"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable sealed json: {e}") from e
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    if hashlib.blake2b(canon.encode(), digest_size=16).hexdigest() != seal:
        raise ValueError("sealed json: seal mismatch")
    return body


class PrefetchHandle:
    """A load started on a thread pool. `result(policy, timeout_s)` -> (arrays, None) or (None, reason).

    Policies: "best_effort" returns at once ((None, prefix + "_not_ready") if the load is still
    running); "wait" blocks until it is done; "timeout" blocks up to timeout_s seconds, then returns
    (None, prefix + "_timeout"). The load keeps running after a not-ready / timeout answer, so a
    later call may return the data. `record(outcome, hidden_s, wait_s)` is the tier's stats hook,
    called once per `result` call: wait_s is how long the call blocked; hidden_s (0 unless the call
    returns the load's outcome) is how long the load ran before it was asked for, i.e. overlapped
    with the caller's other work.
    """

    def __init__(self, key: str, future: cf.Future, prefix: str, record: Callable[[Outcome, float, float], None]):
        self.key = key
        self._future = future
        self._prefix = prefix
        self._record = record
        self._started = time.perf_counter()
        self._finished: float | None = None
        self._lock = threading.Lock()
        future.add_done_callback(self._mark_done)

    def _mark_done(self, _f) -> None:
        with self._lock:
            self._finished = time.perf_counter()

    def done(self) -> bool:
        return self._future.done()

    def result(self, policy: str = "wait", timeout_s: float | None = None) -> Outcome:
        if policy not in POLICIES:
            raise ValueError(f"prefetch policy must be one of {POLICIES}, got {policy!r}")
        if policy == "timeout" and (timeout_s is None or not timeout_s > 0):
            raise ValueError(f"policy 'timeout' needs timeout_s > 0, got {timeout_s!r}")
        called = time.perf_counter()
        wait = {"best_effort": 0.0, "wait": None, "timeout": timeout_s}[policy]
        try:
            outcome = self._future.result(timeout=wait)
        except (cf.TimeoutError, cf.CancelledError) as e:   # cancelled: its tier was closed, never loaded
            reason = "_timeout" if isinstance(e, cf.TimeoutError) and policy != "best_effort" else "_not_ready"
            outcome = (None, self._prefix + reason)
            self._record(outcome, 0.0, time.perf_counter() - called)
            return outcome
        with self._lock:
            finished = self._finished if self._finished is not None else time.perf_counter()
        self._record(outcome, min(finished, called) - self._started, max(0.0, finished - called))
        return outcome
