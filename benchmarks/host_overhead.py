"""Host overhead: how much of the device's rate the engine and the HTTP server deliver.

The "device" is XLA's compute threads kept to CPU 0 (HYBRID_JAX_ENGINE_CPUS, default 0), and the host
every Python thread (this process's step loop, the server's engine core loop, its API server and the
OpenAI client load) kept to the other CPUs (`hybrid_jax/engine/cpu_affinity.py`): on an accelerator a
host cycle never takes a device cycle, and on a CPU shared by both every one would. `--shared-cpus`
runs everything on every CPU instead.

For each model and concurrency (1, 8, 32, 64), in one run:
  bare    the device alone doing this batch's work: the step programs the engine ran in its measured
          pass (prefill chunks, decode calls at growing contexts, the batch as it fills and drains),
          recorded with their inputs and replayed back to back with nothing on the host between them
  decode  the engine's decode program alone, back to back at batch c after 32-token prompts: shorter
          contexts and no prefill, a lighter workload than serving these requests (for reference)
  engine  the async engine alone (AsyncEngine, as the server drives it), c requests in flight
  server  `hybrid-jax serve` in a child process (its engine core in a process of its own), c
          streaming completions at once through the official OpenAI client
Tokens/s of each (engine and server as a share of bare), the engine's device-busy share of the run and
host time per step (its own figures; the server's scraped from /metrics), and TTFT / ITL p50 and p99.
`--baseline` measures the design before overlapped stepping and the engine core process: the engine
reads each step back before it enqueues the next, and the server steps it on a thread of its own.

Every configuration first serves two passes of other prompts (the shapes they batch into compile:
warm-up is `minimal`), then is measured; a measured pass during which a program compiled (a batch
shape the warm-up passes did not meet) is run again, up to MEASURE_TRIES times, so the figures are of
serving, not of compiling.

Models: the embedded default model, and the benchmarks' proportional Qwen3-Next in float32, whose
weights (about 42 MB) exceed this machine's last-level cache. Greedy, ignore_eos, token-id prompts of
16-64 tokens, 256 output tokens (decode-bound, as serving is), c requests per level.

    python benchmarks/host_overhead.py [--concurrency 1,8,32,64] [--models default,medium]
        [--requests-per 1] [--output-len 256] [--prompt-len 16:64] [--baseline] [--shared-cpus]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from hybrid_jax.engine import cpu_affinity  # noqa: E402

# Set before JAX starts its threads (they inherit it); the server's engine core reads the same variable.
DEVICE_CPUS = HOST_CPUS = None
if "--shared-cpus" not in sys.argv and (os.cpu_count() or 1) > 1:
    DEVICE_CPUS = cpu_affinity.from_env() or {0}
    HOST_CPUS = cpu_affinity.host_cpus(DEVICE_CPUS)
    if HOST_CPUS == DEVICE_CPUS:
        sys.exit(f"{cpu_affinity.CPUS_ENV} leaves no CPU for the host")
    os.environ[cpu_affinity.CPUS_ENV] = ",".join(map(str, sorted(DEVICE_CPUS)))
    cpu_affinity.keep_to(DEVICE_CPUS)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.bench import (RequestResult, StreamTally, engine_totals, make_workload, run_load,  # noqa: E402
                              scraped_totals, step_figures, summarize)
from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: E402
from hybrid_jax.engine.async_engine import AsyncEngine  # noqa: E402

MAX_SEQS = 64
MEASURE_TRIES = 4
BASELINE = False         # --baseline: no overlapped stepping, the server's engine on a thread of its own
OUT_LEN = 256
PROMPT_LEN = (16, 64)


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{**dict(max_num_seqs=MAX_SEQS, max_num_batched_tokens=512, max_model_len=2048,
                                  decode_steps=4, warmup="minimal", compilation_cache_dir=None,
                                  async_scheduling=not BASELINE), **kw})


def split():
    """XLA's threads (any started since) to the device CPUs, Python's to the host's (module docstring)."""
    if DEVICE_CPUS:
        cpu_affinity.split_threads(DEVICE_CPUS)


def decode_only(llm, c: int, calls: int = 24) -> float:
    """Tokens/s of the decode program alone at batch c (module docstring)."""
    eng = LLMEngine(llm, engine_config())
    sp = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(c):
        eng.add_request(f"b{i}", {"prompt_token_ids": rng.integers(0, llm.config.vocab_size, 32).tolist()}, sp)
    runner, seen = eng.runner, {}
    jitted = runner._decode

    def spy(*a, **k):
        out = jitted(*a, **k)
        seen.setdefault("call", (a, k, out))
        return out
    runner._decode = spy
    while "call" not in seen or len(eng.scheduler.running) < c:
        seen.clear()
        eng.step()
    runner._decode = jitted
    a, k, out = seen["call"]
    cache, dcache, last = out[2], out[3], out[4]
    for timed in (False, True):
        t0 = time.perf_counter()
        for _ in range(calls):
            toks, _, cache, dcache, last = jitted(a[0], cache, last, *a[3:9], dcache, **k)
        jax.block_until_ready(toks)
        if timed:
            return c * k["steps"] * calls / (time.perf_counter() - t0)


