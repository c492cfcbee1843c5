"""Pallas indexer: DeepSeek's index scores fused with the per-query Top-K selection over paged keys.

score[b, t, j] = sum_h w[b, t, h] * relu(q[b, t, h] . k[j])   (scales folded into w, fp8 scale per key)

Heads are reduced per key page on chip ([H, ps] tile -> [1, ps]); no [T, H, S] tensor exists.

Selection without `top_k` (Pallas TPU has no lowering for it): an exact threshold search.
  1. Each score is mapped to an int32 whose signed order is the float order (`ordered_int`).
  2. The K-th largest key tau is built bit by bit, most significant first, in the unsigned view:
     a bit is kept iff at least K scores are >= the candidate. 32 counting passes over the score
     row that sits in VMEM, each a compare and a sum; no sort and no data-dependent shapes.
  3. The selected set is {score > tau} plus the lowest-position keys with score == tau until K are
     taken (ties resolved by position, as XLA's top_k does). With fewer than K readable keys tau
     ends at -inf's key and every readable key is taken.
  The compaction of the selection mask into an index list (a prefix sum and a scatter, O(S) int
  work per query, ~1.5% of the bytes of the keys it replaces at D = 128) runs in XLA after the kernel.

Backends (both proven by `jax.export` tests):
  * TPU (Mosaic): grid (B, T/tq, NP); the page table, lengths and query positions are scalar-prefetched
    into SMEM and the key BlockSpec's index_map reads the page table, so the pipeline DMAs page p+1
    while page p is scored. The [tq, S] score block stays resident across the page axis; at the last
    page the threshold search runs on it. ps must be a multiple of 128.
  * GPU (Triton): a scoring kernel (grid (B, T/tq, NP), the page gathered in-kernel through the page
    table) and a threshold kernel (grid (B, T)) reading the score rows back; Triton programs run
    unordered, so no block can stay resident across pages. H is padded to 16 (zero weights) for
    tl.dot; ps and D must be powers of two.

Heads split over devices (`head_axis`, inside shard_map): each device's scores cover its heads only,
so the threshold cannot run on them. The TPU path then runs the scoring kernel alone, all-reduces the
[B, T, S] scores over the axis, and runs a threshold kernel (grid (B, T/tq), a [tq, S] block of the
summed rows) -- the same search as the fused kernel's last page; the GPU path all-reduces between its
two kernels.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.kernel_params import compiler_params, cost

INT_MIN = -(2 ** 31)


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """block_q: queries per program (TPU: a multiple of 8 or all of T)."""
    block_q: int = 8
    num_warps: int = 4        # Triton only


def _ordered(s):
    i = jax.lax.bitcast_convert_type(s, jnp.int32)
    return jnp.where(i >= 0, i, i ^ jnp.int32(0x7FFFFFFF))


def _score_tile(q, w_col, k, scale_row):
    """q [H, D], w_col [H, 1], k [ps, D] (f32), scale_row [1, ps] | None -> [1, ps]."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)                  # [H, ps]
    s = jnp.sum(jax.nn.relu(s) * w_col, axis=0, keepdims=True)                   # [1, ps]
    return s if scale_row is None else s * scale_row


def _mask(s, p, ps, qpos, length, page_ok):
    pos = p * ps + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.where((pos <= qpos) & (pos < length) & page_ok, s, -jnp.inf)


def _kth_largest(load_row_block, n_blocks: int, topk: int):
    """The ordered-int key [1, 1] of the K-th largest score of one row (see module docstring)."""
    def count(thr):                                                               # [1, 1] int32
        def body(p, acc):
            return acc + jnp.sum((_ordered(load_row_block(p)) >= thr).astype(jnp.int32), axis=1, keepdims=True)
        return jax.lax.fori_loop(0, n_blocks, body, jnp.zeros((1, 1), jnp.int32))

    def bit_step(_, carry):
        ans, bit = carry
        cand = ans | bit
        ans = jnp.where(count(cand ^ jnp.int32(INT_MIN)) >= topk, cand, ans)
        return ans, jax.lax.shift_right_logical(bit, jnp.ones_like(bit))

    ans, _ = jax.lax.fori_loop(0, 32, bit_step, (jnp.zeros((1, 1), jnp.int32),
                                                 jnp.full((1, 1), INT_MIN, jnp.int32)))
    return ans ^ jnp.int32(INT_MIN)


