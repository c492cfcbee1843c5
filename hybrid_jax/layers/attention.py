"""Gated full attention (Qwen3-Next): query gate, q/k RMSNorm, partial RoPE, GQA, KV written into
the cache's paged KV group at each row's own positions.

One function serves prefill, chunked prefill and decode: the T new tokens of row b sit at positions
lengths[b] .. lengths[b] + n_new[b] - 1 and attend to every cached key at a position <= their own.
Keys and values live in pages ([L, P, ps, Hkv, D], cache.state.KVGroup) reached through the rows'
page table [B, NP]; the read walks the pages in blocks up to the longest row of the step (a loop
with a run-time trip count), so a step costs what its rows hold, not what a row could hold.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from cache.mla import write_paged, write_paged_flat
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.norms import rms_norm_zero_centered
from hybrid_jax.layers.rope import apply_rope
from hybrid_jax.parallel.context import MODEL, constrain, current, kv_replicas, per_device, tensor_size

KEY_BLOCK = 512       # tokens of cached keys per iteration of the paged read


def write_kv(pool: jax.Array, new: jax.Array, page_table: jax.Array, positions: jax.Array, valid: jax.Array,
             layer: int | slice | None = None) -> jax.Array:
    """Scatter new entries into their pages; invalid (padding) tokens are dropped, never clamped
    onto a live slot. pool: [P, ps, Hkv, D], or with `layer` the group's stack [L, P, ps, Hkv, D]
    (written in place: XLA updates the stack's buffer instead of slicing the layer out, writing the
    copy and stacking the layers again, each a copy of the whole cache per step);
    new: [B, T, Hkv, D], or [L, B, T, Hkv, D] with layer=slice(None) (every layer in one write);
    page_table: [B, NP]; positions, valid: [B, T]."""
    if isinstance(layer, slice):
        out = jax.vmap(lambda p, n: write_paged(p, n, page_table, positions, valid))(pool, new)
    else:
        out = write_paged(pool, new, page_table, positions, valid, layer)
    return pinned_pool(out)


def pinned_pool(pool: jax.Array) -> jax.Array:
    """A KV pool ([..., Hkv, D]) just written, held to the cache's layout on a mesh (`parallel.constrain`)."""
    return constrain(pool, (None,) * (pool.ndim - 2) + ("kv_heads", None))


def whole_pool(pool: jax.Array) -> jax.Array:
    """A latent / indexer pool just written, held whole on every device on a mesh (every head reads all of
    it; `parallel.constrain`). Left free, the partitioner may split it after the write and all-gather it for
    the read: Qwen4-Exp's indexer keys, 1.25 GiB a layer and decode step at 64 rows x 32k."""
    return constrain(pool, (None,) * pool.ndim)


def _scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """qg: [B, G, R, T, D]; k: [B, S, G, D] -> [B, G, R, T, S] fp32, as one batched matmul per group."""
    B, G, R, T, D = qg.shape
    s = jnp.matmul(qg.reshape(B, G, R * T, D), k.transpose(0, 2, 3, 1), preferred_element_type=jnp.float32)
    return s.reshape(B, G, R, T, k.shape[1])


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """p: [B, G, R, T, S]; v: [B, S, G, D] -> [B, G, R, T, D] fp32."""
    B, G, R, T, S = p.shape
    o = jnp.matmul(p.reshape(B, G, R * T, S).astype(v.dtype), v.transpose(0, 2, 1, 3),
                   preferred_element_type=jnp.float32)
    return o.reshape(B, G, R, T, v.shape[-1])


def _safe_step(carry, s, v):
    """Folds one key block's scores s [B, G, R, Q, K] and values v [B, K, G, D] into the running
    softmax carry (m, l, o): m the row max so far, l the sum of exp(s - m), o the exp-weighted values.
    A block whose scores are all -inf (every key masked) adds nothing, and a row with no key yet keeps
    m = -inf, l = o = 0 (never a NaN)."""
    m, l, o = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_use)
    e = jnp.exp(s - m_use)
    return m_new, l * alpha + jnp.sum(e, axis=-1, keepdims=True), o * alpha + _weighted(e, v)


