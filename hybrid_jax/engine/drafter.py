"""The runner's drafter: what speculative decoding keeps on the device beside the pools, as one strategy.

  Drafter      no state on the device: no speculation, or n-gram drafts (proposed on the host by
               engine/speculate.py and sent in the verify step's tokens)
  DraftModel   a smaller model of the same tokenizer with its own cache rows (one per pool row),
               kept in step with the target's rows; it writes the drafts inside the verify step
  MTPDrafter   the target's own multi-token-prediction block (speculative/mtp.py): per row its
               one-layer cache and the target's hidden state at the row's last position

Every compiled step (engine/steps.py) calls the same methods whatever the drafter, so no step asks
which one it has: `take` the step's rows of the state, `advance` them over what the target was fed
(a draft model runs the same tokens; the MTP block reads the target's hidden states, which the
target's forward returns when `return_hidden`), `put` them back; a verify step first has `draft`
write the K drafts from a scratch copy of the rows. A drafter with state steps padded batches only
(`ragged` False: its state advances on the padded [Bb, T] tokens).

On the host: `new_state()` is the state of every pool row (None without one), and `params` the
weights the steps take as an argument beside the target's (a draft model's; None otherwise).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cache import put_rows, take_rows
from hybrid_jax.models import get_model
from hybrid_jax.parallel.context import active
from hybrid_jax.sampling import sample
from hybrid_jax.speculative import mtp
from hybrid_jax.speculative.acceptance import processed_logits
from hybrid_jax.speculative.drafters import DRAFT_SALT


class Drafter:
    """No drafter state on the device: every method leaves the step as it is."""
    return_hidden = False      # the target's forward returns its hidden states (the MTP block reads them)
    ragged = True              # mixed steps may run ragged
    fresh_rows = False         # a mixed step sends which rows start over (StepRows.fresh): the MTP block
    params = None              # weights the steps take beside the target's
    on_device = False          # it writes its drafts on the device (inside the verify, or `draft_step`)

    def new_state(self):
        """The drafter's state of every pool row (a pytree on the device), None without one."""
        return None

    def take(self, state, rows, reset=None, fresh=None):
        """The rows' [Bb] sub-state; reset [Bb] (a draft model) or fresh [Bb] (the MTP block) rows
        come back empty."""
        return None

    def put(self, state, rows, sub):
        """The state with the rows' sub-state written back."""
        return state

    def advance(self, params, dparams, sub, out, tokens, n_new, fresh=None):
        """The sub-state after the target was fed tokens [Bb, T] (row b's first n_new[b] real); out: the
        target's StepOutput or Verified (its `hidden` with return_hidden); fresh: as `take`."""
        return sub

    def draft(self, params, dparams, sub, r, tokens, run, flags):
        """tokens [Bb, K+1] = [pending, d_1 .. d_K] (drafts the host wrote, or none); run [Bb] int32: 1
        for a real row. Returns (tokens with the drafts, draft_probs [Bb, K, V] f32 or None)."""
        return tokens, None


class _OnDevice(Drafter):
    """A drafter that writes its drafts on the device: `draft_step(params, dparams, run)` gives
    step(carry, token [Bb]) -> (logits [Bb, V], carry), started from `draft_carry(sub)`."""
    ragged = False
    on_device = True

    def draft(self, params, dparams, sub, r, tokens, run, flags):
        step = self.draft_step(params, dparams, run)
        drafts, probs = draft_tokens(step, self.draft_carry(sub), r, tokens[:, 0], tokens.shape[1] - 1, flags)
        return tokens.at[:, 1:].set(drafts), probs

    def draft_step(self, params, dparams, run):
        raise NotImplementedError

    def draft_carry(self, sub):
        raise NotImplementedError


