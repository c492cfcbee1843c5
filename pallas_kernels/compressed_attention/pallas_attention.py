"""Pallas sparse read for DeepSeek-V4: shared K=V multi-query attention over a sliding window plus compressed
entries, with a per-head attention sink.

  o[b, t, h] = sum_j p_j v_j,  p = softmax over {q_h . k_j * scale : j visible} ∪ {sink_h}, sink column dropped
  keys = values: window keys kv[b, s] (kpos in (p - window, p]) and the entries the query reads:
    gather (CSA)  entries[indices[b, t, :]] (readable ones), a different set per query
    dense  (HCA)  every readable entry j of the row with (j + 1) * rate <= p + 1, read page by page

The sink is the online softmax's starting point: running max = sink_h, running sum = 1, accumulator = 0;
every key then folds in as usual and the result is acc / sum. One program owns one query token and all H
heads: K = V is one shared head, so a block of keys (the window, an HCA entry page) is scored as one
[H, D] x [D, S] matmul; CSA's gathered entries fold in one row at a time.

Reuse, and where it stops:
  * Entry addressing is the DSA one: logical entry ids -> physical pool rows through a page table, with a
    readable flag (sparse_attention.common.physical_rows, an XLA prologue over [B, T, K] ints); the CSA
    layer's ids come from the shared DSA indexer op (sparse_attention.indexer_topk), unchanged.
  * The DSA sparse-MLA kernel (sparse_attention/pallas_mla.py) cannot be reused for the attention itself:
    its keys are split latent [R] + decoupled rope [Dr] with values = the latent part only, while V4's key
    and value are the same full D row; it has no sink logit and returns normalised outputs without the
    log-sum-exp, so a sink (or the window keys) can't be merged in afterwards; and it reads one paged pool
    by index lists, while V4 also reads the sliding window (ring + this step's tokens) under a position
    rule, and HCA reads whole entry pages. This kernel keeps the MLA kernel's gather structure for CSA's
    entries and adds the window block, the dense page walk and the sink.

Backends (both proven by `jax.export` tests):
  * TPU (Mosaic): grid (B, T, J). Query positions and the entries' rows / flags (gather) or the page table
    and counts (dense) are scalar-prefetched into SMEM. The window block [S, D] and its positions stay
    resident across J (index map constant in j) and are folded in at j = 0. gather: J = K / bk, the pool
    stays in HBM and each step DMAs its bk selected rows (pallas_kernels.row_gather, bf16 rows in aligned
    8-row groups), prefetching step j + 1's while step j computes; dense: J = NP, the entry BlockSpec's
    index_map reads the page table, so the pipeline fetches page j + 1 while page j computes.
    Running statistics live in VMEM scratch.
  * GPU (Triton): grid (B, T); the window block is scored with one tl.dot, then the program walks the
    selected rows (gather) or the row's pages (dense, one tl.dot per page), loading each from the whole
    pool in-kernel. D (and, dense, the page size) must be powers of two >= 16; H, S and K are padded to
    powers of two (H, S to >= 16) with masked / zero entries.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import abi
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.compressed_attention.common import hca_reach
from pallas_kernels import row_gather
from pallas_kernels.kernel_params import compiler_params, cost
from pallas_kernels.row_gather import RowGather
from pallas_kernels.sparse_attention.common import physical_rows

ABI = abi.V4_SPARSE_READ
HP = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """block_k: selected entries DMA'd per TPU grid step (K is padded up to a multiple)."""
    block_k: int = 8
    num_warps: int = 4        # Triton only


