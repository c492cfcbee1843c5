"""The engine core's paged pools, measured: capacity, what a prefix hit moves, TTFT with a cached
prefix, and serving throughput, on the benchmark's tiny Qwen3-Next checkpoint, in one run.

1. Capacity: at max_model_len 32768 and a cache budget equal to what 8 preallocated rows took (the
   row layout this replaced: every request reserved max_model_len tokens), how many requests of
   300-2,000 tokens hold their whole prompt in the pools at once. Target >= 8x the 8 rows.
2. Hit cost: device bytes a prefix hit of 3,584 tokens moves: the checkpoint units copied into the
   request's row (the pages are shared, listed in its block table), against the bytes of those tokens'
   pages that a copy-in would have moved; read off the compiled load program's cost analysis and the
   pools' shapes.
3. TTFT of a 4,096-token prompt whose first 3,584 tokens are cached, against cold (target >= 7x), on
   two models: the tiny heads64 one, whose 128-wide layers make attention 63% of a token's matmul FLOPs
   at 4,096 tokens of context (the last chunk, the only one a hit computes, is the dearest), and one of
   Qwen3-Next-80B-A3B's proportions (attention 12%; the real model 11%), where the chunks cost what
   they cost in a real model.
4. Throughput at concurrency 1 / 8 / 32 through the async engine (as benchmarks/serving.py runs it),
   beside the row layout it replaced: the same measuring code runs in child processes against this
   tree and against a checkout of the row layout (--baseline-tree), alternating.

    git worktree add /tmp/rows 4a562d0        # the row layout, for section 4
    python benchmarks/engine_core.py [--section capacity,hit,ttft,throughput] [--baseline-tree /tmp/rows]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tiny_qwen3_next import CONFIG, CONFIGS, attention_share, write_checkpoint  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: E402
from hybrid_jax.models import get_model  # noqa: E402


def capacity(llm, max_model_len=32768, rows=8, seed=0):
    """Requests of 300-2,000 tokens admitted at once into pools of the 8-row budget."""
    from hybrid_jax.engine.runner import default_budget  # noqa: PLC0415
    model = get_model(llm.config.model_type)
    abstract = jax.eval_shape(lambda: model.new_cache(llm.config, 1, max_model_len, llm.dtype, page_size=64))
    budget = default_budget(abstract, rows, max_model_len)
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=512, max_model_len=max_model_len, kv_cache_bytes=budget,
                                      compilation_cache_dir=None, warmup="none"))
    bm = eng.blocks
    rng = np.random.default_rng(seed)
    n = 0
    tokens = 0
    while bm.free_rows():
        length = int(rng.integers(300, 2001))
        if bm.take_row(f"q{n}") is None or not bm.grow(f"q{n}", length):
            break
        n += 1
        tokens += length
    row_bytes = sum(g.row_nbytes() for g in abstract.groups.values())
    print("1. capacity: max_model_len 32768, cache budget = 8 preallocated rows "
          f"({budget / 2**20:.1f} MiB; fixed-size state {row_bytes / 2**10:.1f} KiB per request row)")
    print(f"   {'layout':<28}{'requests at once':>18}{'tokens held':>14}")
    print(f"   {'rows at max_model_len':<28}{rows:>18}{rows * max_model_len:>14}")
    print(f"   {'paged pools':<28}{n:>18}{tokens:>14}")
    print(f"   ratio: {n / rows:.1f}x (target >= 8x); bounded by "
          f"{'rows (max_num_seqs)' if not bm.free_rows() else 'pages'}")


def hit_cost(llm, prompt_len=4096, cached=3584):
    """What a 3,584-token hit moves: checkpoint units only; the pages are shared."""
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=512, max_model_len=prompt_len + 64,
                                      enable_prefix_caching=True, compilation_cache_dir=None, warmup="none"))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, llm.config.vocab_size, prompt_len).tolist()
    eng.generate([{"prompt_token_ids": prompt[:cached]}], SamplingParams(max_tokens=1, temperature=0))
    pc = eng.prefix
    hit = pc.lookup(prompt)
    assert hit.ok and hit.boundary == cached, hit
    pages, plan, _ = pc._load_plan(hit)
    groups = eng.runner.cache.groups
    page_bytes = sum(len(p) * groups[g].page_nbytes() for g, p in pages.items())
    unit_bytes = sum(groups[g].row_nbytes() for g, (u, _) in plan.items() if int(u) >= 0)
    compiled = pc.store.load_program.lower(eng.runner.cache, pc.versions, jnp.int32(0), plan, jnp.int32(cached)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    accessed = cost.get("bytes accessed", float("nan"))
    print(f"\n2. hit cost: a {cached}-token hit of a {prompt_len}-token prompt")
    print(f"   {'':44}{'bytes':>14}")
    print(f"   {'pages shared (listed in the block table)':44}{page_bytes:>14}   (a copy-in moved these)")
    print(f"   {'checkpoint units copied into the row':44}{unit_bytes:>14}")
    print(f"   {'compiled load: bytes accessed (XLA cost)':44}{accessed:>14.0f}   (read + write of the units)")
    print(f"   pages copied by the hit: 0; moved / copy-in = {unit_bytes / (page_bytes + unit_bytes):.3f}")


def ttft(name, llm, prompt_len=4096, cached=3584, repeats=5, chunk=512):
    """TTFT cold vs with the first 3,584 tokens cached (cold / warm alternate; medians)."""
    from prefix_cache import ttft as one_ttft  # noqa: PLC0415
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=prompt_len + 64,
                                      enable_prefix_caching=True, prefix_cache_bytes=64 << 20,
                                      compilation_cache_dir=None, warmup="all"))
    eng.warmup()
    rng = np.random.default_rng(0)
    cold_s, warm_s = [], []
    # Fresh random prompts every time (never a hit by chance), and no reset of the store between the
    # runs: a new store compiles its programs again, which the warm run would then pay.
    for r in range(repeats + 1):
        c = one_ttft(eng, rng.integers(0, llm.config.vocab_size, prompt_len).tolist())
        prompt = rng.integers(0, llm.config.vocab_size, prompt_len).tolist()
        one_ttft(eng, prompt[:cached])
        before = eng.cache_stats()["tokens_reused"]
        w = one_ttft(eng, prompt)
        assert eng.cache_stats()["tokens_reused"] - before == cached
        if r:
            cold_s.append(c)
            warm_s.append(w)
    cold, warm = statistics.median(cold_s), statistics.median(warm_s)
    s = attention_share(CONFIGS[name], prompt_len)
    print(f"   {name:<14}{s:>11.0%}{cold * 1e3:>10.1f}{warm * 1e3:>10.1f}{cold / warm:>9.2f}x")


def throughput_child(concurrency: str, requests: int, out_len: int):
    """One process: output tok/s and TTFT p50 of the async engine at each concurrency, printed as one
    JSON line. Uses only the API the row layout had too, so the same code runs against either tree."""
    import json  # noqa: PLC0415

    from hybrid_jax.bench import Workload, run_load, summarize  # noqa: PLC0415
    from hybrid_jax.engine.async_engine import AsyncEngine  # noqa: PLC0415
    llm = LLM(model=write_checkpoint(os.path.join(tempfile.mkdtemp(), "s")))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CONFIG["vocab_size"], int(n)).tolist() for n in rng.integers(16, 65, requests)]
    wl = Workload(prompts, [out_len] * len(prompts))
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=256,
                                         decode_steps=8, warmup="all"))
    engine.warmup()
    ae = AsyncEngine(engine)
    ae.start()
    out = {}
    try:
        for c in map(int, concurrency.split(",")):
            results, secs = asyncio.run(run_load(wl, c, engine=ae, progress=False))
            s = summarize(results, secs)
            out[c] = (s["throughput_tok_s"], s["ttft_ms"]["p50"])
    finally:
        ae.shutdown()
    print("RESULT " + json.dumps(out))


def throughput(baseline_tree: str | None, rounds=3, concurrency="1,8,32", requests=64, out_len=32):
    """Paged core vs the row layout (a checkout of commit 4a562d0 at `baseline_tree`), each in its
    own process with the same script, alternating, `rounds` each; medians."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("paged", here)] + ([("rows", os.path.abspath(baseline_tree))] if baseline_tree else [])
    got = {name: [] for name, _ in trees}
    for _ in range(rounds):
        for name, tree in trees:
            env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1")
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-throughput", concurrency,
                                "--requests", str(requests), "--output-len", str(out_len)],
                               env=env, cwd=tree, capture_output=True, text=True, check=True)
            line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
            got[name].append({int(k): v for k, v in json.loads(line[7:]).items()})
    print(f"\n4. throughput (async engine, {requests} requests of 16-64 prompt tokens, {out_len} output tokens; "
          f"median of {rounds} processes per layout, alternating)")
    print(f"   {'concurrency':>12}{'paged tok/s':>14}{'rows tok/s':>14}{'ratio':>8}{'paged TTFT p50 ms':>19}")
    for c in map(int, concurrency.split(",")):
        tps = statistics.median(r[c][0] for r in got["paged"])
        t50 = statistics.median(r[c][1] for r in got["paged"])
        old = statistics.median(r[c][0] for r in got["rows"]) if "rows" in got else float("nan")
        print(f"   {c:>12}{tps:>14.1f}{old:>14.1f}{tps / old:>7.2f}x{t50:>19.1f}")
    if not baseline_tree:
        print("   (rows: pass --baseline-tree, a checkout of 4a562d0, e.g. `git worktree add /tmp/rows 4a562d0`)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--section", default="capacity,hit,ttft,throughput")
    ap.add_argument("--baseline-tree", default=None, help="a checkout of the row layout (commit 4a562d0)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child-throughput", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    if args.child_throughput:
        return throughput_child(args.child_throughput, args.requests, args.output_len)
    sections = set(args.section.split(","))
    tmp = tempfile.mkdtemp()
    path = write_checkpoint(os.path.join(tmp, "m"), config=dict(CONFIGS["heads64"], max_position_embeddings=40000))
    llm = LLM(model=path, dtype="float32")
    t0 = time.perf_counter()
    if "capacity" in sections:
        capacity(llm)
    if "hit" in sections:
        hit_cost(llm)
    if "ttft" in sections:
        print("\n3. TTFT, 4096-token prompt, first 3584 cached (median of 5, alternating); target >= 7x")
        print(f"   {'model':<14}{'attention':>11}{'cold ms':>10}{'warm ms':>10}{'speed-up':>10}")
        ttft("heads64", llm)
        prop = write_checkpoint(os.path.join(tmp, "p"),
                                config=dict(CONFIGS["proportional"], max_position_embeddings=40000))
        ttft("proportional", LLM(model=prop, dtype="float32"))
        print("   (attention: its share of a token's matmul FLOPs at 4,096 tokens of context; Qwen3-Next-80B-A3B: 11%)")
    if "throughput" in sections:
        throughput(args.baseline_tree, args.rounds, requests=args.requests, out_len=args.output_len)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
