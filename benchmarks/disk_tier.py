"""TTFT with a long shared prefix: cold, from the disk tier, and from the device, in one run; how
much of the disk read prefetch hides; and a fresh process reusing the same directory.

The embedded default model serves `prefix + suffix` prompts (4096 + 64 tokens). "device": the
prefix was published by an earlier request and is still in the device store. "disk": the device
store was dropped (reset), so the spans come back from the Orbax tier. Runs alternate and report
medians. Prefetch: the disk-hit request arrives while another long request prefills (one slot),
so its spans load during that work; the tier's counters say how much of the load was hidden.

    python benchmarks/disk_tier.py [--prefix-len 4096] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

SP = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def make_engine(kv_dir: str, prefix_len: int, chunk: int, seqs: int = 1) -> LLMEngine:
    eng = LLMEngine(LLM(), EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=chunk, max_model_len=prefix_len + 128,
                                        enable_prefix_caching=True, kv_cache_dir=kv_dir, prefix_cache_bytes=256 << 20,
                                        compilation_cache_dir=None, warmup="all"))
    eng.warmup()
    return eng


def ttft(eng, prompt) -> float:
    """Arrival to the end of the step that returns the request's first token."""
    t0 = time.perf_counter()
    eng.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt}, SP)
    while not eng.step():
        pass
    t = time.perf_counter() - t0
    eng.flush_publishes()       # what the serving loop does once the token is out
    return t


def settle(eng):
    eng.step()                      # publishes queued by the last step
    eng.prefix.disk.flush()         # spans written behind reach the disk


CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
from disk_tier import make_engine, ttft
eng = make_engine(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
prompts = json.loads(sys.stdin.read())
times = [ttft(eng, p) for p in prompts]
st = eng.cache_stats()
print(json.dumps({"ttft": times, "spans": st["disk"]["spans_restored"], "tokens": st["disk"]["tokens_restored"]}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    kv_dir = tempfile.mkdtemp(prefix="hybrid_jax_kv_")
    eng = make_engine(kv_dir, args.prefix_len, args.chunk)
    vocab = eng.loaded.config.vocab_size
    rng = np.random.default_rng(0)
    cold, disk, dev = [], [], []
    for r in range(args.repeats + 1):
        prefix = rng.integers(0, vocab, args.prefix_len).tolist()
        p1, p2, p3 = (prefix + rng.integers(0, vocab, args.suffix_len).tolist() for _ in range(3))
        eng.reset_prefix_cache()
        c = ttft(eng, p1)                        # cold: nothing cached anywhere for this prefix
        settle(eng)
        w = ttft(eng, p2)                        # device: the prefix is in the device store
        settle(eng)
        eng.reset_prefix_cache()                 # the device store is gone, the disk tier stays
        d = ttft(eng, p3)                        # disk: spans restored (read on the critical path)
        st = eng.cache_stats()
        assert st["disk"]["tokens_restored"] >= args.prefix_len - eng.prefix.disk.span, st["disk"]
        settle(eng)
        if r:
            cold.append(c), dev.append(w), disk.append(d)
    med = {k: statistics.median(v) for k, v in (("cold", cold), ("disk", disk), ("device", dev))}
    print(f"embedded model, {args.prefix_len}-token shared prefix + {args.suffix_len}-token suffix, chunk {args.chunk},"
          f" median of {args.repeats}")
    print(f"{'':30}{'TTFT ms':>10}{'vs cold':>10}")
    for k in ("cold", "disk", "device"):
        print(f"{k:30}{med[k] * 1e3:>10.1f}{med['cold'] / med[k]:>9.2f}x")
    print(f"disk hit vs cold: {med['cold'] / med['disk']:.2f}x (target >= 3x)")

    # Prefetch: the disk-hit request queues behind a long cold request; its spans load meanwhile.
    eng.reset_prefix_cache()
    prefix = rng.integers(0, vocab, args.prefix_len).tolist()
    eng.generate([{"prompt_token_ids": prefix + [1]}], SP)
    settle(eng)
    eng.reset_prefix_cache()
    st0 = eng.prefix.disk.tier.stats()
    eng.add_request("busy", {"prompt_token_ids": rng.integers(0, vocab, args.prefix_len).tolist()}, SP)
    eng.add_request("hit", {"prompt_token_ids": prefix + [2]}, SP)
    while eng.has_unfinished():
        eng.step()
    st1 = eng.prefix.disk.tier.stats()
    hidden = st1["prefetch_hidden_s"] - st0["prefetch_hidden_s"]
    waited = st1["prefetch_wait_s"] - st0["prefetch_wait_s"]
    print(f"prefetch while another request prefills: {hidden * 1e3:.1f} ms of disk reads hidden, {waited * 1e3:.1f} ms"
          f" waited at admission ({hidden / max(hidden + waited, 1e-9):.0%} hidden)")
    settle(eng)

    # A fresh process pointed at the same directory: two prefixes written by this one.
    other = rng.integers(0, vocab, args.prefix_len).tolist()
    eng.generate([{"prompt_token_ids": other + [3]}], SP)
    settle(eng)
    prompts = [p + rng.integers(0, vocab, args.suffix_len).tolist() for p in (prefix, other)]
    out = subprocess.run([sys.executable, "-c", CHILD, kv_dir, str(args.prefix_len), str(args.chunk),
                          __import__("os").path.dirname(__file__)], input=json.dumps(prompts), text=True,
                         capture_output=True, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    first, second = child["ttft"]
    print(f"fresh process, same --kv-cache-dir: {child['spans']} spans / {child['tokens']} tokens reused from disk;"
          f" TTFT {first * 1e3:.1f} ms for its first request ({med['cold'] / first:.2f}x vs"
          f" cold), {second * 1e3:.1f} ms for the second ({med['cold'] / second:.2f}x)")
    print(f"disk tier: {eng.cache_stats()['disk']}")


if __name__ == "__main__":
    main()
