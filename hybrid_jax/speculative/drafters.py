"""Drafters: who proposes the K tokens a verify step checks.

* `NgramDrafter` (prompt lookup, host side): finds the most recent earlier occurrence of the
  longest suffix n-gram (prompt_lookup_max .. prompt_lookup_min tokens) of a row's history and
  proposes the tokens that followed it, reading on through its own proposal when the match is
  close to the end (so a loop shorter than K still yields K tokens). Deterministic: q is one-hot.
  The decoder also keeps each row's place in the copied text: when a draft was rejected at an
  edit (the model wrote another token where the source had one) and no n-gram matches yet, it
  proposes the source's tokens after the edited one (`read_from`), as code editing continues.
* `DraftModelDrafter` (device side): a smaller checkpoint of any family the loader accepts, with its
  own cache. Each call first catches up on the tokens emitted since its previous call (one forward:
  the cache after it is the draft's rollback point, so rejected drafts never reach it), then runs
  K - 1 more single-token steps whose caches are thrown away. Returns its distributions q for
  rejection sampling.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.models import empty_cache, get_model
from hybrid_jax.sampling import SamplerFlags, sample
from hybrid_jax.speculative.acceptance import processed_logits

DRAFT_SALT = 0x5EED


class NgramDrafter:
    """Prompt-lookup drafting over a row's token history (numpy, no device work)."""

    def __init__(self, lookup_min: int = 1, lookup_max: int = 4):
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"need 1 <= lookup_min <= lookup_max; got {lookup_min}, {lookup_max}")
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, history: np.ndarray, k: int) -> np.ndarray:
        """history [N] int (prompt + generated, the last one pending); k: tokens wanted.
        Returns up to k proposed tokens [<= k] int32 (empty when no n-gram of length >= lookup_min
        recurs)."""
        return self.propose_at(history, k)[0]

    def propose_at(self, history: np.ndarray, k: int) -> tuple[np.ndarray, int]:
        """Like propose; also returns where in history the proposal starts (-1 when empty)."""
        h = np.asarray(history)
        n = h.shape[0]
        none = np.zeros((0,), np.int32), -1
        if k <= 0 or n < self.lookup_min + 1:
            return none
        ends = np.flatnonzero(h[:-1] == h[-1])            # candidate match ends, before the suffix itself
        if ends.size == 0:
            return none
        length = np.ones(ends.shape, np.int64)
        alive = np.ones(ends.shape, bool)
        for m in range(1, min(self.lookup_max, n - 1)):
            ok = alive & (ends - m >= 0)
            ok &= h[np.maximum(ends - m, 0)] == h[n - 1 - m]
            length += ok
            alive = ok
        best = length.max()
        if best < self.lookup_min:
            return none
        start = int(ends[np.flatnonzero(length == best)[-1]]) + 1   # most recent of the longest matches
        return self.read_from(h, start, k), start

    @staticmethod
    def read_from(history: np.ndarray, start: int, k: int) -> np.ndarray:
        """k tokens of history [N] from index start (0 <= start < N), reading on through the
        proposal itself past the end. Returns [k] int32."""
        n = len(history)
        out = np.empty((k,), np.int32)
        for j in range(k):
            idx = start + j
            out[j] = history[idx] if idx < n else out[idx - n]
        return out


def _fwd(cfg, impl, params, cache, tokens, n_new, **kw):
    return get_model(cfg.model_type).forward(cfg, params, cache, tokens, n_new, impl=impl, **kw)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnums=(1,))
def draft_prefill(params, cache, tokens, n_prompt, *, cfg, impl):
    """tokens [B, Tp]; n_prompt [B]. Returns the draft cache after the prompt."""
    return _fwd(cfg, impl, params, cache, tokens, n_prompt)[1]


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "k", "flags"), donate_argnums=(1,))
def draft_tokens(params, cache, catchup, n_catchup, seeds, step, temperature, top_k, top_p, *, cfg, impl, k: int,
                 flags: SamplerFlags):
    """catchup [B, Tc] int32: tokens emitted since the previous call, the pending one last;
    n_catchup [B] (0 for finished rows); seeds [B] uint32; step [B] int32 (tokens generated so far);
    temperature, top_p [B] f32; top_k [B] int32.
    Returns (drafts [B, k] int32, q [B, k, V] f32 or None for all-greedy batches, cache after the
    catch-up: the draft's state at the pending token, the point every later call resumes from)."""
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), DRAFT_SALT))(seeds)
    logits, snapshot = _fwd(cfg, impl, params, cache, catchup, n_catchup)
    run = (n_catchup > 0).astype(jnp.int32)
    B, V = logits.shape

    def draw(j, logits):
        tok = sample(logits, keys, step + j, temperature, top_k, top_p, flags)
        q = (jax.nn.softmax(processed_logits(logits[:, None], temperature, top_k, top_p, flags)[:, 0], axis=-1)
             if flags.any_random else jnp.zeros((B, 0), jnp.float32))
        return tok, q

    tok0, q0 = draw(0, logits)
    toks = jnp.zeros((B, k), jnp.int32).at[:, 0].set(tok0)
    qs = jnp.zeros((B, k) + q0.shape[1:], jnp.float32).at[:, 0].set(q0)

    def body(j, carry):           # single-token steps on a scratch copy of the cache
        c, toks, qs = carry
        logits, c = _fwd(cfg, impl, params, c, toks[:, j - 1][:, None], run)
        tok, q = draw(j, logits)
        return c, toks.at[:, j].set(tok), qs.at[:, j].set(q)

    _, toks, qs = jax.lax.fori_loop(1, k, body, (snapshot, toks, qs))
    return toks, (qs if flags.any_random else None), snapshot


class DraftModelDrafter:
    """A small draft model with its own cache (cfg, params, dtype as LLM holds them)."""

    def __init__(self, cfg, params, dtype, impl: str = "auto"):
        self.cfg, self.params, self.dtype, self.impl = cfg, params, dtype, impl
        self.model = get_model(cfg.model_type)
        self.prefill = functools.partial(draft_prefill, cfg=cfg, impl=impl)
        self.draft = functools.partial(draft_tokens, cfg=cfg, impl=impl)

    def new_cache(self, batch_size: int, capacity: int):
        return empty_cache(self.cfg, batch_size, capacity, self.dtype)
