"""The engine's step bodies, each defined once over a static `StepContext` (engine/compile.py jits them).

A step receives its rows (`StepRows`: cache rows, block tables, lengths, sampling parameters) from
the host, opens the rows' view of the pools (`open_view`), runs the model, samples on device and
writes the rows back (`close_view`), the pools donated:

  mixed step   [Bb, T] tokens: prefill chunks and decodes together, one sample per row at most
  ragged step  the mixed step over a flat token-major batch (models.ragged.RaggedBatch)
  decode step  [Bb] last tokens: `decode_steps` iterations (`hybrid_jax.decode_loop.decode_tokens`,
               the one decode iteration), stop ids and max-token limits checked on device
  verify step  [Bb, K+1] tokens: speculative drafts checked in one forward, rejected ones rolled back
  loop step    offline n-gram speculation, `speculative.device_loop.ngram_generate` over the rows

The drafter (engine/drafter.py) rides along in every padded step: each calls its take / advance /
put (a verify also its draft), whichever drafter it is. The mixed and decode steps carry `last`, the
runner's `slot_last` (a `logits_processors.RowState` per cache row on the device): they write every
row's last sampled token into it (a row whose last token is still on the device, `from_dev`, is fed
from there), apply the logits processors of the rows that have them before sampling and count the
tokens those rows sample (hybrid_jax/logits_processors.py).

`hybrid-jax plan` compiles these same bodies (hybrid_jax/plan/compile.py): its prefill chunk is
`chunk_forward`, the model part of the mixed step; its decode step `decode_forward`, one decode
iteration's model part (the view opened in place, one forward, the view closed).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cache.pools import put_view, take_view
from hybrid_jax.decode_loop import decode_tokens
from hybrid_jax.engine.drafter import Drafter
from hybrid_jax.engine.prompt_logprobs import score_positions
from hybrid_jax.engine.step_inputs import StepRows
from hybrid_jax.logits_processors import RowState, note_tokens, processed, row_min_p
from hybrid_jax.sampling import FULL_SAMPLER, sample, token_logprobs
from hybrid_jax.speculative.device_loop import ngram_generate
from hybrid_jax.structured.bitmask import apply_allowed
from hybrid_jax.speculative.verify import replay_verified, select_verified


@dataclasses.dataclass(frozen=True, eq=False)
class StepContext:
    """What a compiled step closes over (static): the family (ModelFamily) and its config, the
    kernels' implementation, the layout (parallel.Layout, None on one device), the pools' shardings on
    it (None: the layout's own for the pools given), the drafter."""
    model: Any
    cfg: Any
    impl: str = "auto"
    layout: Any = None
    pool_shardings: Any = None
    drafter: Drafter = dataclasses.field(default_factory=Drafter)

    def pin(self, view):
        """A step's view of the pools (or a forward's output cache) pinned to the pools' layout on a
        mesh: inside a step's loop too, the partitioner keeps every pool as it is stored (left free, it
        may split a replicated KV pool the way the attention reads it, and gather it back whole at the
        step's end)."""
        return view if self.layout is None else self.layout.pin(view)

    def pin_rows(self, last: RowState) -> RowState:
        """The rows' state (`last`) held replicated on a mesh, as the runner places it: a step's output
        otherwise takes whatever layout the partitioner picks (the penalty counts split like the
        vocabulary), and the next step's compiled program, built for the state as placed, refuses it."""
        return last if self.layout is None else jax.lax.with_sharding_constraint(last, self.layout.replicated)

    def pin_pools(self, pools):
        """The pools held to their shardings on a mesh (so the donated buffers are reused step after
        step instead of the partitioner choosing another layout for the output)."""
        if self.layout is None:
            return pools
        if self.pool_shardings is None:
            return self.layout.pin(pools)
        return jax.lax.with_sharding_constraint(pools, self.pool_shardings)


def open_view(pools, r: StepRows, reset=None, in_place: bool = False):
    """The cache the rows' forward reads (`cache.pools.take_view`): rows flagged in reset [Bb] start
    empty; in_place lends the groups' in-place row fields whole (the decode step)."""
    return take_view(pools, r.rows, r.tables, r.lengths, reset, in_place=in_place)


def close_view(ctx: StepContext, pools, rows, view):
    """The pools with the rows' view written back (`cache.pools.put_view`), pinned on a mesh."""
    return ctx.pin_pools(put_view(pools, rows, view))


def forward(ctx: StepContext, params, view, tokens, n_new, **kw):
    """The target's forward of tokens [Bb, T] (row b's first n_new[b] real): a StepOutput, its
    `hidden` asked for when the drafter reads it."""
    out = ctx.model.forward(ctx.cfg, params, ctx.pin(view), tokens, n_new, impl=ctx.impl,
                            return_hidden=ctx.drafter.return_hidden, **kw)
    return out.replace(cache=ctx.pin(out.cache))


def chunk_forward(ctx: StepContext, params, pools, r: StepRows, tokens, n_new, reset, **kw):
    """The model part of a padded mixed step: the rows' view (reset rows start empty), one forward of
    tokens [Bb, T] (kw: the forward's options), the rows written back. Returns (the StepOutput, pools)."""
    out = forward(ctx, params, open_view(pools, r, reset), tokens, n_new, **kw)
    return out, close_view(ctx, pools, r.rows, out.cache)


def decode_forward(ctx: StepContext, params, pools, r: StepRows, tokens, n_new):
    """One decode iteration's model part alone: the rows' view in place, one forward of tokens [Bb],
    the rows written back. Returns (logits [Bb, V], pools)."""
    out = forward(ctx, params, open_view(pools, r, in_place=True), tokens[:, None], n_new)
    return out.logits, close_view(ctx, pools, r.rows, out.cache)


def draw_tokens(logits, r: StepRows, flags, offset=None, min_p=None):
    """One token per row [Bb] from logits [Bb, V] with the rows' sampling parameters, at RNG index
    r.steps (+ offset: the iteration of a decode loop); min_p [Bb] (None: none)."""
    keys = jax.vmap(jax.random.key)(r.seeds)
    steps = r.steps if offset is None else r.steps + offset
    return sample(logits, keys, steps, r.temperature, r.top_k, r.top_p, flags, min_p)


def sample_rows(logits, r: StepRows, flags, top_n: int, offset=None, state: RowState | None = None):
    """`draw_tokens` and their logprob triples ([Bb], [Bb, top_n] x 2) of the model's logits; with the
    rows' `state`, the tokens are drawn from the logits its processors made (rows with `r.procs`) and
    within each masked row's grammar (`r.masked`). The logprobs stay the model's own distribution."""
    x, min_p = logits, None
    if state is not None:
        steps = r.steps if offset is None else r.steps + offset
        x, min_p = processed(logits, state, r.rows, r.procs, steps), row_min_p(state, r.rows, r.procs)
        if r.masked is not None:          # structured outputs: tokens outside a row's grammar are dropped
            x = apply_allowed(x, state.allowed, r.rows, r.masked)
    tok = draw_tokens(x, r, flags, offset, min_p)
    return tok, token_logprobs(logits, tok, top_n, r.logprobs)


def noted(last: RowState, r: StepRows, tok) -> RowState:
    """`last` with each row's new token tok [Bb] (-1: the row sampled none) written in (and counted for
    the rows with processors)."""
    return note_tokens(last, r.rows, r.procs, tok)


def mixed_step(ctx: StepContext):
    def mixed(params, cache, last, r: StepRows, reset, tokens, n_new, do_sample, dparams=None, dcache=None, *,
              flags, top_n, targets, prompt_n):
        """tokens [Bb, T] (row b's first n_new[b] real; a row fed from the device gets its first from
        `last`); reset [Bb]: rows that start empty; do_sample [Bb]: rows that sample a token; targets
        [Bb, T]: the prompt token each position scores, -1 none (engine/prompt_logprobs.py). Returns
        (tokens [Bb], -1 for a row that samples none; logprob triples; pools; drafter state; last;
        prompt scores [Bb * T], [Bb * T, prompt_n] x 2)."""
        tokens = tokens.at[:, 0].set(jnp.where(r.from_dev, last.last[r.rows], tokens[:, 0]))
        out, cache = chunk_forward(ctx, params, cache, r, tokens, n_new, reset, return_final_hidden=True)
        tok, lps = sample_rows(out.logits, r, flags, top_n, state=last)
        tok = jnp.where(do_sample, tok, -1)
        d = ctx.drafter
        dsub = d.advance(params, dparams, d.take(dcache, r.rows, reset, r.fresh), out, tokens, n_new, r.fresh)
        plp = score_positions(ctx.model, ctx.cfg, params, out.final_hidden, targets, prompt_n)
        return tok, lps, cache, d.put(dcache, r.rows, dsub), ctx.pin_rows(noted(last, r, tok)), plp
    return mixed


def ragged_step(ctx: StepContext):
    def ragged(params, cache, last, r: StepRows, reset, batch, do_sample, *, flags, top_n, targets, prompt_n):
        """`mixed_step` over a ragged batch (models.ragged.RaggedBatch of the step's S rows; targets [N]);
        no drafter."""
        first = batch.cu_seqlens[:-1]            # each row's first token (a row fed from the device has one)
        fed = jnp.where(r.from_dev, last.last[r.rows], batch.tokens[jnp.minimum(first, batch.tokens.shape[0] - 1)])
        batch = batch.replace(tokens=batch.tokens.at[first].set(fed, mode="drop"))
        sub = open_view(cache, r, reset)
        out = ctx.model.forward_ragged(ctx.cfg, params, ctx.pin(sub), batch, impl=ctx.impl, return_final_hidden=True)
        tok, lps = sample_rows(out.logits, r, flags, top_n, state=last)
        tok = jnp.where(do_sample, tok, -1)
        plp = score_positions(ctx.model, ctx.cfg, params, out.final_hidden, targets, prompt_n)
        return tok, lps, close_view(ctx, cache, r.rows, out.cache), ctx.pin_rows(noted(last, r, tok)), plp
    return ragged


def decode_step(ctx: StepContext):
    def decode(params, cache, last, r: StepRows, last_tok, active, stop_ids, remaining, dparams=None, dcache=None,
               *, steps, flags, top_n):
        """Up to `steps` decode iterations from last_tok [Bb] (a row fed from the device: from `last`);
        active [Bb]: real rows; stop_ids [Bb, S] (-1 padded); remaining [Bb]: tokens each may still
        sample. Returns (tokens [Bb, steps], -1 past a row's end; logprob triples [Bb, steps], [Bb,
        steps, top_n] x 2; pools; drafter state; last)."""
        d = ctx.drafter
        last_tok = jnp.where(r.from_dev, last.last[r.rows], last_tok)
        # in place: each layer reads and writes its rows of the recurrent pools once per token
        sub = open_view(cache, r, in_place=True)

        def feed(carry, tok, n):
            sub, dsub, st = carry
            o = forward(ctx, params, sub, tok[:, None], n)
            return o.logits, (o.cache, d.advance(params, dparams, dsub, o, tok[:, None], n), st)

        def draw(logits, j, carry):      # the processors see the tokens of the iterations before j
            return sample_rows(logits, r, flags, top_n, j, state=carry[2])

        def note(carry, tok):
            return carry[:2] + (noted(carry[2], r, tok),)

        Bb = last_tok.shape[0]
        lps = (jnp.zeros((Bb, steps), jnp.float32), jnp.zeros((Bb, steps, top_n), jnp.float32),
               jnp.zeros((Bb, steps, top_n), jnp.int32))
        out, lps, (sub, dsub, last) = decode_tokens(feed, draw, (sub, d.take(dcache, r.rows), last), last_tok, active,
                                                    remaining, stop_ids, lps, steps=steps, note=note)
        return out, lps, close_view(ctx, cache, r.rows, sub), d.put(dcache, r.rows, dsub), ctx.pin_rows(last)
    return decode


def verify_step(ctx: StepContext):
    def verify(params, cache, r: StepRows, tokens, meta, allowed, dparams=None, dcache=None, *, flags, replay,
               given=None):
        """Speculative verify of tokens [Bb, K+1] = [pending, d_1 .. d_K] per row in ONE forward (a
        drafter on the device writes the drafts first); meta [2, Bb] = (n_fed = 1 + n_draft, 0 for
        padding rows; n_draft); allowed [Bb, K+1, W] int32: the structured-output bitmask of each
        position of the rows flagged in r.masked (drafts checked against the grammar on the host, the
        target held to it here). Rejected tokens are rolled back by selection of the recurrent state
        after the last kept token, or (replay) by running the kept tokens from the pre-verify rows
        again; the rows' versions change when anything was rejected. The drafter then takes the kept
        tokens from where it was. given [Bb, K, V] f32: the drafts are in `tokens` already, drawn by the
        drafter on the device from these distributions (`draft_step`: read back first, so a grammar could
        cut them); None: the drafter drafts here. Returns (n_accepted [Bb], tokens [Bb, K+1]: the first
        n_accepted + 1 are emitted; pools; drafter state)."""
        d = ctx.drafter
        sub = open_view(cache, r)   # the snapshot, for replay (never donated)
        n_fed, n_draft = meta[0], meta[1]
        dsub = d.take(dcache, r.rows)
        if given is None:
            tokens, draft_probs = d.draft(params, dparams, dsub, r, tokens, (n_fed > 0).astype(jnp.int32), flags)
        else:
            draft_probs = given
        verified = replay_verified if replay else select_verified
        v = verified(params, sub, tokens, jnp.stack([n_fed, n_draft, r.steps]), draft_probs, r.seeds,
                     r.temperature, r.top_k, r.top_p, ctx.cfg, ctx.impl, flags, return_hidden=d.return_hidden,
                     allowed=allowed, masked=r.masked)
        n_keep = jnp.where(n_fed > 0, 1 + v.n_accepted, 0).astype(jnp.int32)
        dcache = d.put(dcache, r.rows, d.advance(params, dparams, dsub, v, tokens, n_keep))
        return v.n_accepted, v.tokens, close_view(ctx, cache, r.rows, v.cache), dcache
    return verify


def draft_step(ctx: StepContext):
    def draft(params, r: StepRows, tokens, meta, dparams=None, dcache=None, *, flags):
        """The drafts a verify of tokens [Bb, K+1] (meta as `verify_step`'s) would draw on the device, drawn
        alone so the host can read them before the verify (a structured output's grammar cuts a masked
        row's draft to what it allows, and fills each position's mask): (tokens [Bb, K+1] with the drafts,
        their distributions [Bb, K, V]). The drafter's state is read, not changed (its draft runs on a
        scratch copy, as in the verify)."""
        d = ctx.drafter
        return d.draft(params, dparams, d.take(dcache, r.rows), r, tokens, (meta[0] > 0).astype(jnp.int32), flags)
    return draft


def loop_step(ctx: StepContext):
    def loop(params, cache, r: StepRows, hist, first, rows, tune, stop_ids, *, lc):
        """`speculative.device_loop.ngram_generate` over the rows' view of the pools. Returns (tokens
        [Bb, N + W], n_out [Bb], log [4, N, Bb], branch [N], pools)."""
        sub = open_view(cache, r)
        out, n_out, _, log, branch, sub = ngram_generate(
            params, sub, hist, first, rows, tune, stop_ids, r.seeds, r.temperature, r.top_k, r.top_p,
            cfg=ctx.cfg, impl=ctx.impl, flags=FULL_SAMPLER, lc=lc)
        return out, n_out, log, branch, close_view(ctx, cache, r.rows, sub)
    return loop
