"""A bounded soak of `hybrid-jax serve` on loopback: N rounds of mixed traffic, then overload and a
failing engine core, all checked.

Each round sends, at once: greedy streams and non-streaming requests whose prompts share a prefix
(prefix-cache hits from the second round on), a few long greedy requests that with the KV budget
below (`--kv-cache-bytes`: pages for about half the rows at full length) make the scheduler preempt
and copy shared pages (copy-on-write) under load, sampled requests with huge top_k, clients that
hang up (a stream after its first chunk, a non-streaming request after a short timeout) and
malformed or out-of-range requests. It prints requests sent / completed / failed by cause, whether
every greedy output equals a sequential baseline (the same requests one at a time before the soak),
the API server's and the engine core's RSS and the compiled programs after each round, and the p99
TTFT of the streams. `--speculative` serves with n-gram speculation (greedy output must not change).

Then three rounds of faults:
- overload: `--flood-requests` concurrent short completions from one client beside a well-behaved
  client (benchmarks/overload.py's admission round): accepted / refused with 429 + Retry-After, and
  the well-behaved requests' latency beside their unloaded latency;
- core kill: the engine core is SIGKILLed with streams and a non-streaming request open: every
  stream must end with an error event and [DONE], the non-streaming request get a JSON 503, answers
  that need no engine (404, 400) stay JSON while it is down; the server restarts the core, and a
  round of greedy requests then equals the baseline;
- core hang: the core is SIGSTOPped: /health must turn non-200 within the unresponsive timeout and
  200 again after SIGCONT.
At the end the engine's step failures (0: a step never fails for want of a page) and preemptions.

    python benchmarks/soak.py                   # 5 rounds, the tiny benchmark model, a few minutes on a CPU
    python benchmarks/soak.py --rounds 20 --concurrency 32
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(__file__))
import overload  # noqa: E402
from tiny_qwen3_next import CONFIG, write_checkpoint  # noqa: E402

VOCAB = CONFIG["vocab_size"]
BAD = [b"{not json", b'{"prompt": [1], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
       b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", b'{"prompt": "\\ud800"}',
       json.dumps({"prompt": [1], "stop_token_ids": [10**12]}).encode(),
       json.dumps({"prompt": [1], "top_p": 1e-46}).encode(), json.dumps({"prompt": [1], "model": "nope"}).encode(),
       json.dumps({"prompt": [1], "logit_bias": {"3": 1}}).encode()]


def _prompts(n: int, seed: int, n_long: int = 0) -> list[list[int]]:
    """n prompts along a shared prefix (> 2 prefix blocks of 64: reusable), the last n_long of them long
    (250-330 tokens)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 160).tolist()
    short = [shared[:int(rng.integers(64, 160))] + rng.integers(0, VOCAB, int(rng.integers(4, 40))).tolist()
             for _ in range(n - n_long)]
    return short + [shared + rng.integers(0, VOCAB, int(rng.integers(90, 170))).tolist() for _ in range(n_long)]