class DraftModel(_OnDevice):
    """A draft model (cfg, params its own); its cache holds `rows` rows of `capacity` positions
    (max_model_len plus the scratch drafts). It is never split over a mesh."""

    def __init__(self, cfg, params, dtype, rows: int, capacity: int, impl: str):
        self.cfg, self.params, self.model, self.impl = cfg, params, get_model(cfg.model_type), impl
        self.shape = (rows, capacity, dtype)

    def new_state(self):
        return self.model.new_cache(self.cfg, *self.shape)

    def take(self, state, rows, reset=None, fresh=None):
        return take_rows(state, rows, reset)

    def put(self, state, rows, sub):
        return put_rows(state, rows, sub)

    def forward(self, dparams, sub, tokens, n_new):
        with active(None):        # a draft model is not split: its cache and forward ignore the layout
            return self.model.forward(self.cfg, dparams, sub, tokens, n_new, impl=self.impl)

    def advance(self, params, dparams, sub, out, tokens, n_new, fresh=None):
        return self.forward(dparams, sub, tokens, n_new).cache

    def draft_step(self, params, dparams, run):
        def step(c, tok):
            o = self.forward(dparams, c, tok[:, None], run)
            return o.logits, o.cache
        return step

    def draft_carry(self, sub):
        return sub


class MTPDrafter(_OnDevice):
    """The target's MTP block (params["mtp"], read from the target's params): `rows` rows of
    `capacity` positions; its state follows the target's layout."""
    return_hidden = True
    fresh_rows = True

    def __init__(self, model, cfg, dtype, rows: int, capacity: int, impl: str, layout=None):
        self.model, self.cfg, self.dtype, self.impl, self.layout = model, cfg, dtype, impl, layout
        self.rows, self.capacity = rows, capacity

    def new_state(self):
        with active(self.layout):     # the MTP block is the target's: its cache follows the layout
            return mtp.new_state(self.model, self.cfg, self.rows, self.capacity, self.dtype)

    def take(self, state, rows, reset=None, fresh=None):
        return mtp.take(state, rows, fresh)

    def put(self, state, rows, sub):
        return mtp.put(state, rows, sub)

    def advance(self, params, dparams, sub, out, tokens, n_new, fresh=None):
        hidden = self.model.mtp.target_hidden(self.cfg, params, out.hidden)     # [Bb, T, Hd]
        return mtp.advance(self.model, self.cfg, params, sub, tokens, hidden, n_new, fresh, impl=self.impl)

    def draft_step(self, params, dparams, run):
        return mtp.draft_step(self.model, self.cfg, params, run, self.impl)

    def draft_carry(self, sub):
        return mtp.draft_carry(sub)


def draft_tokens(step, carry, r, pending, K: int, flags):
    """K draft tokens per row: step(carry, token [Bb]) -> (logits [Bb, V], carry) is the drafter (on a
    scratch copy of its rows), fed the pending token [Bb] first and then its own drafts, each drawn
    with the row's sampling parameters (r: the StepRows) and a salted key. Returns (drafts [Bb, K]
    int32, q [Bb, K, V] f32: the distributions they were drawn from)."""
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), DRAFT_SALT))(r.seeds)

    def draw(j, logits):
        tok = sample(logits, keys, r.steps + j, r.temperature, r.top_k, r.top_p, flags)
        q = jax.nn.softmax(processed_logits(logits[:, None], r.temperature, r.top_k, r.top_p, flags)[:, 0], axis=-1)
        return tok, q

    logits, carry = step(carry, pending)
    t0, q0 = draw(0, logits)
    drafts = jnp.zeros((t0.shape[0], K), jnp.int32).at[:, 0].set(t0)
    qs = jnp.zeros((t0.shape[0], K) + q0.shape[1:], jnp.float32).at[:, 0].set(q0)

    def body(j, state):
        carry, drafts, qs = state
        logits, carry = step(carry, drafts[:, j - 1])
        t, q = draw(j, logits)
        return carry, drafts.at[:, j].set(t), qs.at[:, j].set(q)

    _, drafts, qs = jax.lax.fori_loop(1, K, body, (carry, drafts, qs))
    return drafts, qs
