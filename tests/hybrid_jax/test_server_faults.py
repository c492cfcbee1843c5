"""A server that stays whole when its engine fails (server/supervisor.py, engine/heartbeat.py).

A real server on loopback: a SIGKILLed engine core ends every open stream with an error event and
`[DONE]` and every request in flight with a JSON 503, 401 / 400 / 404 stay JSON with their codes,
new requests get a JSON 503 until the core is restarted, and then it serves again; a SIGSTOPped core
turns /health 503 within a few seconds and back to 200 after SIGCONT, while /metrics (served from
the core's heartbeats, never a round trip to the core) still answers; a clean SIGTERM logs no error;
with --core-restarts 0 a dead core ends the server with a non-zero exit code.

Without HTTP: a core that stops beating is killed and restarted by the API server that owns it, at
the same address, and another API server reconnects to it; an engine thread (--no-engine-process)
that dies or wedges makes the app answer 503s, its streams end with an error event and [DONE].
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import stop_process
from test_server import _free_port   # noqa: PLC2701  (sibling test module's helper)

from hybrid_jax import LLM
from hybrid_jax.engine import EngineConfig, LLMEngine

KEY = "faults-key"
H = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True}


def _start(args, log_path):
    port = _free_port()
    cc = os.environ["JAX_COMPILATION_CACHE_DIR"]          # conftest's, shared by the session
    log = open(log_path, "wb")                            # noqa: SIM115  (the server's whole life)
    proc = subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--compilation-cache-dir", cc, *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, url: str, log_path, seconds: float):
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    tail = open(log_path, "rb").read().decode()[-3000:]
    pytest.fail(f"server not healthy within {seconds} s: {tail}")


def _cores(server_pid: int) -> list[int]:
    """The server's engine core processes (its children started by multiprocessing's spawn)."""
    out = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            for c in f.read().split():
                try:
                    with open(f"/proc/{c}/cmdline", "rb") as g:
                        if b"spawn_main" in g.read():
                            out.append(int(c))
                except OSError:
                    pass
    return sorted(set(out))


def _core(server_pid: int) -> int:
    cores = _cores(server_pid)
    assert len(cores) == 1, cores
    return cores[0]


def _metric_text(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=5)
    assert r.status_code == 200, r.text
    return r.text


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def _post(url, body, headers=H, timeout=120):
    return httpx.post(url + "/v1/completions", headers=headers, json=body, timeout=timeout)


def _serve_retrying(url, body, seconds=90):
    """A request, tried again while the engine is briefly unavailable (a first-use compile after a
    restart stalls its heartbeat): the response that is not a 503."""
    deadline = time.time() + seconds
    while True:
        r = _post(url, body)
        if r.status_code != 503 or time.time() > deadline:
            return r
        time.sleep(0.5)


def _is_error_json(r, status: int, kind: str | None = None):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if kind is not None:
        assert err["type"] == kind, err
    return err


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """warm-up none (a restart takes seconds) with programs from the session's compilation cache, the
    first ones compiled by the priming requests below; the unresponsive timeout small; no hang kill
    (a first-use compile may stall the core for longer than a test wants to wait)."""
    log_path = tmp_path_factory.mktemp("faults") / "server.log"
    proc, url = _start(["--model", tiny_checkpoint, "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                        "--max-model-len", "512", "--max-tokens-limit", "500", "--warmup", "none",
                        "--core-restarts", "2", "--core-unresponsive-timeout", "2", "--core-hang-timeout", "0",
                        "--shutdown-timeout", "2"], log_path)
    try:
        _wait_healthy(proc, url, log_path, 300)

        async def prime():                 # the step shapes the tests use, compiled (and cached) now
            async with httpx.AsyncClient(timeout=300) as c:
                async def one(stream):
                    for _ in range(200):
                        r = await c.post(url + "/v1/completions", headers=H,
                                         json={**LONG, "max_tokens": 12, "stream": stream})
                        if r.status_code != 503:
                            return r.status_code
                        await asyncio.sleep(0.5)
                return await asyncio.gather(*(one(i % 2 == 0) for i in range(5)))
        assert asyncio.run(prime()) == [200] * 5
        yield proc, url, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_are_served_without_asking_the_core(server):
    """/metrics comes from the core's heartbeats: scraping sends the core no command, and the series
    this process counts itself (errors, restarts, the heartbeat's age) are merged in once each."""
    _, url, _ = server
    text = _metric_text(url)
    before = _metric(text, "hybrid_jax_engine_core_commands_total")
    for _ in range(40):
        _metric_text(url)
    time.sleep(1.2)                        # two beats later: the core's own count of what it received
    text = _metric_text(url)
    assert _metric(text, "hybrid_jax_engine_core_commands_total") == before
    assert _metric(text, "hybrid_jax_engine_up") == 1
    assert 0 <= _metric(text, "hybrid_jax_engine_heartbeat_age_seconds") < 2
    assert text.count("# TYPE hybrid_jax_request_errors_total counter") == 1
    assert "hybrid_jax_engine_core_restarts_total 0.0" in text
    assert "hybrid_jax_generation_tokens_total" in text            # the core's series are there too
    assert _post(url, {"prompt": [1], "max_tokens": 1}).status_code == 200     # and a request is one
    time.sleep(1.2)
    assert _metric(_metric_text(url), "hybrid_jax_engine_core_commands_total") == before + 1


def test_a_stopped_core_turns_health_503_and_back(server):
    proc, url, _ = server
    _wait_healthy(proc, url, server[2], 60)
    core = _core(proc.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        t0 = time.time()
        while httpx.get(url + "/health", timeout=5).status_code == 200:
            assert time.time() - t0 < 5, "/health stayed 200 while the core was stopped"
            time.sleep(0.1)
        h = httpx.get(url + "/health", timeout=5)
        assert h.status_code == 503 and "not responding" in h.text
        t = time.time()
        m = httpx.get(url + "/metrics", timeout=5)       # served from the last beat: no wait on the core
        assert m.status_code == 200 and time.time() - t < 2
        assert _metric(m.text, "hybrid_jax_engine_up") == 0
        assert "hybrid_jax_num_requests_running" in m.text
        err = _is_error_json(_post(url, {"prompt": [1], "max_tokens": 2}, timeout=10), 503, "unavailable")
        assert err["code"] == "engine_unavailable" and "not responding" in err["message"]
    finally:
        os.kill(core, signal.SIGCONT)
    t0 = time.time()
    while httpx.get(url + "/health", timeout=5).status_code != 200:
        assert time.time() - t0 < 5, "/health did not come back after SIGCONT"
        time.sleep(0.1)
    assert _core(proc.pid) == core                    # not restarted: it only paused
    assert _serve_retrying(url, {"prompt": [1], "max_tokens": 2}).status_code == 200


def test_a_killed_core_fails_what_is_open_answers_json_and_is_restarted(server):
    proc, url, _ = server
    _wait_healthy(proc, url, server[2], 60)
    core = _core(proc.pid)

    async def stream(c, first):
        events = []
        async with c.stream("POST", url + "/v1/completions", headers=H, json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
        return events

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            firsts = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(stream(c, f)) for f in firsts]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
            plain = asyncio.create_task(c.post(url + "/v1/completions", headers=H, json=LONG))
            await asyncio.sleep(0.3)
            os.kill(core, signal.SIGSTOP)          # nothing finishes from here on: all five are in flight
            await asyncio.sleep(0.2)
            os.kill(core, signal.SIGKILL)
            return await asyncio.gather(*streams), await plain

    streams, plain = asyncio.run(main())
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["type"] == "unavailable" and err["code"] == "engine_unavailable"
        assert "engine core exited" in err["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])    # tokens until then
    assert "engine core" in _is_error_json(plain, 503, "unavailable")["message"]
    # while the core is down (or restarting): every answer is JSON with its own code
    _is_error_json(_post(url, {"prompt": [1]}, headers={}), 401, "authentication_error")
    _is_error_json(httpx.post(url + "/v1/completions", headers=H, content=b"{nope"), 400, "invalid_request_error")
    _is_error_json(httpx.get(url + "/v1/nope", headers=H), 404, "not_found_error")
    _is_error_json(_post(url, {"prompt": [1], "max_tokens": 2, "model": "other"}), 404, "not_found_error")
    err = _is_error_json(_post(url, {"prompt": [1], "max_tokens": 2}), 503, "unavailable")
    assert err["code"] == "engine_unavailable"
    h = httpx.get(url + "/health", timeout=5)
    assert h.status_code == 503 and "engine core" in h.text
    assert _metric(_metric_text(url), 'hybrid_jax_request_errors_total{type="unavailable"}') >= 6
    # the restart: a new core, serving
    _wait_healthy(proc, url, server[2], 120)
    assert _core(proc.pid) != core
    r = _serve_retrying(url, {"prompt": [5, 6], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, (r.text, open(server[2], "rb").read().decode()[-6000:])
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    assert _metric(_metric_text(url), "hybrid_jax_engine_core_restarts_total") == 1
    assert "restarting it (restart 1 of 2)" in open(server[2], "rb").read().decode()


def test_a_clean_sigterm_logs_no_error(server):
    """Last test of the module: it stops the server (after a restart: the new core stops cleanly too)."""
    proc, url, log_path = server
    _wait_healthy(proc, url, log_path, 60)
    mark = len(open(log_path, "rb").read())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    after = open(log_path, "rb").read()[mark:].decode()
    assert "shutting down the engine" in after
    assert not [line for line in after.splitlines() if line.startswith("ERROR") or "Traceback" in line], after


def test_with_no_restarts_left_a_dead_core_ends_the_server(tiny_checkpoint, tmp_path):
    log_path = tmp_path / "server.log"
    proc, url = _start(["--model", tiny_checkpoint, "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                        "--max-model-len", "256", "--warmup", "none", "--core-restarts", "0"], log_path)
    try:
        _wait_healthy(proc, url, log_path, 300)
        os.kill(_core(proc.pid), signal.SIGKILL)
        code = proc.wait(timeout=60)
    finally:
        stop_process(proc)
    log = open(log_path, "rb").read().decode()
    assert code == 1, log[-3000:]
    assert "restarts allowed (--core-restarts) are used up" in log


# --- without HTTP: the supervisor over a core process, and over an engine thread ------------------

CORE_CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, warmup="none",
                           compilation_cache_dir=None)


def test_a_hung_core_is_killed_restarted_and_another_api_server_reconnects():
    """The owner (the API server that started the core) kills a core that stopped beating and starts
    a new one at the same address; a follower (another API server) never kills it and reconnects to
    the new one. (Serving after a restart: the HTTP test above; here a first-use compile would stall
    the new core past this test's short hang timeout.)"""
    from hybrid_jax.default_model import DEFAULT_MODEL_DIR  # noqa: PLC0415
    from hybrid_jax.engine.core_client import EngineCoreClient  # noqa: PLC0415
    from hybrid_jax.engine.core_process import start_core  # noqa: PLC0415
    from hybrid_jax.llm import build_engine  # noqa: PLC0415
    from hybrid_jax.server.api_metrics import ApiMetrics  # noqa: PLC0415
    from hybrid_jax.server.supervisor import EngineSupervisor, SupervisionConfig  # noqa: PLC0415
    from hybrid_jax.tokenizer import load_tokenizer  # noqa: PLC0415
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    proc, address, authkey, info = start_core(None, "auto", CORE_CONFIG, build=build_engine)

    def restart(on_spawn):
        p, _, _, i = start_core(None, "auto", CORE_CONFIG, build=build_engine, address=address, authkey=authkey,
                                on_spawn=on_spawn)
        return EngineCoreClient(address, authkey, i, tok, process=p)

    cfg = SupervisionConfig(core_restarts=1, unresponsive_after_s=1.0, hung_after_s=3.0)
    fatal = []
    owner = EngineSupervisor(EngineCoreClient(address, authkey, info, tok, process=proc), ApiMetrics(), cfg,
                             role="owner", renew=restart, on_fatal=fatal.append)
    follower_metrics = ApiMetrics()
    follower = EngineSupervisor(EngineCoreClient(address, authkey, info, tok), follower_metrics, cfg, role="follower",
                                renew=lambda _: EngineCoreClient(address, authkey, info, tok))
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.time()
        while owner.unavailable() is None or follower.unavailable() is None:
            assert time.time() - t0 < 3
            time.sleep(0.05)
        assert "not responding" in follower.unavailable()
        # killed at 3 s without a beat (SIGKILL ends a stopped process). The supervisor reaps it on its own
        # thread: a `join` here can lose that race to waitpid (ECHILD) and return before the exit code is set,
        # so poll the exit code instead.
        t0 = time.time()
        while proc.exitcode is None:
            assert time.time() - t0 < 20, "the hung core was not killed"
            time.sleep(0.05)
        assert proc.exitcode == -signal.SIGKILL
        t0 = time.time()
        while owner.unavailable() is not None or follower.unavailable() is not None:
            assert time.time() - t0 < 120, (owner.unavailable(), follower.unavailable())
            time.sleep(0.1)
        assert owner.engine.process.pid != proc.pid and owner.restarts == 1 and not fatal
        assert follower.engine.info["pid"] == info["pid"]      # (its info is the first one's: the same model)
        assert "hybrid_jax_engine_core_reconnects_total 1.0" in follower.render_metrics().decode()
        time.sleep(1.0)                         # both hear the new core beat (and so would serve)
        for sup in (owner, follower):
            assert sup.unavailable() is None and sup.engine.pulse.beats >= 2
            assert b"hybrid_jax_num_requests_running" in sup.render_metrics()
        assert owner.engine.process.pid == owner.engine.info["pid"]
    finally:
        follower.close()
        owner.shutdown(timeout=30)


class _Die(BaseException):
    """Ends the engine thread (a failure the step loop does not catch)."""


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint)


def _in_process_app(llm, step_hook, cfg):
    """The app over an AsyncEngine whose step first calls step_hook() (to wedge or end the thread)."""
    from hybrid_jax.engine.async_engine import AsyncEngine  # noqa: PLC0415
    from hybrid_jax.server.app import ServerConfig, ServerState, build_app  # noqa: PLC0415
    from hybrid_jax.server.supervisor import EngineSupervisor  # noqa: PLC0415
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                                         compilation_cache_dir=None, warmup="none"))
    step = engine.step

    def hooked():
        step_hook()
        return step()
    engine.step = hooked
    state = ServerState(ServerConfig(model_name="m"))
    ae = AsyncEngine(engine)
    ae.start()
    fatal: list[str] = []
    state.engine = EngineSupervisor(ae, state.metrics, cfg, on_fatal=fatal.append)
    return build_app(state), state, fatal


async def _events(c, body):
    r = await c.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def test_an_engine_thread_that_dies_ends_its_streams_and_answers_503(llm):
    from hybrid_jax.server.supervisor import SupervisionConfig  # noqa: PLC0415
    steps = {"n": 0}

    def hook():
        steps["n"] += 1
        if steps["n"] == 3:                     # the stream has had output by then
            raise _Die()
    app, state, fatal = _in_process_app(llm, hook, SupervisionConfig(unresponsive_after_s=30, hung_after_s=0))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            events = await _events(c, {"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True})
            for _ in range(50):
                if fatal:
                    break
                await asyncio.sleep(0.1)
            return (events, await c.get("/health"), await c.post("/v1/completions", json={"prompt": [1]}),
                    await c.post("/v1/completions", content=b"[1"), await c.get("/metrics"))
    try:
        events, health, new, bad, metrics = asyncio.run(main())
    finally:
        state.engine.shutdown(timeout=1)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "unavailable" and "engine thread stopped" in err["message"]
    assert health.status_code == 503 and "engine thread stopped" in health.text
    _is_error_json(new, 503, "unavailable")
    _is_error_json(bad, 400, "invalid_request_error")
    assert metrics.status_code == 200
    assert fatal and "cannot be restarted" in fatal[0]         # the server exits 1 (serve() wires this)


def test_an_engine_thread_that_stops_beating_is_unhealthy_until_it_beats_again(llm):
    from hybrid_jax.server.supervisor import SupervisionConfig  # noqa: PLC0415
    wedge, wedged = threading.Event(), threading.Event()
    wedge.set()

    def hook():
        if not wedge.is_set():
            wedged.set()
            wedge.wait(30)
    app, state, fatal = _in_process_app(llm, hook, SupervisionConfig(unresponsive_after_s=1.0, hung_after_s=0))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as c:
            first = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})   # compiles
            assert first.status_code == 200, first.text
            assert (await c.get("/health")).status_code == 200
            wedge.clear()
            pending = asyncio.create_task(c.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 4}))
            while not wedged.is_set():
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            while (health := await c.get("/health")).status_code == 200:
                assert time.monotonic() - t0 < 3
                await asyncio.sleep(0.1)
            refused = await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            wedge.set()
            t0 = time.monotonic()
            while (await c.get("/health")).status_code != 200:
                assert time.monotonic() - t0 < 3
                await asyncio.sleep(0.1)
            return health, refused, await pending
    try:
        health, refused, pending = asyncio.run(main())
    finally:
        wedge.set()
        state.engine.shutdown(timeout=10)
    assert health.status_code == 503 and "not responding" in health.text
    _is_error_json(refused, 503, "unavailable")
    assert pending.status_code == 200              # the request the wedged step held finishes once it goes on
    assert not fatal


def test_supervision_flags_reach_the_supervisor_and_bad_ones_are_errors():
    from hybrid_jax.cli_args import build_parser  # noqa: PLC0415
    from hybrid_jax.cli_config import _supervision  # noqa: PLC0415
    from hybrid_jax.errors import HybridJaxError  # noqa: PLC0415

    def sup(*argv):
        return _supervision(build_parser().parse_args(["serve", *argv]))
    cfg = sup("--core-restarts", "5", "--core-unresponsive-timeout", "2.5", "--core-hang-timeout", "30")
    assert (cfg.core_restarts, cfg.unresponsive_after_s, cfg.hung_after_s) == (5, 2.5, 30.0)
    assert (sup().core_restarts, sup().unresponsive_after_s, sup().hung_after_s) == (3, 5.0, 60.0)
    assert sup("--warmup", "none").hung_after_s == 0          # first-use compiles stall the loop: never killed
    for bad in (["--core-restarts", "-1"], ["--core-unresponsive-timeout", "0"],
                ["--core-hang-timeout", "3", "--core-unresponsive-timeout", "5"]):
        with pytest.raises(HybridJaxError):
            sup(*bad)
