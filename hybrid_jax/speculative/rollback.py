"""Undoing what a verify step wrote for rejected draft tokens, two ways.

A verify step feeds n_fed[b] = 1 + k[b] tokens per row (the pending token and k drafts) and keeps
n_keep[b] = 1 + n_accepted[b] of them. Afterwards the cache must be exactly the cache of the kept
tokens, and nothing rejected may ever be read:

* KV, MLA latent and indexer entries sit at positions >= lengths + n_keep. Resetting `lengths`
  hides them from every reader (attention masks by position) and the next step overwrites them.
  The row's `version` is bumped once more when anything was rejected, so a prefix-cache entry
  recorded against the verify step's version can never validate against the rolled-back row.
* Recurrent state (Gated DeltaNet state and conv window) is rewritten by every token, so it is
  restored either by **selection** (`RecurrentGroup.truncate`: the verify forward emitted what the state
  after every position is made from, its conv inputs and the recurrence's per-token rank-one
  updates; keep the state after the last kept token) or by **snapshot + replay**
  (`finish_replay`: the pre-verify cache, kept by reference and never donated, is run again over
  the kept tokens only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cache import ModelCache


def rollback_by_selection(cache: ModelCache, states: dict, old_lengths: jax.Array, n_fed: jax.Array,
                          n_keep: jax.Array) -> ModelCache:
    """The verify step's cache cut back to the kept tokens. cache: after the verify forward;
    states: the forward's per-position recurrent states ({} when the model has none);
    old_lengths, n_fed, n_keep: [B] int32. Every group truncates itself (`CacheGroup.truncate`: a
    recurrent group selects its state after the last kept token, a per-position group has nothing to
    undo, a group that needs replay refuses). Lengths become old_lengths + n_keep; rows that
    rejected anything get a new version."""
    groups = {name: g.truncate(states, n_keep) for name, g in cache.groups.items()}
    return cache.replace(groups=groups, lengths=old_lengths + n_keep,
                         version=cache.version + (n_keep < n_fed).astype(jnp.int32))


def finish_replay(replayed: ModelCache, verify_version: jax.Array, n_fed: jax.Array,
                  n_keep: jax.Array) -> ModelCache:
    """The replayed cache (snapshot + kept tokens) with the version the rollback must carry:
    the verify step's version [B], plus one where a row rejected anything."""
    return replayed.replace(version=verify_version + (n_keep < n_fed).astype(jnp.int32))
