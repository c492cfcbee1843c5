"""The device side of structured outputs: each cache row's allowed-token bitmask, in the rows' state
the steps carry (`logits_processors.RowState.allowed`, [max_num_seqs + 1, W] int32, W = ceil(V / 32):
bit t % 32 of word t // 32 set = token t allowed), written by a fixed-width program before a step
whose rows sample under a grammar (`write_rows`), and applied by the compiled sampler to the rows a
step flags (`StepRows.masked`) as a runtime input: one program serves masked and unmasked rows, a
step without a masked row skips it (a runtime cond), and no grammar ever causes a compile.

At Qwen3's vocabulary (151,936 tokens, 4,748 words) and 257 rows the bitmasks take 4.9 MB."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybrid_jax.logits_processors import RowState

WRITE_WIDTH = 8             # rows one call of the writing program takes


def unpack(words: jax.Array, vocab: int) -> jax.Array:
    """words [B, W] int32 -> allowed [B, vocab] bool."""
    ids = jnp.arange(vocab, dtype=jnp.int32)
    w = jnp.take(words, ids // 32, axis=1)
    return ((w >> (ids % 32)) & 1).astype(bool)


def apply_allowed(logits: jax.Array, allowed_words: jax.Array, rows: jax.Array, masked: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens outside each masked row's bitmask set to -inf; allowed_words
    [R, W] (every row's), rows [B] (the step's cache rows), masked [B] bool. Runs only when a row of
    the batch is masked (a runtime cond)."""
    def run(x):
        ok = unpack(allowed_words[rows], x.shape[-1])
        return jnp.where(masked[:, None] & ~ok, -jnp.inf, x)
    return jax.lax.cond(jnp.any(masked), run, lambda x: x, logits)


def write_rows(allowed_words: jax.Array, rows: jax.Array, words: jax.Array) -> jax.Array:
    """The writing program's body: allowed_words [R, W] with rows [WRITE_WIDTH] (R or more: padding,
    dropped) set to words [WRITE_WIDTH, W]."""
    return allowed_words.at[rows].set(words, mode="drop")


def write_masks(state: RowState, rows: jax.Array, words: jax.Array) -> RowState:
    """The writing program (jitted with `state` donated): `write_rows` on the rows' state."""
    return dataclasses.replace(state, allowed=write_rows(state.allowed, rows, words))
