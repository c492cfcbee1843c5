"""The server process's life: the default warm-up compiles every shape before /health is 200 (prefix
hits and the disk tier included), the API key from the environment, header and body read timeouts,
SIGTERM drains (streams still open at the deadline get an error event, the disk tier's writes are
flushed, the process exits 0), and a model that fails to load exits 1."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_server import _free_port, _metric, _wait_ready   # noqa: PLC2701  (sibling test module's helpers)

KEY = "env-key"
H = {"Authorization": f"Bearer {KEY}"}


def _start(args, env_extra=None):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    proc = subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    return proc, port


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    cc = os.environ.get("JAX_COMPILATION_CACHE_DIR") or tmp_path_factory.mktemp("jaxcache")
    kv = tmp_path_factory.mktemp("kv")
    # no --warmup: serve's default must compile every shape; the key comes from the environment
    proc, port = _start(["--model", tiny_checkpoint, "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                         "--max-model-len", "1024", "--max-tokens-limit", "1000", "--shutdown-timeout", "1",
                         "--timeout-header", "1", "--timeout-body", "1", "--compilation-cache-dir", str(cc),
                         "--enable-prefix-caching", "--kv-cache-dir", str(kv)],
                        {"HYBRID_JAX_API_KEY": KEY})
    url = f"http://127.0.0.1:{port}"
    _wait_ready(proc, url, 500)
    yield proc, url, port, kv
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_default_warmup_compiles_every_shape_before_health(server):
    _, url, _, _ = server
    health = httpx.get(url + "/health").text
    assert "warm-up all" in health and "every step shape" in health
    assert "compiling in the background" in health or "start-up complete" in health, health
    deadline = time.time() + 300
    while "start-up complete" not in (health := httpx.get(url + "/health").text):    # the background set
        assert time.time() < deadline, health
        time.sleep(0.5)
    assert _metric(url, "hybrid_jax_startup_complete") == 1
    before = _metric(url, "hybrid_jax_compiled_programs")
    for body in ({"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 5},             # first logprobs request
                 # first long prompt (398 tokens, stored at 384: its answer's checkpoint at 400 keeps the
                 # prompt's as a spare), then the first prefix hit, there
                 {"prompt": list(range(1, 200)) * 2, "max_tokens": 3},
                 {"prompt": list(range(1, 200)) * 2 + [7], "max_tokens": 3},
                 {"prompt": [4, 5], "max_tokens": 5, "temperature": 0.7, "top_k": 5, "top_p": 0.9}):
        r = httpx.post(url + "/v1/completions", headers=H, json=body, timeout=120)
        assert r.status_code == 200, r.text
    assert _metric(url, "hybrid_jax_compiled_programs") == before     # nothing compiled on the serving path
    assert _metric(url, "hybrid_jax_compile_stalls_total") == 0
    assert _metric(url, "hybrid_jax_prefix_cache_hits_total") > 0


def test_api_key_from_the_environment(server):
    _, url, _, _ = server
    assert httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 401
    assert httpx.post(url + "/v1/completions", headers=H, json={"prompt": [1], "max_tokens": 1}).status_code == 200


def test_slow_headers_and_bodies_are_cut_off(server):
    _, _, port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")          # headers that never finish
        assert s.recv(1024) == b""                                             # closed by the server
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
        assert s.recv(65536).startswith(b"HTTP/1.1 408")


def test_sigterm_drains_then_exits_zero(server):
    """Last test of the module: it stops the server."""
    proc, url, _, kv = server

    async def stream(c, got_first):
        events = []
        async with c.stream("POST", url + "/v1/completions", headers=H,
                            json={"prompt": [3, 4, 5], "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    got_first.set()
        return events

    async def short(c):
        return await c.post(url + "/v1/completions", headers=H, json={"prompt": [1, 2], "max_tokens": 40,
                                                                        "ignore_eos": True})

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            firsts = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(stream(c, f)) for f in firsts]
            await asyncio.gather(*(f.wait() for f in firsts))
            quick = asyncio.create_task(short(c))
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams), await quick

    t0 = time.time()
    streams, quick = asyncio.run(main())
    assert quick.status_code == 200 and len(quick.json()["choices"][0]["token_ids"]) == 40   # drained
    for events in streams:
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_shutdown" and "shut down" in err["message"]
    assert proc.wait(timeout=60) == 0
    assert time.time() - t0 < 60
    log = proc.stdout.read().decode()
    assert "draining" in log and "shutting down the engine" in log
    # the API server's own account of the start-up (the core's pipe, then its beats)
    assert "hybrid_jax.server: engine core: weights loaded in" in log
    assert "hybrid_jax.server: engine core: compiling" in log and "programs before ready" in log
    assert "hybrid_jax.server: engine core: ready in" in log and "loading weights" in log
    assert "hybrid_jax.server: start-up complete:" in log
    assert any(kv.iterdir())                        # the disk tier's write-behind was flushed before exit


def test_a_model_that_fails_to_load_exits_nonzero(tmp_path):
    proc, _ = _start(["--model", str(tmp_path / "no-such-model"), "--compilation-cache-dir", "none"])
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode()
    assert code == 1, out[-2000:]
    assert "loading failed" in out and "does not exist" in out
    assert "HybridJaxError: loading failed" not in out     # the core's message is not wrapped in another


def _children(pid: int) -> list[int]:
    """The processes `pid` spawned (multiprocessing's spawn; not its resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    spawned = b"spawn_main" in f.read()
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid and spawned:
                out.append(int(d))
    return out


def test_two_api_server_processes_share_the_port_and_the_core(tiny_checkpoint, tmp_path_factory):
    """--api-server-count 2: the engine core and a second API server run as this server's children,
    requests on fresh connections (spread over both by the kernel) all get the offline engine's
    tokens, and SIGTERM to the first stops them all, exiting 0."""
    from hybrid_jax import LLM, SamplingParams  # noqa: PLC0415
    cc = os.environ.get("JAX_COMPILATION_CACHE_DIR") or tmp_path_factory.mktemp("jaxcache")
    proc, port = _start(["--model", tiny_checkpoint, "--api-server-count", "2", "--max-num-seqs", "4",
                         "--max-num-batched-tokens", "32", "--max-model-len", "256", "--warmup", "none",
                         "--compilation-cache-dir", str(cc), "--shutdown-timeout", "2"])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, 500)
        deadline = time.time() + 120
        while len(_children(proc.pid)) < 2 and time.time() < deadline:
            time.sleep(0.5)
        kids = _children(proc.pid)
        assert len(kids) == 2, kids                    # the core and the second API server
        prompts = [[5 + i, 9, 13, 2 * i] for i in range(8)]

        async def one(p):
            async with httpx.AsyncClient(timeout=300) as c:     # a connection of its own
                for _ in range(60):                              # the second server may still be starting
                    r = await c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 6, "temperature": 0,
                                                                    "ignore_eos": True})
                    if r.status_code != 503:
                        return r
                    await asyncio.sleep(1)
                return r

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))
        rs = asyncio.run(main())
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        llm = LLM(model=tiny_checkpoint)
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                             SamplingParams(max_tokens=6, temperature=0,
                                                                            ignore_eos=True))]
        assert [r.json()["choices"][0]["token_ids"] for r in rs] == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        time.sleep(1)
        assert not [k for k in kids if os.path.exists(f"/proc/{k}") and "zombie" not in open(f"/proc/{k}/status").read()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
