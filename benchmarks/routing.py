"""Prefix-cache hits of hybrid-jax replicas behind the SGLang Model Gateway (`sglang-router`), by routing policy.

N `hybrid-jax serve` replicas (the shipped default model, prefix caching on) behind the gateway; a
multi-turn workload: C conversations of T turns, each turn's prompt the conversation so far (an opening
passage of the King James text, then each answer and a new line), the C conversations of a turn sent at
once. Per policy, the share of prompt tokens the replicas served from their prefix caches (summed from
their /metrics), beside the same workload sent straight to one replica (what one replica holding every
conversation reuses). Each policy gets conversations of its own (other passages), so no policy reuses
another's prefixes.

Columns: hits = prefix-cache hit tokens / prompt tokens looked up; vs one = hits / one replica's hits;
vs rr = hits / round robin's (same N); spread = requests per replica.

    python benchmarks/routing.py [--replicas 2,4] [--conversations 8] [--turns 4] [--policies cache_aware,round_robin]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx

NAME = "bench"
TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "kjv_heldout.txt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str, path: str, ok, seconds: float, proc: subprocess.Popen):
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            r = httpx.get(url + path, timeout=5)
            if ok(r):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise SystemExit(f"{url}{path} did not come up: {proc.stdout.read().decode()[-2000:] if proc.stdout else ''}")


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("hybrid_jax_prefix_cache_hits_total", "hybrid_jax_prefix_cache_queries_total",
                 "hybrid_jax_request_success_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


def conversations(lines: list[str], first: int, c: int) -> list[str]:
    return [" ".join(lines[first + 3 * i: first + 3 * i + 3]) for i in range(c)]


def run(url: str, openings: list[str], turns: int, max_tokens: int) -> None:
    """The workload against one base URL (a router or a replica): every conversation's turn t at once."""
    texts = list(openings)
    with httpx.Client(timeout=300) as client, cf.ThreadPoolExecutor(len(texts)) as pool:
        for t in range(turns):
            def one(i):
                r = client.post(url + "/v1/completions", json={"model": NAME, "prompt": texts[i],
                                                               "max_tokens": max_tokens, "temperature": 0})
                r.raise_for_status()
                return r.json()["choices"][0]["text"]
            answers = list(pool.map(one, range(len(texts))))
            texts = [x + a + f"\nAnd then, turn {t + 1}: " for x, a in zip(texts, answers)]


def measure(urls: list[str], target: str, openings: list[str], args) -> tuple[float, list[int]]:
    before = [counters(u) for u in urls]
    run(target, openings, args.turns, args.max_tokens)
    after = [counters(u) for u in urls]
    d = lambda k: sum(a[k] - b[k] for a, b in zip(after, before))  # noqa: E731
    spread = [int(a["hybrid_jax_request_success_total"] - b["hybrid_jax_request_success_total"])
              for a, b in zip(after, before)]
    return d("hybrid_jax_prefix_cache_hits_total") / max(d("hybrid_jax_prefix_cache_queries_total"), 1), spread


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--policies", default="cache_aware,round_robin")
    args = ap.parse_args()
    with open(TEXT, encoding="utf-8") as f:
        lines = [x.strip() for x in f if x.strip()]
    policies = args.policies.split(",")
    cc = tempfile.mkdtemp(prefix="routing-cc-")
    rows, block = [], 3 * args.conversations
    for n in [int(x) for x in args.replicas.split(",")]:
        ports = [free_port() for _ in range(n)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        servers = [subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(p),
                                     "--served-model-name", NAME, "--max-num-seqs", "4", "--max-model-len", "1024",
                                     "--enable-prefix-caching", "--compilation-cache-dir", cc],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env={**os.environ, "JAX_PLATFORMS": "cpu"}) for p in ports]
        try:
            for s, u in zip(servers, urls):
                wait(u, "/health", lambda r: r.status_code == 200, 600, s)
            first = 0
            one, _ = measure(urls, urls[0], conversations(lines, first, args.conversations), args)
            results = {}
            for k, policy in enumerate(policies):
                first = (k + 1) * block
                rport = free_port()
                router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
                                           *urls, "--host", "127.0.0.1", "--port", str(rport), "--policy", policy,
                                           "--prometheus-port", str(free_port())],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rurl = f"http://127.0.0.1:{rport}"
                try:
                    wait(rurl, "/workers", lambda r: len(r.json().get("workers", [])) == n
                         and all(w["is_healthy"] for w in r.json()["workers"]), 120, router)
                    results[policy] = measure(urls, rurl, conversations(lines, first, args.conversations), args)
                finally:
                    router.terminate()
                    router.wait(30)
            rr = results.get("round_robin", (None,))[0]
            for policy, (hits, spread) in results.items():
                rows.append((n, policy, hits, hits / one if one else float("nan"),
                             hits / rr if rr else float("nan"), spread))
            rows.append((n, "one replica", one, 1.0, one / rr if rr else float("nan"), "-"))
        finally:
            for s in servers:
                s.terminate()
            for s in servers:
                s.wait(60)
    print(f"{args.conversations} conversations x {args.turns} turns, {args.max_tokens} tokens an answer")
    print(f"{'replicas':>8}  {'policy':<12} {'hits':>6} {'vs one':>7} {'vs rr':>6}  spread")
    for n, policy, hits, vs_one, vs_rr, spread in rows:
        print(f"{n:>8}  {policy:<12} {hits:6.3f} {vs_one:7.2f} {vs_rr:6.2f}  {spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
