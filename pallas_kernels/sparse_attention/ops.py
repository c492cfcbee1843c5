"""Public DeepSeek sparse-attention ops: one signature each, implementations chosen by `impl`.

  impl="reference"  dense scores + lax.top_k / gather + softmax (naive.py)
  impl="xla"        blocked XLA: running Top-K over key blocks, selected-row gather (xla.py)
  impl="pallas"     Pallas kernels (interpret mode on CPU)
  impl="auto"       Pallas on GPU/TPU, XLA on CPU
chosen by the platform the program is lowered for (pallas_kernels.dispatch).

Shapes and the masking contract are in common.py. The Top-K order differs between
implementations (reference/xla: best first; pallas: position order); the selected set is the same.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.sparse_attention import naive, xla
from pallas_kernels.ragged_paged_attention.common import cdiv, softmax_fold
from pallas_kernels.ragged_paged_attention.xla import gather_any
from pallas_kernels.sparse_attention.common import check_lengths, check_page_table, check_pool, physical_rows


def _pallas_indexer():
    from pallas_kernels.sparse_attention import pallas_indexer  # noqa: PLC0415
    return pallas_indexer.indexer_topk_pallas


def _pallas_mla():
    from pallas_kernels.sparse_attention import pallas_mla  # noqa: PLC0415
    return pallas_mla.sparse_mla_pallas


def indexer_topk(
    q: jax.Array,              # [B, T, H, D]
    w: jax.Array,              # [B, T, H]  per-head weights, both scales folded in (common.indexer_weights)
    k_pages: jax.Array,        # [P, ps, D] bf16 / f32, or float8_e4m3fn with k_scale
    page_table: jax.Array,     # [B, NP] int32
    q_positions: jax.Array,    # [B, T] int32, -1 for padding queries
    kv_lengths: jax.Array,     # [B] int32
    *,
    topk: int,
    k_scale: jax.Array | None = None,   # [P, ps] f32 per-token scale of fp8 keys
    impl: str = "auto",
    layer: int | None = None,
    head_axis: str | None = None,
) -> jax.Array:
    """Indices [B, T, topk] int32 of the topk best keys per query by sum_h w_h relu(q_h . k), -1 padded.
    layer: k_pages [L, P, ps, D] (and k_scale [L, P, ps]) are the layers' stacks and layer `layer` is read
    (the TPU kernel reads it in place; a slice handed to it would be a copy of the layer's keys).
    head_axis: called inside shard_map with the heads split over that mesh axis (q and w hold this
    device's heads): the per-device scores are summed over the axis before any selection, so the
    Top-K is the global one and every device returns the same indices."""
    stacks = k_pages, k_scale
    if layer is not None:
        k_pages, k_scale = _layer_of(k_pages, layer), _layer_of(k_scale, layer)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D]; got shape {q.shape}")
    B, T, H, D = q.shape
    if w.shape != (B, T, H):
        raise ValueError(f"w must be [B, T, H] = {(B, T, H)}; got {w.shape}")
    check_pool(k_pages, "k_pages", D)
    P, ps, _ = k_pages.shape
    _, NP = check_page_table(page_table, B)
    check_lengths(kv_lengths, B)
    if q_positions.shape != (B, T):
        raise ValueError(f"q_positions must be [B, T] = {(B, T)}; got {q_positions.shape}")
    if k_scale is not None and k_scale.shape != (P, ps):
        raise ValueError(f"k_scale must be [P, ps] = {(P, ps)}; got {k_scale.shape}")
    if k_pages.dtype == jnp.float8_e4m3fn and k_scale is None:
        raise ValueError("fp8 indexer keys need their per-token k_scale [P, ps]")
    if head_axis is not None and not isinstance(head_axis, str):
        raise ValueError(f"head_axis must be a mesh axis name or None; got {head_axis!r}")
    if not 0 < topk <= NP * ps:
        raise ValueError(f"topk={topk} must be in [1, context capacity {NP * ps}] (page_table has {NP} pages "
                         f"of {ps}); clamp it to the context for short requests")
    def on_args(fn, stacked=False):
        def call(q, w, kp, pt, qp, kl, ks, **be):
            if layer is None:
                return fn(q, w, kp, pt, qp, kl, topk=topk, k_scale=ks, head_axis=head_axis, **be)
            if stacked:
                return fn(q, w, kp, pt, qp, kl, topk=topk, k_scale=ks, layer=layer, head_axis=head_axis, **be)
            return fn(q, w, kp[layer], pt, qp, kl, topk=topk, k_scale=None if ks is None else ks[layer],
                      head_axis=head_axis, **be)
        return call
    return dispatch.run(
        "indexer_topk", impl, (q, w, stacks[0], page_table, q_positions, kv_lengths, stacks[1]),
        reference=on_args(naive.indexer_topk_reference), xla=on_args(xla.indexer_topk_xla, stacked=True),
        pallas=lambda: on_args(_pallas_indexer(), stacked=True))


def _layer_of(a, layer: int):
    """The shape of layer `layer` of a stack (for the checks; nothing is sliced)."""
    if a is None:
        return None
    if not 0 <= layer < a.shape[0]:
        raise ValueError(f"layer {layer} is outside the stack of {a.shape[0]} layers")
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)


def _check_mla(q_lat, q_rope, latent, rope, page_table, kv_lengths):
    if q_lat.ndim != 4 or q_rope.ndim != 4 or q_lat.shape[:3] != q_rope.shape[:3]:
        raise ValueError(f"q_lat [B, T, H, R] and q_rope [B, T, H, Dr] must agree; got {q_lat.shape}, {q_rope.shape}")
    B = q_lat.shape[0]
    check_pool(latent, "latent", q_lat.shape[-1])
    check_pool(rope, "rope", q_rope.shape[-1])
    if rope.shape[:2] != latent.shape[:2]:
        raise ValueError(f"latent and rope pools must have the same pages; got {latent.shape}, {rope.shape}")
    check_page_table(page_table, B)
    check_lengths(kv_lengths, B)


def sparse_mla_attention(
    q_lat: jax.Array,          # [B, T, H, R]  q_nope absorbed through W_uk
    q_rope: jax.Array,         # [B, T, H, Dr]
    latent: jax.Array,         # [P, ps, R]    compressed KV (normed)
    rope: jax.Array,           # [P, ps, Dr]   decoupled RoPE key
    page_table: jax.Array,     # [B, NP] int32
    indices: jax.Array,        # [B, T, K] int32 logical positions, -1 = padding
    kv_lengths: jax.Array,     # [B] int32
    *,
    scale: float,
    impl: str = "auto",
    layer: int | None = None,
    in_order: bool = False,
) -> jax.Array:
    """Absorbed-MLA attention over the selected positions -> o_lat [B, T, H, R] f32. Unreadable indices
    (negative, >= kv_lengths[b], or on a page outside the pool) are masked, never read. layer: latent and
    rope are the layers' stacks [L, P, ps, X] and layer `layer` is read (in place by the TPU kernel).
    in_order: indices[b, t, k] is k or -1 (every position of the table, `in_order_selection`): the same
    result, which the TPU kernel reads row by row in runs instead of gathering each selection."""
    stacks = latent, rope
    if layer is not None:
        latent, rope = _layer_of(latent, layer), _layer_of(rope, layer)
    _check_mla(q_lat, q_rope, latent, rope, page_table, kv_lengths)
    if indices.ndim != 3 or indices.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"indices must be [B, T, K] with B, T = {q_lat.shape[:2]}; got {indices.shape}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be integers; got dtype {indices.dtype}")
    def on_args(fn, stacked=False):
        def call(ql, qr, lat, rp, *rest, **be):
            if layer is None:
                return fn(ql, qr, lat, rp, *rest, scale=scale, **be)
            if stacked:
                return fn(ql, qr, lat, rp, *rest, scale=scale, layer=layer, **be)
            return fn(ql, qr, lat[layer], rp[layer], *rest, scale=scale, **be)
        return call
    return dispatch.run(
        "sparse_mla_attention", impl, (q_lat, q_rope, *stacks, page_table, indices, kv_lengths),
        reference=on_args(naive.sparse_mla_reference), xla=on_args(xla.sparse_mla_xla),
        pallas=lambda: on_args(functools.partial(_pallas_mla(), in_order=in_order), stacked=True))


def in_order_selection(q_positions: jax.Array, span: int) -> jax.Array:
    """[B, T, span] int32: position k where k <= the query's position, else -1 (q_positions [B, T], -1
    for padding queries): every causal position, the selection a Top-K at least `span` wide makes over
    a table of `span` positions, in the order `sparse_mla_attention(in_order=True)` reads."""
    k = jnp.arange(span, dtype=jnp.int32)
    return jnp.where(k <= q_positions[..., None], k, -1)


DENSE_BLOCK_KEYS = 512     # key positions per iteration of the dense read


def dense_mla_attention(q_lat, q_rope, latent, rope, page_table, q_positions, kv_lengths, *, scale: float,
                        layer: int | None = None, block_keys: int = DENSE_BLOCK_KEYS):
    """Dense absorbed MLA over every readable position <= each query's (XLA; Kimi-Linear's MLA).
    Shapes as sparse_mla_attention with q_positions [B, T] (-1: a padding query, which reads nothing and
    gives 0) -> [B, T, H, R] f32; layer: the pools are the layers' stacks [L, P, ps, X], read in place.
    Keys are read a block of about `block_keys` positions (whole pages) at a time through the page table,
    only as far as the step's furthest readable query position (a loop with a run-time trip count, folded
    into an online softmax): the memory and work follow the context the rows hold, never the table's
    capacity, and no [B, T, H, context] score tensor exists."""
    stacks = latent, rope
    if layer is not None:
        latent, rope = _layer_of(latent, layer), _layer_of(rope, layer)
    _check_mla(q_lat, q_rope, latent, rope, page_table, kv_lengths)
    if q_positions.shape != q_lat.shape[:2]:
        raise ValueError(f"q_positions must be [B, T] = {q_lat.shape[:2]}; got {q_positions.shape}")
    return _dense_mla(q_lat, q_rope, *stacks, page_table, q_positions, kv_lengths, scale=jnp.float32(scale),
                      layer=layer, block_keys=block_keys)



@functools.partial(jax.jit, static_argnames=("layer", "block_keys"))
def _dense_mla(q_lat, q_rope, latent, rope, page_table, q_positions, kv_lengths, *, scale, layer, block_keys):
    P, ps, R = latent.shape[-3:]
    B, NP = page_table.shape
    bp = max(1, min(NP, block_keys // ps))                                  # pages per block
    nb = cdiv(NP, bp)
    table = jnp.pad(page_table, ((0, 0), (0, nb * bp - NP)), constant_values=-1)
    qpos = jnp.minimum(q_positions, kv_lengths[:, None] - 1)                # the last key each query reads
    n = jnp.clip(cdiv(jnp.max(qpos) + 1, bp * ps), 0, nb)                   # blocks up to the furthest one
    hp = jax.lax.Precision.HIGHEST
    ql, qr = q_lat.astype(jnp.float32) * scale, q_rope.astype(jnp.float32) * scale

    def gather(pool, pages):                                                # [B, bp * ps, X] f32
        rows = gather_any(pool, pages if layer is None else (layer, pages))
        return rows.reshape(B, bp * ps, -1).astype(jnp.float32)

    def body(j, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * bp, bp, axis=1)    # [B, bp]
        on_pool = jnp.repeat((pages >= 0) & (pages < P), ps, axis=1)       # [B, bp * ps]
        safe = jnp.clip(pages, 0, P - 1)
        pos = j * bp * ps + jnp.arange(bp * ps, dtype=jnp.int32)
        readable = on_pool & (pos[None, :] < kv_lengths[:, None])
        lat = jnp.where(readable[..., None], gather(latent, safe), 0.0)     # a slot past a row's length may hold NaN
        s = (jnp.einsum("bthr,bsr->bths", ql, lat, precision=hp)
             + jnp.einsum("bthr,bsr->bths", qr, gather(rope, safe), precision=hp))
        seen = readable[:, None, :] & (pos[None, None, :] <= qpos[:, :, None])         # [B, T, bs]
        m, l, alpha, e = softmax_fold(m, l, jnp.where(seen[:, :, None, :], s, -jnp.inf))
        return m, l, alpha * acc + jnp.einsum("bths,bsr->bthr", e, lat, precision=hp)

    stat = jnp.zeros(q_lat.shape[:3] + (1,), jnp.float32)
    m, l, acc = jax.lax.fori_loop(0, n, body, (stat - jnp.inf, stat, jnp.zeros(q_lat.shape, jnp.float32)))
    return acc / jnp.where(l > 0, l, 1.0)


# Above this many (selection, page-table slot) pairs, sparse_hit_rate gathers instead of comparing.
COMPARE_PAIRS = 1 << 28


def sparse_hit_rate(indices: jax.Array, page_table: jax.Array, page_resident: jax.Array, page_size: int,
                    kv_lengths: jax.Array) -> jax.Array:
    """Fraction of the step's selected positions whose page is resident on the device, per row.

    indices [B, T, K] (-1 padded), page_table [B, NP], page_resident [P] bool -> [B] f32
    (1.0 for a row that selected nothing). The rest would have to be fetched from host or disk.

    A decode step (B * T * K * NP pairs up to COMPARE_PAIRS) counts each row's selections per page-table
    slot by comparison, with no gather of the [B, T, K] selections: a TPU pays an XLA gather a memory
    tile per gathered entry (0.7 GiB a DeepSeek-V3.2 layer at 64 rows x Top-K 2048, more than the layer's
    weights). Only the [B, NP] residency of the slots is gathered, the same for every layer of a step.
    Larger problems (prefill chunks) gather, as common.physical_rows."""
    B, T, K = indices.shape
    NP = page_table.shape[1]
    P = page_resident.shape[0]
    if B * T * K * NP > COMPARE_PAIRS:
        rows, ok = physical_rows(indices, page_table, page_size, P, kv_lengths)
        hit = ok & page_resident[rows // page_size]
        n, h = jnp.sum(ok, axis=(1, 2)), jnp.sum(hit, axis=(1, 2))
    else:
        slot_ok = (page_table >= 0) & (page_table < P)                                     # [B, NP]
        slot_hit = slot_ok & page_resident[jnp.clip(page_table, 0, P - 1)]
        ok = (indices >= 0) & (indices < kv_lengths[:, None, None]) & (indices < NP * page_size)
        slot = jnp.where(ok, indices // page_size, -1)                                     # [B, T, K]
        per_slot = jnp.sum(slot[..., None] == jnp.arange(NP, dtype=slot.dtype), axis=2, dtype=jnp.int32)
        n = jnp.sum(per_slot * slot_ok[:, None, :], axis=(1, 2))                           # [B]
        h = jnp.sum(per_slot * slot_hit[:, None, :], axis=(1, 2))
    return jnp.where(n > 0, h / jnp.maximum(n, 1), 1.0).astype(jnp.float32)
