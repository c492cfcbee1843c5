"""The one plain decode iteration every on-device decode loop runs, and the max_tokens budget rule.

A decode iteration has two halves, each written once here:

  emit   one token per row from the logits (`draw(logits, i)`: the row's sampler at RNG step i),
         -1 for a row already done, recorded with its logprobs; a row is done once it samples one
         of its stop ids or the last token its budget allows (`allowed_tokens`)
  feed   one forward of each row's token [B] (n_new 1 for a running row, 0 for a done one), the
         caller's: `feed(carry, tokens [B], n_new [B]) -> (logits [B, V], carry)`

Two loop shapes put them together:

  `decode_tokens`       feed, then emit: the engine's decode step (engine/steps.py). The program
                        holds one forward (tests/hybrid_jax/test_parallel.py counts its collectives)
  `decode_from_logits`  emit, then feed, from the logits of a forward already run, the last token
                        emitted after the loop (peeled, so no cache sits inside a conditional): the
                        plain decode chunks of the speculative loops (speculative/verify.py)

Either way the last token sampled is not fed: it stays pending, the next step's first input.

The max_tokens budget has one rule, `allowed_tokens(want, remaining)`: of `want` tokens a row may
emit min(want, remaining), never fewer than 0, where remaining = max_tokens - tokens sampled so far.
The scheduler's count of a decode step's tokens and the runner's decode inputs (`decode_count`), the
decode loops here, the n-gram device loop and the draft lengths of a verify (`allowed_drafts`: a
verify of k drafts emits up to k + 1 tokens) all apply it. Each function takes numpy (host) or
jax.numpy (device) values, `xp` naming which.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.generate import bucket


def allowed_tokens(want, remaining, xp=np):
    """Tokens a row may emit of `want` under its budget: min(want, remaining), at least 0.
    remaining: max_tokens - tokens sampled so far. Elementwise; xp is np (host) or jnp (device)."""
    return xp.maximum(xp.minimum(want, remaining), 0)


def decode_count(steps, remaining, cap=None, xp=np):
    """Tokens a decode step of `steps` iterations samples for a row unless a stop id ends it sooner:
    allowed_tokens(steps, remaining), and at most cap (the row's publish cap; None: none). The
    scheduler counts a step's tokens ahead with it, and the runner sends the decode step each row's
    budget from the same rule (`decode_budget`), so host and device apply one number."""
    return allowed_tokens(steps, decode_budget(remaining, cap, xp), xp)


def steps_to_end(remaining) -> int:
    """The iterations of an offline decode call that takes every row to its end: bucket(the largest
    remaining max_tokens [n], 16), a short ladder of widths (each a compiled program)."""
    return bucket(int(max(remaining)), 16)


def decode_budget(remaining, cap=None, xp=np):
    """A row's budget for a decode step: remaining, and at most cap (None: no cap)."""
    return remaining if cap is None else xp.minimum(remaining, cap)


def allowed_drafts(k, remaining, xp=np):
    """Drafts a row may verify of `k`: a verify of k drafts emits up to k + 1 tokens, so
    allowed_tokens(k + 1, remaining) - 1, at least 0."""
    return xp.maximum(allowed_tokens(k + 1, remaining, xp) - 1, 0)


def emit(i, logits, out, lps, done, draw: Callable, stop_ids, limit):
    """Iteration i's tokens: new [B] (-1 for a row already done) written to out[:, i] (and the
    logprobs draw returns to lps[k][:, i]); a row is done after a stop id or its limit-th token.
    Returns (new, out, lps, done)."""
    new, lp = draw(logits, i)
    new = jnp.where(done, -1, new)
    out = out.at[:, i].set(new)
    lps = tuple(a.at[:, i].set(b) for a, b in zip(lps, lp))
    done = done | jnp.any(new[:, None] == stop_ids, axis=-1) | (i + 1 >= limit)
    return new, out, lps, done


def fed(tok, done):
    """What a row feeds (a done row a placeholder with n_new 0): (tokens [B] int32, n_new [B] int32)."""
    return jnp.maximum(tok, 0), (~done).astype(jnp.int32)


def decode_tokens(feed: Callable, draw: Callable, carry, tok, running, remaining, stop_ids, lps=(), *, steps: int,
                  note: Callable | None = None):
    """Up to `steps` iterations of feed-then-emit from tok [B] int32 (each row's pending token): a
    running row samples up to allowed_tokens(steps, remaining [B]) tokens, fewer after a stop id.
    running [B] bool; stop_ids [B, S] int32 (-1 padded); draw(logits, i, carry) -> (tokens [B],
    logprobs tuple of [B, ...]); note(carry, tokens [B]) -> carry, after each emit (the tokens, -1 for
    a row done; None: nothing); lps: buffers [B, steps, ...] the logprobs go to (() for none).
    Returns (tokens [B, steps] int32, -1 past a row's end; lps; carry)."""
    B = tok.shape[0]
    limit = allowed_tokens(steps, remaining, jnp)
    out = jnp.full((B, steps), -1, jnp.int32)

    def body(state):
        j, tok, done, carry, out, lps = state
        logits, carry = feed(carry, *fed(tok, done))
        new, out, lps, done = emit(j, logits, out, lps, done, lambda x, i: draw(x, i, carry), stop_ids, limit)
        return j + 1, new, done, carry if note is None else note(carry, new), out, lps

    def cond(state):
        return (state[0] < steps) & jnp.any(~state[2])

    state = (jnp.int32(0), tok, ~running | (limit <= 0), carry, out, tuple(lps))
    _, _, _, carry, out, lps = jax.lax.while_loop(cond, body, state)
    return out, lps, carry


def decode_from_logits(feed: Callable, draw: Callable, carry, logits, running, remaining, n_steps, stop_ids, *,
                       steps: int):
    """Up to n_steps (an int32 scalar <= the static buffer size `steps`) iterations of emit-then-feed
    from logits [B, V] (the forward that fed each row's pending token): a running row samples up to
    allowed_tokens(n_steps, remaining [B]) tokens, fewer after a stop id (n_steps 0: the loop does not
    run and the tokens returned are meaningless). Other arguments as `decode_tokens`.
    Returns (tokens [B, steps] int32, -1 once a row stopped and past n_steps, carry)."""
    B = logits.shape[0]
    limit = allowed_tokens(n_steps, remaining, jnp)
    out = jnp.full((B, steps), -1, jnp.int32)

    def body(state):
        i, logits, carry, out, done = state
        new, out, _, done = emit(i, logits, out, (), done, draw, stop_ids, limit)
        logits, carry = feed(carry, *fed(new, done))
        return i + 1, logits, carry, out, done

    def cond(state):
        i, _, _, _, done = state
        return (i + 1 < jnp.minimum(n_steps, steps)) & ~jnp.all(done)

    # The last token is emitted after the loop and not fed: it stays pending (it opens the next verify
    # window). Peeling it off, rather than a lax.cond around the forward, keeps the cache out of a
    # conditional, which cost XLA:CPU ~30% per step at batch 8 (buffer copies).
    done = ~running | (remaining <= 0)
    i, logits, carry, out, done = jax.lax.while_loop(cond, body, (jnp.int32(0), logits, carry, out, done))
    _, out, _, _ = emit(i, logits, out, (), done, draw, stop_ids, limit)
    return out, carry