def _core_pid(server_pid: int) -> int | None:
    """The engine core: the server's spawned child (not multiprocessing's resource tracker)."""
    for child in psutil.Process(server_pid).children():
        try:
            if any("spawn_main" in a for a in child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def _rss(pid: int | None) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20 if pid else float("nan")
    except psutil.Error:
        return float("nan")


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


def _metric(url, name, default: float = float("nan")) -> float:
    """A series' value (labelled series summed); `default` when the server has none (a labelled counter
    has no series until it is first counted)."""
    vals = [float(line.split()[-1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")]
    return sum(vals) if vals else default


def _wait_health(url: str, ok: bool, limit_s: float) -> float | None:
    """Seconds until /health answers 200 (ok) or anything else (not ok); None past limit_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            if (httpx.get(url + "/health", timeout=2).status_code == 200) == ok:
                return time.monotonic() - t0
        except httpx.HTTPError:
            if not ok:
                return time.monotonic() - t0
        time.sleep(0.05)
    return None


async def _kill_round(c, url: str, server_pid: int, prompt) -> dict:
    """SIGKILLs the core with 4 streams and one non-streaming request open; what each got, and the
    JSON answers while the core is down."""
    pid = _core_pid(server_pid)
    started = asyncio.Event()
    n_started = 0
    body = {"prompt": prompt, "max_tokens": 500 - len(prompt), "ignore_eos": True, "temperature": 0}

    async def stream():
        nonlocal n_started
        events, done, err = 0, False, None
        async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"]["type"]
                elif events == 0:
                    n_started += 1
                    if n_started == 4:
                        started.set()
                events += 1
        return f"stream: error event {err!r}, [DONE] {done}"

    async def plain():
        r = await c.post(url + "/v1/completions", json=body)
        shape = set(r.json().get("error", {})) == {"message", "type", "param", "code"}
        return f"non-streaming: HTTP {r.status_code}, OpenAI error shape {shape}"

    tasks = [asyncio.ensure_future(stream()) for _ in range(4)] + [asyncio.ensure_future(plain())]
    await asyncio.wait_for(started.wait(), 120)   # (every stream has its first tokens)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    ended = await asyncio.gather(*tasks)
    down = {}
    for name, method, path, content in (("404", "GET", "/v1/nope", None), ("400", "POST", "/v1/completions", b"{no"),
                                        ("new request", "POST", "/v1/completions", json.dumps(body).encode())):
        r = await c.request(method, url + path, content=content, headers={"content-type": "application/json"})
        down[name] = f"HTTP {r.status_code}, JSON {r.headers.get('content-type', '').startswith('application/json')}"
    back = await asyncio.to_thread(_wait_health, url, True, 600)
    return {"killed": pid, "ended": ended, "while down": down,
            "back": None if back is None else time.monotonic() - t0, "new core": _core_pid(server_pid)}


async def _greedy_round(soak, c, bounded, prompts, lens):
    return await asyncio.gather(*(bounded(soak.greedy(c, p, n, stream=i % 2 == 0))
                                  for i, (p, n) in enumerate(zip(prompts, lens))))


async def _run(args, url, proc):
    soak = Soak(url)
    compiled = _metric(url, "hybrid_jax_compiled_programs")
    prompts = _prompts(args.requests, args.seed, args.long)
    lens = [int(x) for x in np.random.default_rng(args.seed + 1).integers(8, 48, len(prompts) - args.long)]
    lens += [150] * args.long                                     # the long ones: 400-480 tokens in all
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
            rss.append((_rss(proc.pid), _rss(_core_pid(proc.pid)), _metric(url, "hybrid_jax_compiled_programs")))
            print(f"round {rnd + 1}/{args.rounds}: {time.time() - t0:5.1f} s, RSS API server {rss[-1][0]:7.1f} MiB, "
                  f"engine core {rss[-1][1]:7.1f} MiB, programs {rss[-1][2]:.0f}, "
                  f"running {_metric(url, 'hybrid_jax_num_requests_running'):.0f}", flush=True)
        await asyncio.sleep(1.0)
        print(f"\nrequests sent: {soak.sent} ({args.rounds} rounds)")
        for k, v in sorted(soak.outcomes.items()):
            print(f"  {k:45s} {v}")
        compared = args.rounds * len(prompts) - sum(v for k, v in soak.outcomes.items() if k.startswith("failed: ")
                                                    and "bad request" not in k)
        print(f"greedy outputs identical to the sequential baseline: {compared - mismatches} / {compared}")
        print("RSS per round (MiB), API server: " + " ".join(f"{a:.0f}" for a, _, _ in rss)
              + "; engine core: " + " ".join(f"{b:.0f}" for _, b, _ in rss)
              + "; programs compiled: " + " ".join(f"{n:.0f}" for _, _, n in rss))
        print(f"stream TTFT p50 {np.percentile(soak.ttfts, 50) * 1e3:.0f} ms, p99 {np.percentile(soak.ttfts, 99) * 1e3:.0f} ms "
              f"({len(soak.ttfts)} streams)")
        print(f"after the soak: running {_metric(url, 'hybrid_jax_num_requests_running'):.0f}, waiting "
              f"{_metric(url, 'hybrid_jax_num_requests_waiting'):.0f}, prefix-cache hit tokens "
              f"{_metric(url, 'hybrid_jax_prefix_cache_hits_total'):.0f} / "
              f"{_metric(url, 'hybrid_jax_prefix_cache_queries_total'):.0f}, aborted "
              f"{_metric(url, 'hybrid_jax_requests_aborted_total'):.0f}, preempted "
              f"{_metric(url, 'hybrid_jax_preemptions_total'):.0f}")
        print(f"programs compiled: {compiled:.0f} at /health 200, {_metric(url, 'hybrid_jax_compiled_programs'):.0f} "
              "after the soak")
        text = httpx.get(url + "/metrics", timeout=10).text
        ended = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("hybrid_jax_request_success_total{")}
        print("server side, requests ended by reason (baseline included): "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(ended.items())))
        failures = _metric(url, "hybrid_jax_engine_step_failures_total", default=0.0)

        print("\n--- overload ---", flush=True)
        await asyncio.to_thread(overload.admission_round, args, url)

        print("\n--- the engine core killed (SIGKILL) with 4 streams and a non-streaming request open ---", flush=True)
        kill = await _kill_round(c, url, proc.pid, prompts[0])
        for line in kill["ended"]:
            print(f"  {line}")
        print("  while it was down: " + "; ".join(f"{k}: {v}" for k, v in kill["while down"].items()))
        print(f"  /health 200 again {kill['back']:.1f} s after the kill (core pid {kill['killed']} -> "
              f"{kill['new core']}), hybrid_jax_engine_core_restarts_total "
              f"{_metric(url, 'hybrid_jax_engine_core_restarts_total'):.0f}" if kill["back"] is not None
              else "  the server did not come back within 600 s")
        after = await _greedy_round(soak, c, bounded, prompts, lens)
        same = sum(o == b for o, b in zip(after, baseline))
        mismatches += len(prompts) - same
        print(f"  greedy outputs after the restart identical to the baseline: {same} / {len(prompts)}")

        print("\n--- the engine core stopped (SIGSTOP) ---", flush=True)
        pid = _core_pid(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        try:
            off = _wait_health(url, False, 60)
            scrape = httpx.get(url + "/metrics", timeout=10).status_code
            r = await c.post(url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 4})
        finally:
            os.kill(pid, signal.SIGCONT)
        on = _wait_health(url, True, 60)
        print(f"  /health non-200 {off:.1f} s after SIGSTOP; meanwhile /metrics HTTP {scrape}, a new request HTTP "
              f"{r.status_code} ({r.json().get('error', {}).get('code')}); /health 200 {on:.1f} s after SIGCONT")
        print(f"\nengine step failures (the core before the kill; 0: no step failed for want of a page): {failures:.0f}")
    return mismatches + int(failures != 0) + int(kill["back"] is None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=24, help="greedy requests per round (half of them stream)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long", type=int, default=6, help="of the greedy requests, long ones (about 450 tokens each)")
    ap.add_argument("--kv-cache-bytes", type=int, default=1_600_000,
                    help="the server's cache budget (default: 32 pages of 64 tokens beside 8 rows: preemption and "
                         "copy-on-write under load)")
    ap.add_argument("--flood-requests", type=int, default=1000, help="overload: concurrent short requests")
    ap.add_argument("--flood-tokens", type=int, default=32, help="overload: tokens of each flood request")
    ap.add_argument("--short-tokens", type=int, default=8, help="overload: tokens of each well-behaved request")
    ap.add_argument("--speculative", action="store_true", help="serve with n-gram speculative decoding")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hybrid_jax_soak_")
    ckpt = write_checkpoint(os.path.join(tmp, "model"))
    port = overload.free_port()
    cmd = [sys.executable, "-m", "hybrid_jax.cli", "serve", "--model", ckpt, "--port", str(port),
           "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "512",
           "--enable-prefix-caching", "--kv-cache-bytes", str(args.kv_cache_bytes), "--shutdown-timeout", "5",
           "--core-unresponsive-timeout", "3"]
    if args.speculative:
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})]
    server_log = open(os.path.join(tmp, "server.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = overload.wait_ready(proc, url, server_log.name)
        print(f"server ready in {ready_s:.0f} s: {httpx.get(url + '/health').text}")
        mismatches = asyncio.run(_run(args, url, proc))
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    print(f"server exit code after SIGTERM: {code}")
    sys.exit(1 if mismatches or code != 0 else 0)


if __name__ == "__main__":
    main()
