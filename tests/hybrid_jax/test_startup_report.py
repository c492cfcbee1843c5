"""Start-up progress as the API server reports it: /health's 503 body while the model loads names the
phase and the counts (a build held at each step by events, so each state is seen, not raced), the
log says weights loaded, N of M programs and ready with the time split, a restarting core's progress
shows in /health, and a real warm-up's statuses, log and metrics agree with its engine (stalls 0
after requests, programs by source summing to the compiled programs)."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from fastapi.testclient import TestClient

from hybrid_jax import SamplingParams
from hybrid_jax.engine import EngineConfig
from hybrid_jax.engine.compile import Stats
from hybrid_jax.engine.heartbeat import Pulse
from hybrid_jax.engine.startup import StartupProgress
from hybrid_jax.engine.startup_status import StartupClock, StartupStatus, status
from hybrid_jax.llm import build_engine
from hybrid_jax.server import main
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.server.startup_report import StartupLog
from hybrid_jax.server.supervisor import EngineSupervisor, SupervisionConfig

QUICK = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, decode_steps=2, warmup="none",
                     compilation_cache_dir=None)
COMPILING = StartupStatus(phase="compiling", done=2, ready_total=5, total=9, from_store=1, last="decode[2] steps=2",
                          seconds=3.0, weights_s=1.0)


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# --- the status itself --------------------------------------------------------------------------
def test_status_phases_follow_the_clock_and_the_warm_ups():
    clock = StartupClock(started=100.0)
    assert status([], [], clock).phase == "loading"
    clock.weights_at = 104.0
    ready = StartupProgress(phase="ready", done=3, ready_total=3, total=7, from_store=2)
    # the warm-up says ready before build_engine does (the prefix store's programs come after): not yet
    assert status([ready], [Stats()], clock).phase == "compiling"
    clock.ready_at, clock.last_program_at = 110.0, 115.5
    other = StartupProgress(phase="complete", done=3, ready_total=3, total=3, from_store=0)
    s = status([ready, other], [Stats(lower_s=1.0, stalls=1), Stats(compile_s=2.0, load_s=0.5)], clock)
    # two replicas: the slower one's phase, the counts summed
    assert (s.phase, s.done, s.ready_total, s.total, s.from_store) == ("ready", 6, 6, 10, 2)
    assert (s.weights_s, s.ready_s, s.lower_s, s.compile_s, s.load_s, s.stalls) == (4.0, 6.0, 1.0, 2.0, 0.5, 1)
    assert "compiling in the background: 0 of 4 programs" in s.describe()
    done = status([other], [Stats()], clock)
    assert done.phase == "complete" and done.background_s == pytest.approx(5.5)
    assert done.phase_seconds() == {"loading_weights": 4.0, "compiling": 6.0, "background": pytest.approx(5.5)}


def test_describe_and_split_name_the_counts():
    assert COMPILING.describe() == ("compiling 2 of 5 programs before ready (1 from the program store), "
                                    "last decode[2] steps=2 (3.0 s so far)")
    assert COMPILING.describe(seconds=7.25).endswith("(7.2 s so far)")
    assert StartupStatus(seconds=2.0).describe() == "loading weights (2.0 s so far)"
    planning = StartupStatus(phase="compiling", weights_s=1.25, seconds=1.5)      # no plan yet: no "0 of 0"
    assert planning.describe() == "weights loaded in 1.2 s, planning the warm-up (1.5 s so far)"
    ready = StartupStatus(phase="complete", done=5, ready_total=5, total=5, from_store=5, weights_s=1.5, ready_s=2.5,
                          load_s=0.25)
    assert "loading weights 1.5 s" in ready.split() and "loading 5 from the program store 0.2 s" in ready.split()
    assert ready.describe() == "start-up complete: 5 programs (5 from the program store)"


# --- /health and the log while loading ----------------------------------------------------------
class _HeldBuild:
    """build_engine's stand-in for load_engine: reports each status, then waits for the test's go."""

    def __init__(self):
        self.go, self.reported = threading.Semaphore(0), threading.Semaphore(0)

    def __call__(self, model, dtype, engine_config, parallel=None, on_status=None):
        for s in (StartupStatus(), COMPILING):
            on_status(s)
            self.reported.release()
            assert self.go.acquire(timeout=60)
        return build_engine(model, dtype, engine_config, parallel, on_status)    # the real one, warm-up "none"


def test_health_while_loading_says_the_phase_and_counts(monkeypatch, caplog):
    held = _HeldBuild()
    monkeypatch.setattr(main, "build_engine", held)
    state = ServerState(ServerConfig())
    caplog.set_level(logging.INFO, logger="hybrid_jax.server")
    loader = threading.Thread(target=main.load_engine, args=(state, None, "auto", QUICK))
    with TestClient(build_app(state)) as c:
        loader.start()
        assert held.reported.acquire(timeout=60)
        h = c.get("/health")
        assert h.status_code == 503 and h.text.startswith("loading: loading weights (")
        held.go.release()
        assert held.reported.acquire(timeout=60)
        h = c.get("/health")
        assert h.status_code == 503
        assert "compiling 2 of 5 programs before ready (1 from the program store), last decode[2] steps=2" in h.text
        held.go.release()
        loader.join(timeout=120)
        assert state.load_error is None and state.engine is not None
        deadline = time.monotonic() + 30
        while state.engine.startup_status() is None:      # the engine thread's first beat
            assert time.monotonic() < deadline
            time.sleep(0.05)
        h = c.get("/health")
        assert h.status_code == 200 and h.text.startswith("ok: warm-up none")
        assert "start-up complete: 0 programs" in h.text
        state.engine.shutdown()
    said = [r.getMessage() for r in caplog.records if r.name == "hybrid_jax.server"]
    assert "engine: loading the model's weights" in said
    assert "engine: weights loaded in 1.0 s" in said
    assert any(m.startswith("engine: compiling 2 of 5 programs before ready (1 from the program store)") for m in said)
    assert any(m.startswith("engine: ready in ") and "loading weights" in m for m in said), said


# --- a restarting core's progress ---------------------------------------------------------------
class _FakeCore:
    """An engine client with nothing behind it: alive until `die`, a fresh pulse."""

    def __init__(self):
        self.alive, self.error, self.process, self.pulse, self.info = True, None, None, Pulse(), {}

    def kill(self):
        self.alive = False

    def abandon(self, reason):
        pass

    def shutdown(self, timeout=30.0):
        self.alive = False


def test_a_restarting_core_shows_its_progress_in_health():
    old, new = _FakeCore(), _FakeCore()
    reported, go = threading.Event(), threading.Event()

    def renew(on_spawn):
        sup.note_startup(COMPILING)
        reported.set()
        assert go.wait(timeout=30)
        return new

    sup = EngineSupervisor(old, ServerState(ServerConfig()).metrics, SupervisionConfig(poll_s=0.01), role="owner",
                           renew=renew)
    try:
        old.alive = False                 # the core died
        assert reported.wait(timeout=30)
        down = sup.unavailable()
        assert "restarting it (restart 1 of 3)" in down and "compiling 2 of 5 programs before ready" in down
        go.set()
        deadline = time.monotonic() + 30
        while sup.engine is not new:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sup.unavailable() is None
    finally:
        sup.shutdown()


# --- a real warm-up -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def warm():
    """An engine built by build_engine with warm-up "minimal", its statuses and log lines."""
    seen: list[StartupStatus] = []
    handler = _Lines()
    logging.getLogger("hybrid_jax.server").addHandler(handler)
    logging.getLogger("hybrid_jax.server").setLevel(logging.INFO)
    try:
        cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, decode_steps=2,
                           warmup="minimal", compilation_cache_dir=None)
        engine = build_engine(None, "auto", cfg, None, StartupLog(seen.append))
    finally:
        logging.getLogger("hybrid_jax.server").removeHandler(handler)
    yield engine, seen, handler.lines
    engine.close()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_warm_up_statuses_run_in_order_to_ready(warm):
    engine, seen, _ = warm
    phases = [s.phase for s in seen]
    assert phases[0] == "loading" and phases[-1] == "complete"       # "minimal": nothing left for the background
    assert set(phases[1:-1]) == {"compiling"}
    plan = engine.startup.plan
    last = seen[-1]
    assert last.ready_total == last.total == last.done == len(plan.ready) > 0
    dones = [s.done for s in seen[1:]]        # (the compile threads report as they finish: in any order)
    assert dones[0] == 0 and sorted(dones[1:-1]) == list(range(1, len(plan.ready) + 1))   # one per program
    assert len(seen) == 1 + 1 + len(plan.ready) + 1                   # loading, weights loaded, each program, ready
    assert last.weights_s > 0 and last.ready_s > 0 and last.compile_s > 0 and last.from_store == 0


def test_the_ready_line_has_the_time_split(warm):
    _, seen, lines = warm
    n = seen[-1].ready_total
    ready = [m for m in lines if m.startswith("engine: ready in ")]
    assert len(ready) == 1, lines
    assert f"building {n} programs" in ready[0] and "loading weights" in ready[0] and "program store" in ready[0]
    assert any(m.startswith(f"engine: compiling {n} of {n} programs before ready") for m in lines)


def test_metrics_after_requests(warm):
    engine, seen, _ = warm
    engine.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}],
                    [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 2)
    m = _metrics(engine.metrics.render().decode())
    assert m["hybrid_jax_compile_stalls_total"] == 0
    by = {src: m[f'hybrid_jax_compiled_programs_by_source{{source="{src}"}}'] for src in ("store", "compiled",
                                                                                          "on_demand")}
    assert by["store"] == 0 and by["compiled"] == seen[-1].ready_total
    assert sum(by.values()) == m["hybrid_jax_compiled_programs"]      # (no prefix caching: its programs none)
    assert m['hybrid_jax_startup_programs{state="built"}'] == m['hybrid_jax_startup_programs{state="planned"}']
    assert m["hybrid_jax_startup_complete"] == 1
    assert m['hybrid_jax_startup_phase_seconds{phase="loading_weights"}'] == pytest.approx(seen[-1].weights_s)
    assert m['hybrid_jax_startup_phase_seconds{phase="compiling"}'] == pytest.approx(seen[-1].ready_s)


def test_a_data_parallel_engine_reports_its_replicas_summed(tiny_checkpoint):
    """Two replicas on this process's one device, timed as build_engine times a load: one status for
    both (the ready sets summed), the metrics' programs by source summed over the replicas."""
    from hybrid_jax import LLM  # noqa: PLC0415
    from hybrid_jax.engine.data_parallel import DataParallelEngine  # noqa: PLC0415
    llm = LLM(model=tiny_checkpoint)
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=128, decode_steps=2,
                       warmup="minimal", compilation_cache_dir=None)
    dp = DataParallelEngine([llm, llm], cfg)
    try:
        assert dp.startup_status() is None                  # no load timed: nothing to say
        dp.clock.weights_loaded()
        seen: list[StartupStatus] = []
        dp.warmup(on_progress=lambda _: seen.append(dp.startup_status()))
        dp.clock.ready()
        one = len(dp.replicas[0].startup.plan.ready)
        assert len(seen) == 2 * one and {s.phase for s in seen} == {"compiling"}
        st = dp.startup_status()
        assert (st.phase, st.done, st.ready_total, st.total) == ("complete", 2 * one, 2 * one, 2 * one)
        dp.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        m = _metrics(dp.metrics.render().decode())
        by = {s: m[f'hybrid_jax_compiled_programs_by_source{{source="{s}"}}']
              for s in ("store", "compiled", "on_demand")}
        assert sum(by.values()) == m["hybrid_jax_compiled_programs"] and by["compiled"] == 2 * one
        assert m["hybrid_jax_compile_stalls_total"] == 0
        assert m['hybrid_jax_startup_programs{state="built"}'] == 2 * one
    finally:
        dp.close()
