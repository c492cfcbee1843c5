"""`hybrid-jax bench`: a bounded load generator against the in-process engine or a running server.

Requests carry token ids (so any tokenizer works), prompt and output lengths drawn uniformly from
the given ranges, and an optional shared prefix. Each request streams; TTFT is the time to its
first token, ITL the gap between tokens. Prints percentiles and throughput.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np
from tqdm.auto import tqdm

from hybrid_jax.errors import InputError


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclasses.dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    tokens: list[int]
    latency: float


def _range(s: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in s.split(":")) if ":" in s else (int(s), int(s))
    except ValueError:
        raise InputError(f"a length range is MIN:MAX; got {s!r}") from None
    if not 0 < a <= b:
        raise InputError(f"a length range needs 0 < MIN <= MAX; got {s!r}")
    return a, b


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], shared_prefix: float,
                  vocab: int, seed: int) -> Workload:
    if not 0.0 <= shared_prefix <= 1.0:
        raise InputError(f"shared prefix fraction must be in [0, 1]; got {shared_prefix}")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, prompt_len[1]).tolist()
    prompts, outs = [], []
    for _ in range(n):
        L = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        k = int(shared_prefix * L)
        prompts.append(prefix[:k] + rng.integers(0, vocab, L - k).tolist())
        outs.append(int(rng.integers(output_len[0], output_len[1] + 1)))
    return Workload(prompts, outs)


class StreamTally:
    """One streamed request's figures: started at construction, fed each piece's new token ids."""

    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.ttft, self.itls, self.tokens = None, [], []

    def add(self, new: list[int]):
        now = time.perf_counter()
        if new:
            if self.ttft is None:
                self.ttft = now - self.t0
            else:
                self.itls += [(now - self.last) / len(new)] * len(new)
            self.last = now
            self.tokens += new

    def result(self) -> RequestResult:
        return RequestResult(self.ttft, self.itls, self.tokens, time.perf_counter() - self.t0)


async def _one_engine(engine, i, prompt, n_out) -> RequestResult:
    from hybrid_jax.sampling import SamplingParams  # noqa: PLC0415
    tally = StreamTally()
    sp = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    async for out in engine.generate(f"bench-{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, sp):
        tally.add(out.new_token_ids)
    return tally.result()


async def _one_http(client, url, api_key, i, prompt, n_out) -> RequestResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": True}
    tally = StreamTally()
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tally.add(json.loads(line[6:])["choices"][0].get("token_ids") or [])
    return tally.result()


async def run_load(workload: Workload, concurrency: int, *, engine=None, url: str | None = None,
                   api_key: str | None = None, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Sends every request of the workload, at most `concurrency` at once. Returns (results, seconds)."""
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(workload.prompts), desc="requests", disable=not progress)
    client = None
    if url is not None:
        import httpx  # noqa: PLC0415
        client = httpx.AsyncClient(timeout=600)

    async def one(i):
        async with sem:
            if client is not None:
                r = await _one_http(client, url, api_key, i, workload.prompts[i], workload.output_lens[i])
            else:
                r = await _one_engine(engine, i, workload.prompts[i], workload.output_lens[i])
            bar.update(1)
            return r

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
    finally:
        bar.close()
        if client is not None:
            await client.aclose()
    return list(results), time.perf_counter() - t0


def summarize(results: list[RequestResult], seconds: float) -> dict:
    ttft = np.array([r.ttft for r in results]) * 1e3
    itl = np.array([x for r in results for x in r.itls] or [0.0]) * 1e3
    n_tok = sum(len(r.tokens) for r in results)
    pct = lambda a: {f"p{p}": float(np.percentile(a, p)) for p in (50, 90, 99)}  # noqa: E731
    return {"requests": len(results), "seconds": seconds, "output_tokens": n_tok,
            "throughput_tok_s": n_tok / seconds, "requests_s": len(results) / seconds,
            "ttft_ms": pct(ttft), "itl_ms": pct(itl)}


