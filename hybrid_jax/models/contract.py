"""The typed contract between the engine and a model family.

  StepOutput     what every family's `forward` returns, whatever the mode: logits and the updated
                 cache always; the optional parts (hidden states, per-token recurrent states, KV
                 entries left unwritten) are fields that are None unless the option asked for them,
                 never extra tuple entries whose position depends on flags.
  LayerType      one entry of a family's layer-type registry: the mixer that runs a layer of that
                 type and the cache groups it reads and writes.
  MTPHead        the multi-token-prediction block's functions, when a family has one.
  ModelFamily    everything the rest of the code may call on a family, built by the family module
                 (`FAMILY = ModelFamily(...)`); optional capabilities are None, not probed with
                 `hasattr`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class StepOutput:
    """One forward's results (a pytree: it leaves jitted functions as is).

    logits   [B, V] f32 at each row's last real token (logits_at="last") or [B, T, V] ("all")
    cache    the updated ModelCache (lengths += n_new)
    hidden   with return_hidden: the residual stream after the embedding and after each layer,
             L + 1 arrays [B, T, Hd] (DeepSeek-V4: the mHC streams [B, T, N, Hd])
    states   with per_token_states: what the recurrent group's state after every position is made
             from (`RecurrentGroup.truncate` reads it); {} for a family without one
    deferred with defer_kv_write: the per-position entries the forward left unwritten
             ({"k", "v": [L, B, T, Hkv, D]}, {} without attention layers), for the family's
             `write_deferred_kv`
    final_hidden with return_final_hidden: the residual stream after the last layer at EVERY position,
             [B, T, Hd] (a ragged forward: [N, Hd]; DeepSeek-V4: its mHC streams [.., N, Hd]): the
             family's `final_norm` and the LM head (`models.common.lm_head`) make any position's
             logits from it, so a caller scores the positions it wants (prompt log-probabilities)
             without the forward holding [T, V] logits
    """
    logits: jax.Array
    cache: Any
    hidden: list | None = None
    states: dict | None = None
    deferred: dict | None = None
    final_hidden: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class LayerType:
    """A layer type of a family: `mixer(cfg, lp, h, step, layer)` runs the token mixer of model layer
    `layer` on h [B, T, Hd] (after the input norm) and returns its output [B, T, Hd], reading and
    writing the family's per-step working state `step`; `groups` names the cache groups a layer of
    this type keeps its objects in (the family's `new_cache` makes exactly the groups its layers'
    types name)."""
    mixer: Callable
    groups: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MTPHead:
    """The functions of a family's multi-token-prediction block (hybrid_jax.speculative.mtp):
    prefixes(cfg): where the checkpoint keeps it; new_cache(cfg, B, capacity, dtype): its own cache;
    target_hidden(cfg, params, hidden): what it reads from the target's forward; step(cfg, params, cache,
    tokens, hidden, n_new, impl=) -> (h, cache); logits(cfg, params, h) -> [.., V]; hidden_shape(cfg):
    the shape of one position's hidden state it reads, None for [hidden_size]."""
    prefixes: Callable
    new_cache: Callable
    target_hidden: Callable
    step: Callable
    logits: Callable
    hidden_shape: Callable | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """A model family, as the engine, loader, planner and tools see it.

    forward(cfg, params, cache, tokens [B, T], n_new [B], *, logits_at, impl, return_hidden,
            fused_recurrent, per_token_states, defer_kv_write, return_final_hidden) -> StepOutput
    new_cache(cfg, batch_size, capacity, dtype, page_size=None) -> cache.ModelCache
    init_params(cfg, seed, dtype, rng=None) -> params        (deterministic random init)
    convert_hf_weights(cfg, get, has, dtype, progress) -> params   (the one-time HF re-layout)
    final_norm(cfg, params, x) -> x                           (the norm before the LM head)
    layer_types: layer type -> LayerType (the types this family runs; a config naming another is
                 refused by name)
    forward_ragged(cfg, params, cache, batch: models.ragged.RaggedBatch, *, impl, return_final_hidden)
                 -> StepOutput (logits [S, V] at each sequence's last token): one step over a flat
                 token-major batch, or None for a family that steps padded [B, T] batches only
    write_deferred_kv(cache, deferred, positions [B, T], valid [B, T]) -> cache, or None when the
                 family cannot defer its per-position writes (forward's defer_kv_write); the groups
                 it writes are `deferred_groups`
    mtp: MTPHead or None
    param_axes: glob pattern of a parameter path ("layers/*/attn/o_proj") -> the logical axis names of
                its dimensions (hybrid_jax.parallel.rules), first match wins; every parameter must
                match one. None: the family runs on one device only.
    row_tables: glob patterns of parameters a step reads only a few rows of, by id (Qwen4-Exp's n-gram
                tables, ~95 GiB at the release's sizes, of which a decode step gathers 16 rows a token): the
                planner's minimum decode bytes leave them out instead of reading them whole.
    """
    name: str
    forward: Callable
    new_cache: Callable
    init_params: Callable
    convert_hf_weights: Callable
    final_norm: Callable
    layer_types: Mapping[str, LayerType]
    forward_ragged: Callable | None = None
    write_deferred_kv: Callable | None = None
    deferred_groups: tuple[str, ...] = ()
    mtp: MTPHead | None = None
    param_axes: Mapping[str, tuple] | None = None
    row_tables: tuple[str, ...] = ()

    def groups_of(self, layer_types) -> tuple[str, ...]:
        """The cache groups a model with these per-layer types keeps (in first-use order)."""
        out: dict[str, None] = {}
        for t in layer_types:
            out.update(dict.fromkeys(self.layer_types[t].groups))
        return tuple(out)
