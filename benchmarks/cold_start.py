"""Cold vs warm start of the engine: two fresh processes warm every bucket of the same engine,
the first with an empty persistent compilation cache, the second reading the cache the first
wrote. Prints both times and the ratio.

    python benchmarks/cold_start.py [--max-num-seqs 8] [--max-num-batched-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from hybrid_jax import LLM
from hybrid_jax.engine import EngineConfig, LLMEngine
llm = LLM()
t1 = time.perf_counter()
eng = LLMEngine(llm, EngineConfig(max_num_seqs=int(sys.argv[2]), max_num_batched_tokens=int(sys.argv[3]),
                                  max_model_len=512, warmup="all", compilation_cache_dir=sys.argv[1]))
eng.warmup()
print(json.dumps({"load": t1 - t0, "warmup": eng.warmup_seconds, "programs": eng.runner.num_compiled()}))
"""


def run(cache_dir, seqs, tokens):
    out = subprocess.run([sys.executable, "-c", CHILD, cache_dir, str(seqs), str(tokens)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="hybrid_jax_cc_")
    cold = run(cache, args.max_num_seqs, args.max_num_batched_tokens)
    warm = run(cache, args.max_num_seqs, args.max_num_batched_tokens)
    print(f"{'':14}{'load s':>10}{'warm-up s':>12}{'programs':>10}")
    print(f"{'cold start':14}{cold['load']:>10.2f}{cold['warmup']:>12.2f}{cold['programs']:>10}")
    print(f"{'warm start':14}{warm['load']:>10.2f}{warm['warmup']:>12.2f}{warm['programs']:>10}")
    print(f"warm-up with the persistent compilation cache: {cold['warmup'] / warm['warmup']:.1f}x faster")


if __name__ == "__main__":
    main()
