"""A real server process on loopback, driven over HTTP: concurrent streams, bounded load tests (ours
and the official OpenAI client's) whose every completion matches the offline engine, malformed and
out-of-range requests beside innocent ones, OpenAI's error shape, body limits, disconnects of
streaming and non-streaming clients, latency metrics from HTTP arrival."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from conftest import stop_process

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.bench import make_workload, run_load

KEY = "test-key"
H = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc, url: str, seconds: float):
    """Polls /health until 200; fails the test with the server's output if it exits or times out."""
    deadline, status = time.time() + seconds, None
    while time.time() < deadline and proc.poll() is None:
        try:
            status = httpx.get(url + "/health", timeout=5).status_code
            if status == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    pytest.fail(f"server did not become ready: {proc.stdout.read().decode()[-3000:]}")


_SERVERS: dict[str, subprocess.Popen] = {}      # url -> the server process (to find its engine core)


def _engine_core_pid(url: str) -> int:
    """The pid of the server's engine core: the one child process of the server (`serve` spawns it)."""
    pid = _SERVERS[url].pid
    children = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children |= {int(c) for c in f.read().split()}
    cores = []
    for c in children:
        with open(f"/proc/{c}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():     # multiprocessing's spawned child (not its resource tracker)
                cores.append(c)
    assert len(cores) == 1, f"expected one engine core among the server's children {sorted(children)}"
    return cores[0]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    port = _free_port()
    cc = os.environ.get("JAX_COMPILATION_CACHE_DIR") or tmp_path_factory.mktemp("jaxcache")   # conftest's, shared
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybrid_jax.cli", "serve", "--model", tiny_checkpoint, "--port", str(port),
         "--api-key", KEY, "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "256",
         "--max-tokens-limit", "200", "--max-request-bytes", "20000", "--warmup", "all",
         "--compilation-cache-dir", str(cc)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "HYBRID_JAX_ENGINE_CPUS": "0"})   # the core keeps to CPU 0
    url = f"http://127.0.0.1:{port}"
    _wait_ready(proc, url, 400)
    _SERVERS[url] = proc
    yield url
    stop_process(proc)


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
    return LLM(model=tiny_checkpoint)


def _wait_start_up_complete(url, timeout=300):
    """Until the warm-up's background set is built (/health says so)."""
    deadline = time.time() + timeout
    while "start-up complete" not in (health := httpx.get(url + "/health").text):
        assert time.time() < deadline, health
        time.sleep(0.5)


def _metric(url, name, default=None) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    if default is not None:             # a labelled series appears with its first count
        return default
    raise AssertionError(f"metric {name} not exported")


def _greedy(offline, prompts, lens):
    outs = offline.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens])
    return [o.outputs[0].token_ids for o in outs]


