"""The target model's speculative steps, traced inside the engine runner's verify step and the
on-device n-gram loop (one body each, whoever calls it):

  select_verified  [pending, drafts] in ONE forward, acceptance, and rollback by selection of the
                   recurrent state after the last kept token (rebuilt from the per-token updates
                   the forward emits), all on device
  replay_verified  the same forward and acceptance; rollback by running the kept tokens again from
                   the pre-verify cache (the snapshot, which the forward never wrote)
  decode_chunk     up to `steps` plain decode steps in an on-device loop: what the n-gram loop runs
                   when no row speculates (dynamic K chose 0), so it costs what plain decoding costs

Verify and replay run the linear-attention layers with the token-level (fused recurrent) kernel,
numerically the same recurrence a decode step runs, so greedy output matches plain decoding.
Shapes: B rows (bucketed), T = K + 1 fed positions (K a draft-length bucket), V vocabulary.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from hybrid_jax.decode_loop import decode_from_logits
from hybrid_jax.models import get_model
from hybrid_jax.models.contract import StepOutput
from hybrid_jax.sampling import SamplerFlags, sample
from hybrid_jax.speculative.acceptance import accept
from hybrid_jax.speculative.rollback import finish_replay, rollback_by_selection
from hybrid_jax.structured.bitmask import apply_allowed


STATIC = ("cfg", "impl", "flags")


@flax.struct.dataclass
class Verified:
    """What a verify step returns (a pytree). n_accepted [B] int32; tokens [B, K+1] int32 (the first
    n_accepted + 1 are emitted); cache: holding exactly the kept tokens; hidden: with return_hidden, the
    forward's residual streams (L + 1 arrays [B, K+1, Hd]; an MTP drafter reads them); deferred: with
    defer_kv_write, the KV entries the forward did not write (the family's `write_deferred_kv`)."""
    n_accepted: jax.Array
    tokens: jax.Array
    cache: Any
    hidden: list | None = None
    deferred: dict | None = None


def _fwd(cfg, impl, params, cache, tokens, n_new, **kw) -> StepOutput:
    return get_model(cfg.model_type).forward(cfg, params, cache, tokens, n_new, impl=impl, **kw)


def _verify(params, cache, tokens, meta, draft_probs, seeds, temperature, top_k, top_p, cfg, impl, flags,
            per_token_states, defer_kv_write: bool = False, return_hidden: bool = False, allowed=None, masked=None):
    """The verify forward and acceptance. allowed [B, K+1, W] int32: each position's structured-output
    bitmask for the rows flagged in masked [B] (None: no row is masked); the target's logits at a
    position are held to it before acceptance, so a draft the grammar refuses is rejected and the
    token drawn in its place is allowed. Returns (n_acc, out_tok, n_fed, n_keep, the forward's
    StepOutput: its cache holds all fed tokens)."""
    n_fed, n_draft, step = meta[0], meta[1], meta[2]
    out = _fwd(cfg, impl, params, cache, tokens, n_fed, logits_at="all", fused_recurrent=True,
               per_token_states=per_token_states, defer_kv_write=defer_kv_write, return_hidden=return_hidden)
    keys = jax.vmap(jax.random.key)(seeds)
    logits = out.logits
    if allowed is not None:
        B, T, V = logits.shape
        flat = apply_allowed(logits.reshape(B * T, V), allowed.reshape(B * T, -1), jnp.arange(B * T),
                             jnp.repeat(masked, T))
        logits = flat.reshape(B, T, V)
    n_acc, out_tok = accept(logits, tokens[:, 1:], draft_probs, n_draft, keys, step, temperature, top_k, top_p,
                            flags)
    n_keep = jnp.where(n_fed > 0, 1 + n_acc, 0).astype(jnp.int32)
    return n_acc, out_tok, n_fed, n_keep, out


def select_verified(params, cache, tokens, meta, draft_probs, seeds, temperature, top_k, top_p, cfg, impl, flags,
                    defer_kv_write: bool = False, return_hidden: bool = False, allowed=None,
                    masked=None) -> Verified:
    """The verify forward, acceptance and rollback by selection. tokens [B, K+1] int32 = [pending,
    d_1 .. d_K] (drafts past n_draft[b] are padding); meta [3, B] int32 = (n_fed: 1 + n_draft for
    running rows, 0 for the others; n_draft; step: tokens generated so far); draft_probs [B, K, V]
    f32 or None; seeds [B] uint32; temperature, top_p [B] f32; top_k [B] int32; allowed [B, K+1, W],
    masked [B]: structured outputs' bitmasks (`_verify`; None: none).
    Returns a Verified (hidden with return_hidden, deferred with defer_kv_write)."""
    n_acc, out_tok, n_fed, n_keep, out = _verify(
        params, cache, tokens, meta, draft_probs, seeds, temperature, top_k, top_p, cfg, impl, flags, True,
        defer_kv_write=defer_kv_write, return_hidden=return_hidden, allowed=allowed, masked=masked)
    return Verified(n_acc, out_tok, rollback_by_selection(out.cache, out.states, cache.lengths, n_fed, n_keep),
                    hidden=out.hidden, deferred=out.deferred)


def replay_verified(params, cache, tokens, meta, draft_probs, seeds, temperature, top_k, top_p, cfg, impl, flags,
                    return_hidden: bool = False, allowed=None, masked=None) -> Verified:
    """The verify forward and acceptance with rollback by snapshot + replay: `cache` (the snapshot,
    never written) runs again over the kept tokens only. Same arguments and result as
    `select_verified`."""
    n_acc, out_tok, n_fed, n_keep, out = _verify(params, cache, tokens, meta, draft_probs, seeds, temperature,
                                                 top_k, top_p, cfg, impl, flags, False, return_hidden=return_hidden,
                                                 allowed=allowed, masked=masked)
    rep = _fwd(cfg, impl, params, cache, tokens, n_keep, fused_recurrent=True).cache
    return Verified(n_acc, out_tok, finish_replay(rep, out.cache.version, n_fed, n_keep), hidden=out.hidden)


@functools.partial(jax.jit, static_argnames=STATIC + ("steps",), donate_argnums=(1,))
def decode_chunk(params, cache, rows, stop_ids, seeds, temperature, top_k, top_p, *, cfg, impl, steps: int,
                 flags: SamplerFlags):
    """Plain decoding on device, up to n_steps (<= the static buffer size `steps`) tokens per row.
    rows [5, B] int32, one host-to-device copy: pending (emitted, not yet in the cache), running
    (0 / 1), step (tokens generated so far), remaining (tokens the row may still emit), n_steps
    (the same in every column); stop_ids [B, S] int32 (-1 padded); seeds, temperature, top_k, top_p [B].
    Returns (tokens [B, steps] with -1 once a row stopped and past n_steps, cache)."""
    pending, running, remaining = rows[0], rows[1] > 0, rows[3]
    done = ~running | (remaining <= 0)
    # The forward of the pending token first, then emit-then-feed iterations (logits carried, the
    # forward last in the body): XLA:CPU runs this form ~10% faster than a forward-first body.
    out = _fwd(cfg, impl, params, cache, pending[:, None], (~done).astype(jnp.int32))
    logits, cache = out.logits, out.cache
    return decode_from(params, cache, logits, rows, stop_ids, seeds, temperature, top_k, top_p, cfg=cfg,
                       impl=impl, steps=steps, flags=flags)


def decode_from(params, cache, logits, rows, stop_ids, seeds, temperature, top_k, top_p, *, cfg, impl, steps: int,
                flags: SamplerFlags):
    """`decode_chunk` after its first forward (the pending token already fed): logits [B, V] f32 are
    its output, the other arguments decode_chunk's. With n_steps = 0 the loop does not run (the
    returned tokens are then meaningless). The iterations are `decode_loop.decode_from_logits`, the
    decode iteration the engine's decode step runs too. Returns (tokens [B, steps], cache)."""
    running, step, remaining, n_steps = rows[1] > 0, rows[2], rows[3], rows[4, 0]
    keys = jax.vmap(jax.random.key)(seeds)

    def feed(cache, tok, n_new):
        o = _fwd(cfg, impl, params, cache, tok[:, None], n_new)
        return o.logits, o.cache

    def draw(logits, i):
        return sample(logits, keys, step + i, temperature, top_k, top_p, flags), ()

    return decode_from_logits(feed, draw, cache, logits, running, remaining, n_steps, stop_ids, steps=steps)
