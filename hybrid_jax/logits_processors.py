"""vLLM's logits processors, on the device, as runtime inputs: logit_bias, min_tokens, the repetition,
frequency and presence penalties (applied to the logits before sampling, greedy rows too) and min_p
(applied after temperature, in `sampling.sample`).

Order, as vLLM v1's sampler: min_tokens (the request's stop ids and EOS masked to -inf while fewer than
min_tokens tokens were generated) and logit_bias (added), then the penalties: repetition (a token of
the prompt or of the output: logit / r where the logit is > 0, logit * r otherwise), frequency (minus
f x the token's count in the output) and presence (minus p once it occurs in the output); then the
sampler: greedy rows take the argmax, random rows divide by the temperature, drop tokens whose
probability is under min_p x the most likely's, then top-k / top-p. Log-probabilities stay the
model's own distribution (vLLM's default `logprobs_mode`, "raw_logprobs").

State on the device (`ProcState`, one row per cache row: `max_num_seqs` + the null row), seeded when
a request with processors is placed in a row (`seed_row`: the prompt and the outputs so far, in
chunks of SEED_WIDTH ids, one fixed-shape program) and updated inside every step with the tokens
each row samples (`note_tokens`). Memory: one int32 per (row, vocabulary entry) holds both what the
penalties need: the low 24 bits count the token in the request's output, bit 24 says it is in its
prompt (repetition reads "either": the word != 0). At 151,936 entries and 257 rows that is 156 MB;
counts saturate nowhere below 2^24 tokens. A row without processors is never seeded nor counted
(`on` false), and its stale state is never read: every read goes through `on`.

`RowState` (`slot_last` in the runner) bundles this with each row's last sampled token, the state the
steps carry beside the pools.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

COUNT_BITS = 24
COUNT_MASK = (1 << COUNT_BITS) - 1
IN_PROMPT = 1 << COUNT_BITS
SEED_WIDTH = 512            # token ids one call of the seeding program takes


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("counts", "presence", "frequency", "repetition", "min_p", "min_tokens", "bias_ids",
                                "bias_vals", "stop_ids"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class ProcState:
    """Per row (leading axis R): counts [R, V] int32 (output count | IN_PROMPT), presence, frequency,
    repetition, min_p [R] f32, min_tokens [R] int32, bias_ids [R, NB] int32 (-1 padded), bias_vals
    [R, NB] f32, stop_ids [R, S] int32 (-1 padded: what min_tokens masks)."""
    counts: Any
    presence: Any
    frequency: Any
    repetition: Any
    min_p: Any
    min_tokens: Any
    bias_ids: Any
    bias_vals: Any
    stop_ids: Any

    @staticmethod
    def empty(rows: int, vocab: int, n_bias: int, n_stop: int) -> "ProcState":
        f = functools.partial(jnp.zeros, (rows,), jnp.float32)
        return ProcState(counts=jnp.zeros((rows, vocab), jnp.int32), presence=f(), frequency=f(),
                         repetition=jnp.ones((rows,), jnp.float32), min_p=f(), min_tokens=jnp.zeros((rows,), jnp.int32),
                         bias_ids=jnp.full((rows, n_bias), -1, jnp.int32),
                         bias_vals=jnp.zeros((rows, n_bias), jnp.float32),
                         stop_ids=jnp.full((rows, n_stop), -1, jnp.int32))

    def take(self, rows) -> "ProcState":
        """The state of rows [B] (a gather of every field)."""
        return jax.tree_util.tree_map(lambda a: a[rows], self)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("last", "procs", "allowed"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class RowState:
    """What the steps carry per cache row beside the pools: last [R] int32, each row's last sampled
    token (a row whose token is still in flight is fed from it), the processors' `ProcState`, and
    allowed [R, W] int32, each row's structured-output bitmask (hybrid_jax/structured/bitmask.py)."""
    last: Any
    procs: ProcState
    allowed: Any


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("row", "first", "ids", "in_prompt", "presence", "frequency", "repetition", "min_p",
                                "min_tokens", "bias_ids", "bias_vals", "stop_ids"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Seed:
    """One call of the seeding program: row (scalar int32); first (scalar bool: the row starts over and
    takes the coefficients); ids [SEED_WIDTH] int32 (-1 padded) of the request's tokens, in_prompt
    [SEED_WIDTH] bool (prompt token, else output token); the request's coefficients (scalars), bias
    ids / values [NB] and stop ids [S] as in ProcState."""
    row: Any
    first: Any
    ids: Any
    in_prompt: Any
    presence: Any
    frequency: Any
    repetition: Any
    min_p: Any
    min_tokens: Any
    bias_ids: Any
    bias_vals: Any
    stop_ids: Any


def seeds(row: int, prompt: list[int], output: list[int], params, stop_ids: np.ndarray, n_bias: int) -> list[Seed]:
    """The seeding calls (numpy) for a request placed in `row` with tokens prompt + output so far and
    sampling parameters `params` (SamplingParams); stop_ids [S], -1 padded: the ids its min_tokens holds
    back, every one of its stop ids and EOS unless ignore_eos (`StepInputs.held_ids`)."""
    bias_ids, bias_vals = np.full((n_bias,), -1, np.int32), np.zeros((n_bias,), np.float32)
    for i, (t, v) in enumerate(sorted((params.logit_bias or {}).items())):
        bias_ids[i], bias_vals[i] = t, v
    ids = np.asarray(list(prompt) + list(output), np.int32)
    flag = np.arange(len(ids)) < len(prompt)
    out = []
    for start in range(0, max(len(ids), 1), SEED_WIDTH):
        chunk, pr = np.full((SEED_WIDTH,), -1, np.int32), np.zeros((SEED_WIDTH,), bool)
        n = min(SEED_WIDTH, len(ids) - start)
        chunk[:n], pr[:n] = ids[start:start + n], flag[start:start + n]
        out.append(Seed(row=np.int32(row), first=np.bool_(start == 0), ids=chunk, in_prompt=pr,
                        presence=np.float32(params.presence_penalty), frequency=np.float32(params.frequency_penalty),
                        repetition=np.float32(params.repetition_penalty), min_p=np.float32(params.min_p),
                        min_tokens=np.int32(params.min_tokens), bias_ids=bias_ids, bias_vals=bias_vals,
                        stop_ids=np.asarray(stop_ids, np.int32)))
    return out


def seed_row(state: RowState, s: Seed) -> RowState:
    """The seeding program's body: row s.row starts over (s.first: zero counts, the coefficients
    written), then its counts take s.ids (prompt ids set IN_PROMPT, output ids add 1 each)."""
    p = state.procs
    V = p.counts.shape[1]
    ids = jnp.where(s.ids >= 0, s.ids, V)                       # padding: out of range, dropped
    prompt = jnp.zeros((V,), bool).at[jnp.where(s.in_prompt, ids, V)].set(True, mode="drop")
    output = jnp.zeros((V,), jnp.int32).at[jnp.where(s.in_prompt, V, ids)].add(1, mode="drop")
    row = jnp.where(s.first, 0, p.counts[s.row])
    row = (row | jnp.where(prompt, IN_PROMPT, 0)) + output

    def put(a, v):
        return a.at[s.row].set(jnp.where(s.first, v, a[s.row]))
    p = ProcState(counts=p.counts.at[s.row].set(row), presence=put(p.presence, s.presence),
                  frequency=put(p.frequency, s.frequency), repetition=put(p.repetition, s.repetition),
                  min_p=put(p.min_p, s.min_p), min_tokens=put(p.min_tokens, s.min_tokens),
                  bias_ids=put(p.bias_ids, s.bias_ids), bias_vals=put(p.bias_vals, s.bias_vals),
                  stop_ids=put(p.stop_ids, s.stop_ids))
    return dataclasses.replace(state, procs=p)


def apply_processors(logits, p: ProcState, steps):
    """The processors before sampling (min_tokens, logit_bias, repetition, frequency, presence) on
    logits [B, V] f32 with the rows' state p (B rows, `ProcState.take`); steps [B] int32: tokens each
    row generated before the one sampled now."""
    B, V = logits.shape
    b = jnp.arange(B)[:, None]
    ban = (steps < p.min_tokens)[:, None] & (p.stop_ids >= 0)
    x = logits.at[b, jnp.where(ban, p.stop_ids, V)].set(-jnp.inf, mode="drop")
    x = x.at[b, jnp.where(p.bias_ids >= 0, p.bias_ids, V)].add(p.bias_vals, mode="drop")
    count = p.counts & COUNT_MASK
    r = p.repetition[:, None]
    x = jnp.where(p.counts != 0, jnp.where(x > 0, x / r, x * r), x)
    return x - p.frequency[:, None] * count.astype(jnp.float32) - p.presence[:, None] * (count > 0)


def processed(logits, state: RowState, rows, on, steps):
    """`apply_processors` for the rows flagged in on [B] (the others' logits untouched), run only when
    a row of the batch has processors (a runtime cond: a batch without any costs nothing)."""
    def run(x):
        return jnp.where(on[:, None], apply_processors(x, state.procs.take(rows), steps), x)
    return jax.lax.cond(jnp.any(on), run, lambda x: x, logits)


def row_min_p(state: RowState, rows, on):
    """[B] f32: each row's min_p (0 for rows without processors)."""
    return jnp.where(on, state.procs.min_p[rows], 0.0)


def note_tokens(state: RowState, rows, on, tok) -> RowState:
    """The rows' new tokens tok [B] (-1: none) written in: `last` for every row, the output counts of
    the rows with processors (on [B])."""
    last = state.last.at[rows].set(jnp.where(tok >= 0, tok, state.last[rows]))
    R = state.last.shape[0]
    counts = state.procs.counts.at[jnp.where(on & (tok >= 0), rows, R), jnp.maximum(tok, 0)].add(1, mode="drop")
    return dataclasses.replace(state, last=last, procs=dataclasses.replace(state.procs, counts=counts))


def apply_min_p(x, min_p):
    """Drops (-inf) tokens of x [B, V] (logits after temperature) whose probability is under min_p [B]
    x the row's most likely token's."""
    probs = jax.nn.softmax(x, axis=-1)
    top = jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < min_p[:, None] * top, -jnp.inf, x)
