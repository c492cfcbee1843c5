"""Multi-token prediction (MTP): a checkpoint's own MTP block as the engine's speculative drafter.

Qwen3-Next / Qwen3.5 (`mtp.*`), DeepSeek-V3.2 (layer `num_hidden_layers`) and DeepSeek-V4
(`mtp.0.*`) ship one extra decoder layer trained to predict the token after next: at position i it
reads the token at i + 1 and the target's hidden state at i (`target_hidden`: the last layer's output
after the final norm; for DeepSeek-V4 its mHC streams before the hyper head, `MTPHead.hidden_shape`).
Each family that has one gives its `ModelFamily` an `MTPHead`: `step(cfg, params, cache, tokens,
hidden, n_new)` -> (hidden out, cache), `logits(cfg, params, h)` (the target's LM head), and
`new_cache` (a one-layer cache of the family).

The runner keeps an MTP state per cache row, in step with the target's rows:
  cache   the block's KV entries for positions 0 .. n-2 of a row the target holds n tokens of (the
          entry of position i needs the token at i + 1, known once the target has sampled it);
  hidden  [rows, Hd] the target's hidden state at position n - 1, waiting for the next token.
Every target step feeds it what the target fed (`advance`): the step's tokens against the hidden
states one position before them. A verify step drafts K tokens first (`draft_step`, recursively:
draft j + 1 reads draft j and the block's own output hidden state, as vLLM does), on a scratch copy,
and after acceptance feeds the kept tokens from the pre-draft state. The drafts only ever affect
acceptance: verification keeps the output equal to the target's.

A row that starts over (a new request, a preempted one recomputed, a prefix-cache hit) starts with
an empty MTP cache: its first token has no hidden state before it and is skipped; after a prefix hit
the block lacks the prefix's entries (its positions are then offset by the prefix length, which
RoPE's relative form makes harmless), which can lower acceptance, never change output.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from cache import put_rows, take_rows
from hybrid_jax.errors import CheckpointError, InputError
from hybrid_jax.quantization import scale_names

log = logging.getLogger(__name__)


def check_mtp(model, cfg, params: dict, name: str):
    """Raises InputError unless `params` hold an MTP block this project can draft with."""
    if model.mtp is None:
        raise InputError(f"speculative_config method 'mtp': drafting with the MTP block is not supported for "
                         f"model_type {cfg.model_type!r}")
    if "mtp" not in params:
        raise InputError(f"speculative_config method 'mtp' needs the checkpoint's multi-token-prediction block, "
                         f"but {name} has none (no MTP tensors were found, e.g. "
                         f"{', '.join(repr(p + '*') for p in model.mtp.prefixes(cfg))})")
    n = len(params["mtp"]["layers"])
    if n != 1:
        raise InputError(f"speculative_config method 'mtp': {name} has {n} MTP layers; drafting uses a single "
                         f"MTP layer applied recursively")


def check_all_read(model, cfg, keys, read: set[str]):
    """After a weight conversion: every checkpoint tensor where the family keeps its MTP block was
    read (or is the scale of one that was). An MTP layout the loader does not understand is a
    CheckpointError naming the tensors, never silently dropped."""
    prefixes = tuple(model.mtp.prefixes(cfg)) if model.mtp is not None else ()
    if not prefixes:                 # a family without MTP support (DeepSeek-V4): said, not silent
        n = sum(1 for k in keys if k.startswith("mtp."))
        if n:
            log.warning("%s: the checkpoint's MTP block (%d mtp.* tensors) is not loaded: this family has no MTP "
                        "drafting yet; the model itself is complete", cfg.model_type, n)
        return
    scales = {s for k in read for s in scale_names(k)}
    left = sorted(k for k in keys if k.startswith(prefixes) and k not in read and k not in scales)
    if left:
        raise CheckpointError(f"checkpoint holds MTP tensors the {cfg.model_type} loader does not understand "
                              f"({len(left)}, e.g. {left[:4]}); expected the layout of the published release")


def new_state(model, cfg, rows: int, capacity: int, dtype) -> dict:
    """The MTP state of `rows` cache rows of up to `capacity` positions (see the module docstring).
    One position's hidden state is [Hd], or the head's `hidden_shape` (DeepSeek-V4: its N mHC streams
    [N, Hd])."""
    shape = model.mtp.hidden_shape(cfg) if model.mtp.hidden_shape is not None else (cfg.hidden_size,)
    return {"cache": model.mtp.new_cache(cfg, rows, capacity, dtype), "hidden": jnp.zeros((rows, *shape), dtype)}


def take(state: dict, rows: jax.Array, reset: jax.Array | None = None) -> dict:
    """The rows' sub-state (rows flagged in `reset` come back empty)."""
    return {"cache": take_rows(state["cache"], rows, reset), "hidden": state["hidden"][rows]}


def put(state: dict, rows: jax.Array, sub: dict) -> dict:
    return {"cache": put_rows(state["cache"], rows, sub["cache"]), "hidden": state["hidden"].at[rows].set(sub["hidden"])}


def advance(model, cfg, params, sub: dict, tokens: jax.Array, hidden: jax.Array, n_new: jax.Array,
            fresh: jax.Array | None = None, impl: str = "auto") -> dict:
    """Feeds the block what the target was fed: tokens [B, T] (row b's first n_new[b] real) and the
    target's hidden states there [B, T, *hidden shape]. Token t is paired with the hidden state before it (the
    row's waiting one for t = 0); a `fresh` row [B] (an empty MTP cache) skips its first token, which
    has none. The last real position's hidden state waits for the next token."""
    B, T = tokens.shape
    shift = jnp.zeros((B,), jnp.int32) if fresh is None else fresh.astype(jnp.int32)
    idx = jnp.arange(T, dtype=jnp.int32)[None, :] + shift[:, None]                   # [B, T]
    toks = jnp.take_along_axis(jnp.pad(tokens, ((0, 0), (0, 1))), idx, axis=1)
    prev = sub["hidden"]
    extra = (1,) * (hidden.ndim - 2)                                                  # trailing hidden axes
    hs = jnp.concatenate([prev[:, None].astype(hidden.dtype), hidden], axis=1)        # [B, T + 1, ...]
    hin = jnp.take_along_axis(hs, idx.reshape(B, T, *extra), axis=1)
    n = jnp.maximum(n_new - shift, 0).astype(jnp.int32)
    _, cache = model.mtp.step(cfg, params, sub["cache"], toks, hin, n, impl=impl)
    last = jnp.take_along_axis(hidden, jnp.maximum(n_new - 1, 0).reshape(B, 1, *extra), axis=1)[:, 0]
    return {"cache": cache, "hidden": jnp.where((n_new > 0).reshape(B, *extra), last.astype(prev.dtype), prev)}


def draft_step(model, cfg, params, run: jax.Array, impl: str = "auto"):
    """The drafter's step for `ModelRunner._draft`: (carry, token [B]) -> (logits [B, V], carry), with
    carry = (scratch cache, hidden [B, 1, *hidden shape]); starting from (sub["cache"], sub["hidden"][:, None]),
    the first call drafts from the target's waiting hidden state, the next ones from the block's own."""
    def step(carry, tok):
        cache, h = carry
        out, cache = model.mtp.step(cfg, params, cache, tok[:, None], h, run, impl=impl)
        return model.mtp.logits(cfg, params, out[:, 0]), (cache, out.astype(h.dtype))
    return step


def draft_carry(sub: dict):
    return sub["cache"], sub["hidden"][:, None]