def _thresholds(s_ref, tau_ref, *, tq, ps, NP, topk):
    """tau_ref [tq, 1] <- the K-th largest key of each of the tq score rows of s_ref [tq, S]."""
    for r in range(tq):
        def load(j, r=r):
            return s_ref[pl.ds(r, 1), pl.ds(pl.multiple_of(j * ps, ps), ps)]
        tau_ref[pl.ds(r, 1), :] = _kth_largest(load, NP, topk)


def _tpu_kernel(pt_ref, len_ref, qpos_ref,             # SMEM: [B * NP], [B], [B * Tp]
                q_ref,                                 # [tq, H, D]
                w_ref,                                 # [tq, H, 1] f32
                k_ref,                                 # [ps, D]
                *rest, tq, ps, NP, P, Tp, topk, has_scale, threshold):
    rest = list(rest)
    scale_row = rest.pop(0)[...].astype(jnp.float32) if has_scale else None     # [1, ps]
    s_ref = rest.pop(0)                                                           # [tq, S] f32
    b, i, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = pt_ref[b * NP + p]
    page_ok = (page >= 0) & (page < P)
    k = k_ref[...].astype(jnp.float32)
    for r in range(tq):
        s = _score_tile(q_ref[r].astype(jnp.float32), w_ref[r], k, scale_row)
        s = _mask(s, p, ps, qpos_ref[b * Tp + i * tq + r], len_ref[b], page_ok)
        s_ref[pl.ds(r, 1), pl.ds(pl.multiple_of(p * ps, ps), ps)] = s

    if threshold:                                      # else the scores are summed over devices first
        @pl.when(p == NP - 1)
        def _():
            _thresholds(s_ref, rest[0], tq=tq, ps=ps, NP=NP, topk=topk)      # [tq, 1] int32


def _tpu_threshold_kernel(s_ref, tau_ref, *, tq, ps, NP, topk):     # [tq, S] f32 -> [tq, 1] int32
    _thresholds(s_ref, tau_ref, tq=tq, ps=ps, NP=NP, topk=topk)


def _gpu_score_kernel(pt_ref, len_ref, qpos_ref,      # [B, NP], [B, 1], [B, Tp] int32
                      q_ref, w_ref,                   # [tq, H, D], [tq, H, 1]
                      k_ref,                          # [P * ps, D] (whole pool: in-kernel gather)
                      *rest, tq, ps, P, topk, has_scale):
    if has_scale:
        sc_ref, s_ref = rest                          # [P, ps]; [tq, ps]
    else:
        (s_ref,), sc_ref = rest, None
    b, i, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = pt_ref[b, p]
    page_ok = (page >= 0) & (page < P)
    safe = jnp.clip(page, 0, P - 1)
    k = k_ref[pl.ds(safe * ps, ps), :].astype(jnp.float32)
    scale_row = None if sc_ref is None else sc_ref[pl.ds(safe, 1), :].astype(jnp.float32)
    for r in range(tq):
        s = _score_tile(q_ref[r].astype(jnp.float32), w_ref[r], k, scale_row)
        s_ref[pl.ds(r, 1), :] = _mask(s, p, ps, qpos_ref[b, i * tq + r], len_ref[b, 0], page_ok)


def _gpu_threshold_kernel(s_ref, tau_ref, *, ps, NP, topk):     # [1, S] f32 -> [1, 1]
    tau_ref[...] = _kth_largest(lambda j: s_ref[:, pl.ds(j * ps, ps)], NP, topk)