def _paged_partial(qg, k_pool, v_pool, page_table, limit, inclusive: bool, layer=None):
    """Unnormalised softmax pieces (m, l, o) of qg [B, G, R, T, D] over the paged keys of each row at
    positions <= (inclusive) or < `limit` [B, T]. k_pool, v_pool: [P, ps, G, D], or with `layer` the
    stacks [L, P, ps, G, D] read at that layer; page_table [B, NP]. Keys are read a block of pages at
    a time, only as far as the largest limit of the step (a loop with a run-time trip count; a table
    that fits one block is read in one go); table entries past a row's limit are never used (masked)."""
    B, G, R, T, D = qg.shape
    NP = page_table.shape[1]
    ps = k_pool.shape[-3]
    ppb = max(1, min(NP, KEY_BLOCK // ps))              # pages per block
    nblk = -(-NP // ppb)
    table = jnp.pad(page_table, ((0, 0), (0, nblk * ppb - NP)))
    lim = limit[:, None, None, :, None]                   # [B, 1, 1, T, 1]
    reach = jnp.max(limit) + (1 if inclusive else 0)      # positions < reach are read
    n = jnp.clip((reach + ppb * ps - 1) // (ppb * ps), 0, nblk)

    def body(j, carry):
        pages = jax.lax.dynamic_slice_in_dim(table, j * ppb, ppb, axis=1)            # [B, ppb]
        kb = (k_pool[pages] if layer is None else k_pool[layer, pages]).reshape(B, ppb * ps, G, D)
        vb = (v_pool[pages] if layer is None else v_pool[layer, pages]).reshape(B, ppb * ps, G, D)
        kpos = j * ppb * ps + jnp.arange(ppb * ps)[None, None, None, None, :]
        allowed = kpos <= lim if inclusive else kpos < lim
        return _safe_step(carry, jnp.where(allowed, _scores(qg, kb), -jnp.inf), vb)

    shape = qg.shape[:-1] + (1,)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(qg.shape, jnp.float32))
    if nblk == 1:          # the whole table is one block: read it (masked) unless no row reaches a key
        return jax.lax.cond(n > 0, lambda c: body(0, c), lambda c: c, init)
    return jax.lax.fori_loop(0, n, body, init)


def _normalise(m, l, o):
    return o / jnp.where(l > 0, l, 1.0)


BLOCK_Q = 256


def _prefill_attention(qg, k_new, v_new, k_pool, v_pool, page_table, positions, layer=None):
    """Attention of T > 1 new tokens, flash style in plain XLA: per query block of BLOCK_Q, first
    the cached prefix (positions < lengths, read from the pages; no iteration when no row of the step
    has one), then the earlier key blocks of the new tokens in a fori_loop (no mask needed), then the
    diagonal block under the causal mask. Scores never exist beyond one tile per head.
    qg: [B, G, R, T, D]; k_new, v_new: [B, T, G, D]; k_pool, v_pool: [P, ps, G, D] (or the [L, ...]
    stacks with `layer`); page_table [B, NP]; positions: [B, T]."""
    B, G, R, T, D = qg.shape
    BQ = min(BLOCK_Q, T)
    nq = -(-T // BQ)
    pad = nq * BQ - T
    if pad:   # padded keys sit after every real query: the causal mask hides them
        qg = jnp.pad(qg, [(0, 0)] * 3 + [(0, pad), (0, 0)])
        k_new = jnp.pad(k_new, [(0, 0), (0, pad), (0, 0), (0, 0)])
        v_new = jnp.pad(v_new, [(0, 0), (0, pad), (0, 0), (0, 0)])
    prefix = jnp.broadcast_to(positions[:, :1], (B, BQ))                       # = lengths: slots < it
    causal = jnp.arange(BQ)[None, :] <= jnp.arange(BQ)[:, None]

    outs = []
    for i in range(nq):
        qb = qg[:, :, :, i * BQ:(i + 1) * BQ]
        carry = _paged_partial(qb, k_pool, v_pool, page_table, prefix, inclusive=False, layer=layer)

        def body(j, carry, qb=qb):
            kb = jax.lax.dynamic_slice_in_dim(k_new, j * BQ, BQ, axis=1)
            vb = jax.lax.dynamic_slice_in_dim(v_new, j * BQ, BQ, axis=1)
            return _safe_step(carry, _scores(qb, kb), vb)

        carry = jax.lax.fori_loop(0, i, body, carry)
        kb, vb = k_new[:, i * BQ:(i + 1) * BQ], v_new[:, i * BQ:(i + 1) * BQ]
        m, l, o = _safe_step(carry, jnp.where(causal, _scores(qb, kb), -jnp.inf), vb)
        outs.append(o / l)
    out = jnp.concatenate(outs, axis=3) if nq > 1 else outs[0]
    return out[:, :, :, :T]


def _qkv(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, Hq: int, Hkv: int, D: int, eps: float):
    """x [B, T, Hd] -> q [B, T, Hq, D], the output gate [B, T, Hq*D], k, v [B, T, Hkv, D]: q / k
    RMS-normed and rotated (cos, sin [B, T, R]). The projections are grouped per head (so a slice of
    their columns is whole heads): qg [Hd, Hq * 2D] (query_h | gate_h, as the checkpoint's q_proj),
    kv [Hd, Hkv * 2D] (k_h | v_h); optional biases qg_bias, kv_bias alike. Under a layout that keeps
    r copies of each KV head (`parallel.kv_replicas`), k and v come back with Hkv * r heads."""
    B, T, _ = x.shape
    qg, kv = linear(x, p["qg"]), linear(x, p["kv"])
    if "qg_bias" in p:
        qg, kv = qg + p["qg_bias"], kv + p["kv_bias"]
    qg, kv = qg.reshape(B, T, Hq, 2 * D), kv.reshape(B, T, Hkv, 2 * D)
    q = rms_norm_zero_centered(qg[..., :D], p["q_norm"], eps)
    k = rms_norm_zero_centered(kv[..., :D], p["k_norm"], eps)
    k, v = apply_rope(k, cos, sin), kv[..., D:]
    r = kv_replicas(Hkv)
    if r > 1:     # the cache holds r copies of each KV head, one per device (parallel.kv_replicas)
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    return apply_rope(q, cos, sin), qg[..., D:].reshape(B, T, Hq * D), k, v


def _gated_output(p: dict, out: jax.Array, gate: jax.Array) -> jax.Array:
    """The attention output [..., Hq*D] times sigmoid(gate), then the output projection."""
    out = linear(out * jax.nn.sigmoid(gate), p["o_proj"])
    return out + p["o_bias"] if "o_bias" in p else out


def gated_attention(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                    valid: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array, *,
                    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, layer: int | None = None,
                    defer_write: bool = False, impl: str = "auto"):
    """x: [B, T, Hd]; cos, sin: [B, T, R]; positions, valid: [B, T]; k_pool, v_pool: [P, ps, Hkv, D]
    pages, or with `layer` the KV group's stacks [L, P, ps, Hkv, D], updated in place (`write_kv`);
    page_table: [B, NP].
    Returns (out [B, T, Hd], k_pool, v_pool), the pools in the shape they came in.
    defer_write: the pools are only read (the prefix, positions < positions[:, 0]; the new tokens
    attend to each other from their fresh entries, for any T) and the new entries k, v
    [B, T, Hkv, D] are returned in place of the pools, for the caller to write (`write_kv`):
    a program that branches between forwards then writes the cache once, after the branch,
    instead of in every branch (XLA copies a cache that a conditional's branches update).
    impl: how a decode step (T = 1) reads the pages: "auto" runs the ragged paged attention kernel when
    lowered for a TPU or GPU (`_decode_read`) and the paged XLA read on the CPU; "pallas" the kernel
    everywhere (interpreted on the CPU); "xla" / "reference" the paged XLA read."""
    B, T, _ = x.shape
    q, gate, k, v = _qkv(p, x, cos, sin, num_heads, num_kv_heads, head_dim, eps)
    out, k_pool, v_pool = paged_attend(q, k, v, positions, valid, k_pool, v_pool, page_table, layer=layer,
                                       defer_write=defer_write, impl=impl)
    out = _gated_output(p, out.astype(x.dtype), gate)
    return out, k_pool, v_pool


def paged_attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array,
                 k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array, *, layer: int | None = None,
                 defer_write: bool = False, impl: str = "auto"):
    """Causal GQA of q [B, T, Hq, D] (unscaled: scaled by D^-0.5 here) over the paged cache and the new
    k, v [B, T, Hkv, D], which are written first (`write_kv`) unless defer_write. Pools, layer,
    defer_write and impl as `gated_attention`. Returns (out [B, T, Hq * D] f32, k_pool, v_pool), or
    with defer_write (out, k, v)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if not defer_write:
        k_pool = write_kv(k_pool, k, page_table, positions, valid, layer)
        v_pool = write_kv(v_pool, v, page_table, positions, valid, layer)

    rep = Hq // Hkv
    qg = q.reshape(B, T, Hkv, rep, D).transpose(0, 2, 3, 1, 4) * jnp.asarray(D ** -0.5, q.dtype)  # [B, G, R, T, D]
    if T == 1 and not defer_write:
        def paged(qg, q, k_pool, v_pool):
            return _normalise(*_paged_partial(qg, k_pool, v_pool, page_table, positions, inclusive=True, layer=layer))

        def kernel(qg, q, k_pool, v_pool, how="auto"):
            return _decode_read(q, k_pool, v_pool, page_table, positions, layer, how).reshape(qg.shape)
        args = (qg, q, k_pool, v_pool)
        if impl in ("xla", "reference"):
            out = paged(*args)
        elif impl == "pallas":
            out = kernel(*args, how="pallas")
        else:
            out = jax.lax.platform_dependent(*args, cpu=paged, default=kernel)
    else:
        out = _prefill_attention(qg, k, v, k_pool, v_pool, page_table, positions, layer=layer)
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq * D)
    if defer_write:
        return out, k, v
    return out, k_pool, v_pool


_Q = (None, "heads", None)                     # [N, Hq, D]


def _decode_read(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array, positions: jax.Array,
                 layer: int | None, impl: str) -> jax.Array:
    """A decode step's attention through the ragged paged attention op (`ragged_read`): each row one
    sequence of one query, q [B, 1, Hq, D] (unscaled) at positions [B, 1], its keys the row's first
    position + 1 entries. Returns [B, Hkv, Hq / Hkv, 1, D] f32 (gated_attention's layout). A row without
    a new token reads as if it had one (its output is not used); the length is kept inside the table."""
    B, _, Hq, D = q.shape
    Hkv = k_pool.shape[-2]
    kv_lens = jnp.minimum(positions[:, 0] + 1, page_table.shape[1] * k_pool.shape[-3]).astype(jnp.int32)
    cu = jnp.arange(B + 1, dtype=jnp.int32)
    o = ragged_read(q[:, 0], k_pool, v_pool, kv_lens, page_table, cu, sm_scale=D ** -0.5, impl=impl, layer=layer,
                    max_q_len=1, decode_only=True)
    return o.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, 1, D)


def _own_kv_heads(q_heads: int, Hq: int, k_pages: jax.Array, v_pages: jax.Array):
    """Inside a per-device op whose query heads are split and whose KV pages are whole (fewer KV heads
    than devices): the KV heads this device's `q_heads` query heads read, in their order. When they
    all read one KV head (the tensor size a multiple of the KV heads), that head alone."""
    Hkv = k_pages.shape[2]
    rep = Hq // Hkv
    first = jax.lax.axis_index(MODEL) * q_heads
    if rep % q_heads == 0:
        pick = lambda a: jax.lax.dynamic_slice_in_dim(a, first // rep, 1, axis=2)  # noqa: E731
    else:
        idx = (first + jnp.arange(q_heads)) // rep
        pick = lambda a: jnp.take(a, idx, axis=2)  # noqa: E731
    return pick(k_pages), pick(v_pages)


def ragged_read(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array, page_table: jax.Array,
                cu_seqlens: jax.Array, *, sm_scale: float, impl: str = "auto", layer: int | None = None,
                max_q_len: int | None = None, decode_only: bool = False) -> jax.Array:
    """`pallas_kernels.ragged_paged_attention` for every sequence of a ragged batch, on each device's
    query heads when the heads are split (`hybrid_jax.parallel`; with fewer KV heads than devices the
    pages are whole on every device and each reads the KV heads of its own query heads).
    q [N, Hq, D]; k_pages, v_pages [P, ps, Hkv, D], or with `layer` the group's stacks [L, P, ps, Hkv, D]
    read in place (the stack seen as L * P pages, the table shifted to the layer's: a layer sliced out
    for the kernel would be a copy of its pool every step); kv_lens [S]; page_table [S, NP];
    cu_seqlens [S + 1]; max_q_len, decode_only: the op's static hints. Returns [N, Hq, D]."""
    Hq, S = q.shape[1], kv_lens.shape[0]
    lay = current()
    kv_axes = (None,) * (k_pages.ndim - 2) + ("kv_heads", None)
    kv_whole = lay is not None and tensor_size() > 1 and lay.spec(kv_axes, k_pages.shape, "KV pages")[-2] is None

    def fn(q, kp, vp, kv_lens, table, cu):
        if layer is not None:
            L, P = kp.shape[:2]
            kp, vp = kp.reshape((L * P,) + kp.shape[2:]), vp.reshape((L * P,) + vp.shape[2:])
            table = table + layer * P
        if kv_whole:
            kp, vp = _own_kv_heads(q.shape[1], Hq, kp, vp)
        return pallas_kernels.ragged_paged_attention.ragged_paged_attention(
            q, kp, vp, kv_lens, table, cu, jnp.full((1,), S, jnp.int32), sm_scale=sm_scale, impl=impl,
            max_q_len=max_q_len, decode_only=decode_only)
    return per_device(fn, (_Q, kv_axes, kv_axes, None, None, None), _Q, out_like=q)(q, k_pages, v_pages, kv_lens,
                                                                                     page_table, cu_seqlens)


def gated_attention_ragged(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, seq: jax.Array,
                           positions: jax.Array, valid: jax.Array, cu_seqlens: jax.Array, kv_lens: jax.Array,
                           k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array, *, num_heads: int,
                           num_kv_heads: int, head_dim: int, eps: float, layer: int, impl: str = "auto"):
    """`gated_attention` over a ragged batch (hybrid_jax.models.ragged): x [N, Hd]; cos, sin [N, R];
    seq, positions, valid [N]; cu_seqlens [S + 1]; kv_lens [S]: tokens each sequence holds after this
    step; k_pool, v_pool: the group's stacks [L, P, ps, Hkv, D], written in place at `layer`;
    page_table [S, NP]. The new entries are written first, then `pallas_kernels.ragged_paged_attention`
    reads each sequence's pages for its own queries. Returns (out [N, Hd], k_pool, v_pool)."""
    N = x.shape[0]
    Hq, Hkv, D = num_heads, num_kv_heads, head_dim
    q, gate, k, v = _qkv(p, x[None], cos[None], sin[None], Hq, Hkv, D, eps)
    k_pool = pinned_pool(write_paged_flat(k_pool, k[0], page_table, seq, positions, valid, layer))
    v_pool = pinned_pool(write_paged_flat(v_pool, v[0], page_table, seq, positions, valid, layer))
    o = ragged_read(q[0], k_pool, v_pool, kv_lens, page_table, cu_seqlens, sm_scale=D ** -0.5, impl=impl,
                    layer=layer)
    return _gated_output(p, o.reshape(N, Hq * D).astype(x.dtype), gate[0]), k_pool, v_pool
