"""Token-level reference of ragged paged attention: one query row at a time (`lax.map`), against its sequence's
whole page row gathered and masked by position.

It reads every page of the row (clamped into the pool) and relies on the mask alone, which is what makes it
obviously right; the fast paths read only the used pages. Shapes and the masking contract: see common.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.common import as_int32, cap_scores, token_sequences, visible

HP = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                     sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None):
    """q [N, Hq, D], k_pages / v_pages [P, ps, Hkv, D], kv_lens [R], page_indices [R, NP], cu_q_lens [R + 1],
    num_seqs [] / [1] -> o [N, Hq, D] in q.dtype."""
    N, Hq, D = q.shape
    P, ps, Hkv, _ = k_pages.shape
    NP = page_indices.shape[1]
    S = NP * ps
    kv_lens, page_indices, cu_q_lens, ns = as_int32(kv_lens, page_indices, cu_q_lens, num_seqs)
    seq, row, valid = token_sequences(cu_q_lens, ns, N)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + row
    k_pos = jnp.arange(S, dtype=jnp.int32)

    def one(args):
        qn, i, p, ok = args                                                   # [Hq, D], scalars
        pages = jnp.clip(page_indices[i], 0, P - 1)
        k = k_pages[pages].reshape(S, Hkv, D).astype(jnp.float32)
        v = v_pages[pages].reshape(S, Hkv, D).astype(jnp.float32)
        vis = visible(p, k_pos, kv_lens[i], S, sliding_window) & ok           # [S]
        v = jnp.where(vis[:, None, None], v, 0.0)                             # an unread slot may hold NaN
        qh = qn.astype(jnp.float32).reshape(Hkv, Hq // Hkv, D)
        s = cap_scores(jnp.einsum("hgd,shd->hgs", qh, k, precision=HP) * sm_scale, soft_cap)
        s = jnp.where(vis, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        l = jnp.sum(e, axis=-1, keepdims=True)
        o = jnp.einsum("hgs,shd->hgd", e / jnp.where(l > 0, l, 1.0), v, precision=HP)
        return o.reshape(Hq, D)

    return jax.lax.map(one, (q, seq, pos, valid)).astype(q.dtype)
