"""Prefill/decode disaggregation's transfer: a prompt's whole cache handed from one engine to another
through the disk tier's directory (shared storage), checked on arrival as every disk entry is.

A handoff is one tier entry holding what a request with this prompt resumes from: every block group's
blocks over [0, b) and every checkpoint group's state at b (recurrent and window states, a compressed
group's uncompressed tail), b the last point of the LCM grid before the prompt's last token (`point`),
so the receiver computes that token itself and samples from its own logits. It is written in the
tier's raw format (read once, on the critical path of the request's first token). It is stored without
mesh layout, like a span (cache.prefix_disk), so a sender at tensor size 4 hands over to a receiver at
tensor size 2: the receiver places the arrays in its own pools' layout. Unlike a chain of spans it
holds one checkpoint, not one per span: the bytes moved are the request's cache bytes at b.

Its key is a hash of the room and every group's chain key at b (weights fingerprint, dtype, kernel ABI
and every token id are in them), computed again by the receiver from its own tokens: a receiver whose prompt
differs (another tokenizer, another template) or whose weights differ looks for another key and
recomputes. The read checks the entry's seal, its sizes, checksums and the exact expected meta
(`DiskSpans.expect(b, start=0)`); a damaged or mismatched handoff is a miss with its reason
("handoff_mismatch", "handoff_refused", or the tier's own reason) and the prompt is recomputed: nothing
is served unless every check passed.

The rendezvous is the request's room (the `bootstrap_room` a P/D router writes into both copies of a
request): the sender writes `handoffs/<room>.json` after the entry is durable, or with the reason it
could not hand over; the receiver waits for that marker (`wait_marker`, up to its timeout) before it
admits the request, then reads the entry the marker names, and deletes it once installed (a handoff
nobody takes, its receiver timed out, leaves by the tier's cap like any entry).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import json
import os
import time
from typing import Sequence

import numpy as np

from cache.state import ModelCache

ROLES = ("send", "receive")
MARKERS = "handoffs"          # the markers' folder inside the tier's directory


@dataclasses.dataclass(frozen=True)
class KVTransfer:
    """A request's part in prefill/decode disaggregation (vLLM's kv_transfer_params): "send" (the
    prefill server computes the prompt and hands its cache over under `room`) or "receive" (the decode
    server takes that handoff before computing). end, key: a receiver's handoff as its marker names
    it (end 0: there is none; the prompt is recomputed)."""
    role: str
    room: int
    end: int = 0
    key: str = ""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"KVTransfer.role must be one of {ROLES}; got {self.role!r}")
        if not isinstance(self.room, int) or isinstance(self.room, bool) or self.room < 0:
            raise ValueError(f"KVTransfer.room must be a non-negative integer; got {self.room!r}")


@dataclasses.dataclass(frozen=True)
class Marker:
    """What a sender says of a room: the handoff's key and boundary (status "ok"), or why there is
    none (status "refused", reason)."""
    room: int
    status: str
    key: str = ""
    end: int = 0
    nbytes: int = 0
    reason: str = ""


def _marker_path(directory: str, room: int) -> str:
    return os.path.join(directory, MARKERS, f"{int(room)}.json")


def write_marker(directory: str, marker: Marker) -> None:
    """Atomically (temp file, fsync, rename): a reader sees the whole marker or none."""
    folder = os.path.join(directory, MARKERS)
    os.makedirs(folder, exist_ok=True)
    path = _marker_path(directory, marker.room)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(marker), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_marker(directory: str, room: int) -> Marker | None:
    """The room's marker, or None while there is none. A marker that does not parse is a refusal."""
    try:
        with open(_marker_path(directory, room)) as f:
            raw = json.load(f)
        return Marker(**{k: raw[k] for k in ("room", "status", "key", "end", "nbytes", "reason")})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Marker(room=room, status="refused", reason=f"unreadable marker: {e}")


def remove_marker(directory: str, room: int) -> None:
    try:
        os.unlink(_marker_path(directory, room))
    except OSError:
        pass


def clean_markers(directory: str, older_than_s: float = 3600.0) -> int:
    """Deletes markers nobody took within `older_than_s` (their receivers timed out). Returns how many."""
    folder, gone = os.path.join(directory, MARKERS), 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    now = time.time()
    for n in names:
        p = os.path.join(folder, n)
        try:
            if now - os.stat(p).st_mtime > older_than_s:
                os.unlink(p)
                gone += 1
        except OSError:
            pass
    return gone


def wait_marker_blocking(directory: str, room: int, timeout_s: float, poll_s: float = 0.005) -> Marker:
    """`wait_marker` for a caller with no event loop (tests, benchmarks, offline senders and receivers)."""
    deadline = time.monotonic() + timeout_s
    while (m := read_marker(directory, room)) is None:
        if time.monotonic() >= deadline:
            return Marker(room=room, status="refused", reason="handoff_timeout")
        time.sleep(poll_s)
    return m


