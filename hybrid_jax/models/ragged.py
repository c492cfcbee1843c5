"""Ragged (flat, token-major) batches: one step's tokens of every sequence back to back, no padding to
the longest sequence.

  RaggedBatch   what a family's `forward_ragged` reads (a pytree; N and S are static, the values are
                not): sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1, and its cache
                row is row s of the step's view (`cache.pools.take_view` over S rows)
  pack          builds one on the host from per-sequence token lists, padded to N tokens and S
                sequences (buckets, so shapes stay static); padding sequences have no tokens

Shapes: N tokens, S sequences. A prefill chunk, a decode token and a speculative window are all just
sequences of some length: one step mixes them at the cost of their real tokens (plus the chunk
padding of the Gated DeltaNet kernels, at most one chunk per sequence), where a padded [S, T] batch
pays S x the longest.
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class RaggedBatch:
    """tokens [N] int32 (0 past the last sequence); seq [N] int32: each token's sequence (S - 1 for
    padding tokens, whose `valid` is False); positions [N] int32: each token's position in its
    sequence's cache (cache.lengths[seq] + its index in the step); valid [N] bool; cu_seqlens [S + 1]
    int32 (non-decreasing, cu_seqlens[0] = 0); n_new [S] int32 = cu_seqlens[1:] - cu_seqlens[:-1]."""
    tokens: jax.Array
    seq: jax.Array
    positions: jax.Array
    valid: jax.Array
    cu_seqlens: jax.Array
    n_new: jax.Array

    def last_index(self) -> jax.Array:
        """[S] int32: the flat index of each sequence's last token (a sequence without tokens points at
        the token before it, or 0: its logits are meaningless and the caller ignores them)."""
        return jnp.maximum(self.cu_seqlens[1:] - 1, 0)


def pack(token_lists: Sequence[Sequence[int]], lengths: Sequence[int], num_tokens: int, num_seqs: int
         ) -> RaggedBatch:
    """The host's ragged batch of len(token_lists) <= num_seqs sequences whose tokens fit num_tokens:
    sequence s feeds token_lists[s] after the lengths[s] tokens its cache row holds. numpy arrays
    (the step's jit moves them). Raises ValueError when they do not fit."""
    n = [len(t) for t in token_lists]
    if len(n) > num_seqs or sum(n) > num_tokens:
        raise ValueError(f"a ragged batch of {len(n)} sequences / {sum(n)} tokens does not fit "
                         f"{num_seqs} / {num_tokens}")
    cu = np.zeros((num_seqs + 1,), np.int32)
    cu[1:len(n) + 1] = np.cumsum(n)
    cu[len(n) + 1:] = cu[len(n)]
    tokens = np.zeros((num_tokens,), np.int32)
    seq = np.full((num_tokens,), num_seqs - 1, np.int32)
    positions = np.zeros((num_tokens,), np.int32)
    for s, (toks, start) in enumerate(zip(token_lists, lengths)):
        a, b = cu[s], cu[s + 1]
        tokens[a:b] = toks
        seq[a:b] = s
        positions[a:b] = start + np.arange(b - a)
    valid = np.arange(num_tokens) < cu[-1]
    return RaggedBatch(tokens=tokens, seq=seq, positions=positions, valid=valid, cu_seqlens=cu,
                       n_new=np.diff(cu).astype(np.int32))
