"""TTFT with and without a cached prefix, on the same engine in one run.

A 4096-token prompt is served cold (empty prefix store) and after a request for its first 3584
tokens has published them (KV blocks and Gated DeltaNet checkpoints): the warm request loads 3584
tokens and prefills 512, so the ideal ratio is 8x. Runs alternate cold / warm and report medians.
Also prints the host-side cost of lookup + validation per request.

    python benchmarks/prefix_cache.py [--config heads64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from tiny_qwen3_next import CONFIGS, write_checkpoint  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: E402


def ttft(eng, prompt) -> float:
    """Arrival to the end of the step that returns the request's first token."""
    t0 = time.perf_counter()
    eng.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while not eng.step():
        pass
    t = time.perf_counter() - t0
    eng.flush_publishes()       # what the serving loop does once the token is out
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="heads64", choices=sorted(CONFIGS))
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--cached-len", type=int, default=3584)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefix-cache-mb", type=int, default=64)
    args = ap.parse_args()
    cfg = CONFIGS[args.config]
    path = write_checkpoint(os.path.join(tempfile.mkdtemp(), "m"), config=dict(cfg, max_position_embeddings=8192))
    llm = LLM(model=path, dtype="float32")
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.chunk,
                                      max_model_len=args.prompt_len + 64, enable_prefix_caching=True,
                                      prefix_cache_bytes=args.prefix_cache_mb << 20,
                                      compilation_cache_dir=None, warmup="all"))
    eng.warmup()
    rng = np.random.default_rng(0)
    cold_s, warm_s, lookups = [], [], []
    for r in range(args.repeats + 1):          # the first round compiles nothing it measures twice
        prompt = rng.integers(0, cfg["vocab_size"], args.prompt_len).tolist()
        eng.reset_prefix_cache()
        c = ttft(eng, prompt)                                   # cold: empty store (it also publishes)
        eng.reset_prefix_cache()
        ttft(eng, prompt[:args.cached_len])                     # publish the first 3584 tokens
        n = len(eng.prefix.lookup_seconds)
        w = ttft(eng, prompt)                                   # warm: 3584 loaded, 512 prefilled
        st = eng.cache_stats()
        assert st["tokens_reused"] == args.cached_len, st
        if r:
            cold_s.append(c)
            warm_s.append(w)
            lookups += list(eng.prefix.lookup_seconds)[n:]
    cold, warm = statistics.median(cold_s), statistics.median(warm_s)
    print(f"[{args.config}] {args.prompt_len}-token prompt, first {args.cached_len} cached; chunk {args.chunk};"
          f" median of {args.repeats}; programs compiled after warm-up: {eng.num_compiled()}")
    print(f"{'':34}{'TTFT ms':>10}")
    print(f"{'cold (empty prefix store)':34}{cold * 1e3:>10.1f}")
    print(f"{'warm (3584 tokens reused)':34}{warm * 1e3:>10.1f}")
    print(f"speed-up: {cold / warm:.2f}x   (ideal {args.prompt_len / (args.prompt_len - args.cached_len):.1f}x,"
          f" target >= 6.5x)")
    print(f"host lookup + validation per request: {statistics.median(lookups) * 1e6:.0f} us (median),"
          f" {max(lookups) * 1e6:.0f} us (max)")
    st = eng.cache_stats()
    print(f"cache: hit rate {st['hit_rate']:.2f} x validation pass rate {st['validation_pass_rate']:.2f} ="
          f" effective reuse {st['effective_reuse']:.2f}; bytes by group {st['bytes_by_group']}")


if __name__ == "__main__":
    main()
