"""Prefix-cache hits of hybrid-jax replicas behind the SGLang Model Gateway (`sglang-router`), by routing policy.

N `hybrid-jax serve` replicas (the shipped default model, prefix caching on) behind the gateway; a
multi-turn workload: C conversations of T turns, each turn's prompt the conversation so far (an opening
passage of the King James text, then each answer and a new line), the C conversations of a turn sent at
once. Per policy, the share of prompt tokens the replicas served from their prefix caches (summed from
their /metrics), beside the same workload sent straight to one replica (what one replica holding every
conversation reuses). Each policy gets the same passages opened by a line of its own, so no policy
reuses another's prefixes and all compare on prompts of the same lengths.

A turn's requests are sent in a shuffled order (seeded): in a fixed order, round robin over N
replicas with C a multiple of N sends every conversation back to the replica it went to before, by
accident of the arithmetic, which no real traffic does.

Policy "kv_events" is precise prefix routing from the replicas' KV events, as Dynamo's KV router and
llm-d's precise prefix scorer do it, written here from the documented events and hash rule (no
gateway): each replica serves with `--kv-events-config`. A subscriber keeps, per replica, the block
hashes it announced stored and not yet removed. Each prompt is tokenized (`/tokenize`) and its blocks'
public hashes chained (`cache.kv_events.chain_hashes`). The request goes to the replica holding the
longest run of them, ties to the replica with the fewest requests so far.

Round robin's share depends on which replica each of a turn's concurrent requests reaches first (0.22 to
0.38 at 4 replicas over three runs of the same workload), so it is the mean of --rr-runs runs.

Columns: hits = prefix-cache hit tokens / prompt tokens looked up; vs one = hits / one replica's hits;
vs rr = hits / round robin's (same N); spread = requests per replica.

    python benchmarks/routing.py [--replicas 2,4] [--conversations 8] [--turns 4]
                                 [--policies cache_aware,round_robin,kv_events]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import msgpack
import zmq

from cache.kv_events import chain_hashes

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


def conversations(lines: list[str], run: int, c: int) -> list[str]:
    """The same C passages for every run, each opened by the run's number (so no run reuses another's
    prefixes, and every run's prompts have the same lengths give or take a token)."""
    return [f"Run {run}. " + " ".join(lines[3 * i: 3 * i + 3]) for i in range(c)]


class KVEventIndex:
    """Per replica, the block hashes its KV events say it holds (BlockStored adds, BlockRemoved takes
    away, AllBlocksCleared empties), kept by a subscriber thread."""

    def __init__(self, endpoints: list[str]):
        self.blocks = [set() for _ in endpoints]
        self.block_size = 0
        self._socks = []
        for e in endpoints:                   # one socket per replica: the events do not name their server
            sock = zmq.Context.instance().socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(e)
            self._socks.append(sock)
        self._stop = False
        self.last_event = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(100):
                _, _, payload = sock.recv_multipart()
                self._apply(self.blocks[self._socks.index(sock)], msgpack.unpackb(payload))

    def settle(self, quiet_s: float = 0.3, timeout_s: float = 10.0):
        """Waits until no event has come for `quiet_s` (the turn's events are in), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() - self.last_event < quiet_s and time.monotonic() < deadline:
            time.sleep(0.05)

    def _apply(self, held: set, batch: dict):
        self.last_event = time.monotonic()
        for e in batch["events"]:
            if e["type"] == "BlockStored":
                self.block_size = e["block_size"]
                held.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                held.difference_update(e["block_hashes"])
            elif e["type"] == "AllBlocksCleared":
                held.clear()

    def match(self, tokens: list[int]) -> list[int]:
        """Per replica, how many of the prompt's leading blocks it holds."""
        hashes = chain_hashes(tokens, self.block_size) if self.block_size else []
        out = []
        for held in self.blocks:
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            out.append(n)
        return out

    def close(self):
        self._stop = True
        self._thread.join(5)
        for sock in self._socks:
            sock.close(0)


