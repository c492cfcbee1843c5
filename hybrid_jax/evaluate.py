"""`hybrid-jax eval`: a model's perplexity on a text, and what a serving option costs in quality.

Every figure is read through the serving path, the engine's own steps, so an option that changes
only the engine (prefix caching, speculative decoding) is measured as much as one that changes the
model (FP8 weights, a DeepSeek indexer's key format, Top-K against dense attention).

Scoring. The text's tokens are read in windows of `context` tokens that start every `stride` tokens.
Position p (the prediction of token p) is scored once, in the first window that gives it at least
context - stride tokens before it (the first window scores every position from 1): it is one engine
request whose prompt is the window's tokens before p, max_tokens=1, logprobs=-1 (the next-token
distribution over the whole vocabulary). A window's requests extend one another, as a chat's turns do,
so a prefix cache finds every earlier request's blocks. Perplexity = exp(mean -log p(token p)).

Comparison. The same positions are scored under two configurations of one checkpoint (LLM keyword
options); reported: each one's perplexity, KL(A || B) of the next-token distributions (mean and max over
positions), the top-1 agreement, and whether `generate` greedy tokens from the text's start are identical.
An exact option must give KL = 0 and identical text.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import numpy as np

from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Windows:
    """Which position each request scores and from where its prompt starts."""
    positions: np.ndarray        # [n] int: the scored positions p (token p is predicted)
    starts: np.ndarray           # [n] int: its prompt is tokens[start:p]


def score_windows(n_tokens: int, context: int, stride: int) -> Windows:
    """The scoring plan of a text of n_tokens tokens (see the module docstring)."""
    if not 0 < stride <= context:
        raise InputError(f"stride must be in [1, context]; got stride {stride}, context {context}")
    if n_tokens < 2:
        raise InputError(f"the text has {n_tokens} token(s): at least 2 are needed to score one")
    p = np.arange(1, n_tokens)
    return Windows(p, np.where(p < context, 0, ((p - context) // stride + 1) * stride))


@dataclasses.dataclass
class Scored:
    """One configuration's reading of a text."""
    positions: np.ndarray        # [n]
    nll: np.ndarray              # [n] float64: -log p(token p | its prompt)
    logprobs: np.ndarray | None  # [n, V] float32: the whole next-token distribution (log), when kept
    greedy: list[int]            # the tokens `generate` gave greedily after the text's first tokens
    cache_stats: dict            # the prefix cache's figures after scoring ({"enabled": False} when off)

    @property
    def perplexity(self) -> float:
        return float(math.exp(np.mean(self.nll)))