class Recorder:
    """Records the step programs the engine's runner enqueues (mixed, ragged and decode calls, with
    their host inputs) and replays them back to back: the device running exactly the engine's work
    (the same programs on the same rows, lengths and block tables) with no host work between them."""
    NAMES = ("_mixed", "_ragged", "_decode")

    def __init__(self, runner):
        self.runner, self.calls, self.on = runner, [], False
        self.jitted = {name: getattr(runner, name) for name in self.NAMES}
        for name, fn in self.jitted.items():
            setattr(runner, name, self._spy(name, fn))

    def _spy(self, name, fn):
        def call(*a, **k):
            if self.on:
                self.calls.append((name, a, k))
            return fn(*a, **k)
        call._cache_size = fn._cache_size        # the engine counts its compiled programs through it
        return call

    def replay_seconds(self) -> float:
        """Wall time of the recorded calls replayed back to back; the cache, the draft cache and the
        rows' last tokens are threaded from call to call as the engine threaded them."""
        r = self.runner
        cache, last, dcache = r.cache, r.slot_last, r.dcache
        t0 = time.perf_counter()
        for name, a, k in self.calls:
            a = list(a)
            a[1], a[2] = cache, last
            if name != "_ragged":
                a[9] = dcache
            out = self.jitted[name](*a, **k)
            cache, last = out[2], out[-1]
            if name != "_ragged":
                dcache = out[3]
        jax.block_until_ready(last)
        seconds = time.perf_counter() - t0
        r.cache, r.slot_last, r.dcache = cache, last, dcache
        return seconds


def engine_run(llm, c: int, n: int) -> dict:
    eng = LLMEngine(llm, engine_config())
    eng.warmup()
    split()
    rec = Recorder(eng.runner)
    ae = AsyncEngine(eng)
    ae.start()
    try:
        wl = make_workload(n, PROMPT_LEN, (OUT_LEN, OUT_LEN), 0.0, llm.config.vocab_size, seed=c)
        for seed in (c + 100, c + 200):          # two passes of other prompts: the shapes they batch into compile
            warm = make_workload(n, PROMPT_LEN, (OUT_LEN, OUT_LEN), 0.0, llm.config.vocab_size, seed=seed)
            asyncio.run(run_load(warm, c, engine=ae, progress=False))
        for _ in range(MEASURE_TRIES):
            before, k = engine_totals(eng.metrics), eng.num_compiled()
            rec.calls, rec.on = [], True
            results, secs = asyncio.run(run_load(wl, c, engine=ae, progress=False))
            rec.on = False
            if eng.num_compiled() == k:
                break
        out = {**summarize(results, secs), **step_figures(before, engine_totals(eng.metrics), secs),
               "compiled": eng.num_compiled() - k}
    finally:
        ae.shutdown()
    replayed = rec.replay_seconds()
    return {**out, "replay_tok_s": out["throughput_tok_s"] * secs / replayed}


async def _openai_load(url: str, model: str, wl, c: int) -> tuple[list[RequestResult], float]:
    from openai import AsyncOpenAI  # noqa: PLC0415
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)
    sem = asyncio.Semaphore(c)

    async def one(prompt, n_out):
        async with sem:
            tally = StreamTally()
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=n_out, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:       # the server's token_ids extension rides in the choice's extras
                tally.add((chunk.choices[0].model_extra or {}).get("token_ids") or [] if chunk.choices else [])
            return tally.result()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p, k) for p, k in zip(wl.prompts, wl.output_lens)))
    await client.close()
    return list(results), time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_runs(path: str | None, dtype: str, vocab: int, levels: list[int], per: int) -> dict:
    """One `hybrid-jax serve` child for all concurrency levels (the same engine config as the others)."""
    import httpx  # noqa: PLC0415
    port = _free_port()
    cmd = [sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(port), "--dtype", dtype,
           "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", "512", "--max-model-len", "2048",
           "--decode-steps", "4", "--warmup", "minimal", "--compilation-cache-dir", "none"]
    if BASELINE:
        cmd += ["--no-engine-process", "--no-async-scheduling"]
    if path:
        cmd += ["--model", path]
    if HOST_CPUS:                            # the API server on the host's CPUs, its engine core on the device's
        cmd = ["taskset", "-c", ",".join(map(str, sorted(HOST_CPUS)))] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not become ready")
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        out = {}
        for c in levels:
            wl = make_workload(per * c, PROMPT_LEN, (OUT_LEN, OUT_LEN), 0.0, vocab, seed=c)
            for seed in (c + 100, c + 200):      # two passes of other prompts: the shapes they batch into compile
                warm = make_workload(per * c, PROMPT_LEN, (OUT_LEN, OUT_LEN), 0.0, vocab, seed=seed)
                asyncio.run(_openai_load(url, model, warm, c))
            for _ in range(MEASURE_TRIES):
                before = scraped_totals(url, {})
                results, secs = asyncio.run(_openai_load(url, model, wl, c))
                after = scraped_totals(url, {})
                if after["compiled"] == before["compiled"]:
                    break
            out[c] = {**summarize(results, secs), **step_figures(before, after, secs),
                      "compiled": after["compiled"] - before["compiled"]}
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def model(name: str) -> tuple[LLM, str | None, str]:
    if name == "default":
        llm, path, dtype = LLM(), None, "auto"
    else:
        from tiny_qwen3_next import CONFIG_PROPORTIONAL, write_checkpoint  # noqa: PLC0415
        path = write_checkpoint(os.path.join(tempfile.mkdtemp(), "medium"), config=CONFIG_PROPORTIONAL)
        llm, dtype = LLM(model=path, dtype="float32"), "float32"
    split()
    return llm, path, dtype