def _block_fold(q, keys, ok, scale, m, l, acc):
    """A block of keys = values: q [H, D], keys [S, D] f32, ok [1, S] bool; m, l [H, 1]; acc [H, D]."""
    s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=HP,
                            preferred_element_type=jnp.float32) * scale            # [H, S]
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))                      # finite: m starts at the sink
    alpha = jnp.exp(m - m_new)
    e = jnp.exp(s - m_new)
    pv = jax.lax.dot_general(e, keys, (((1,), (0,)), ((), ())), precision=HP, preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(e, axis=1, keepdims=True), alpha * acc + pv


def _window_ok(kpos, p, window):
    """kpos [1, S] int32, p scalar -> [1, S] bool (common.window_mask's rule)."""
    return (kpos >= 0) & (kpos <= p) & (kpos > p - window)


def _dense_ok(i, ps, page, P, count, p, rate, column=False):
    """Entry page i of the row (HCA): [1, ps] bool ([ps, 1] with column), readable and closed at or before
    position p."""
    shape, axis = ((ps, 1), 0) if column else ((1, ps), 1)
    pos = i * ps + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return (pos < count) & (page >= 0) & (page < P) & ((pos + 1) * rate <= p + 1)


def _dense_fold(q, keys, i, ps, page, P, count, p, rate, scale, m, l, acc):
    """Folds entry page i ([ps, D] f32) into the running softmax; its unreadable slots (past the row's count,
    not yet closed, off the pool) are zeroed first: a slot past a row's count may hold anything, NaN too,
    and a zero weight times NaN is NaN."""
    keys = jnp.where(_dense_ok(i, ps, page, P, count, p, rate, column=True), keys, 0.0)
    return _block_fold(q, keys, _dense_ok(i, ps, page, P, count, p, rate), scale, m, l, acc)


def _dense_pages(count, p, rate, ps):
    """How many of a row's entry pages a query at position p reads (`common.hca_reach`, whole pages): pages
    past it are neither fetched nor folded."""
    return jax.lax.div(hca_reach(count, p, rate) + (ps - 1), jnp.int32(ps))


def _row_fold(q, row, ok, scale, m, l, acc):
    """One entry: q [H, D], row [1, D], ok bool scalar."""
    s = jnp.where(ok, jnp.sum(q * row, axis=1, keepdims=True) * scale, -jnp.inf)  # [H, 1]
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp(m - m_new)
    e = jnp.exp(s - m_new)
    return m_new, alpha * l + e, alpha * acc + e * row


def _tpu_kernel(qpos_ref,                             # SMEM [B * T] int32
                *refs, mode, bk, K, T, NP, P, ps, G, rate, window, scale):
    if mode == "gather":
        rows_ref, ok_ref = refs[:2]                    # SMEM [B * T * K] int32
    elif mode == "dense":
        pt_ref, cnt_ref = refs[:2]                     # SMEM [B * NP], [B] int32
    refs = refs[2:] if mode != "window" else refs
    q_ref, kv_ref, kpos_ref, sink_ref = refs[:4]       # [H, D], [S, D], [1, S], [H, 1]
    refs = refs[4:]
    if mode == "gather":
        pool_hbm, o_ref, buf, sem, m_sc, l_sc, acc_sc = refs   # pool [P, ps, D] in HBM; row_gather scratch
    elif mode == "dense":
        page_ref, o_ref, m_sc, l_sc, acc_sc = refs     # [ps, D]: this step's entry page
    else:
        o_ref, m_sc, l_sc, acc_sc = refs
    b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q = q_ref[...].astype(jnp.float32)
    p = qpos_ref[b * T + t]

    @pl.when(j == 0)
    def _():
        m0 = sink_ref[...].astype(jnp.float32)
        m, l, acc = _block_fold(q, kv_ref[...].astype(jnp.float32), _window_ok(kpos_ref[...], p, window), scale,
                                m0, jnp.ones_like(m0), jnp.zeros(acc_sc.shape, jnp.float32))
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    if mode == "gather":
        gather = RowGather(rows_ref, (pool_hbm,), (buf,), sem, ps, bk, G)

        def base_of(jj):
            return (b * T + t) * K + jj * bk
        slot = gather.pipeline(j, pl.num_programs(2), base_of)
        m, l, acc = m_sc[...], l_sc[...], acc_sc[...]
        base = base_of(j)
        for i in range(bk):
            m, l, acc = _row_fold(q, gather.row(0, slot, i, base), ok_ref[base + i] == 1, scale, m, l, acc)
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc
    elif mode == "dense":
        @pl.when(j < _dense_pages(cnt_ref[b], p, rate, ps))
        def _():
            m_sc[...], l_sc[...], acc_sc[...] = _dense_fold(q, page_ref[...].astype(jnp.float32), j, ps,
                                                            pt_ref[b * NP + j], P, cnt_ref[b], p, rate, scale,
                                                            m_sc[...], l_sc[...], acc_sc[...])

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)


