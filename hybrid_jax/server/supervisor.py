"""Keeps the engine behind an API server serving, or says plainly that it is not.

`EngineSupervisor` is what the app serves from (`ServerState.engine`): it passes requests to the
current engine (an `EngineCoreClient`, or an in-process `AsyncEngine`) and watches it on a thread of
its own, from two signals that need nothing from the engine but its step loop:

- **dead**: the core's socket closed (its process died), or the engine thread ended;
- **hung**: no heartbeat (engine/heartbeat.py: the step loop beats between steps and while idle,
  every 0.5 s) for `unresponsive_after_s` (default 5 s): the engine is *unresponsive* (new requests
  get a JSON 503, /health 503 saying so; it is healthy again when beats resume); for
  `hung_after_s` (default 60 s; 0: never), it is treated as dead: the core is SIGKILLed.

What happens to a dead engine depends on who holds it:

- the API server that spawned the core (the *owner*) restarts it: the same model, dtype and
  EngineConfig (the disk tier's directory and the compilation cache included, so the warm-up loads
  its programs), at the same socket address and key. At most `core_restarts` times over the
  server's life (`--core-restarts`, default 3; each counted in
  `hybrid_jax_engine_core_restarts_total`); then the process exits 1, for an orchestrator to
  replace the whole server;
- another API server process (`--api-server-count` > 1, a *follower*) never restarts or kills the
  core: it answers 503 while the core is down and reconnects to the same address once the owner's
  restart is up (`hybrid_jax_engine_core_reconnects_total`); when the owner gives up it stops them;
- an in-process engine (`--no-engine-process`) cannot be restarted: a dead (or hung past
  `hung_after_s`) engine thread ends the process with exit code 1.

While a restarted core loads, /health's 503 says how far it is (the new core's start-up statuses:
`note_startup`); once an engine serves, `startup_status` is the one its last heartbeat carried, and
the supervisor logs when its background compiles complete.

Requests in flight when the engine dies end with `EngineUnavailable` (the app: an error event and
`[DONE]` on a stream, a JSON 503 otherwise); while it is down every new request gets a JSON 503.
Nothing on these paths talks to the engine, so a dead core cannot turn an answer into a 500.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hybrid_jax.engine.contracts import EngineClient
from hybrid_jax.server.api_metrics import ApiMetrics

log = logging.getLogger("hybrid_jax.server")


@dataclasses.dataclass(frozen=True)
class SupervisionConfig:
    core_restarts: int = 3                 # restarts of a dead or hung core over the server's life, then exit 1
    unresponsive_after_s: float = 5.0      # no heartbeat this long: 503 until beats resume
    hung_after_s: float = 60.0             # no heartbeat this long: dead (killed, restarted); 0: never
    poll_s: float = 0.1                    # how often the supervisor looks


class EngineSupervisor:
    def __init__(self, engine: EngineClient, metrics: ApiMetrics, config: SupervisionConfig = SupervisionConfig(), *,
                 role: str = "in_process", renew: Callable[[Callable], Any] | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        """engine: the running engine; role: "in_process", "owner" (renew(on_spawn) starts a new core
        and returns its client) or "follower" (renew(on_spawn) connects to the core's address again,
        raising while nothing listens there); on_fatal(reason): the engine cannot come back (the
        server stops and exits 1)."""
        if role not in ("in_process", "owner", "follower"):
            raise ValueError(f"unknown role {role!r}")
        self.engine, self.metrics, self.config, self.role = engine, metrics, config, role
        self._renew, self._on_fatal = renew, on_fatal
        self.restarts = 0
        self.fatal: str | None = None           # why the engine cannot come back
        self._down: str | None = None           # why it is down now (dead, restarting, reconnecting)
        self._spawning = None                   # a core process still loading (killed at shutdown)
        self._starting = None                   # that core's last StartupStatus (note_startup)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hybrid-jax-supervisor", daemon=True)
        self._thread.start()

    # --- what the app reads (as from an engine) --------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def connection(self):
        return self.engine.connection

    def model_card(self) -> dict:
        return self.engine.model_card()

    def validate(self, prompt, params) -> list[int]:
        return self.engine.validate(prompt, params)

    def generate(self, request_id: str, prompt, params, arrival: float | None = None):
        return self.engine.generate(request_id, prompt, params, arrival=arrival)

    def unavailable(self) -> str | None:
        """None while the engine serves; else why not (the body of /health's and the requests' 503)."""
        down, starting = self._down, self._starting
        if down is not None:
            return down if starting is None else f"{down}; {starting.describe()}"
        eng = self.engine
        if not eng.alive:
            return self._death(eng)
        age = eng.pulse.age()
        if age > self.config.unresponsive_after_s:
            return f"the engine is not responding (no heartbeat for {age:.1f} s)"
        return None

    def startup_status(self):
        """The serving engine's start-up (engine/startup_status.StartupStatus) as of its last heartbeat;
        None before the first, or for an engine that timed no load."""
        return self.engine.pulse.startup

    def note_startup(self, status):
        """A restarting core's start-up status (its renew passes each one here): /health says it."""
        self._starting = status

    @property
    def alive(self) -> bool:
        return self.unavailable() is None

    def count_error(self, kind: str):
        self.metrics.count_error(kind)

    def render_metrics(self) -> bytes:
        """The engine's metrics as of its last heartbeat and this process's own: no engine round trip."""
        eng = self.engine
        self.metrics.heartbeat_age.set(eng.pulse.age())
        self.metrics.up.set(1 if self.unavailable() is None else 0)
        return self.metrics.render(eng.render_metrics())

    def shutdown(self, timeout: float = 30.0):
        """Stops watching (a clean stop is no death), then the engine (a core still loading is killed)."""
        self._stop.set()
        with self._lock:
            spawning = self._spawning
        if spawning is not None and spawning.is_alive():
            spawning.kill()
        self._thread.join(timeout=10)
        with self._lock:
            engine = self.engine
        engine.shutdown(timeout=timeout)

    def close(self):
        """A follower's exit: stops watching and disconnects."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.engine.close()

    # --- the watch ---------------------------------------------------------------------------------
    def _death(self, eng) -> str:
        if self.role == "in_process":
            return "the engine thread stopped" + (f" ({type(eng.error).__name__}: {eng.error})" if eng.error else "")
        return eng.error or "the engine core exited"

    def _watch(self):
        unresponsive = False
        hung = self.config.hung_after_s
        seen = (None, None)                     # (engine, its start-up phase) as last seen
        while not self._stop.wait(self.config.poll_s):
            eng = self.engine
            seen = (eng, self._note_complete(eng, seen[1] if seen[0] is eng else None))
            if not eng.alive:
                reason = self._death(eng)
            elif hung and self.role != "follower" and eng.pulse.age() > hung:
                reason = f"the engine hung (no heartbeat for {eng.pulse.age():.0f} s)"
                if self.role == "owner":
                    log.error("%s: killing the engine core", reason)
                    eng.kill()
            else:
                now = eng.pulse.age() > self.config.unresponsive_after_s
                if now != unresponsive:
                    if now:
                        log.warning("the engine is not responding (no heartbeat for %.1f s): new requests get 503",
                                    eng.pulse.age())
                    else:
                        log.info("the engine is responding again")
                unresponsive = now
                continue
            if self._stop.is_set():             # a shutdown under way: the engine's end is no death
                return
            unresponsive = False
            if not self._recover(eng, reason):
                return

    def _note_complete(self, eng, before: str | None) -> str | None:
        """Logs the serving engine's start-up completing (its background compiles, once: `before` is
        its phase as last seen); its phase now."""
        st = eng.pulse.startup
        if st is None:
            return before
        if st.phase == "complete" and before != "complete" and st.total > st.ready_total:
            log.info("%s (the background set in %.1f s; %d steps waited on a compile)", st.describe(),
                     st.background_s or 0.0, st.stalls)
        return st.phase

    def _recover(self, old, reason: str) -> bool:
        """After `old` died: restart, reconnect or give up. False when the watch is over."""
        self._down = reason
        if self.role == "in_process":
            old.abandon(reason)
            self._give_up(f"{reason}; an engine on the server's thread cannot be restarted")
            return False
        if self.role == "owner":
            old.kill()                          # (its socket closed: it is dead or past saving)
            if old.process is not None:
                old.process.join(timeout=10)
            old.abandon(reason)
            while self.restarts < self.config.core_restarts:
                if self._stop.is_set():
                    return False
                self.restarts += 1
                self.metrics.core_restarts.inc()
                self._down = f"{reason}; restarting it (restart {self.restarts} of {self.config.core_restarts})"
                log.error("%s", self._down)
                t0 = time.monotonic()
                try:
                    new = self._renew(self._note_spawn)
                except Exception as e:  # noqa: BLE001  (counted: the next restart, or the exit)
                    reason = f"the engine core failed to restart ({type(e).__name__}: {e})"
                    log.error("%s", reason)
                    self._stop.wait(min(2.0 ** (self.restarts - 1), 30.0))     # 1, 2, 4 ... s before the next
                    continue
                finally:
                    self._note_spawn(None)
                    self._starting = None
                if self._adopt(new):
                    log.info("engine core restarted in %.1f s (pid %s, warm-up %s: %s programs)", time.monotonic() - t0,
                             new.info.get("pid"), new.info.get("warmup"), new.info.get("num_compiled"))
                    return True
                return False
            self._give_up(f"{reason}; the {self.config.core_restarts} restarts allowed (--core-restarts) are used "
                          "up")
            return False
        old.abandon(reason)                     # a follower: the owner restarts the core
        self._down = f"{reason}; waiting for it to be restarted"
        log.error("%s", self._down)
        while not self._stop.wait(0.5):
            try:
                new = self._renew(None)
            except Exception:  # noqa: BLE001, S112  (nothing listens there yet)
                continue
            if self._adopt(new):
                self.metrics.core_reconnects.inc()
                log.info("reconnected to the engine core")
                return True
            return False
        return False

    def _adopt(self, new) -> bool:
        with self._lock:
            if self._stop.is_set():             # shut down meanwhile: the new engine goes too
                stopping = True
            else:
                stopping = False
                self.engine, self._down = new, None
        if stopping:
            new.shutdown(timeout=30) if self.role == "owner" else new.close()
        return not stopping

    def _note_spawn(self, proc):
        with self._lock:
            self._spawning = proc

    def _give_up(self, reason: str):
        self.fatal = self._down = reason + ": exiting"
        log.error("%s", self.fatal)
        if self._on_fatal is not None:
            self._on_fatal(reason)
