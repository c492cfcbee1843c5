"""The shipped default model's quality figures, measured through the engine in one run:

  1. held-out perplexity (`hybrid-jax eval`'s scoring: windows of --context tokens every --stride) on
     the chapters scripts/train_default.py held out, beside the uniform baseline (the vocabulary) and
     an oracle unigram model fitted to the same held-out tokens;
  2. what serving options cost, as `hybrid-jax eval --compare` reports them: prefix caching (exact),
     n-gram speculative decoding (exact), bfloat16 activations against float32 (approximate);
  3. n-gram speculative decoding on the model's own text: acceptance rate and tokens per verify step
     (emitted tokens / verify steps) on continuations of held-out chapter openings, and on a
     repetitive prompt (a held-out passage of six verses, then its first seven words again, so the
     continuation can copy).

    python benchmarks/default_model.py [--tokens 2048] [--context 256] [--stride 128] [--k 4]
"""
from __future__ import annotations

import argparse
import math
import os
import time
from collections import Counter

import numpy as np

from hybrid_jax import LLM, SamplingParams, evaluate
from hybrid_jax.default_model import training_figures

HELDOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                       "kjv_heldout.txt")


def spec_run(prompts: list[str], k: int, max_tokens: int) -> tuple[dict, bool]:
    """n-gram speculation over prompts, greedy; (its stats, whether its text equals plain decoding's)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(max_model_len=1024).generate(prompts, sp)]
    spec = LLM(max_model_len=1024, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp)]
    return spec.spec_stats(), got == plain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="n-gram draft length")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    with open(HELDOUT, encoding="utf-8") as f:
        chapters = [c for c in f.read().split("\n\n") if c.strip()]
    fig = training_figures()
    print(f"default model: {fig['parameters'] / 1e6:.2f}M parameters, trained {fig['steps']} steps on "
          f"{fig['training_tokens_seen'] / 1e6:.1f}M tokens ({fig['corpus']}), {fig['train_time_s'] / 60:.0f} min on "
          f"{fig['host']}; final training loss {fig['final_train_loss']:.3f}, held-out {fig['final_heldout_loss']:.3f}")

    # 1. held-out perplexity
    base = LLM(max_model_len=a.context + 64)
    ids = base.tokenizer.encode("\n\n".join(chapters))[:a.tokens]
    t0 = time.perf_counter()
    s = evaluate.score(base, ids, context=a.context, stride=a.stride, generate_tokens=32)
    counts = np.asarray(list(Counter(ids).values()), np.float64)
    p = counts / counts.sum()
    print(f"\n1. held-out perplexity over {len(s.positions)} positions (context {a.context}, stride {a.stride}; "
          f"{time.perf_counter() - t0:.0f} s)")
    print(f"   model {s.perplexity:8.2f}   oracle unigram {math.exp(-np.sum(p * np.log(p))):8.2f}   "
          f"uniform {base.config.vocab_size:8d}")

    # 2. what options cost
    print("\n2. configuration B against A = the default (float32, no prefix caching, no speculation)")
    print(f"   {'B':<36}{'ppl A':>9}{'ppl B':>9}{'KL mean':>11}{'KL max':>11}{'top-1':>8}  greedy 32")
    n = min(len(ids), 769)
    for label, opts in (("prefix caching (block 16)", dict(enable_prefix_caching=True,
                                                            engine_config={"prefix_block_size": 16})),
                        ("n-gram speculation, k=4", dict(speculative_config={"method": "ngram",
                                                                            "num_speculative_tokens": 4})),
                        ("bfloat16 activations", dict(dtype="bfloat16"))):
        other = LLM(max_model_len=a.context + 64, **opts)
        kw = dict(context=a.context, stride=a.stride, max_positions=n - 1, generate_tokens=32)
        c = evaluate.compare(evaluate.score(base, ids[:n], **kw), evaluate.score(other, ids[:n], **kw))
        print(f"   {label:<36}{c.a.perplexity:9.3f}{c.b.perplexity:9.3f}{c.kl_mean:11.2e}{c.kl_max:11.2e}"
              f"{c.top1_agreement:8.1%}  {'identical' if c.greedy_identical else 'differs at ' + str(c.first_greedy_difference)}")

    # 3. n-gram speculation on the model's text
    openings = [c.split("\n")[0] for c in chapters[:8]]
    passage = "\n".join(chapters[1].split("\n")[:6])
    repetitive = [passage + "\n" + " ".join(passage.split()[:7])]       # its first seven words again
    print(f"\n3. n-gram speculation (k={a.k}, greedy, {a.max_tokens} tokens)")
    for label, prompts in (("own text: 8 held-out chapter openings", openings),
                           ("repetitive: a passage, then its start again", repetitive)):
        st, same = spec_run(prompts, a.k, a.max_tokens)
        print(f"   {label:<46} acceptance {st['acceptance_rate']:5.1%}   tokens per verify "
              f"{st['mean_accepted_length']:.2f}   identical to plain decoding: {same}")


if __name__ == "__main__":
    main()