def _gpu_kernel(qpos_ref,                             # [1] int32
                *refs, mode, K, NP, P, ps, rate, window, scale):
    if mode == "gather":
        rows_ref, ok_ref = refs[:2]                    # [K] int32
    elif mode == "dense":
        pt_ref, cnt_ref = refs[:2]                     # [B, NP], [B, 1] int32 (whole)
    refs = refs[2:] if mode != "window" else refs
    q_ref, kv_ref, kpos_ref, sink_ref = refs[:4]       # [H, D], [S, D], [1, S], [H, 1]
    pool_ref = refs[4] if mode != "window" else None   # [P * ps, D] (whole pool: in-kernel gather)
    o_ref = refs[-1]                                   # [H, D]
    q = q_ref[...].astype(jnp.float32)
    p = qpos_ref[0]
    m0 = sink_ref[...].astype(jnp.float32)
    carry = _block_fold(q, kv_ref[...].astype(jnp.float32), _window_ok(kpos_ref[...], p, window), scale,
                        m0, jnp.ones_like(m0), jnp.zeros(o_ref.shape, jnp.float32))
    if mode == "gather":
        def body(i, c):
            row = pool_ref[pl.ds(rows_ref[i], 1), :].astype(jnp.float32)
            return _row_fold(q, row, ok_ref[i] == 1, scale, *c)
        carry = jax.lax.fori_loop(0, K, body, carry)
    elif mode == "dense":
        b = pl.program_id(0)
        count = cnt_ref[b, 0]

        def body(i, c):
            page = pt_ref[b, i]
            keys = pool_ref[pl.ds(jnp.clip(page, 0, P - 1) * ps, ps), :].astype(jnp.float32)
            return _dense_fold(q, keys, i, ps, page, P, count, p, rate, scale, *c)
        carry = jax.lax.fori_loop(0, jnp.minimum(_dense_pages(count, p, rate, ps), NP), body, carry)
    _, l, acc = carry
    o_ref[...] = (acc / l).astype(o_ref.dtype)


def _cost(q, kv, entries, mode, K, NP, ps, G):
    """Per query token and key (window, gathered or dense entries): the score and the value product over
    all H heads (4 H D flops, H exp). Bytes: the queries, each row's window once, the entries every query
    reads (K gathered rows, G rows a DMA, or every page of the row), the f32 output."""
    B, T, H, D = q.shape
    S = kv.shape[1]
    per_query = {"window": 0, "gather": K, "dense": NP * ps}[mode]
    ent_bytes = 0 if entries is None else B * T * per_query * D * entries.dtype.itemsize * (G if mode == "gather" else 1)
    return cost(B * T * (S + per_query) * 4 * H * D, B * T * (S + per_query) * H, q,
                extra_bytes=B * S * D * kv.dtype.itemsize + ent_bytes + B * T * H * D * 4)