def score(llm, token_ids: Sequence[int], *, context: int = 256, stride: int = 128, max_positions: int | None = None,
          generate_tokens: int = 32, keep_distributions: bool = True) -> Scored:
    """Scores token_ids with llm (a hybrid_jax.LLM) through its engine. max_positions: score only the
    first that many positions; generate_tokens: greedy tokens generated after the text's first
    min(context // 2, len) tokens, for the comparison."""
    ids = [int(t) for t in token_ids]
    w = score_windows(len(ids), context, stride)
    if max_positions is not None:
        w = Windows(w.positions[:max_positions], w.starts[:max_positions])
    if context + 1 > llm.max_model_len:
        raise InputError(f"context {context} + 1 generated token exceeds the model's max_model_len {llm.max_model_len}")
    prompts = [{"prompt_token_ids": ids[s:p]} for p, s in zip(w.positions, w.starts)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    V = llm.config.vocab_size
    dists = np.empty((len(outs), V), np.float32) if keep_distributions else None
    nll = np.empty(len(outs), np.float64)
    for j, (o, p) in enumerate(zip(outs, w.positions)):
        top = np.asarray(o.outputs[0].logprobs[0]["top"], np.float64)      # [V, 2]: (token id, logprob)
        d = np.full(V, -np.inf, np.float32)
        d[top[:, 0].astype(np.int64)] = top[:, 1]
        nll[j] = -float(d[ids[p]])
        if dists is not None:
            dists[j] = d
    greedy = []
    if generate_tokens:
        head = ids[:max(1, min(context // 2, len(ids)))]
        greedy = llm.generate({"prompt_token_ids": head},
                              SamplingParams(max_tokens=generate_tokens, temperature=0.0, ignore_eos=True)
                              )[0].outputs[0].token_ids
    return Scored(w.positions, nll, dists, list(greedy), llm.cache_stats())


@dataclasses.dataclass
class Comparison:
    a: Scored
    b: Scored
    kl_mean: float               # mean over positions of KL(A || B), nats
    kl_max: float
    top1_agreement: float        # share of positions whose most likely token is the same
    greedy_identical: bool
    first_greedy_difference: int | None


def _normalized(lp: np.ndarray) -> np.ndarray:
    """Log-probabilities renormalized in float64: float32 ones sum to 1 only within ~1e-6, an error
    that enters KL at first order (a distribution against itself would read ~1e-7, not 0)."""
    lp = lp.astype(np.float64)
    m = np.max(lp, axis=-1, keepdims=True)
    return lp - m - np.log(np.sum(np.exp(lp - m), axis=-1, keepdims=True))


def kl_divergence(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """KL(A || B) per row of log-probabilities a, b [n, V] (natural log; a token A gives no mass adds
    nothing; one only B rules out gives +inf)."""
    a, b = _normalized(a), _normalized(b)
    pa = np.exp(a)
    return np.sum(pa * np.where(pa > 0, a - b, 0.0), axis=-1)


def compare(a: Scored, b: Scored) -> Comparison:
    """A against B (each `score`d with keep_distributions, over the same positions)."""
    if a.logprobs is None or b.logprobs is None:
        raise InputError("compare needs both readings' distributions (score with keep_distributions=True)")
    if not np.array_equal(a.positions, b.positions):
        raise InputError(f"the two readings scored different positions ({len(a.positions)} and {len(b.positions)})")
    kl = kl_divergence(a.logprobs, b.logprobs)
    agree = float(np.mean(np.argmax(a.logprobs, -1) == np.argmax(b.logprobs, -1)))
    diff = next((i for i, (x, y) in enumerate(zip(a.greedy, b.greedy)) if x != y), None)
    if diff is None and len(a.greedy) != len(b.greedy):
        diff = min(len(a.greedy), len(b.greedy))
    return Comparison(a, b, float(np.mean(kl)), float(np.max(kl)), agree, diff is None, diff)


def _hit_rate(s: Scored) -> str:
    return f"{s.cache_stats['hit_rate']:.0%}" if s.cache_stats.get("enabled") else "off"


def format_score(name: str, n_tokens: int, s: Scored, context: int, stride: int) -> str:
    return (f"{name}: {n_tokens} tokens, {len(s.positions)} positions scored (context {context}, stride {stride})\n"
            f"perplexity {s.perplexity:.4f} (mean NLL {np.mean(s.nll):.6f} nats); prefix cache hits {_hit_rate(s)}")


def format_comparison(name: str, n_tokens: int, c: Comparison, labels: tuple[str, str], context: int,
                      stride: int) -> str:
    w = max(len(labels[0]), len(labels[1]), 12)
    rows = [f"{name}: {n_tokens} tokens, {len(c.a.positions)} positions scored (context {context}, stride {stride})",
            f"{'':24}{'A':<{w}}  B", f"{'configuration':24}{labels[0]:<{w}}  {labels[1]}",
            f"{'perplexity':24}{c.a.perplexity:<{w}.4f}  {c.b.perplexity:.4f}",
            f"{'prefix cache hits':24}{_hit_rate(c.a):<{w}}  {_hit_rate(c.b)}",
            f"KL(A || B) per position: mean {c.kl_mean:.3g} nats, max {c.kl_max:.3g} nats; "
            f"top-1 agreement {c.top1_agreement:.1%}",
            f"greedy {len(c.a.greedy)} tokens: " + ("identical" if c.greedy_identical
                                                    else f"differ from token {c.first_greedy_difference}")]
    return "\n".join(rows)


def parse_options(text: str | None) -> dict:
    """A configuration: LLM keyword options as a JSON object ('{"enable_prefix_caching": true}')."""
    if not text:
        return {}
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"a configuration must be a JSON object of LLM options: {e}") from None
    if not isinstance(d, dict):
        raise InputError(f"a configuration must be a JSON object of LLM options; got {text!r}")
    return d
