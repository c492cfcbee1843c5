"""The engine's heartbeat: how an API server tells a working engine from a dead or a wedged one, and
where it reads the engine's metrics from without asking the engine.

The engine's step loop itself beats (the core process's `Core.run`, or `AsyncEngine`'s thread),
never a side thread: a loop stuck inside a step stops beating, which is the point. It beats between
steps and while idle, at most every `HEARTBEAT_S` seconds apart, and once more as soon as it runs out
of work (before that step's outputs go out). Each `Beat` carries the engine's metrics rendered at that
moment (Prometheus text), and where its start-up is (engine/startup_status.py: the background compiles
after ready), so the API server answers /metrics and /health from the last beat and neither costs the
engine anything; because the last step's counts leave before its outputs, a client that saw its
requests finish reads metrics that count them.

  BeatSchedule   the step loop's side: whether a beat is due, and the next Beat
  Pulse          the receiving side: when the last beat came, and its metrics
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

HEARTBEAT_S = 0.5        # the longest a working step loop goes between beats (plus one step)


@dataclasses.dataclass(frozen=True)
class Beat:
    """One heartbeat of the step loop (core to client: sent to every connected API server)."""
    seq: int              # 1, 2, ... per engine (a restarted core starts again at 1)
    metrics: bytes        # the engine's Prometheus text, rendered by the step loop at this beat
    startup: Any = None   # engine/startup_status.StartupStatus at this beat (None: the engine timed no load)


class BeatSchedule:
    """The step loop's side: a beat is due when `period_s` passed since the last one, or when the loop
    has just gone idle (its last step's counts then go out before that step's outputs)."""

    def __init__(self, period_s: float = HEARTBEAT_S):
        self.period_s = period_s
        self._next = 0.0          # the first beat is due at once
        self._busy = False
        self._seq = 0

    def due(self, busy: bool) -> bool:
        """busy: whether the engine has unfinished requests now."""
        went_idle = self._busy and not busy
        self._busy = busy
        return went_idle or time.monotonic() >= self._next

    def beat(self, metrics: bytes, startup=None) -> Beat:
        self._seq += 1
        self._next = time.monotonic() + self.period_s
        return Beat(self._seq, metrics, startup)


class Pulse:
    """The receiving side: the time of the last beat (the creation time until the first) and the
    metrics and start-up status it carried. Written by one thread (a reader, or the engine's own), read by any."""

    def __init__(self):
        self._lock = threading.Lock()
        self.last = time.monotonic()
        self.metrics = b""
        self.startup = None
        self.beats = 0

    def note(self, beat: Beat):
        with self._lock:
            self.last, self.metrics, self.beats = time.monotonic(), beat.metrics, self.beats + 1
            self.startup = beat.startup

    def age(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self.last
