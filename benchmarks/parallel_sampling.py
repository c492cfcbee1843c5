"""What `n` > 1 costs: TTFT and decode rows of n = 1, n = 4 forked, and n = 4 as four separate requests.

On the shipped default model, one engine serves, round after round and in turn (A/B alternating, so
drift in the machine's speed hits every mode alike), a fresh random prompt as

  n1        one request;
  n4 fork   one group of four (engine/fork.py; ids tagged as the server's fan-out tags them): the
            leader prefills P - 1 tokens, the three others fork from it, and all four feed the last
            prompt token in one step;
  n4 apart  four ordinary requests of the same prompt (each prefills all P tokens).

TTFT is from the requests' arrival to the end of the step that returns the last of the mode's first
tokens (every choice has one). Decode rows: the most rows a decode-only step ran in the mode (the
issue's goal: at most 4 for n = 4); prompt tokens: those the mode's prefill computed. Medians over
--repeats rounds after one warm round; the issue's goal is n4 fork / n1 <= 1.3.

    python benchmarks/parallel_sampling.py [--prompt-len 1000] [--chunk 512] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

MODES = ("n1", "n4 fork", "n4 apart")


class DecodeRows:
    """Wraps the engine's scheduler: the most rows of any decode-only step since `reset`."""

    def __init__(self, eng: LLMEngine):
        self.most = 0
        schedule = eng.scheduler.schedule

        def counted():
            out = schedule()
            if out.rows and out.is_decode_only:
                self.most = max(self.most, len(out.rows))
            return out
        eng.scheduler.schedule = counted

    def reset(self):
        self.most = 0


def serve(eng: LLMEngine, mode: str, prompt: list[int], sp: SamplingParams, tag: str) -> tuple[float, list]:
    """Runs one mode to the end; (TTFT in s, the choices' token ids)."""
    k = 1 if mode == "n1" else 4
    # a fork group's ids as the server's fan-out writes them (`<group>#<index>/<k>`: the engine reads
    # the ForkGroup from them)
    ids = [f"{tag}#{i}/{k}" if mode == "n4 fork" else f"{tag}-{i}" for i in range(k)]
    t0 = time.perf_counter()
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                tokens[o.request_id] = o.token_ids
    eng.flush_publishes()
    return max(first.values()) - t0, [tokens[r] for r in ids]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    llm = LLM(max_model_len=a.prompt_len + a.max_tokens + 64)
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=8, max_num_batched_tokens=a.chunk,
                                      max_model_len=a.prompt_len + a.max_tokens + 64,
                                      compilation_cache_dir=None, warmup="all"))
    eng.warmup()
    n0 = eng.num_compiled()
    rows, rng = DecodeRows(eng), np.random.default_rng(0)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {m: [] for m in MODES}
    most: dict[str, int] = {m: 0 for m in MODES}
    prompt_tokens: dict[str, float] = {}
    for r in range(a.repeats + 1):                 # round 0 warms what warm-up does not (host caches)
        prompt = rng.integers(0, llm.config.vocab_size, a.prompt_len).tolist()
        outs = {}
        for j in range(len(MODES)):
            mode = MODES[(j + r) % len(MODES)]         # each mode goes first, second, third in turn
            rows.reset()
            before = eng.metrics.prompt_tokens._value.get()
            t, outs[mode] = serve(eng, mode, prompt, sp, f"r{r}-{j}")
            prompt_tokens[mode] = eng.metrics.prompt_tokens._value.get() - before
            most[mode] = max(most[mode], rows.most)
            if r:
                ttft[mode].append(t)
        # greedy: every choice of every mode is the same text
        assert outs["n4 fork"] == outs["n4 apart"] == outs["n1"] * 4, f"round {r}: the modes disagree"
    med = {m: statistics.median(v) for m, v in ttft.items()}
    print(f"default model, {a.prompt_len}-token prompt, chunk {a.chunk}, {a.max_tokens} greedy tokens per choice;"
          f" medians of {a.repeats} alternating rounds; programs compiled after warm-up: {eng.num_compiled() - n0}")
    print(f"{'mode':<10}{'TTFT ms':>10}{'x n1':>8}{'prompt tokens':>15}{'decode rows':>13}")
    for m in MODES:
        print(f"{m:<10}{med[m] * 1e3:>10.1f}{med[m] / med['n1']:>8.2f}{prompt_tokens[m]:>15.0f}{most[m]:>13d}")
    print(f"n4 fork / n1 = {med['n4 fork'] / med['n1']:.2f} (goal <= 1.3); n4 apart / n1 ="
          f" {med['n4 apart'] / med['n1']:.2f}; n4 fork decodes {most['n4 fork']} rows (goal <= 4)")


if __name__ == "__main__":
    main()