def main():
    global OUT_LEN, PROMPT_LEN, BASELINE  # noqa: PLW0603
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--models", default="default,medium")
    ap.add_argument("--requests-per", type=int, default=1, help="requests per unit of concurrency")
    ap.add_argument("--output-len", type=int, default=OUT_LEN)
    ap.add_argument("--prompt-len", default=f"{PROMPT_LEN[0]}:{PROMPT_LEN[1]}")
    ap.add_argument("--baseline", action="store_true",
                    help="no overlapped stepping; the server steps its engine on a thread (no engine core process)")
    ap.add_argument("--shared-cpus", action="store_true", help="device and host threads on every CPU")
    args = ap.parse_args()
    OUT_LEN, BASELINE = args.output_len, args.baseline
    PROMPT_LEN = tuple(int(x) for x in args.prompt_len.split(":"))
    levels = [int(x) for x in args.concurrency.split(",")]
    where = (f"device: XLA's threads on CPU {','.join(map(str, sorted(DEVICE_CPUS)))}, host: Python's on CPU "
             f"{','.join(map(str, sorted(HOST_CPUS)))}" if DEVICE_CPUS else "device and host share every CPU")
    print(f"{'baseline (no overlap, engine on the server thread)' if BASELINE else 'overlapped stepping, engine core process'}; {where}")
    for name in args.models.split(","):
        llm, path, dtype = model(name)
        nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(llm.params))
        print(f"\n{name}: {llm.config.model_type}, weights {nbytes / 2**20:.1f} MiB ({dtype}); {OUT_LEN} output "
              f"tokens, prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]}, {args.requests_per} requests per unit of concurrency")
        rows = {c: {"decode": decode_only(llm, c), "engine": engine_run(llm, c, args.requests_per * c)} for c in levels}
        for c, r in server_runs(path, dtype, llm.config.vocab_size, levels, args.requests_per).items():
            rows[c]["server"] = r
        print(f"{'conc':>5} {'bare tok/s':>11} {'decode':>7} {'engine':>7} {'/bare':>6} {'/dec':>5} {'server':>7} "
              f"{'/bare':>6} {'/dec':>5} {'busy e/s':>9} {'host ms/step e/s':>17} {'TTFT p50/p99 ms e | s':>24} "
              f"{'ITL p50/p99 ms e | s':>23}")
        for c, r in rows.items():
            e, s, d = r["engine"], r["server"], r["decode"]
            b, et, st = e["replay_tok_s"], e["throughput_tok_s"], s["throughput_tok_s"]
            print(f"{c:>5} {b:>11.0f} {d:>7.0f} {et:>7.0f} {et / b:>6.0%} {et / d:>5.0%} {st:>7.0f} {st / b:>6.0%} "
                  f"{st / d:>5.0%} "
                  f"{e['device_busy']:>4.0%}/{s['device_busy']:<4.0%} "
                  f"{e['host_ms_per_step']:>8.2f}/{s['host_ms_per_step']:<8.2f} "
                  f"{e['ttft_ms']['p50']:>5.0f}/{e['ttft_ms']['p99']:<5.0f}|{s['ttft_ms']['p50']:>5.0f}/"
                  f"{s['ttft_ms']['p99']:<6.0f} {e['itl_ms']['p50']:>5.1f}/{e['itl_ms']['p99']:<5.1f}|"
                  f"{s['itl_ms']['p50']:>5.1f}/{s['itl_ms']['p99']:<5.1f}"
                  + (" (compiled during the measured pass)" if e["compiled"] or s["compiled"] else ""))
    print("\n(bare: the programs the engine ran in its measured pass, replayed back to back on the device with "
          "nothing on the host between them: this batch's work (prefill chunks, growing contexts, the batch as it "
          "fills and drains) at the device's rate; decode: the decode program alone after 32-token prompts, a "
          "lighter workload, for reference; busy: the share of the run the device ran engine steps; one run on a "
          "shared machine: ratios within a run are the figures)")


if __name__ == "__main__":
    main()
