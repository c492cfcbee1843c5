"""`hybrid-jax serve` behind the SGLang Model Gateway (`sglang-router`, the released binary): the gateway
discovers the worker's model and tokenizer (/server_info, /model_info), and the requests it forwards —
rewritten with SGLang's own request fields (`no_stop_trim`, `separate_reasoning`, ...) at their defaults —
are answered as the same requests sent straight to the server."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from conftest import stop_process
from test_server import _free_port, _wait_ready

pytest.importorskip("sglang_router")

NAME = "tiny-gateway"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """(router url, server url): one server (the shipped default model) behind one router."""
    tmp = tmp_path_factory.mktemp("gateway")
    port, rport = _free_port(), _free_port()
    server = subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(port),
                               "--served-model-name", NAME, "--max-num-seqs", "2", "--max-model-len", "256",
                               "--compilation-cache-dir", str(tmp / "cc")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url, rurl = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{rport}"
    router = None
    try:
        _wait_ready(server, url, 300)
        router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", url,
                                   "--host", "127.0.0.1", "--port", str(rport), "--policy", "cache_aware",
                                   "--prometheus-port", str(_free_port())],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline and router.poll() is None:
            try:
                w = httpx.get(rurl + "/workers", timeout=5).json().get("workers", [])
                if w and w[0]["is_healthy"]:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        else:
            pytest.fail(f"the gateway did not register the worker: {router.stdout.read().decode()[-3000:]}")
        yield rurl, url
    finally:
        if router is not None:
            stop_process(router)
        stop_process(server)


def test_the_gateway_learns_the_model_and_loads_its_tokenizer(gateway):
    rurl, _ = gateway
    (w,) = httpx.get(rurl + "/workers", timeout=10).json()["workers"]
    assert w["model_id"] == NAME                  # before /server_info existed: "unknown"
    meta = w["metadata"]
    assert (meta["model_type"], meta["architectures"]) == ("qwen3_next", '["Qwen3NextForCausalLM"]')
    assert meta["served_model_name"] == NAME and meta["tp_size"] == "1"
    # the gateway tokenizes with the checkpoint's tokenizer, from the path /model_info gave
    r = httpx.post(rurl + "/v1/tokenize", json={"model": NAME, "prompt": "In the beginning"}, timeout=60)
    assert r.status_code == 200, r.text
    direct = httpx.post(gateway[1] + "/tokenize", json={"model": NAME, "prompt": "In the beginning",
                                                        "add_special_tokens": False}, timeout=60).json()
    assert r.json()["tokens"] == direct["tokens"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "And God said", "max_tokens": 12, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "In the beginning"}], "max_tokens": 12,
                              "temperature": 0}),
])
def test_forwarded_requests_are_answered_as_direct_ones(gateway, path, body):
    rurl, url = gateway
    routed = httpx.post(rurl + path, json={"model": NAME, **body}, timeout=120)
    assert routed.status_code == 200, routed.text
    direct = httpx.post(url + path, json={"model": NAME, **body}, timeout=120).json()
    key = "text" if path == "/v1/completions" else "message"
    got, want = routed.json()["choices"][0], direct["choices"][0]
    assert got[key] == want[key] and got["finish_reason"] == want["finish_reason"]