@functools.partial(jax.jit, static_argnames=("topk", "config", "backend", "interpret", "layer", "head_axis"))
def index_scores_threshold_pallas(q, w, k_pages, page_table, q_positions, kv_lengths, *, topk: int,
                                  k_scale=None, config: IndexerConfig = IndexerConfig(),
                                  backend: str = "tpu", interpret: bool = False, layer: int | None = None,
                                  head_axis: str | None = None):
    """q [B, T, H, D], w [B, T, H] f32 (scales folded), k_pages [P, ps, D] (bf16/f32/fp8),
    k_scale [P, ps] | None, page_table [B, NP], q_positions [B, T], kv_lengths [B]
    -> (scores [B, T, S] f32 (-inf = not selectable), tau [B, T] int32 ordered key of the K-th best).
    head_axis: inside shard_map with the heads split over that mesh axis, the scoring kernel's partial
    scores (this device's heads) are summed over it (psum) before the threshold kernel runs on them."""
    if layer is not None and backend != "tpu":
        k_pages, k_scale, layer = k_pages[layer], None if k_scale is None else k_scale[layer], None
    B, T, H, D = q.shape
    P, ps, _ = k_pages.shape[-3:]
    NP = page_table.shape[1]
    # with `layer`, k_pages [L, P, ps, D] and k_scale [L, P, ps] are the layers' stacks: the key blocks are
    # fetched out of the stack (a slice handed to the kernel would copy the layer's pool)
    lead = () if layer is None else (None,)
    at = (lambda *i: i) if layer is None else (lambda *i: (layer, *i))  # noqa: E731
    S = NP * ps
    tq = T if T <= config.block_q else config.block_q
    Tp = -(-T // tq) * tq
    padT = ((0, 0), (0, Tp - T))
    q = jnp.pad(q, padT + ((0, 0), (0, 0)))
    w = jnp.pad(w.astype(jnp.float32), padT + ((0, 0),))
    qpos = jnp.pad(q_positions.astype(jnp.int32), padT, constant_values=-1)
    pt = page_table.astype(jnp.int32)
    lens = kv_lengths.astype(jnp.int32)
    has_scale = k_scale is not None
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        if ps % 128 and not interpret:
            raise KernelUnsupported(f"the TPU indexer kernel needs a page size that is a multiple of 128; got {ps}")
        in_specs = [pl.BlockSpec((None, tq, H, D), lambda b, i, p, *_: (b, i, 0, 0)),
                    pl.BlockSpec((None, tq, H, 1), lambda b, i, p, *_: (b, i, 0, 0)),
                    pl.BlockSpec((*lead, None, ps, D), lambda b, i, p, pt_, *_: at(
                        jnp.clip(pt_[b * NP + p], 0, P - 1), 0, 0))]
        args = [q, w[..., None], k_pages]
        if has_scale:
            in_specs.append(pl.BlockSpec((*lead, None, 1, ps), lambda b, i, p, pt_, *_: at(
                jnp.clip(pt_[b * NP + p], 0, P - 1), 0, 0)))
            args.append(k_scale.astype(jnp.float32).reshape(*k_scale.shape[:-1], 1, ps))
        fused = head_axis is None              # the threshold in the scoring kernel, on its resident rows
        score_spec = pl.BlockSpec((None, tq, S), lambda b, i, p, *_: (b, i, 0))
        tau_spec = pl.BlockSpec((None, tq, 1), lambda b, i, p, *_: (b, i, 0))
        score_shape = jax.ShapeDtypeStruct((B, Tp, S), jnp.float32)
        tau_shape = jax.ShapeDtypeStruct((B, Tp, 1), jnp.int32)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(B, Tp // tq, NP), in_specs=in_specs,
            out_specs=[score_spec, tau_spec] if fused else [score_spec])
        kernel = functools.partial(_tpu_kernel, tq=tq, ps=ps, NP=NP, P=P, Tp=Tp, topk=topk, has_scale=has_scale,
                                   threshold=fused)
        outs = pl.pallas_call(
            kernel, grid_spec=grid_spec, out_shape=[score_shape, tau_shape] if fused else [score_shape],
            compiler_params=compiler_params("tpu", ("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="dsa_indexer_topk" if fused else "dsa_indexer_scores",
            cost_estimate=_cost(q, jax.ShapeDtypeStruct(k_pages.shape[-3:], k_pages.dtype), k_scale, NP, tq,
                                threshold=fused),
        )(pt.reshape(-1), lens, qpos.reshape(-1), *args)
        if fused:
            scores, tau = outs
        else:
            scores = jax.lax.psum(outs[0], head_axis)
            tau = pl.pallas_call(
                functools.partial(_tpu_threshold_kernel, tq=tq, ps=ps, NP=NP, topk=topk), grid=(B, Tp // tq),
                in_specs=[pl.BlockSpec((None, tq, S), lambda b, i: (b, i, 0))],
                out_specs=pl.BlockSpec((None, tq, 1), lambda b, i: (b, i, 0)), out_shape=tau_shape,
                compiler_params=compiler_params("tpu", ("parallel", "parallel")), interpret=interpret,
                name="dsa_indexer_threshold", cost_estimate=_threshold_cost(B, Tp, S))(scores)
        return scores[:, :T], tau[:, :T, 0]
    # GPU: pad heads to a multiple of 16 (tl.dot) with zero weights; relu(q.k) * 0 adds nothing.
    Hp = max(16, 1 << (H - 1).bit_length())
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Hp - H), (0, 0)))
    w = jnp.pad(w, ((0, 0), (0, 0), (0, Hp - H)))
    for name, x in (("page size", ps), ("D", D)):
        if x & (x - 1):
            raise KernelUnsupported(f"the Triton indexer kernel needs {name} a power of two; got {x}")
    in_specs = [pl.BlockSpec((B, NP), lambda b, i, p: (0, 0)), pl.BlockSpec((B, 1), lambda b, i, p: (0, 0)),
                pl.BlockSpec((B, Tp), lambda b, i, p: (0, 0)),
                pl.BlockSpec((None, tq, Hp, D), lambda b, i, p: (b, i, 0, 0)),
                pl.BlockSpec((None, tq, Hp, 1), lambda b, i, p: (b, i, 0, 0)),
                pl.BlockSpec((P * ps, D), lambda b, i, p: (0, 0))]
    args = [pt, lens[:, None], qpos, q, w[..., None], k_pages.reshape(P * ps, D)]
    if has_scale:
        in_specs.append(pl.BlockSpec((P, ps), lambda b, i, p: (0, 0)))
        args.append(k_scale.astype(jnp.float32))
    kernel = functools.partial(_gpu_score_kernel, tq=tq, ps=ps, P=P, topk=topk, has_scale=has_scale)
    scores = pl.pallas_call(
        kernel, grid=(B, Tp // tq, NP), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, tq, ps), lambda b, i, p: (b, i, p)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, S), jnp.float32),
        compiler_params=compiler_params("gpu", (), config.num_warps), interpret=interpret,
        name="dsa_indexer_scores", cost_estimate=_cost(q, k_pages, k_scale, NP, tq, threshold=False))(*args)
    if head_axis is not None:
        scores = jax.lax.psum(scores, head_axis)
    tau = pl.pallas_call(
        functools.partial(_gpu_threshold_kernel, ps=ps, NP=NP, topk=topk), grid=(B, Tp),
        in_specs=[pl.BlockSpec((None, 1, S), lambda b, t: (b, t, 0))],
        out_specs=pl.BlockSpec((None, 1, 1), lambda b, t: (b, t, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, 1), jnp.int32),
        compiler_params=compiler_params("gpu", (), config.num_warps), interpret=interpret,
        name="dsa_indexer_threshold", cost_estimate=_threshold_cost(B, Tp, S))(scores)
    return scores[:, :T], tau[:, :T, 0]


def _cost(q, k_pages, k_scale, NP, tq, *, threshold: bool):
    """Per query and key: the [H, D] x [D] scores, relu, weight and head sum (2 H D + 3 H flops); the
    threshold search makes 32 counting passes over the row (2 flops a key each). Bytes: queries and
    weights once, every page of the row once per block of tq queries, the f32 score rows written."""
    B, Tp, H, D = q.shape
    ps = k_pages.shape[1]
    S = NP * ps
    n = B * Tp * S
    per_key = D * k_pages.dtype.itemsize + (4 if k_scale is not None else 0)
    keys = B * (Tp // tq) * S * per_key
    return cost(n * (2 * H * D + 3 * H + (64 if threshold else 0)), 0, q,
                extra_bytes=B * Tp * H * 4 + keys + n * 4 + B * Tp * 4)


def _threshold_cost(B, Tp, S):
    """The threshold search alone: 32 counting passes over each f32 score row, read from HBM once."""
    return cost(B * Tp * S * 64, 0, extra_bytes=B * Tp * S * 4 + B * Tp * 4)


def _count_prefix(mask, blk: int = 128):
    """Inclusive prefix count of a bool mask [..., S] -> int32 [..., S]: within 128-wide blocks a product
    with a triangular matrix (exact in f32 for counts below 2^24), then a short cumsum over the block
    totals. Same values as jnp.cumsum; the TPU compiler takes a third of the time over a 32k row."""
    *lead, n = mask.shape
    pad = (-n) % blk
    x = jnp.pad(mask.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, pad)]).reshape(*lead, (n + pad) // blk, blk)
    tri = jnp.triu(jnp.ones((blk, blk), jnp.float32))
    within = jnp.einsum("...pi,ij->...pj", x, tri, precision=jax.lax.Precision.HIGHEST)
    total = within[..., -1]
    before = jnp.cumsum(total, axis=-1) - total
    return (within + before[..., None]).reshape(*lead, n + pad)[..., :n].astype(jnp.int32)


def select_from_threshold(scores, tau, topk: int):
    """Compaction (XLA): scores [B, T, S] f32, tau [B, T] -> indices [B, T, topk] int32 in position
    order, -1 padded. Takes score > tau, then score == tau by position until topk are taken."""
    key = _ordered(scores)
    t = tau[..., None]
    finite = jnp.isfinite(scores)
    n_gt = jnp.sum(key > t, axis=-1, keepdims=True)
    eq = (key == t) & finite
    eq_rank = _count_prefix(eq) - 1
    sel = ((key > t) & finite) | (eq & (eq_rank < topk - n_gt))
    rank = _count_prefix(sel) - 1
    S = scores.shape[-1]
    slot = jnp.where(sel, rank, topk)                                  # topk: out of range, dropped
    B, T = tau.shape
    out = jnp.full((B, T, topk), -1, jnp.int32)
    bi = jnp.arange(B)[:, None, None]
    ti = jnp.arange(T)[None, :, None]
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), scores.shape)
    return out.at[bi, ti, slot].set(pos, mode="drop")


def indexer_topk_pallas(q, w, k_pages, page_table, q_positions, kv_lengths, *, topk: int, k_scale=None,
                        config: IndexerConfig = IndexerConfig(), backend: str = "tpu", interpret: bool = False,
                        layer: int | None = None, head_axis: str | None = None):
    """Shapes as ops.indexer_topk -> indices [B, T, topk] int32 in position order, -1 padded: the kernel's
    scores and threshold, then the compaction (XLA). head_axis: see index_scores_threshold_pallas."""
    scores, tau = index_scores_threshold_pallas(q, w, k_pages, page_table, q_positions, kv_lengths, topk=topk,
                                                k_scale=k_scale, config=config, backend=backend,
                                                interpret=interpret, layer=layer, head_axis=head_axis)
    return select_from_threshold(scores, tau, topk)
