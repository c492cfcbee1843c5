"""What an API server process counts itself, and the /metrics text it serves.

The engine's metrics come with its heartbeats (engine/heartbeat.py): /metrics is that snapshot plus
this process's own registry, rendered without a round trip to the engine, so a scrape works (and
costs the engine nothing) while the engine is busy, wedged or being restarted. What this process
counts never depends on the engine either: an error answered while the engine core is down is
still counted.

  hybrid_jax_request_errors_total{type}        requests answered with an error, by OpenAI error type
  hybrid_jax_engine_core_restarts_total        engine cores this process restarted (server/supervisor.py)
  hybrid_jax_engine_core_reconnects_total      reconnections to a restarted core (other API servers)
  hybrid_jax_engine_up                         1 while the engine answers (beats), else 0
  hybrid_jax_engine_heartbeat_age_seconds      seconds since the engine's last beat (the snapshot's age)

With several API server processes each counts its own errors (a scrape reaches one of them); the
engine's series are the same from every one.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

P = "hybrid_jax_"


class ApiMetrics:
    """This process's registry (others may register theirs in it: server/admission.py does)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.errors = Counter(P + "request_errors", "Requests answered with an error, by OpenAI error type",
                              ["type"], registry=r)
        self.core_restarts = Counter(P + "engine_core_restarts", "Engine core processes this API server restarted "
                                     "after one died or hung", registry=r)
        self.core_reconnects = Counter(P + "engine_core_reconnects", "Reconnections of this API server to a "
                                       "restarted engine core", registry=r)
        self.up = Gauge(P + "engine_up", "1 while the engine answers (its heartbeat is recent), else 0", registry=r)
        self.heartbeat_age = Gauge(P + "engine_heartbeat_age_seconds", "Seconds since the engine's last heartbeat "
                                   "(the age of the engine's series here)", registry=r)
        self._engine_text: bytes | None = None
        self._engine_kept = b""

    def count_error(self, kind: str):
        self.errors.labels(type=kind).inc()

    def render(self, engine_text: bytes) -> bytes:
        """The engine's text (less the series this process keeps itself) and this process's."""
        if engine_text is not self._engine_text:          # a new snapshot: filtered once, not per scrape
            # (base names: a counter's without _total; read now, with whatever others registered here)
            families = {m.name.encode() for m in self.registry.collect()}
            self._engine_text, self._engine_kept = engine_text, _without(engine_text, families)
        return self._engine_kept + generate_latest(self.registry)


def _base(name: bytes) -> bytes:
    for suffix in (b"_total", b"_created"):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def _without(text: bytes, families: set[bytes]) -> bytes:
    """Prometheus text less the families named by base name (a counter's `_total` and `_created`
    series both go; a family runs from its "# HELP" line to the next)."""
    out, skip = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(b"# HELP "):
            name = line.split()[2]
            skip = name in families or _base(name) in families
        if not skip:
            out.append(line)
    return b"".join(out)
