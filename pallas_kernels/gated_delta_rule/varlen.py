"""Packed variable-length batches (`cu_seqlens`) with static shapes.

A packed batch holds N sequences back to back in one row: q [1, T, H, K], sequence n spanning
tokens cu_seqlens[n] .. cu_seqlens[n + 1] - 1. cu_seqlens [N + 1] int32 is a *traced* array (its
values may change without a retrace); only T and N are static. Tokens at or past cu_seqlens[-1]
belong to no sequence: their output is 0 and they touch no state.

Two layouts, both jit-friendly:

* token layout (recurrent forms): per token, the sequence it belongs to, whether it starts that
  sequence (the state is reset to that sequence's initial state before the token) and whether it
  is valid (the state after it is recorded as that sequence's final state).
* chunk layout (chunked forms, as tpu-inference does): each sequence is padded up to a multiple of
  the chunk size C, so no chunk straddles two sequences. The number of chunks is bounded statically
  by NC = max(1, (T + N (C - 1)) // C), and each chunk carries the sequence it belongs to and a
  reset flag. Padded tokens have g = 0, beta = 0, k = 0, which leaves
  the state unchanged, so trailing pad chunks are harmless.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_cu_seqlens(cu_seqlens) -> int:
    """Validates the static part of cu_seqlens; returns N. Raises ValueError naming the problem."""
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1; got shape {cu_seqlens.shape}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"cu_seqlens must be an integer array; got {cu_seqlens.dtype}")
    return cu_seqlens.shape[0] - 1


def token_layout(cu_seqlens: jax.Array, T: int):
    """Per-token metadata. Returns (seq [T] int32, first [T] bool, valid [T] bool)."""
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32), 0, N - 1)
    valid = (t >= cu[0]) & (t < cu[-1])
    first = valid & (t == cu[seq])
    return seq, first, valid


def num_padded_chunks(T: int, N: int, C: int) -> int:
    """Static upper bound on the number of chunks once every sequence is padded to a multiple of C."""
    return max(1, (T + N * (C - 1)) // C)


def chunk_layout(cu_seqlens: jax.Array, T: int, C: int):
    """Chunk metadata for the padded layout.

    Returns:
      src   [NC * C] int32  token index feeding each padded position, T for padding
      pos   [T] int32       padded position of each token, NC * C for tokens outside every sequence
      seq   [NC] int32      sequence each chunk belongs to (trailing pad chunks: the last non-empty one)
      first [NC] bool       reset the state to the sequence's initial state before this chunk
    """
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    NC = num_padded_chunks(T, N, C)
    Tp = NC * C
    lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    pstart = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lens + C - 1) // C) * C])  # [N + 1]
    tseq, _, tvalid = token_layout(cu, T)
    t = jnp.arange(T, dtype=jnp.int32)
    pos = jnp.where(tvalid, pstart[tseq] + t - cu[tseq], Tp)
    src = jnp.full((Tp,), T, jnp.int32).at[pos].set(t, mode="drop")
    start = jnp.arange(NC, dtype=jnp.int32) * C
    cseq = jnp.searchsorted(pstart[1:], start, side="right").astype(jnp.int32)   # first seq ending after start
    nonempty = lens > 0
    any_nonempty = jnp.any(nonempty)
    last_nonempty = jnp.where(any_nonempty, N - 1 - jnp.argmax(nonempty[::-1]), 0).astype(jnp.int32)
    trailing = cseq >= N
    first = jnp.where(trailing, ~any_nonempty & (start == 0),
                      start == pstart[jnp.minimum(cseq, N - 1)])
    seq = jnp.where(trailing, last_nonempty, cseq)
    return src, pos, seq, first


def gather_tokens(x: jax.Array, src: jax.Array) -> jax.Array:
    """x [1, T, ...] -> [1, len(src), ...] with zeros where src == T."""
    xz = jnp.concatenate([x, jnp.zeros((1, 1) + x.shape[2:], x.dtype)], axis=1)
    return jnp.take(xz, src, axis=1)


def scatter_back(o: jax.Array, pos: jax.Array) -> jax.Array:
    """o [1, Tp, ...] in the padded layout -> [1, T, ...] token layout, zeros for tokens in no sequence."""
    oz = jnp.concatenate([o, jnp.zeros((1, 1) + o.shape[2:], o.dtype)], axis=1)
    return jnp.take(oz, jnp.minimum(pos, o.shape[1]), axis=1)


def chunked(arrays: tuple, cu_seqlens: jax.Array | None, B: int, T: int, C: int):
    """The per-token inputs of a chunked kernel laid out in whole chunks, and each chunk's metadata.

    arrays: [B, T, ...] each. Without cu_seqlens every row is padded to NC = ceil(T / C) chunks with zeros
    (g = 0, beta = 0 leave the state as it is); with them (B == 1) every sequence is padded to a multiple
    of C (`chunk_layout`). Returns (arrays [B, NC * C, ...], seq [B * NC] int32 (the sequence, i.e. the
    state slot, each chunk continues), flag [B * NC] int32 (1: the chunk starts its sequence), NC, N (the
    sequences: B, or len(cu_seqlens) - 1), NB (the state slots one row may write: 1, or N), pos (for
    `unchunked`; None without cu_seqlens))."""
    if cu_seqlens is None:
        pad = (-T) % C
        if pad:
            arrays = tuple(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in arrays)
        NC = (T + pad) // C
        return (arrays, jnp.zeros((B * NC,), jnp.int32), jnp.tile((jnp.arange(NC) == 0).astype(jnp.int32), B),
                NC, B, 1, None)
    N = check_cu_seqlens(cu_seqlens)
    src, pos, seq, first = chunk_layout(cu_seqlens, T, C)
    return tuple(gather_tokens(x, src) for x in arrays), seq, first.astype(jnp.int32), seq.shape[0], N, N, pos


def unchunked(o: jax.Array, T: int, pos: jax.Array | None) -> jax.Array:
    """A chunked kernel's output [B, NC * C, ...] back to the tokens' layout [B, T, ...] (`chunked`'s pos)."""
    return o[:, :T] if pos is None else scatter_back(o, pos)
