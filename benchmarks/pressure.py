"""Copy-on-write under a small KV budget, as a client sees it: `hybrid-jax serve` with the shipped
default model, prefix caching on and a cache budget of about 33 pages of 64 tokens, sent 10
concurrent prompts of 150-300 words (held-out King James text) for 450 tokens each, twice.

Decode publishes share each request's last page with the prefix store, so most decode steps past a
grid point write a shared page and need a private copy, in a pool too small for the requests at
once (they preempt). Printed per round: its wall time, the engine's step failures (before the
scheduler reserved copy-on-write pages with the rest of a step's pages, a step whose copy found no
free page failed, and each such failure reset the pools and threw the prefix store away), the
preemptions, the prefix-cache hit tokens, and whether the greedy outputs equal the first round's.

    python benchmarks/pressure.py                    # the issue's setting
    python benchmarks/pressure.py --rounds 3 --max-tokens 200
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import types

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import overload  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "kjv_heldout.txt")


def _metric(url: str, name: str, label: str = "") -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
               if line.startswith(name) and label in line and not line.startswith("#"))


async def _round(url: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=3600) as c:
        async def one(p):
            r = await c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                                             "ignore_eos": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(p) for p in prompts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=450)
    ap.add_argument("--kv-cache-bytes", type=int, default=4_100_000)
    ap.add_argument("--engine-cpus", default="0", help="HYBRID_JAX_ENGINE_CPUS for the server (default 0)")
    args = ap.parse_args()
    words = open(TEXT).read().split()
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(args.requests):
        n = int(rng.integers(150, 300))
        s = int(rng.integers(0, len(words) - n))
        prompts.append(" ".join(words[s:s + n]))
    srv = types.SimpleNamespace(model="default", engine_cpus=args.engine_cpus)
    extra = ["--kv-cache-bytes", str(args.kv_cache_bytes), "--enable-prefix-caching"]
    with overload.server(srv, extra) as url:
        first = None
        print(f"{'round':>6}{'wall s':>9}{'step failures':>15}{'preemptions':>13}{'prefix hit tokens':>19}"
              f"{'same tokens':>13}")
        for r in range(args.rounds):
            t0 = time.perf_counter()
            outs = asyncio.run(_round(url, prompts, args.max_tokens))
            first = first or outs
            failures = _metric(url, "hybrid_jax_engine_step_failures_total", 'attributable="false"')
            print(f"{r + 1:>6}{time.perf_counter() - t0:9.1f}{failures:15.0f}"
                  f"{_metric(url, 'hybrid_jax_preemptions_total'):13.0f}"
                  f"{_metric(url, 'hybrid_jax_prefix_cache_hits_total'):19.0f}{str(outs == first):>13}", flush=True)


if __name__ == "__main__":
    main()
