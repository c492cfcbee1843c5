"""Two `hybrid-jax serve` replicas behind the SGLang Model Gateway (`sglang-router`, the released binary) with
its cache-aware policy: the gateway discovers the workers' model and tokenizer (/server_info, /model_info);
the requests it forwards, rewritten with SGLang's own request fields (`no_stop_trim`, `separate_reasoning`,
...) at their defaults, are answered as the same requests sent straight to a server; and each multi-turn
conversation is routed to the replica that holds its prefix, where its later turns hit the prefix cache."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from conftest import stop_process
from test_server import _free_port, _wait_ready

pytest.importorskip("sglang_router")

NAME = "tiny-gateway"


def _serve(port: int, cc) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(port),
                             "--served-model-name", NAME, "--max-num-seqs", "2", "--max-model-len", "512",
                             "--enable-prefix-caching", "--compilation-cache-dir", str(cc)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def launch_gateway(port: int, workers: int, *args: str) -> subprocess.Popen:
    """sglang-router on 127.0.0.1:`port` with `args`, once it lists `workers` healthy workers (the test
    fails with its output otherwise)."""
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", *args, "--host", "127.0.0.1",
                               "--port", str(port), "--prometheus-port", str(_free_port())],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline, url = time.time() + 120, f"http://127.0.0.1:{port}"
    while time.time() < deadline and router.poll() is None:
        try:
            w = httpx.get(url + "/workers", timeout=5).json().get("workers", [])
            if len(w) == workers and all(x["is_healthy"] for x in w):
                return router
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    stop_process(router)
    pytest.fail(f"the gateway did not register the workers: {router.stdout.read().decode()[-3000:]}")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """(router url, [server urls]): two replicas (the shipped default model) behind one router."""
    tmp = tmp_path_factory.mktemp("gateway")
    ports, rport = [_free_port(), _free_port()], _free_port()
    servers = [_serve(p, tmp / "cc") for p in ports]
    urls, rurl = [f"http://127.0.0.1:{p}" for p in ports], f"http://127.0.0.1:{rport}"
    router = None
    try:
        for proc, url in zip(servers, urls):
            _wait_ready(proc, url, 300)
        router = launch_gateway(rport, 2, "--worker-urls", *urls, "--policy", "cache_aware")
        yield rurl, urls
    finally:
        if router is not None:
            stop_process(router)
        for proc in servers:
            stop_process(proc)


def _counter(url: str, name: str) -> float:
    """The sum of a counter's series on a server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_the_gateway_learns_the_model_and_loads_its_tokenizer(gateway):
    rurl, _ = gateway
    workers = httpx.get(rurl + "/workers", timeout=10).json()["workers"]
    assert len(workers) == 2
    for w in workers:
        assert w["model_id"] == NAME                  # before /server_info existed: "unknown"
        meta = w["metadata"]
        assert (meta["model_type"], meta["architectures"]) == ("qwen3_next", '["Qwen3NextForCausalLM"]')
        assert meta["served_model_name"] == NAME and meta["tp_size"] == "1"
    # the gateway tokenizes with the checkpoint's tokenizer, from the path /model_info gave
    r = httpx.post(rurl + "/v1/tokenize", json={"model": NAME, "prompt": "In the beginning"}, timeout=60)
    assert r.status_code == 200, r.text
    direct = httpx.post(gateway[1][0] + "/tokenize", json={"model": NAME, "prompt": "In the beginning",
                                                        "add_special_tokens": False}, timeout=60).json()
    assert r.json()["tokens"] == direct["tokens"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "And God said", "max_tokens": 12, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "In the beginning"}], "max_tokens": 12,
                              "temperature": 0}),
])
def test_forwarded_requests_are_answered_as_direct_ones(gateway, path, body):
    rurl, urls = gateway
    routed = httpx.post(rurl + path, json={"model": NAME, **body}, timeout=120)
    assert routed.status_code == 200, routed.text
    direct = httpx.post(urls[1] + path, json={"model": NAME, **body}, timeout=120).json()
    key = "text" if path == "/v1/completions" else "message"
    got, want = routed.json()["choices"][0], direct["choices"][0]
    assert got[key] == want[key] and got["finish_reason"] == want["finish_reason"]


def test_each_conversation_stays_on_the_replica_that_holds_its_prefix(gateway):
    """Four conversations of four turns, each turn's prompt the conversation so far: the cache-aware
    policy sends every later turn where the first went, and there it hits the prefix cache."""
    rurl, urls = gateway
    verses = ["In the beginning God created the heaven and the earth. And the earth was without form, and void;",
              "And God said, Let there be light: and there was light. And God saw the light, that it was good:",
              "And God called the firmament Heaven. And the evening and the morning were the second day. And God",
              "And the LORD God formed man of the dust of the ground, and breathed into his nostrils the breath"]
    for c, opening in enumerate(verses):
        text, served = f"Conversation {c}. {opening}", []
        for turn in range(4):
            before = [_counter(u, "hybrid_jax_request_success_total") for u in urls]
            hits = [_counter(u, "hybrid_jax_prefix_cache_hits_total") for u in urls]
            r = httpx.post(rurl + "/v1/completions", json={"model": NAME, "prompt": text, "max_tokens": 16,
                                                           "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            after = [_counter(u, "hybrid_jax_request_success_total") for u in urls]
            (where,) = [i for i in range(2) if after[i] > before[i]]
            served.append(where)
            if turn:
                assert _counter(urls[where], "hybrid_jax_prefix_cache_hits_total") > hits[where], (c, turn)
            text += r.json()["choices"][0]["text"] + f" Turn {turn + 1}: tell me more."
        assert served == [served[0]] * 4, (c, served)
