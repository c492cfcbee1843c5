"""A bounded soak of `hybrid-jax serve` on loopback: N rounds of mixed traffic, checked.

Each round sends, at once: greedy streams and non-streaming requests whose prompts share a prefix
(prefix-cache hits from the second round on), sampled requests with huge top_k, clients that hang
up (a stream after its first chunk, a non-streaming request after a short timeout) and malformed
or out-of-range requests. It prints requests sent / completed / failed by cause, whether every greedy
output equals a sequential baseline (the same requests one at a time before the soak), the server's
RSS after each round and the p99 TTFT of the streams. `--speculative` serves with n-gram
speculation (greedy output must not change).

    python benchmarks/soak.py                   # 5 rounds, the tiny benchmark model, a few minutes on a CPU
    python benchmarks/soak.py --rounds 20 --concurrency 32
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(__file__))
from tiny_qwen3_next import CONFIG, write_checkpoint  # noqa: E402

VOCAB = CONFIG["vocab_size"]
BAD = [b"{not json", b'{"prompt": [1], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
       b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", b'{"prompt": "\\ud800"}',
       json.dumps({"prompt": [1], "stop_token_ids": [10**12]}).encode(),
       json.dumps({"prompt": [1], "top_p": 1e-46}).encode(), json.dumps({"prompt": [1], "model": "nope"}).encode(),
       json.dumps({"prompt": [1], "logit_bias": {"3": 1}}).encode()]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 160).tolist()            # > 2 prefix blocks of 64: reusable
    return [shared[:int(rng.integers(64, 160))] + rng.integers(0, VOCAB, int(rng.integers(4, 40))).tolist()
            for _ in range(n)]


class Soak:
    def __init__(self, url: str):
        self.url = url
        self.sent = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.ttfts: list[float] = []

    async def greedy(self, c, prompt, n_out, stream: bool):
        body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": stream}
        self.sent += 1
        t0 = time.perf_counter()
        try:
            if not stream:
                r = await c.post(self.url + "/v1/completions", json=body)
                self.outcomes["completed" if r.status_code == 200 else f"failed: HTTP {r.status_code}"] += 1
                return r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
            toks, err = [], None
            async with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        err = d["error"]["type"]
                        continue
                    if not toks:
                        self.ttfts.append(time.perf_counter() - t0)
                    toks += d["choices"][0]["token_ids"]
            self.outcomes["completed" if err is None else f"failed: stream error {err}"] += 1
            return toks if err is None else None
        except httpx.HTTPError as e:
            self.outcomes[f"failed: {type(e).__name__}"] += 1
            return None

    async def sampled(self, c, prompt):
        self.sent += 1
        r = await c.post(self.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0.9,
                                                              "top_k": 10**12, "top_p": 0.95, "seed": 1})
        self.outcomes["completed (sampled)" if r.status_code == 200 else f"failed: HTTP {r.status_code}"] += 1

    async def abort_stream(self, c, prompt):
        self.sent += 1
        async with c.stream("POST", self.url + "/v1/completions",
                            json={"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        self.outcomes["aborted by the client (stream)"] += 1

    async def abort_plain(self, c, prompt):
        self.sent += 1
        try:
            await c.post(self.url + "/v1/completions", timeout=0.3,
                         json={"prompt": prompt, "max_tokens": 300, "ignore_eos": True})
            self.outcomes["completed before the client gave up"] += 1
        except httpx.TimeoutException:
            self.outcomes["aborted by the client (non-stream)"] += 1

    async def bad(self, c, body: bytes):
        self.sent += 1
        r = await c.post(self.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        ok = 400 <= r.status_code < 500 and set(r.json().get("error", {})) == {"message", "type", "param", "code"}
        self.outcomes[f"refused as expected: HTTP {r.status_code}" if ok else f"failed: bad request got {r.status_code}"] += 1


def _metric(url, name) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def _run(args, url, proc):
    soak = Soak(url)
    compiled = _metric(url, "hybrid_jax_compiled_programs")
    prompts = _prompts(args.requests, args.seed)
    lens = [int(x) for x in np.random.default_rng(args.seed + 1).integers(8, 48, len(prompts))]
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        baseline = [await soak.greedy(c, p, n, stream=False) for p, n in zip(prompts, lens)]   # one at a time
        soak.sent, soak.outcomes = 0, collections.Counter()
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(coro):
            async with sem:
                return await coro

        mismatches, rss = 0, []
        for rnd in range(args.rounds):
            t0 = time.time()
            greedy = [bounded(soak.greedy(c, p, n, stream=i % 2 == 0)) for i, (p, n) in enumerate(zip(prompts, lens))]
            noise = ([bounded(soak.sampled(c, p)) for p in prompts[:4]]
                     + [bounded(soak.abort_stream(c, p)) for p in prompts[4:7]]
                     + [bounded(soak.abort_plain(c, p)) for p in prompts[7:10]]
                     + [bounded(soak.bad(c, b)) for b in BAD])
            outs = (await asyncio.gather(*greedy, *noise))[:len(prompts)]
            mismatches += sum(o is not None and o != b for o, b in zip(outs, baseline))
            rss.append(psutil.Process(proc.pid).memory_info().rss / 2**20)
            print(f"round {rnd + 1}/{args.rounds}: {time.time() - t0:5.1f} s, server RSS {rss[-1]:7.1f} MiB, "
                  f"running {_metric(url, 'hybrid_jax_num_requests_running'):.0f}", flush=True)
        await asyncio.sleep(1.0)
    print(f"\nrequests sent: {soak.sent} ({args.rounds} rounds)")
    for k, v in sorted(soak.outcomes.items()):
        print(f"  {k:45s} {v}")
    compared = args.rounds * len(prompts) - sum(v for k, v in soak.outcomes.items() if k.startswith("failed: ")
                                                and "bad request" not in k)
    print(f"greedy outputs identical to the sequential baseline: {compared - mismatches} / {compared}")
    print(f"server RSS per round (MiB): {' '.join(f'{x:.0f}' for x in rss)}")
    print(f"stream TTFT p50 {np.percentile(soak.ttfts, 50) * 1e3:.0f} ms, p99 {np.percentile(soak.ttfts, 99) * 1e3:.0f} ms "
          f"({len(soak.ttfts)} streams)")
    print(f"after the soak: running {_metric(url, 'hybrid_jax_num_requests_running'):.0f}, waiting "
          f"{_metric(url, 'hybrid_jax_num_requests_waiting'):.0f}, prefix-cache hit tokens "
          f"{_metric(url, 'hybrid_jax_prefix_cache_hits_total'):.0f} / "
          f"{_metric(url, 'hybrid_jax_prefix_cache_queries_total'):.0f}, aborted "
          f"{_metric(url, 'hybrid_jax_requests_aborted_total'):.0f}")
    print(f"programs compiled: {compiled:.0f} at /health 200, {_metric(url, 'hybrid_jax_compiled_programs'):.0f} "
          "after the soak")
    text = httpx.get(url + "/metrics", timeout=10).text
    ended = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("hybrid_jax_request_success_total{")}
    print("server side, requests ended by reason (baseline included): "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(ended.items())))
    return mismatches


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=24, help="greedy requests per round (half of them stream)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", action="store_true", help="serve with n-gram speculative decoding")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hybrid_jax_soak_")
    ckpt = write_checkpoint(os.path.join(tmp, "model"))
    port = _port()
    cmd = [sys.executable, "-m", "hybrid_jax.cli", "serve", "--model", ckpt, "--port", str(port),
           "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "512",
           "--enable-prefix-caching", "--shutdown-timeout", "5"]
    if args.speculative:
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})]
    server_log = open(os.path.join(tmp, "server.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() - t0 > 1800:
                raise SystemExit(f"the server did not start (log: {server_log.name})")
            time.sleep(1)
        print(f"server ready in {time.time() - t0:.0f} s: {httpx.get(url + '/health').text}")
        mismatches = asyncio.run(_run(args, url, proc))
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    print(f"server exit code after SIGTERM: {code}")
    sys.exit(1 if mismatches or code != 0 else 0)


if __name__ == "__main__":
    main()