def step_figures(before: dict, after: dict, seconds: float) -> dict:
    """Device-busy fraction and host ms per step between two readings {"steps", "host_s", "device_s"} of
    the engine's step totals (`EngineMetrics.note_step`) taken around a run of `seconds`."""
    steps = after["steps"] - before["steps"]
    return {"steps": steps, "device_busy": (after["device_s"] - before["device_s"]) / seconds,
            "host_ms_per_step": 1e3 * (after["host_s"] - before["host_s"]) / max(steps, 1)}


def engine_totals(metrics) -> dict:
    return {"steps": metrics.steps, "host_s": metrics.host_seconds, "device_s": metrics.device_seconds}


def scraped_totals(url: str, headers: dict) -> dict:
    """The same totals from a server's /metrics."""
    import httpx  # noqa: PLC0415
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    val = {}
    for line in text.splitlines():
        name, _, v = line.partition(" ")
        if name in ("hybrid_jax_step_host_seconds_count", "hybrid_jax_step_host_seconds_sum",
                    "hybrid_jax_device_busy_seconds_total", "hybrid_jax_compiled_programs"):
            val[name] = float(v)
    return {"steps": int(val.get("hybrid_jax_step_host_seconds_count", 0)),
            "host_s": val.get("hybrid_jax_step_host_seconds_sum", 0.0),
            "device_s": val.get("hybrid_jax_device_busy_seconds_total", 0.0),
            "compiled": int(val.get("hybrid_jax_compiled_programs", 0))}


def print_summary(s: dict):
    print(f"requests {s['requests']} in {s['seconds']:.2f} s: {s['throughput_tok_s']:.1f} output tok/s, "
          f"{s['requests_s']:.2f} req/s")
    for k in ("ttft_ms", "itl_ms"):
        v = s[k]
        print(f"  {k[:-3].upper():5} ms  p50 {v['p50']:8.2f}  p90 {v['p90']:8.2f}  p99 {v['p99']:8.2f}")
    if "device_busy" in s:
        print(f"  device busy {100 * s['device_busy']:.0f}% of the run; host {s['host_ms_per_step']:.2f} ms per step "
              f"({s['steps']} steps)")


def main(args, engine_config) -> int:
    wl_kw = dict(prompt_len=_range(args.prompt_len), output_len=_range(args.output_len),
                 shared_prefix=args.shared_prefix, seed=args.seed)
    if args.url:
        import httpx  # noqa: PLC0415
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        card = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"][0]
        vocab = int(card.get("vocab_size", 256))      # token ids the server's model accepts
        wl = make_workload(args.num_requests, vocab=vocab, **wl_kw)
        before = scraped_totals(args.url.rstrip("/"), headers)
        results, secs = asyncio.run(run_load(wl, args.concurrency, url=args.url.rstrip("/"), api_key=args.api_key))
        steps = step_figures(before, scraped_totals(args.url.rstrip("/"), headers), secs)
    else:
        from hybrid_jax.cli_config import parallel_options  # noqa: PLC0415
        from hybrid_jax.engine.async_engine import AsyncEngine  # noqa: PLC0415
        from hybrid_jax.llm import build_engine  # noqa: PLC0415
        engine = build_engine(args.model, args.dtype, engine_config, parallel_options(args))
        ae = AsyncEngine(engine)
        ae.start()
        wl = make_workload(args.num_requests, vocab=engine.loaded.config.vocab_size, **wl_kw)
        before = engine_totals(engine.metrics)
        try:
            results, secs = asyncio.run(run_load(wl, args.concurrency, engine=ae))
        finally:
            ae.shutdown()
        steps = step_figures(before, engine_totals(engine.metrics), secs)
        print(f"compiled programs: {engine.num_compiled()} (after warm-up: see warmup)")
    print_summary({**summarize(results, secs), **steps})
    return 0
