"""Overload rounds against a real `hybrid-jax serve` on loopback, each printing its figures side by side.

  --round metrics   stream tokens/s with and without a flood of GET /metrics (16 keep-alive loops in
                    a process of their own, keyless, unthrottled), alternating quiet and flooded
                    windows, and their ratio. /metrics is served from the engine's heartbeats
                    (engine/heartbeat.py), so a scrape costs the engine core nothing; the target is
                    a flood that costs generation less than 20% (before: 198 -> 36 tok/s at ~250
                    scrapes/s, every scrape a round trip answered between the core's steps). The
                    flood's own process runs at nice 19 (`--flood-nice`): it stands in for scrapers
                    on other machines, and on a small host its client work would otherwise take
                    its share of the one CPU the step loop runs on, which is no cost of the server.

  --round admission 1,000 concurrent short completions (32 tokens, one client) beside one well-behaved
                    client (8-token requests one after another, from another address, 127.0.0.2):
                    the flood's accepted / refused (429, by reason) / wrong counts, and the
                    well-behaved requests' latency median / max next to their unloaded latency.
                    The server's admission bounds are its defaults (server/admission.py: 4 x
                    max_num_seqs waiting, a fair share per client); `--unbounded-admission` serves
                    without them (every request queued, as before the bounds: the engine's queue
                    reached 984 and a well-behaved request waited up to 42.6 s, median 1.26 s,
                    against 0.02 s unloaded).

The server runs with HYBRID_JAX_ENGINE_CPUS (default "0": XLA computes on CPU 0) so XLA's compute
threads have a CPU of their own; this script, its flood and the server's Python threads keep to the
other CPUs. A round is a function `(args, url) -> None` registered in ROUNDS: another round (e.g.
admission under overload) adds its own function and name there and shares the server start.

    python benchmarks/overload.py --round metrics [--streams 4] [--seconds 8] [--flood-loops 16]
    python benchmarks/overload.py --round admission [--flood-requests 1000] [--unbounded-admission]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from tiny_qwen3_next import write_checkpoint  # noqa: E402

from hybrid_jax.engine import cpu_affinity  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log_name: str, limit_s: float = 1800) -> float:
    """Seconds until the server at `url` answers /health 200; SystemExit naming its log if it exits or
    takes longer than limit_s."""
    t0 = time.time()
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() - t0 > limit_s:
            raise SystemExit(f"the server did not start (log: {log_name})")
        time.sleep(1)


@contextlib.contextmanager
def server(args, extra: list[str] = ()):
    """A `hybrid-jax serve` of `args.model` (tiny: the benchmarks' tiny checkpoint) with
    HYBRID_JAX_ENGINE_CPUS=args.engine_cpus;
    yields its URL once /health is 200; SIGTERM at the end."""
    tmp = tempfile.mkdtemp(prefix="hybrid_jax_overload_")
    model = write_checkpoint(os.path.join(tmp, "model")) if args.model == "tiny" else args.model
    port = free_port()
    cmd = [sys.executable, "-m", "hybrid_jax.cli", "serve", *(["--model", model] if model != "default" else []),
           "--port", str(port),
           "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "1024",
           "--max-tokens-limit", "1000", *extra]
    log = open(os.path.join(tmp, "server.log"), "wb")     # noqa: SIM115  (the server's whole life)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           cpu_affinity.CPUS_ENV: args.engine_cpus}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_ready(proc, url, log.name)
        print(f"server ready in {ready_s:.0f} s ({cpu_affinity.CPUS_ENV}={args.engine_cpus}; log {log.name})")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)


# --- the metrics round -------------------------------------------------------------------------------

async def _streams(url: str, n: int, seconds: float, max_tokens: int) -> float:
    """n streams, each sending one long request after another, for `seconds`: tokens/s received."""
    count = 0
    stop = time.monotonic() + seconds

    async def one(c, i):
        nonlocal count
        while time.monotonic() < stop:
            body = {"prompt": [1 + i, 2, 3, 4], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if time.monotonic() >= stop:
                        return
                    if line.startswith("data: {"):
                        count += len(json.loads(line[6:])["choices"][0]["token_ids"])

    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*(one(c, i) for i in range(n)))
    return count / seconds


def _flood(host: str, port: int, loops: int, seconds: float, rate: float, nice: int, done):
    """In a process of its own (at `nice`): `loops` keep-alive connections, each GET /metrics back to
    back for `seconds` (at most `rate` a second in all, 0: no bound); puts the number of answers on `done`."""
    os.nice(nice)
    gap = loops / rate if rate else 0.0

    async def loop() -> int:
        reader, writer = await asyncio.open_connection(host, port)
        n, stop = 0, time.monotonic() + seconds
        request = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        nxt = time.monotonic()
        while time.monotonic() < stop:
            if gap:
                nxt += gap
                await asyncio.sleep(max(nxt - time.monotonic(), 0))
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            n += head.startswith(b"HTTP/1.1 200")
        writer.close()
        return n

    async def main():
        return sum(await asyncio.gather(*(loop() for _ in range(loops))))
    done.put(asyncio.run(main()))


def metrics_round(args, url: str):
    host, port = url.removeprefix("http://").split(":")
    asyncio.run(_streams(url, args.streams, 3, args.max_tokens))          # warm: every shape in use once
    quiet, flooded, rates = [], [], []
    ctx = multiprocessing.get_context("spawn")
    for _ in range(args.repeats):
        quiet.append(asyncio.run(_streams(url, args.streams, args.seconds, args.max_tokens)))
        done = ctx.Queue()
        flood = ctx.Process(target=_flood, args=(host, int(port), args.flood_loops, args.seconds + 2, args.flood_rate,
                                                 args.flood_nice, done))
        flood.start()
        time.sleep(1)                                                        # the flood is on before we measure
        flooded.append(asyncio.run(_streams(url, args.streams, args.seconds, args.max_tokens)))
        rates.append(done.get(timeout=60) / (args.seconds + 2))
        flood.join()
    q, f = sum(quiet) / len(quiet), sum(flooded) / len(flooded)
    print(f"\n/metrics flood: {args.flood_loops} keep-alive loops, {sum(rates) / len(rates):.0f} scrapes/s answered")
    print(f"{'':24}{'stream tok/s':>14}")
    print(f"{'quiet':24}{q:14.1f}   ({', '.join(f'{x:.0f}' for x in quiet)})")
    print(f"{'during the flood':24}{f:14.1f}   ({', '.join(f'{x:.0f}' for x in flooded)})")
    print(f"flooded / quiet = {f / q:.2f}: the flood costs generation {100 * (1 - f / q):.0f}% (target < 20%)")


# --- the admission round -----------------------------------------------------------------------------

_N_PROMPTS = 16


def _short_body(i: int, n: int) -> dict:
    return {"prompt": [1 + i % _N_PROMPTS, 2, 3], "max_tokens": n, "temperature": 0, "ignore_eos": True}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _post(url: str, body: dict, local: str | None = None) -> tuple[int, dict, bytes]:
    """One POST /v1/completions on a connection of its own, over asyncio streams (an httpx client with a
    thousand requests in flight spends seconds on itself, which would be counted as the server's);
    local: the source address. Returns status, headers, body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(local, 0) if local else None)
    data = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    raw = await reader.read()
    writer.close()
    top, _, rest = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


POLITE_ADDRESS = "127.0.0.2"      # the well-behaved client: another peer address (loopback takes any 127/8)


async def _admission(url: str, flood_n: int, flood_tokens: int, tokens: int):
    # each distinct prompt alone first: the greedy answer every accepted flood request must give
    expected = []
    for i in range(_N_PROMPTS):
        status, _, body = await _post(url, _short_body(i, flood_tokens))
        assert status == 200, body
        expected.append(json.loads(body)["choices"][0]["token_ids"])
    # the well-behaved client keeps one connection (so the flood's thousand connects cannot delay it)
    transport = httpx.AsyncHTTPTransport(local_address=POLITE_ADDRESS)
    async with httpx.AsyncClient(timeout=600, transport=transport) as polite:
        unloaded = []
        for _ in range(10):
            t0 = time.perf_counter()
            r = await polite.post(url + "/v1/completions", json=_short_body(0, tokens))
            unloaded.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        done = asyncio.Event()

        async def well_behaved():
            out = []
            while not done.is_set():
                t0 = time.perf_counter()
                r = await polite.post(url + "/v1/completions", json=_short_body(0, tokens))
                out.append((time.perf_counter() - t0, r.status_code))
            return out

        async def one(i):
            try:
                return i, await _post(url, _short_body(i, flood_tokens))
            except OSError as e:
                return i, e

        wb = asyncio.create_task(well_behaved())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        flood = await asyncio.gather(*(one(i) for i in range(flood_n)))
        flood_s = time.perf_counter() - t0
        done.set()
        return expected, unloaded, flood, flood_s, await wb


def admission_round(args, url: str):
    before = _refused_series(url)
    expected, unloaded, flood, flood_s, polite = asyncio.run(
        _admission(url, args.flood_requests, args.flood_tokens, args.short_tokens))
    after = _refused_series(url)
    accepted = wrong = other = 0
    refused: dict[str, int] = {}
    for i, r in flood:
        if isinstance(r, Exception):
            other += 1
            continue
        status, headers, body = r
        if status == 200:
            accepted += 1
            wrong += json.loads(body)["choices"][0]["token_ids"] != expected[i % _N_PROMPTS]
        elif status == 429 and headers.get("retry-after", "").isdigit():
            code = json.loads(body)["error"]["code"]
            refused[code] = refused.get(code, 0) + 1
        else:
            other += 1
    ok = [t for t, st in polite if st == 200]
    print(f"\nadmission: {args.flood_requests} concurrent {args.flood_tokens}-token completions from one client, "
          f"answered in {flood_s:.1f} s")
    print(f"  accepted {accepted} (wrong outputs: {wrong}), refused with 429 + Retry-After {sum(refused.values())} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(refused.items())) or 'none'}), other {other}")
    print(f"  server's hybrid_jax_requests_refused_total: +{after - before:.0f}")
    print(f"well-behaved client ({args.short_tokens}-token requests one after another, another address): "
          f"{len(polite)} sent, {len(ok)} served, {len(polite) - len(ok)} refused")
    print(f"{'':24}{'median s':>10}{'max s':>10}")
    print(f"{'unloaded':24}{_pct(unloaded, 0.5):10.3f}{max(unloaded):10.3f}")
    if ok:
        print(f"{'during the flood':24}{_pct(ok, 0.5):10.3f}{max(ok):10.3f}")


def _refused_series(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("hybrid_jax_requests_refused_total{"))


ROUNDS = {"metrics": metrics_round, "admission": admission_round}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round", choices=sorted(ROUNDS), action="append", help="rounds to run (default: all)")
    ap.add_argument("--engine-cpus", default="0", help=f"{cpu_affinity.CPUS_ENV} for the server (default 0)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams measured")
    ap.add_argument("--max-tokens", type=int, default=400, help="tokens per streamed request")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each measured window")
    ap.add_argument("--repeats", type=int, default=2, help="quiet / flooded window pairs")
    ap.add_argument("--flood-loops", type=int, default=16, help="metrics round: keep-alive scrape loops")
    ap.add_argument("--flood-rate", type=float, default=0, help="metrics round: scrapes/s of the whole flood "
                    "(default 0: no bound)")
    ap.add_argument("--flood-nice", type=int, default=19, help="metrics round: nice value of the flood's process "
                    "(default 19: the flood's client work yields to the server's)")
    ap.add_argument("--url", default=None, help="a running server instead of starting one")
    ap.add_argument("--model", default="tiny", help="tiny (the benchmarks' tiny checkpoint), default (serve's "
                    "embedded default model) or a checkpoint directory")
    ap.add_argument("--flood-requests", type=int, default=1000, help="admission round: concurrent short requests")
    ap.add_argument("--flood-tokens", type=int, default=32, help="admission round: tokens of each flood request")
    ap.add_argument("--short-tokens", type=int, default=8, help="admission round: tokens of each well-behaved request")
    ap.add_argument("--unbounded-admission", action="store_true",
                    help="serve without admission bounds (every request queued; the comparison point)")
    args = ap.parse_args()
    device = cpu_affinity.parse_cpus(args.engine_cpus)
    os.sched_setaffinity(0, cpu_affinity.host_cpus(device))    # this script and its flood: off XLA's CPUs
    extra = ["--max-queued-requests", str(10**9), "--max-queued-tokens", str(10**12),
             "--no-fair-admission"] if args.unbounded_admission else []
    with (contextlib.nullcontext(args.url) if args.url else server(args, extra)) as url:
        for name in args.round or sorted(ROUNDS):
            print(f"\n== round: {name} ==")
            ROUNDS[name](args, url)


if __name__ == "__main__":
    main()