class KVEventRouter:
    """Sends each request to the replica whose KV events show the longest run of its prompt's blocks
    (ties: the fewest requests so far)."""

    def __init__(self, urls: list[str], index: KVEventIndex):
        self.urls, self.index, self.sent = urls, index, [0] * len(urls)
        self.settle = index.settle

    def __call__(self, client: httpx.Client, prompt: str) -> str:
        ids = client.post(self.urls[0] + "/tokenize", json={"model": NAME, "prompt": prompt}).json()["tokens"]
        m = self.index.match(ids)
        best = max(range(len(self.urls)), key=lambda i: (m[i], -self.sent[i]))
        self.sent[best] += 1
        return self.urls[best]


def run(url, openings: list[str], turns: int, max_tokens: int, seed: int = 0) -> None:
    """The workload against one base URL (a router or a replica), or a function choosing one per request:
    every conversation's turn t at once, sent in a shuffled order."""
    texts, rng = list(openings), random.Random(seed)
    with httpx.Client(timeout=300) as client, cf.ThreadPoolExecutor(len(texts)) as pool:
        for t in range(turns):
            def one(i):
                base = url if isinstance(url, str) else url(client, texts[i])
                r = client.post(base + "/v1/completions", json={"model": NAME, "prompt": texts[i],
                                                                "max_tokens": max_tokens, "temperature": 0})
                r.raise_for_status()
                return i, r.json()["choices"][0]["text"]
            order = list(range(len(texts)))
            rng.shuffle(order)
            answers = dict(pool.map(one, order))
            texts = [x + answers[i] + f"\nAnd then, turn {t + 1}: " for i, x in enumerate(texts)]
            # a router fed by KV events routes the next turn once this turn's events are in (a fixed pause
            # lost events to a loaded machine)
            getattr(url, "settle", lambda: time.sleep(0.2))()


def measure(urls: list[str], target, openings: list[str], args) -> tuple[float, list[int]]:
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
    ap.add_argument("--policies", default="cache_aware,round_robin,kv_events")
    ap.add_argument("--rr-runs", type=int, default=3, help="round robin's share is the mean of this many runs")
    args = ap.parse_args()
    with open(TEXT, encoding="utf-8") as f:
        lines = [x.strip() for x in f if x.strip()]
    policies = args.policies.split(",")
    cc = tempfile.mkdtemp(prefix="routing-cc-")
    rows = []
    for n in [int(x) for x in args.replicas.split(",")]:
        ports = [free_port() for _ in range(n)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        events = [free_port() for _ in range(n)]
        servers = [subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(p),
                                     "--served-model-name", NAME, "--max-num-seqs", "4", "--max-model-len", "1024",
                                     "--enable-prefix-caching", "--compilation-cache-dir", cc, "--kv-events-config",
                                     json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{e}"})],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env={**os.environ, "JAX_PLATFORMS": "cpu"}) for p, e in zip(ports, events)]
        try:
            for s, u in zip(servers, urls):
                wait(u, "/health", lambda r: r.status_code == 200, 600, s)
            one, _ = measure(urls, urls[0], conversations(lines, 0, args.conversations), args)
            results = {}
            for k, policy in enumerate(policies):
                if policy == "kv_events":
                    index = KVEventIndex([f"tcp://127.0.0.1:{e}" for e in events])
                    try:
                        results[policy] = measure(urls, KVEventRouter(urls, index),
                                                  conversations(lines, k + 1, args.conversations), args)
                    finally:
                        index.close()
                    continue
                rport = free_port()
                router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
                                           *urls, "--host", "127.0.0.1", "--port", str(rport), "--policy", policy,
                                           "--prometheus-port", str(free_port())],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rurl = f"http://127.0.0.1:{rport}"
                try:
                    wait(rurl, "/workers", lambda r: len(r.json().get("workers", [])) == n
                         and all(w["is_healthy"] for w in r.json()["workers"]), 120, router)
                    runs = args.rr_runs if policy == "round_robin" else 1
                    got = [measure(urls, rurl, conversations(lines, k + 1 + 100 * j, args.conversations), args)
                           for j in range(runs)]
                    results[policy] = (statistics.mean(h for h, _ in got), got[-1][1])
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
