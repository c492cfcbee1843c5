"""Prompt log-probabilities (SamplingParams.prompt_logprobs, vLLM's): for each prompt token after the
first, its log-probability given the tokens before it and the top n, scored in the prefill chunks the
engine runs anyway.

A chunk of a prompt of P tokens covers positions [a, b): the forward's distribution at position p
scores prompt token p + 1, so the chunk scores tokens a + 1 .. min(b, P - 1); its last position scores
the NEXT chunk's first token, which the host already knows (the whole prompt is), so nothing is
carried between chunks. A step never holds more than [its tokens, V] logits: the family's forward
returns the residual stream at every position (StepOutput.final_hidden) and `score_positions` makes
logits of it inside a `lax.cond` that only runs when some row of the step asks, in the one program
that serves every row (its extra output has a fixed width, LOGPROBS_WIDTH; -1, the whole vocabulary,
offline only, is a program of its own, as sampled logprobs=-1 is).

  score_positions     the device side (a step body calls it): (chosen [M], top values [M, W], top ids [M, W])
  plan_targets        the host side of a step: the token each flat position scores (-1: none), and
                      where each asking row's scores sit (ScoredSpan)
  PromptFlight, landed  a dispatched step's scores, read back with its tokens as PromptScores
  PromptLogprobsBook  the entries of every asking request, by prompt position (so a recompute after a
                      preemption overwrites, never duplicates), handed out once, with its first output

A request that asks takes nothing from the prefix cache (engine/prefix_manager.py): a reused prefix
would leave its tokens unscored.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.engine.request import Request
from hybrid_jax.engine.step_inputs import LOGPROBS_WIDTH
from hybrid_jax.models.common import lm_head
from hybrid_jax.sampling import token_logprobs

SCORE_BLOCK = 512          # positions whose logits [SCORE_BLOCK, V] are made at once (a step's tokens in turn)


def prompt_width(reqs, vocab_size: int) -> int:
    """The static top width of a step's prompt scores: the vocabulary when a request asks for all of it
    (prompt_logprobs=-1), else LOGPROBS_WIDTH (asked or not: one program)."""
    return vocab_size if any(q.params.prompt_logprobs == -1 for q in reqs) else LOGPROBS_WIDTH


def score_positions(model, cfg, params, final_hidden: jax.Array, targets: jax.Array, width: int):
    """Log-probabilities of targets [...] (the token each position scores; -1: none) under the
    distribution at each position, final_hidden [..., Hd] the forward's residual stream there (its
    leading shape is targets'). Computed only when some position is scored; returns flat (chosen [M],
    top values [M, width], top ids [M, width]) over the M = targets.size positions, zeros otherwise.
    The logits are made a block of positions at a time (at most SCORE_BLOCK x V), whatever M."""
    M = targets.size
    blk = math.gcd(M, SCORE_BLOCK)
    h = final_hidden.reshape((M // blk, blk) + final_hidden.shape[targets.ndim:])
    t = targets.reshape(M // blk, blk)

    def block(ht):
        return token_logprobs(lm_head(params, model.final_norm(cfg, params, ht[0])), ht[1], width)

    def scored(h):
        c, v, ids = jax.lax.map(block, (h, t))
        return c.reshape(M), v.reshape(M, width), ids.reshape(M, width)

    def unscored(h):
        return (jnp.zeros((M,), jnp.float32), jnp.zeros((M, width), jnp.float32), jnp.zeros((M, width), jnp.int32))

    return jax.lax.cond(jnp.any(t >= 0), scored, unscored, h)


@dataclasses.dataclass(frozen=True)
class ScoredSpan:
    """One asking row of a step: the flat positions [offset, offset + count) score its prompt tokens
    first .. first + count - 1."""
    request: Request
    first: int
    offset: int
    count: int


def plan_targets(plan_rows, offsets, size: int) -> tuple[np.ndarray, list[ScoredSpan]]:
    """A step's targets [size] int32 (-1 where nothing is scored) and its spans. plan_rows: the
    scheduler's rows (request, num_tokens); offsets[i]: the flat position of row i's first token. A row
    fed from the device (a decode) scores nothing."""
    targets = np.full((size,), -1, np.int32)
    spans = []
    for i, p in enumerate(plan_rows):
        q = p.request
        if q.params.prompt_logprobs is None or q.num_inflight:
            continue
        a, P = q.num_computed, len(q.prompt_ids)
        count = min(a + p.num_tokens, P - 1) - a
        if count <= 0:
            continue
        o = int(offsets[i])
        targets[o:o + count] = q.prompt_ids[a + 1:a + 1 + count]
        spans.append(ScoredSpan(q, a + 1, o, count))
    return targets, spans


@dataclasses.dataclass
class PromptFlight:
    """A dispatched step's prompt scores: its spans and the step's (chosen, values, ids) on the device."""
    spans: list[ScoredSpan]
    scores: tuple


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """One span's scores read back: prompt tokens first .. first + len(chosen) - 1 of `request`."""
    request: Request
    first: int
    chosen: np.ndarray       # [count] f32
    values: np.ndarray       # [count, W] f32, best first
    ids: np.ndarray          # [count, W] int32


def landed(flight: PromptFlight | None) -> list[PromptScores]:
    """A step's prompt scores, read back (nothing to copy when no row asked)."""
    if flight is None or not flight.spans:
        return []
    c, v, ids = (np.asarray(a) for a in flight.scores)
    return [PromptScores(s.request, s.first, c[s.offset:s.offset + s.count], v[s.offset:s.offset + s.count],
                         ids[s.offset:s.offset + s.count]) for s in flight.spans]


class PromptLogprobsBook:
    """Every asking request's prompt entries, by position (None for the first token), until its first
    output takes them (`take`); entries are shaped like `logprobs` ones: {"token_id", "logprob",
    "top": [(id, logprob), ...]} with the top prompt_logprobs (all of the vocabulary for -1)."""

    def __init__(self):
        self._entries: dict[str, list[dict | None]] = {}
        self._requests: dict[str, Request] = {}

    def add(self, q: Request):
        if q.params.prompt_logprobs is not None:
            self._entries[q.request_id] = [None] * len(q.prompt_ids)
            self._requests[q.request_id] = q

    def forget(self, request_id: str):
        self._entries.pop(request_id, None)
        self._requests.pop(request_id, None)

    def note(self, scores: list[PromptScores]):
        """A landed step's scores written in by position (a recompute writes the same positions again)."""
        for s in scores:
            q = s.request
            entries = self._entries.get(q.request_id)
            if entries is None or self._requests.get(q.request_id) is not q:
                continue                    # ended, or its output took the entries already
            n = q.params.prompt_logprobs if q.params.prompt_logprobs >= 0 else s.ids.shape[1]
            for k in range(len(s.chosen)):
                j = s.first + k
                entries[j] = {"token_id": q.prompt_ids[j], "logprob": float(s.chosen[k]),
                              "top": list(zip(s.ids[k, :n].tolist(), s.values[k, :n].tolist()))}

    def take(self, q: Request) -> list[dict | None] | None:
        """The request's entries, once (its first output); None for a request that did not ask or got
        them already. Raises RuntimeError when a prompt token was never scored (a lost chunk)."""
        entries = self._entries.pop(q.request_id, None)
        self._requests.pop(q.request_id, None)
        if entries is None:
            return None
        missing = [j for j in range(1, len(entries)) if entries[j] is None]
        if missing:
            raise RuntimeError(f"prompt_logprobs: prompt tokens {missing[:5]} were never scored")
        return entries