def test_health_models_and_auth(server):
    assert httpx.get(server + "/health").status_code == 200
    r = httpx.get(server + "/v1/models", headers=H)
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "model"
    assert r.json()["data"][0]["vocab_size"] == 211 and r.json()["data"][0]["max_model_len"] == 256
    r = httpx.post(server + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 401


def test_completion_matches_offline_engine(server, offline):
    prompt = [5, 9, 13, 2, 77]
    r = httpx.post(server + "/v1/completions", headers=H, timeout=60,
                   json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == _greedy(offline, [prompt], [12])[0]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert body["choices"][0]["finish_reason"] == "length"


def test_concurrent_streams(server, offline):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 211, int(n)).tolist() for n in rng.integers(3, 60, 6)]

    async def stream(client, p):
        toks, chunks = [], 0
        async with client.stream("POST", server + "/v1/completions", headers=H,
                                 json={"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                                       "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    toks += json.loads(line[6:])["choices"][0]["token_ids"]
                    chunks += 1
        return toks, chunks

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(stream(c, p) for p in prompts))

    got = asyncio.run(main())
    assert [t for t, _ in got] == _greedy(offline, prompts, [10] * len(prompts))
    assert all(n >= 2 for _, n in got)        # streamed in several chunks, not one


def test_bounded_load_no_request_lost_and_all_match(server, offline):
    wl = make_workload(64, (4, 48), (4, 24), shared_prefix=0.5, vocab=211, seed=3)
    stalls = _metric(server, "hybrid_jax_compile_stalls_total")
    results, _ = asyncio.run(run_load(wl, 8, url=server, api_key=KEY, progress=False))
    assert len(results) == 64
    expected = _greedy(offline, wl.prompts, wl.output_lens)
    assert [r.tokens for r in results] == expected
    assert all(r.ttft is not None for r in results)
    # every step ran in a program the warm-up built, or the background built meanwhile: none waited on a compile
    assert _metric(server, "hybrid_jax_compile_stalls_total") == stalls == 0


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"prompt": [1, 2], "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": [1, 2], "max_tokens": 500}).encode(), 400, "limit"),
    (json.dumps({"prompt": [1, 99999], "max_tokens": 5}).encode(), 400, "outside the vocabulary"),
    (json.dumps({"prompt": [], "max_tokens": 5}).encode(), 400, "prompt"),
    (json.dumps({"max_tokens": 5}).encode(), 400, "'prompt' is required"),
    (json.dumps({"prompt": [1], "n": 0}).encode(), 400, "'n' must be a positive integer"),
    (json.dumps({"prompt": [1], "temperature": -2}).encode(), 400, "temperature"),
    (json.dumps({"prompt": [1] * 250, "max_tokens": 10}).encode(), 400, "max_model_len"),
    (json.dumps({"prompt": "text needs a tokenizer", "max_tokens": 3}).encode(), 400, "tokenizer"),
    (b'{"prompt": [1], "pad": "' + b"x" * 30000 + b'"}', 413, "exceeds the limit"),
    # parsing is total: each of these was a 500 with a traceback
    (b'{"prompt": [1], "x": ' + b"[" * 9000 + b"]" * 9000 + b"}", 400, "nested deeper"),
    (b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}", 400, "out of range"),
    (b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    (b'{"prompt": [1], "temperature": 1e400}', 400, "out of range"),
    (b'{"prompt": [1], "temperature": NaN}', 400, "NaN"),
    (b'{"prompt": "\\ud800 lone"}', 400, "lone surrogate"),
    # fields checked against the model and the engine limits at admission
    (json.dumps({"prompt": [1], "stop_token_ids": [10**12]}).encode(), 400, "outside the vocabulary"),
    (json.dumps({"prompt": [1], "top_p": 1e-46, "temperature": 1}).encode(), 400, "rounds to 0"),
    (json.dumps({"prompt": [1], "stop": ["a"] * 100}).encode(), 400, "at most"),
    (json.dumps({"prompt": [1], "logprobs": 21}).encode(), 400, "logprobs"),
    (json.dumps({"prompt": [1], "logprobs": -1}).encode(), 400, "logprobs"),
    # unsupported OpenAI fields are refused, not ignored
    (json.dumps({"prompt": [1], "suffix": "x"}).encode(), 400, "'suffix'"),
    (json.dumps({"prompt": [1], "use_beam_search": True}).encode(), 400, "'use_beam_search'"),
    (json.dumps({"prompt": [1], "no_such_field": 1}).encode(), 400, "Unrecognized request argument supplied"),
    (json.dumps({"prompt": [1], "best_of": 3}).encode(), 400, "'best_of'"),
    (json.dumps({"prompt": [1], "logit_bias": {"5": 101}}).encode(), 400, "logit_bias['5'] must be a number in [-100, 100]"),
    (json.dumps({"prompt": [1], "logit_bias": {"999999": 1}}).encode(), 400, "'logit_bias' names token ids outside"),
    (json.dumps({"prompt": [1], "model": "gpt-4-does-not-exist"}).encode(), 404, "does not exist"),
], ids=lambda v: v[:40].decode("latin-1") if isinstance(v, bytes) else str(v))
def test_malformed_requests_get_4xx_and_server_keeps_serving(server, body, status, needle):
    r = httpx.post(server + "/v1/completions", content=body, headers={**H, "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}      # OpenAI's error shape
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(server + "/v1/completions", headers=H, json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_chat_without_template_is_400(server):
    r = httpx.post(server + "/v1/chat/completions", headers=H, json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def _thread_cpu_ticks(pid: int) -> dict[int, int]:
    """utime + stime of each thread of a process, in clock ticks."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:                 # a thread that ended meanwhile
            continue
        out[int(t)] = int(fields[11]) + int(fields[12])
    return out


def _assert_computation_on_cpu0(url: str, pid: int):
    """Requests through `url` run their computation on threads of `pid` kept to CPU 0; at least two
    threads (XLA's) are, and the main thread (Python's: the step loop or the HTTP loop) is not."""
    before = _thread_cpu_ticks(pid)
    for _ in range(3):
        r = httpx.post(url + "/v1/completions", headers=H, timeout=120,
                       json={"prompt": [1, 2], "max_tokens": 200, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
    after = _thread_cpu_ticks(pid)
    affinity = {t: os.sched_getaffinity(t) for t in after}
    work = {t: after[t] - before.get(t, 0) for t in after}
    on_device = [t for t, cpus in affinity.items() if cpus == {0}]
    assert len(on_device) >= 2
    # Python's threads (the step loop, the HTTP loop) may be as busy as XLA's with a model this small,
    # so they are left out: they are the ones split_threads gave the other CPUs. Of the rest (the
    # runtime's), the busiest is on CPU 0: a runtime thread left on every CPU would be it.
    host = set(range(os.cpu_count() or 1)) - {0}
    runtime = {t: w for t, w in work.items() if not host or affinity[t] != host}
    assert sum(work[t] for t in on_device) > 0 and max(runtime, key=runtime.get) in on_device, (work, affinity)
    if len(os.sched_getaffinity(0)) > 1 and (os.cpu_count() or 1) > 1:
        assert 0 not in affinity[pid] and affinity[pid], affinity      # Python's threads are off the device


def test_engine_core_keeps_its_computation_to_the_cpus_it_is_given(server):
    """HYBRID_JAX_ENGINE_CPUS=0 (the fixture's): the core's compute threads (XLA's) keep to CPU 0, its
    Python threads (the step loop: the main thread) to the other CPUs, and the computation of a
    request runs on CPU 0's threads. The API server process is not held to CPU 0."""
    _wait_start_up_complete(server)          # (the background compiles run on the other CPUs, with Python's)
    _assert_computation_on_cpu0(server, _engine_core_pid(server))
    if len(os.sched_getaffinity(0)) > 1:
        assert os.sched_getaffinity(_SERVERS[server].pid) != {0}


def test_engine_on_the_server_thread_keeps_its_computation_to_the_cpus_it_is_given(tiny_checkpoint, tmp_path):
    """--no-engine-process: the same split inside the server's own process."""
    port = _free_port()
    cc = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path / "cc")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybrid_jax.cli", "serve", "--model", tiny_checkpoint, "--port", str(port),
         "--api-key", KEY, "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "256",
         "--warmup", "minimal", "--compilation-cache-dir", cc, "--no-engine-process", "--no-async-scheduling"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "HYBRID_JAX_ENGINE_CPUS": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, 400)
        _assert_computation_on_cpu0(url, proc.pid)
    finally:
        stop_process(proc)


def test_a_bad_engine_cpu_list_is_named():
    from hybrid_jax.engine.cpu_affinity import parse_cpus  # noqa: PLC0415
    from hybrid_jax.errors import HybridJaxError  # noqa: PLC0415
    assert parse_cpus("0-2, 5") == {0, 1, 2, 5}
    with pytest.raises(HybridJaxError, match="HYBRID_JAX_ENGINE_CPUS='0-x' is not a CPU list"):
        parse_cpus("0-x")


def test_client_disconnect_frees_request(server):
    """A streaming client that hangs up mid-stream has its request aborted. The engine core runs in its
    own process and can finish 200 tiny-model tokens before the hang-up reaches it, so the test freezes
    the core (SIGSTOP) once the first chunk is here: if everything the core had sent by then still leaves
    the request unfinished, the request is in flight, and the client hangs up while the core is frozen.
    The core, let go, must abort it. (A request that had already finished is tried again.)"""
    import signal  # noqa: PLC0415
    core = _engine_core_pid(server)
    aborted = _metric(server, "hybrid_jax_requests_aborted_total")
    in_flight = False
    for _ in range(5):
        try:
            with httpx.Client(timeout=httpx.Timeout(60, read=3)) as c, \
                    c.stream("POST", server + "/v1/completions", headers=H,
                             json={"prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        break
                os.kill(core, signal.SIGSTOP)
                finished = False
                try:                          # drain what the core sent before it froze
                    for line in lines:
                        if line.startswith("data: "):
                            finished |= line == "data: [DONE]" or \
                                json.loads(line[6:])["choices"][0]["finish_reason"] is not None
                except httpx.ReadTimeout:     # nothing more is coming: the request is in flight
                    in_flight = not finished
            # the client has hung up (the stream and its connection are closed)
            if in_flight:
                time.sleep(1.0)               # the API server sees the disconnect and sends the abort
        finally:
            os.kill(core, signal.SIGCONT)
        if in_flight:
            break
    assert in_flight, "every try finished its 200 tokens before the core could be frozen"
    deadline = time.time() + 30
    while time.time() < deadline:
        if (_metric(server, "hybrid_jax_requests_aborted_total") > aborted
                and _metric(server, "hybrid_jax_num_requests_running") == 0):
            break
        time.sleep(0.2)
    assert _metric(server, "hybrid_jax_requests_aborted_total") == aborted + 1
    assert _metric(server, "hybrid_jax_num_requests_running") == 0


def test_metrics_exposes_the_promised_series(server):
    text = httpx.get(server + "/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "generation_throughput_tokens_per_second", "num_requests_waiting", "num_requests_running",
                 "prefix_cache_hit_rate", "prefix_cache_validation_pass_rate", "prefix_cache_effective_reuse",
                 "sparse_attention_hit_rate", "spec_decode_acceptance_rate", "device_busy_ratio",
                 "device_busy_seconds_total", "step_host_seconds_count"):
        assert "hybrid_jax_" + name in text, name


def test_bench_cli_against_the_server(server, capsys):
    from hybrid_jax.cli import main  # noqa: PLC0415
    assert main(["bench", "--url", server, "--api-key", KEY, "--num-requests", "6", "--concurrency", "3",
                 "--prompt-len", "4:20", "--output-len", "2:6"]) == 0
    out = capsys.readouterr().out
    assert "requests 6 in" in out and "TTFT" in out and "ITL" in out
    busy, host, steps = re.search(r"device busy (\d+)% of the run; host ([\d.]+) ms per step \((\d+) steps\)",
                                  out).groups()
    assert 0 < int(busy) <= 100 and float(host) > 0 and int(steps) >= 6


def test_unknown_routes_and_methods_get_the_openai_error_shape(server):
    for r, status in ((httpx.get(server + "/nope", headers=H), 404), (httpx.get(server + "/v1/completions", headers=H), 405)):
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server + "/v1/completions", headers=H, json={"prompt": [1], "model": "nope"})
    assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"


def test_docs_and_openapi_need_the_key(server):
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(server + path).status_code == 401
        assert httpx.get(server + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(server + path, headers=H).status_code == 200


def test_body_over_the_limit_is_refused_while_it_streams_in(server):
    """A chunked body (no content-length) past the limit gets its 413 while the client is still
    sending: the server does not wait for (or hold) the rest."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(30):                          # 30 kB of a body that never ends
            s.sendall(b"3e8\r\n" + b" " * 1000 + b"\r\n")
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_bad_requests_beside_innocent_ones(server, offline):
    """Innocent requests (streams and not) run beside requests that used to fail the whole step;
    they complete, identical to the offline engine (a run without the bad ones)."""
    prompts = [[5, 9, 13, 2], [1, 2, 3, 4, 5, 6, 7], [100, 3, 42, 8, 8], [7] * 30]
    bad = [{"prompt": [1, 2], "stop_token_ids": [10**12]}, {"prompt": [3], "top_k": 10**30},
           {"prompt": [4], "temperature": 1e308}]

    async def innocent(c, i, p):
        body = {"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
        if not body["stream"]:
            r = await c.post(server + "/v1/completions", headers=H, json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        toks = []
        async with c.stream("POST", server + "/v1/completions", headers=H, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    toks += json.loads(line[6:])["choices"][0]["token_ids"]
        return toks

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            good = [innocent(c, i, p) for i, p in enumerate(prompts)]
            evil = [c.post(server + "/v1/completions", headers=H, json={**b, "max_tokens": 8}) for b in bad]
            return await asyncio.gather(*good, *evil)

    got = asyncio.run(main())
    assert got[:len(prompts)] == _greedy(offline, prompts, [12] * len(prompts))
    statuses = [r.status_code for r in got[len(prompts):]]
    assert statuses[0] == 400                      # a stop id outside the vocabulary: refused
    assert statuses[1] == 200                      # top_k past the vocabulary means "all tokens"
    assert statuses[2] == 400 and "float32" in got[-1].json()["error"]["message"]


def test_non_streaming_client_that_leaves_aborts_its_request(server):
    aborted = _metric(server, "hybrid_jax_requests_aborted_total")

    async def impatient(c):
        try:
            await c.post(server + "/v1/completions", headers=H, timeout=0.2,   # (8 x 200 tokens on 2 rows
                         json={"prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True})   # take ~0.5 s)
        except httpx.TimeoutException:
            return True
        return False

    async def main():
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(impatient(c) for _ in range(8)))

    gave_up = sum(asyncio.run(main()))
    t0 = time.time()
    while time.time() - t0 < 15:
        if _metric(server, "hybrid_jax_num_requests_running") == 0 and \
                _metric(server, "hybrid_jax_num_requests_waiting") == 0:
            break
        time.sleep(0.1)
    freed = time.time() - t0
    assert gave_up >= 1
    assert _metric(server, "hybrid_jax_requests_aborted_total") - aborted >= 1
    assert _metric(server, "hybrid_jax_num_requests_running") == 0
    assert freed < 10            # a second or so in practice; bounded generously for a loaded machine
    # every client that gave up had its request aborted (at most the 2 running ones may have
    # finished in the moment between the hang-up and the abort), outputs flowing or not
    assert _metric(server, "hybrid_jax_requests_aborted_total") - aborted >= gave_up - 2


def test_latency_metrics_count_from_arrival_and_gauges_return_to_zero(server):
    names = ("time_to_first_token_seconds", "request_queue_time_seconds", "e2e_request_latency_seconds")
    before = {n: (_metric(server, f"hybrid_jax_{n}_sum"), _metric(server, f"hybrid_jax_{n}_count")) for n in names}

    async def one(c, i):           # 6 requests on 2 rows: the later ones queue
        t0 = time.perf_counter()
        async with c.stream("POST", server + "/v1/completions", headers=H,
                            json={"prompt": [i + 1, 2, 3], "max_tokens": 24, "ignore_eos": True, "stream": True}) as r:
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: "):
                    ttft = time.perf_counter() - t0
        return ttft

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(6)))

    client_ttft = sum(asyncio.run(main()))
    d = {n: (_metric(server, f"hybrid_jax_{n}_sum") - before[n][0], _metric(server, f"hybrid_jax_{n}_count")
             - before[n][1]) for n in names}
    assert all(d[n][1] == 6 for n in names), d
    ttft, queue, e2e = (d[n][0] for n in names)
    assert queue <= ttft <= e2e               # all three count from the same arrival
    assert ttft <= client_ttft                # and the server never sees less than the client: no later start
    assert _metric(server, "hybrid_jax_num_requests_waiting") == 0
    assert _metric(server, "hybrid_jax_num_requests_running") == 0
    assert _metric(server, "hybrid_jax_kv_cache_usage_ratio") == 0
    assert _metric(server, 'hybrid_jax_request_success_total{finished_reason="length"}') >= 6
    errors = _metric(server, 'hybrid_jax_request_errors_total{type="invalid_request_error"}', default=0.0)
    assert httpx.post(server + "/v1/completions", headers=H, json={"prompt": [1], "top_k": -5}).status_code == 400
    assert _metric(server, 'hybrid_jax_request_errors_total{type="invalid_request_error"}') == errors + 1


def test_official_openai_client_bounded_load_and_errors(server, offline):
    """The official client at concurrency 32 (streams and not): every output equals the offline
    engine's; our errors are the ones it understands (NotFoundError, BadRequestError with the body)."""
    import openai  # noqa: PLC0415

    wl = make_workload(96, (4, 40), (2, 8), shared_prefix=0.3, vocab=211, seed=5)

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)
        model = (await client.models.list()).data[0].id
        sem = asyncio.Semaphore(32)

        async def one(i, prompt, n):
            kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
            async with sem:
                if i % 2:
                    return (await client.completions.create(**kw)).choices[0].token_ids
                toks = []
                async for chunk in await client.completions.create(stream=True, **kw):
                    toks += chunk.choices[0].token_ids
                return toks

        got = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))))
        with pytest.raises(openai.NotFoundError) as e:
            await client.completions.create(model="gpt-4-does-not-exist", prompt=[1], max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=model, prompt=[1], max_tokens=2,
                                            extra_body={"stop_token_ids": [10**12]})
        assert "outside the vocabulary" in e.value.body["message"]
        await client.close()
        return got

    assert asyncio.run(main()) == _greedy(offline, wl.prompts, wl.output_lens)