def _pow2(x: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(x, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("window", "scale", "rate", "config", "backend", "interpret"))
def attention_pallas(q, kv, kv_positions, q_positions, entries, page_table, indices, entry_counts, sinks, *,
                     window: int, scale: float, rate: int | None = None, config: AttentionConfig = AttentionConfig(),
                     backend: str = "tpu", interpret: bool = False):
    """Shapes as ops.compressed_sparse_read: q [B, T, H, D], kv [B, S, D], kv_positions [B, S], q_positions [B, T],
    entries [P, ps, D] | None, page_table [B, NP], indices [B, T, K] | None (None with rate: HCA),
    entry_counts [B], sinks [H] -> [B, T, H, D] f32."""
    B, T, H, D = q.shape
    S = kv.shape[1]
    mode = "window" if entries is None else ("dense" if indices is None else "gather")
    K = indices.shape[2] if mode == "gather" else 0
    P, ps = entries.shape[:2] if mode != "window" else (0, 0)
    NP = page_table.shape[1] if mode != "window" else 0
    qpos = q_positions.astype(jnp.int32)
    kpos = kv_positions.astype(jnp.int32)
    sk = sinks.astype(jnp.float32)
    if mode == "gather":
        rows, ok = physical_rows(indices.astype(jnp.int32), page_table.astype(jnp.int32), ps, P,
                                 entry_counts.astype(jnp.int32))                  # [B, T, K]
        ok = ok.astype(jnp.int32)
    if mode != "window":
        pt, counts = page_table.astype(jnp.int32), entry_counts.astype(jnp.int32)
    static = dict(mode=mode, P=P, ps=ps, rate=rate, window=window, scale=scale)
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        bk = min(config.block_k, K) if K else 0
        Kp = -(-K // bk) * bk if K else 0
        G = row_gather.check_pool(entries.dtype, ps, "V4 sparse read") if mode == "gather" else 1
        nj = {"window": 1, "gather": max(Kp // max(bk, 1), 1), "dense": NP}[mode]
        prefetch = [qpos.reshape(-1)]
        ent_specs, ent_args = [], []
        if mode == "gather":
            pad = ((0, 0), (0, 0), (0, Kp - K))
            prefetch += [jnp.pad(rows, pad).reshape(-1), jnp.pad(ok, pad).reshape(-1)]
            ent_specs, ent_args = [pl.BlockSpec(memory_space=pl.ANY)], [entries]
        elif mode == "dense":
            prefetch += [pt.reshape(-1), counts]
            # past the last page the query reads, the block index stays on it: no new page is fetched
            def page_of(b, t, j, qp_, pt_, cnt_):
                last = jnp.maximum(_dense_pages(cnt_[b], qp_[b * T + t], rate, ps) - 1, 0)
                return jnp.clip(pt_[b * NP + jnp.minimum(j, last)], 0, P - 1), 0, 0
            ent_specs = [pl.BlockSpec((None, ps, D), page_of)]
            ent_args = [entries]
        in_specs = [pl.BlockSpec((None, None, H, D), lambda b, t, j, *_: (b, t, 0, 0)),
                    pl.BlockSpec((None, S, D), lambda b, t, j, *_: (b, 0, 0)),
                    pl.BlockSpec((None, 1, S), lambda b, t, j, *_: (b, 0, 0)),
                    pl.BlockSpec((H, 1), lambda b, t, j, *_: (0, 0))] + ent_specs
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(B, T, nj), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, H, D), lambda b, t, j, *_: (b, t, 0, 0)),
            scratch_shapes=(row_gather.scratch([(D, entries.dtype)], bk, G) if mode == "gather" else [])
            + [pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, D), jnp.float32)])
        return pl.pallas_call(
            functools.partial(_tpu_kernel, bk=bk, K=Kp, T=T, NP=NP, G=G, **static), grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct((B, T, H, D), jnp.float32),
            compiler_params=compiler_params("tpu", ("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="v4_sparse_read", cost_estimate=_cost(q, kv, entries, mode, K, NP, ps, G),
        )(*prefetch, q, kv, kpos.reshape(B, 1, S), sk.reshape(H, 1), *ent_args)
    if D & (D - 1) or D < 16:
        raise KernelUnsupported(f"the Triton V4 attention kernel needs D a power of two >= 16; got {D}")
    if mode == "dense" and (ps & (ps - 1) or ps < 16):
        raise KernelUnsupported(f"the Triton V4 attention kernel reads HCA entries by page: page size a power of two "
                         f">= 16; got {ps}")
    Hp, Sp = _pow2(H, 16), _pow2(S, 16)
    args = [qpos[..., None]]
    in_specs = [pl.BlockSpec((None, None, 1), lambda b, t: (b, t, 0))]
    Kp = _pow2(K) if K else 0
    if mode == "gather":
        pad = ((0, 0), (0, 0), (0, Kp - K))
        args += [jnp.pad(rows, pad), jnp.pad(ok, pad)]
        in_specs += [pl.BlockSpec((None, None, Kp), lambda b, t: (b, t, 0))] * 2
    elif mode == "dense":
        args += [pt, counts[:, None]]
        in_specs += [pl.BlockSpec((B, NP), lambda b, t: (0, 0)), pl.BlockSpec((B, 1), lambda b, t: (0, 0))]
    args += [jnp.pad(q, ((0, 0), (0, 0), (0, Hp - H), (0, 0))), jnp.pad(kv, ((0, 0), (0, Sp - S), (0, 0))),
             jnp.pad(kpos, ((0, 0), (0, Sp - S)), constant_values=-1).reshape(B, 1, Sp),
             jnp.pad(sk, (0, Hp - H)).reshape(Hp, 1)]
    in_specs += [pl.BlockSpec((None, None, Hp, D), lambda b, t: (b, t, 0, 0)),
                 pl.BlockSpec((None, Sp, D), lambda b, t: (b, 0, 0)),
                 pl.BlockSpec((None, 1, Sp), lambda b, t: (b, 0, 0)),
                 pl.BlockSpec((Hp, 1), lambda b, t: (0, 0))]
    if mode != "window":
        args.append(entries.reshape(P * ps, D))
        in_specs.append(pl.BlockSpec((P * ps, D), lambda b, t: (0, 0)))
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, K=Kp, NP=NP, **static), grid=(B, T), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, Hp, D), lambda b, t: (b, t, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, Hp, D), jnp.float32),
        compiler_params=compiler_params("gpu", (), config.num_warps), interpret=interpret,
        name="v4_sparse_read", cost_estimate=_cost(q, kv, entries, mode, K, NP, ps, 1),
    )(*args)
    return out[:, :, :H]
