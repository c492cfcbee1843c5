"""The engine half of benchmarks/structured.py: what holding rows to a grammar costs the engine.

On the shipped default model, one engine (overlapped scheduling, decode_steps 4, max_num_seqs 32) serves
a wave of `c` requests (c = 1, 8, 32), a share of them (0, 50%, 100%) under a JSON schema, the others
free text of the same length in tokens, and the wall time of the wave gives generated tokens/s. The
configurations run in turn, round after round (A/B alternating, so the machine's drift hits each alike),
medians over the rounds. A masked row samples one token a step and its step is read back before the
next is enqueued (its next mask is made from that token), so what it costs is the overlap and the
decode iterations per call; the table says how much.

Also the first request's grammar compile (the tokenizer converted, then the grammar), a second
schema's compile (tokenizer ready), and the same schema again (a cache hit), each from `add_request`
to the grammar ready, off the engine thread.

    python benchmarks/structured_engine.py [--rounds 3] [--concurrency 1 8 32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from hybrid_jax import LLM, SamplingParams, StructuredOutputsParams
from hybrid_jax.engine import EngineConfig, LLMEngine

PROMPT = "And the LORD said unto Moses,"
# about 60 tokens of output: an array of eight names
SCHEMA = {"type": "array", "items": {"enum": ["Moses", "Aaron", "Miriam", "Joshua", "Caleb", "Eleazar"]},
          "minItems": 8, "maxItems": 8}
SHARES = (0.0, 0.5, 1.0)


def wave(eng: LLMEngine, c: int, share: float, free_tokens: int, seed: int) -> tuple[float, int]:
    """Runs c requests at once (round(c x share) masked); returns (seconds, tokens generated)."""
    n_masked = int(c * share + 0.5)
    t0 = time.perf_counter()
    for i in range(c):
        masked = i < n_masked
        p = (SamplingParams(max_tokens=200, temperature=0.8, seed=seed + i,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA)) if masked else
             SamplingParams(max_tokens=free_tokens, temperature=0.8, seed=seed + i, ignore_eos=True))
        eng.add_request(f"w{seed}-{i}", PROMPT, p)
    tokens, done = 0, 0
    while done < c:
        for o in eng.step():
            if o.finished:
                done += 1
                tokens += len(o.token_ids)
                if o.request_id.split("-")[1] and int(o.request_id.split("-")[1]) < n_masked:
                    json.loads(o.text)        # a masked output parses (the tests check it validates)
    return time.perf_counter() - t0, tokens


def compile_times(eng: LLMEngine) -> dict[str, float]:
    """Seconds from add_request to the grammar ready: first (cold tokenizer), another schema, the same again."""
    out = {}
    for name, schema in (("first request (tokenizer + grammar)", SCHEMA),
                         ("a new schema", {"type": "object", "properties": {"v": {"type": "integer"}}}),
                         ("the same schema again (cached)", SCHEMA)):
        t0 = time.perf_counter()
        g = eng.grammars.request(StructuredOutputsParams(json=schema))
        g._future.result()
        out[name] = time.perf_counter() - t0
    return out


def run(rounds: int, concurrency: list[int]) -> None:
    llm = LLM()
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=max(concurrency), max_num_batched_tokens=256, max_model_len=512,
                                      decode_steps=4, compilation_cache_dir=None, warmup="none"))
    print("grammar compile, add_request -> ready (off the engine thread):")
    for name, s in compile_times(eng).items():
        print(f"  {name:40s} {s * 1e3:8.1f} ms")
    # the free rows' length: what the masked ones average, so both kinds generate alike
    secs, toks = wave(eng, 4, 1.0, 0, 10_000)
    free_tokens = max(1, toks // 4)
    print(f"\nmasked outputs average {free_tokens} tokens; free rows generate as many (ignore_eos)")
    configs = [(c, s) for c in concurrency for s in SHARES]
    for c, s in configs:                      # warm: every bucket compiled before timing
        wave(eng, c, s, free_tokens, 20_000)
    rates: dict[tuple, list[float]] = {k: [] for k in configs}
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for c, s in order:
            secs, toks = wave(eng, c, s, free_tokens, 30_000 + 1000 * r)
            rates[(c, s)].append(toks / secs)
    print(f"\ngenerated tokens/s, medians of {rounds} rounds (A/B alternating); ratio to the wave with no masked row")
    print(f"{'concurrency':>11} | " + " | ".join(f"{int(s * 100):>3}% masked      " for s in SHARES)
          + "   (masked rows: round(c x share))")
    for c in concurrency:
        base = statistics.median(rates[(c, 0.0)])
        cells = [f"{statistics.median(rates[(c, s)]):7.1f} ({statistics.median(rates[(c, s)]) / base:4.2f}x)"
                 for s in SHARES]
        print(f"{c:>11} | " + " | ".join(f"{x:>18}" for x in cells))
    eng.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    a = ap.parse_args(argv)
    run(a.rounds, a.concurrency)


if __name__ == "__main__":
    main()
