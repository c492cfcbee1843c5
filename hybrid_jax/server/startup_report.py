"""What the API server says about an engine's start-up (engine/startup_status.py): its log while the
model loads and the programs needed before ready compile, and /health's body meanwhile and after.

The statuses come from the engine core's ready pipe (engine/core_process.start_core's on_progress),
or from `hybrid_jax.llm.build_engine` in this process (`--no-engine-process`), and after ready from
the engine's heartbeats (the background compiles: server/supervisor.py logs when they complete).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hybrid_jax.engine.startup_status import StartupStatus

log = logging.getLogger("hybrid_jax.server")

LOG_EVERY_S = 2.0        # the ready set's progress: at most one line this often (and its last program)


class StartupLog:
    """Logs a load's statuses as they come (any thread): the weights loading, then loaded (seconds),
    "compiling N of M programs before ready (K from the program store), last <key>", then ready with
    the time split; each status is handed on to `keep` (what /health reads). who: names the engine in
    the lines (e.g. "engine core process 123", or "restarted engine core")."""

    def __init__(self, keep: Callable[[StartupStatus], None] | None = None, who: str = "engine"):
        self.keep, self.who = keep, who
        self._lock = threading.Lock()
        self._phase = ""
        self._logged_at = 0.0
        self._weights_said = False

    def __call__(self, status: StartupStatus):
        if self.keep is not None:
            self.keep(status)
        with self._lock:
            self._say(status)
            self._phase = status.phase

    def _say(self, s: StartupStatus):
        now = time.monotonic()
        if s.phase == "loading":
            if self._phase != "loading":
                log.info("%s: loading the model's weights", self.who)
            return
        if not self._weights_said:
            self._weights_said = True
            log.info("%s: weights loaded in %.1f s", self.who, s.weights_s or 0.0)
        if s.phase == "compiling":
            if s.ready_total and (s.done >= s.ready_total or now - self._logged_at >= LOG_EVERY_S):
                self._logged_at = now
                log.info("%s: %s", self.who, s.describe())
            return
        if self._phase in ("", "loading", "compiling"):
            later = f"; {s.describe()}" if s.phase == "ready" else ""
            log.info("%s: ready in %.1f s (%s)%s", self.who, (s.weights_s or 0.0) + (s.ready_s or 0.0), s.split(),
                     later)


def loading_body(status: StartupStatus | None, seconds: float) -> str:
    """/health's 503 body while the model loads: what it does, how far, seconds since loading began."""
    if status is None:
        return "loading"
    return f"loading: {status.describe(seconds)}"


def ready_body(note: str, status: StartupStatus | None) -> str:
    """/health's 200 body: the warm-up's note and, once a start-up was timed, whether programs still
    compile in the background (N of M) or the start-up is complete."""
    return note if status is None else f"{note}; {status.describe()}"