async def wait_marker(directory: str, room: int, timeout_s: float, poll_s: float = 0.005) -> Marker:
    """Waits (without blocking the event loop) for the room's marker; a refusal with reason
    "handoff_timeout" after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await asyncio.to_thread(read_marker, directory, room)
        if m is not None:
            return m
        if time.monotonic() >= deadline:
            return Marker(room=room, status="refused", reason="handoff_timeout")
        await asyncio.sleep(poll_s)


class Handoffs:
    """The handoffs of one prefix cache's disk tier (`DiskSpans`, whose reads, key, expectation and
    install it uses): `send` on the prefill side, `prefetch` and `receive` on the decode side."""

    def __init__(self, spans):
        self.spans = spans
        self.directory = spans.config.directory
        self._prefetched: dict[str, tuple[str, object]] = {}
        self.sent = self.received = 0
        self.bytes_sent = self.bytes_received = 0
        clean_markers(self.directory)

    def point(self, num_tokens: int) -> int:
        """The boundary a prompt of `num_tokens` is handed over at: the last point of the resume grid
        before its last token, where a local hit on the same prompt would resume (0: the prompt is
        too short to hand anything over)."""
        grid = self.spans.setup.geometry.resume
        return (num_tokens - 1) // grid * grid

    def key(self, tokens: Sequence[int], b: int, room: int) -> str:
        """The handoff's key: the room's, and every group's chain key at b (fingerprint, dtype, ABI,
        tokens)."""
        return self.spans.key(self.spans._span_keys(tokens), b, kind=f"prefix-handoff-{int(room)}")

    # --- the sender --------------------------------------------------------------------------------
    def send(self, cache: ModelCache, tokens: Sequence[int], b: int, room: int) -> None:
        """After the prompt's publish at b: copies [0, b) to the host now and writes it on the tier's
        writer thread, then the room's marker (or, when it cannot, a refused marker saying why)."""
        spans = self.spans
        if b <= 0:
            return self._refuse(room, "short prompt: nothing before its last LCM point")
        key = self.key(tokens, b, room)
        got = spans.read(cache, tokens, b, start=0)
        if got is None:
            return self._refuse(room, "the prompt's cache was not on the device (a publish refused for room)")
        arrays, _ = got
        put = spans._writer.submit(spans.tier.put, key, arrays, spans.expect(b, start=0), True)   # raw: read once
        self._after(room, key, b, put, sum(a.nbytes for a in arrays.values()))

    def _after(self, room: int, key: str, b: int, put: cf.Future, nbytes: int) -> None:
        """Writes the marker once the put is durable."""
        def mark():
            ok = put.exception() is None and put.result()
            if ok:
                self.sent += 1
                self.bytes_sent += nbytes
            m = Marker(room, "ok", key, b, nbytes) if ok else Marker(room, "refused", reason="the tier refused the write")
            try:
                write_marker(self.directory, m)
            except OSError as e:
                self.spans.setup.notes.once("handoff:marker", f"a handoff marker could not be written ({e})")
        self.spans._writer.submit(mark)

    def _refuse(self, room: int, reason: str) -> None:
        self.spans._writer.submit(write_marker, self.directory, Marker(room, "refused", reason=reason))

    def abandon(self, room: int, reason: str) -> None:
        """A sending request ended without handing over (`reason`)."""
        self._refuse(room, reason)

    # --- the receiver ------------------------------------------------------------------------------
    def prefetch(self, request_id: str, tokens: Sequence[int], room: int, end: int, key: str) -> None:
        """On arrival: starts reading the handoff when its key is the one these tokens make."""
        if end > 0 and key == self.key(tokens, end, room):
            self._prefetched[request_id] = (key, self.spans.tier.prefetch(key, self.spans.expect(end, start=0)))

    def forget(self, request_id: str) -> None:
        self._prefetched.pop(request_id, None)

    def receive(self, cache: ModelCache, tokens: Sequence[int], request_id: str, room: int, end: int,
                key: str) -> tuple[ModelCache, bool]:
        """Installs the handoff [0, end) in the pools if every check passes, then deletes it (one room,
        one taker); otherwise counts why and installs nothing (the prompt is recomputed). Returns
        (cache, installed)."""
        spans = self.spans
        got = self._prefetched.pop(request_id, None)      # (its key was checked against these tokens)
        checked = got is not None and got[0] == key
        if end <= 0 or end >= len(tokens) or not (checked or key == self.key(tokens, end, room)):
            return cache, self._miss("handoff_mismatch", "a handoff's key is not the one this request's tokens,"
                                                         " weights and kernels make")
        handle = got[1] if checked else spans.tier.prefetch(key, spans.expect(end, start=0))
        arrays, reason = handle.result("wait")
        if arrays is None:
            return cache, self._miss(f"handoff_{reason}", f"a handoff was refused on arrival ({reason})")
        cache, ok, _ = spans.install(cache, tokens, end, key, arrays, start=0)
        if not ok:
            return cache, self._miss("handoff_no_room", "a handoff found no room in the pools")
        self.received += 1
        self.bytes_received += sum(np.asarray(a).nbytes for a in arrays.values())
        spans._writer.submit(spans.tier.delete, key)      # off the request's path
        return cache, True

    def _miss(self, reason: str, text: str) -> bool:
        self.spans.reasons[reason] += 1
        self.spans.setup.notes.once(f"disk:{reason}", f"{text}; its tokens are recomputed")
        return False

    def stats(self) -> dict:
        return {"sent": self.sent, "received": self.received, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received}
