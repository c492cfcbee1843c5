"""One prefill and one decode `hybrid-jax serve` behind the SGLang Model Gateway's prefill/decode mode
(`sglang-router --pd-disaggregation`, the released binary): the gateway registers them by their
/server_info's disaggregation_mode; every request it sends to both (with its bootstrap_room) is
answered as a single server answers it, and the decode server resumed from the prefill server's
handoff (its prefix-cache hits and handoff counters moved) rather than computing the prompt."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest
from conftest import stop_process
from test_server import _free_port, _wait_ready
from test_sglang_gateway import launch_gateway

pytest.importorskip("sglang_router")

NAME = "tiny-pd"


def _serve(port: int, cc, kv_dir, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(port),
                             "--served-model-name", NAME, "--max-num-seqs", "2", "--max-model-len", "1024",
                             "--enable-prefix-caching", "--kv-cache-dir", str(kv_dir),
                             "--compilation-cache-dir", str(cc), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(router url, prefill url, decode url, single-server url)."""
    tmp = tmp_path_factory.mktemp("pd")
    ports, rport = [_free_port() for _ in range(3)], _free_port()
    procs = [_serve(ports[0], tmp / "cc", tmp / "shared", "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", "18998"),
             _serve(ports[1], tmp / "cc", tmp / "shared", "--disaggregation-mode", "decode",
                    "--disaggregation-timeout", "20"),
             _serve(ports[2], tmp / "cc", tmp / "alone")]
    urls, rurl = [f"http://127.0.0.1:{p}" for p in ports], f"http://127.0.0.1:{rport}"
    router = None
    try:
        for proc, url in zip(procs, urls):
            _wait_ready(proc, url, 300)
        router = launch_gateway(rport, 2, "--pd-disaggregation", "--prefill", urls[0], "18998", "--decode", urls[1])
        yield rurl, urls[0], urls[1], urls[2]
    finally:
        if router is not None:
            stop_process(router)
        for proc in procs:
            stop_process(proc)


def _counter(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for lab, v in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        if all(f'{k}="{x}"' in lab for k, x in labels.items()):
            total += float(v)
    return total


def test_the_gateway_registers_a_prefill_and_a_decode_worker(pd):
    rurl = pd[0]
    workers = {w["worker_type"]: w for w in httpx.get(rurl + "/workers", timeout=10).json()["workers"]}
    assert set(workers) == {"prefill", "decode"}
    assert workers["prefill"]["metadata"]["disaggregation_mode"] == "prefill"
    assert workers["decode"]["metadata"]["disaggregation_mode"] == "decode"
    assert workers["prefill"]["bootstrap_port"] == 18998


VERSE = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
         "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
         "said, Let there be light: and there was light. And God saw the light, that it was good: and God divided "
         "the light from the darkness. And God called the light Day, and the darkness he called Night.")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": VERSE, "max_tokens": 24, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me more. " + VERSE}], "max_tokens": 24,
                              "temperature": 0}),
    ("/v1/completions", {"prompt": "And God made the firmament. " + VERSE, "max_tokens": 24, "temperature": 0,
                         "stream": True}),
])
def test_requests_through_prefill_and_decode_are_answered_as_one_server_answers(pd, path, body):
    rurl, purl, durl, alone = pd
    sent = _counter(purl, "hybrid_jax_kv_transfer_requests_total", role="prefill")
    taken = _counter(durl, "hybrid_jax_kv_transfer_requests_total", role="decode", outcome="marker_ok")
    hits = _counter(durl, "hybrid_jax_prefix_cache_hits_total")
    queries = _counter(durl, "hybrid_jax_prefix_cache_queries_total")
    prefill_hits = _counter(purl, "hybrid_jax_prefix_cache_hits_total")
    routed = httpx.post(rurl + path, json={"model": NAME, **body}, timeout=180)
    assert routed.status_code == 200, routed.text
    direct = httpx.post(alone + path, json={"model": NAME, **body}, timeout=180)
    if body.get("stream"):
        def text(r):
            return "".join(c["choices"][0].get("text", "") for c in
                           (json.loads(x[6:]) for x in r.text.splitlines()
                            if x.startswith("data: {")) if c.get("choices"))
        assert text(routed) == text(direct) and text(routed)
    else:
        key = "text" if path == "/v1/completions" else "message"
        got, want = routed.json()["choices"][0], direct.json()["choices"][0]
        assert got[key] == want[key] and got["finish_reason"] == want["finish_reason"]
    assert _counter(purl, "hybrid_jax_kv_transfer_requests_total", role="prefill") == sent + 1
    assert _counter(durl, "hybrid_jax_kv_transfer_requests_total", role="decode", outcome="marker_ok") == taken + 1
    # the decode server resumed from the handoff, at the last point of the resume grid (16 tokens) before the
    # prompt's last token, as a local hit would: it computed at most 16 of the prompt's tokens itself
    prompt = _counter(durl, "hybrid_jax_prefix_cache_queries_total") - queries
    got = _counter(durl, "hybrid_jax_prefix_cache_hits_total") - hits
    assert prompt > 64 and got == (prompt - 1) // 16 * 16
    assert _counter(purl, "hybrid_jax_prefix_cache_hits_total") == prefill_hits


def test_a_decode_request_whose_prefill_never_comes_is_computed_after_the_timeout(pd):
    """A room no prefill server writes (sent straight to the decode server): after its wait it computes
    the prompt itself and answers as a single server."""
    _, _, durl, alone = pd
    body = {"model": NAME, "prompt": "And the evening and the morning were the first day. " + VERSE,
            "max_tokens": 8, "temperature": 0}
    before = _counter(durl, "hybrid_jax_kv_transfer_requests_total", role="decode", outcome="handoff_timeout")
    r = httpx.post(durl + "/v1/completions", json={**body, "bootstrap_room": 12345}, timeout=180)
    assert r.status_code == 200, r.text
    want = httpx.post(alone + "/v1/completions", json=body, timeout=180).json()
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert _counter(durl, "hybrid_jax_kv_transfer_requests_total", role="decode",
                    outcome="handoff_timeout") == before + 1


def test_a_bad_room_is_a_400_naming_it(pd):
    durl = pd[2]
    r = httpx.post(durl + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2,
                                                   "bootstrap_room": [1, 2]}, timeout=60)
    assert r.status_code == 400 and "bootstrap_room" in r.text
