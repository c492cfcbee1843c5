"""Ragged (flat, token-major) batches: one step's tokens of every sequence back to back, no padding to
the longest sequence.

  RaggedBatch   what a family's `forward_ragged` reads (a pytree; N and S are static, the values are
                not): sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1, and its cache
                row is row s of the step's view (`cache.pools.take_view` over S rows)
  pack          builds one on the host from per-sequence token lists, padded to N tokens and S
                sequences (buckets, so shapes stay static); padding sequences have no tokens
  over_tiles    runs a padded per-row layer step on a batch's tiles as rows (DeepSeek-V4's attention,
                whose window ring and compressor tails advance token by token)

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

from pallas_kernels.ragged_paged_attention.common import Dims, cdiv, plan_tiles, tile_classes


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


def over_tiles(fn, x: jax.Array, rows, shared, batch: RaggedBatch, lengths: jax.Array, *, max_q_len: int = 1,
               prefill_tile: int = 128):
    """Runs a padded per-row step on a ragged batch's tiles as if they were rows: for layers whose state is
    per row and advances token by token (a sliding-window ring, compressor tails), where a flat form of
    the math would need ops of its own.

    fn(x_t [G, tile, ...], positions [G, tile], valid [G, tile], lengths [G], n_new [G], rows_t, shared)
      -> (out_t [G, tile, ...] (x's trailing shape), rows_t, shared): the padded step of G rows that hold
      `lengths` tokens and feed n_new; rows_t is `rows` (a pytree of [S, ...]) gathered at the tiles'
      sequences, `shared` a pytree passed whole (pools written in place).
    The batch is cut like the ragged attention op cuts it (`plan_tiles`): a sequence of at most max_q_len
    tokens is one tile, and all of those (distinct sequences) run as one call; a longer one is cut into
    tiles of prefill_tile tokens that run one call each, in order, so each tile sees the state the previous
    one left. Only real tiles run. Returns (out [N, ...], rows, shared).
    x may be a pytree of [N, ...] arrays (out_t then one of [G, tile, ...] of the same structure): a step
    that reads the tokens and writes a hidden state of another width passes both."""
    N = jax.tree_util.tree_leaves(x)[0].shape[0]
    S = batch.n_new.shape[0]
    kv_lens = lengths + batch.n_new
    dims = Dims(N, 1, 1, 1, 1, 1, S, 1 << 30)                    # only the sizes the planner reads
    out = jax.tree_util.tree_map(jnp.zeros_like, x)
    carry = (out, rows, shared)
    for tile, longer_than, at_most in tile_classes(N, min(max_q_len, N), min(prefill_tile, N)):
        plan = plan_tiles(kv_lens, batch.cu_seqlens, jnp.full((1,), S, jnp.int32), dims, tile=tile,
                          longer_than=longer_than, at_most=at_most, block=1, sliding_window=None)
        one_each = at_most is not None and at_most <= tile      # one tile per sequence: all in one call
        G = plan.size if one_each else 1
        token_rows = plan.token_rows(N)
        real = plan.rows > 0
        r = jnp.arange(tile, dtype=jnp.int32)

        def body(i, carry, token_rows=token_rows, real=real, plan=plan, G=G, r=r):
            out, rows, shared = carry
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * G, G)    # noqa: E731
            t_rows, seq, ok, n, pos0 = sl(token_rows), sl(plan.seq), sl(real), sl(plan.rows), sl(plan.pos0)
            rows_t = jax.tree_util.tree_map(lambda a: a[seq], rows)
            x_t = jax.tree_util.tree_map(lambda a: a[jnp.minimum(t_rows, N - 1)], x)
            o, rows_t, shared = fn(x_t, pos0[:, None] + r[None, :], t_rows < N, pos0, n, rows_t, shared)
            out = jax.tree_util.tree_map(lambda a, b: a.at[t_rows].set(b.astype(a.dtype), mode="drop"), out, o)
            dest = jnp.where(ok, seq, S)                           # tiles without tokens write nothing back
            rows = jax.tree_util.tree_map(lambda a, b: a.at[dest].set(b.astype(a.dtype), mode="drop"), rows, rows_t)
            return out, rows, shared
        carry = jax.lax.fori_loop(0, cdiv(jnp.sum(real.astype(jnp.int32)), G), body, carry)
    return carry
