"""Pallas sparse MLA: absorbed-form attention over only the selected positions of a paged latent cache.

  o_lat[b, t, h] = softmax_j(scale * (q_lat[h] . c[j] + q_rope[h] . k_rope[j])) @ c[j],
  j over indices[b, t, :] (readable ones; see common.py)

The caller absorbs W_uk into q (q_lat = q_nope @ W_uk) and W_uv into the output, so the kernel reads
R + Dr values per selected token and nothing per head. Softmax is online (running max, sum, and
accumulator [H, R] in f32), one selected token at a time.

The logical indices are turned into physical pool rows (page_table[b, j // ps] * ps + j % ps, with a
readable flag; common.physical_rows): on TPU inside the kernel, from the row's page table in SMEM (an
XLA gather of B * T * K table entries costs a TPU a memory tile per entry); for Triton by an XLA
prologue over [B, T, K] ints. Unreadable rows point at row 0 and are masked in the kernel, so no index
reaches another request's pages.

Backends (both proven by `jax.export` tests):
  * TPU (Mosaic): grid (B, T, K / bk). Each (b, t)'s K selections and its row's page table come into
    SMEM as blocks of the [B, T, K] and [B, NP] arrays (not scalar-prefetched whole: at 64 rows x Top-K
    2048, or a 2048-token prefill chunk, they are 1 to 32 MiB, and SMEM holds 1 MiB); kv_lengths [B]
    is scalar-prefetched; the pools stay in HBM and every grid step DMAs its bk scattered rows (pallas_kernels.row_gather), fetching
    step i + 1's rows while step i computes. bf16 rows travel in aligned 8-row groups, so pages must
    hold a multiple of 8 tokens. A selection of every position in order (`in_order`: a Top-K as wide
    as the table) is read in runs instead, one DMA per bk consecutive rows (row_gather.RowRun): each
    row once, where the gather moves 8 rows per selection. Running statistics live in VMEM scratch; the output block is
    resident across the K axis.
  * GPU (Triton): grid (B, T); the program loops over the K selected rows and gathers each from the
    whole pool in-kernel. H, R, Dr must be powers of two (H is padded).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels import row_gather
from pallas_kernels.kernel_params import compiler_params, cost
from pallas_kernels.row_gather import RowGather, RowRun
from pallas_kernels.sparse_attention.common import physical_rows


@dataclasses.dataclass(frozen=True)
class SparseMLAConfig:
    """block_k: selected rows DMA'd per TPU grid step (must divide K)."""
    block_k: int = 8
    num_warps: int = 4        # Triton only


def _online_step(q_lat, q_rope, lat, rp, ok, scale, m, l, acc):
    """One token: q_lat [H, R], q_rope [H, Dr], lat [1, R], rp [1, Dr], ok bool; m, l [H, 1]; acc [H, R]."""
    s = (jnp.sum(q_lat * lat, axis=1, keepdims=True) + jnp.sum(q_rope * rp, axis=1, keepdims=True)) * scale
    s = jnp.where(ok, s, -jnp.inf)                                   # [H, 1]
    m_new = jnp.maximum(m, s)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)                                      # 0 when m was -inf
    e = jnp.exp(s - m_safe)
    return m_new, alpha * l + e, alpha * acc + e * lat


def _locate(idx_ref, pt_ref, kv_len, k, *, ps: int, NP: int, P: int):
    """Selection k of this (b, t) as (page, slot, readable), from its logical position idx_ref[0, k] and
    the row's page table pt_ref [1, NP] (SMEM), as common.physical_rows computes them; an unreadable
    selection points at page 0, slot 0 (masked by the caller)."""
    pos = idx_ref[0, k]
    ok = (pos >= 0) & (pos < kv_len) & (pos < NP * ps)
    pos = jnp.where(ok, pos, 0)
    page = pt_ref[0, jax.lax.div(pos, ps)]
    ok = ok & (page >= 0) & (page < P)
    return jnp.where(ok, page, 0), jnp.where(ok, jax.lax.rem(pos, ps), 0), ok


def _run_start(pt_ref, k, *, ps: int, P: int):
    """(page, slot) of position k of the row (pt_ref [1, NP] its page table, k < NP * ps): the first row of
    an in-order step's run; an unmapped page reads page 0 (its rows are masked by their selections)."""
    page = pt_ref[0, jax.lax.div(k, ps)]
    return jnp.where((page >= 0) & (page < P), page, 0), jax.lax.rem(k, ps)


def _tpu_kernel(len_ref,                              # scalar prefetch [B] int32: kv_lengths
                idx_ref, pt_ref,                      # SMEM [1, Kp], [1, NP] int32: this (b, t)'s selections
                                                      # (logical positions) and its row's page table
                ql_ref, qr_ref,                       # [H, R], [H, Dr]
                lat_hbm, rp_hbm,                      # [P, ps, R], [P, ps, Dr] in HBM
                o_ref,                                # [H, R] f32
                lat_buf, rp_buf, sem,                 # row_gather scratch
                m_sc, l_sc, acc_sc,                   # [H, 1], [H, 1], [H, R] f32
                *, bk, ps, NP, P, G, scale, layer, in_order):
    j = pl.program_id(2)
    kv_len = len_ref[pl.program_id(0)]
    pools = (lat_hbm, rp_hbm) if layer is None else (lat_hbm.at[layer], rp_hbm.at[layer])
    locate = functools.partial(_locate, idx_ref, pt_ref, kv_len, ps=ps, NP=NP, P=P)
    if in_order:        # selection k is position k (or -1): a step's bk rows are one run of a page
        gather = RowRun(pools, (lat_buf, rp_buf), sem, bk, locate=functools.partial(_run_start, pt_ref, ps=ps, P=P))
    else:
        gather = RowGather(None, pools, (lat_buf, rp_buf), sem, ps, bk, G, locate=lambda k: locate(k)[:2])

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def base_of(jj):
        return jj * bk
    slot = gather.pipeline(j, pl.num_programs(2), base_of)
    q_lat, q_rope = ql_ref[...].astype(jnp.float32), qr_ref[...].astype(jnp.float32)
    m, l, acc = m_sc[...], l_sc[...], acc_sc[...]
    base = base_of(j)
    for i in range(bk):
        ok = locate(base + i)[2]
        m, l, acc = _online_step(q_lat, q_rope, gather.row(0, slot, i, base), gather.row(1, slot, i, base), ok,
                                 scale, m, l, acc)
    m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _gpu_kernel(rows_ref, ok_ref,                     # [K] int32
                ql_ref, qr_ref,                       # [H, R], [H, Dr]
                lat_ref, rp_ref,                      # [P * ps, R], [P * ps, Dr] (whole pools)
                o_ref, *, K, scale):
    q_lat, q_rope = ql_ref[...].astype(jnp.float32), qr_ref[...].astype(jnp.float32)
    H, R = q_lat.shape

    def body(i, carry):
        row = rows_ref[i]
        lat = lat_ref[pl.ds(row, 1), :].astype(jnp.float32)
        rp = rp_ref[pl.ds(row, 1), :].astype(jnp.float32)
        return _online_step(q_lat, q_rope, lat, rp, ok_ref[i] == 1, scale, *carry)

    m, l, acc = jax.lax.fori_loop(0, K, body, (jnp.full((H, 1), -jnp.inf, jnp.float32),
                                               jnp.zeros((H, 1), jnp.float32), jnp.zeros((H, R), jnp.float32)))
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "config", "backend", "interpret", "layer", "in_order"))
def sparse_mla_pallas(q_lat, q_rope, latent, rope, page_table, indices, kv_lengths, *, scale: float,
                      config: SparseMLAConfig = SparseMLAConfig(), backend: str = "tpu",
                      interpret: bool = False, layer: int | None = None, in_order: bool = False):
    """q_lat [B, T, H, R], q_rope [B, T, H, Dr], latent [P, ps, R], rope [P, ps, Dr], page_table [B, NP],
    indices [B, T, K], kv_lengths [B] -> o_lat [B, T, H, R] f32. With `layer`, latent and rope are the
    layers' stacks [L, P, ps, X] and layer `layer` is read: the TPU kernel DMAs its rows out of the stack
    (a slice handed to a kernel is a copy of the layer's pool, every layer of every step).
    in_order: the caller promises indices[b, t, k] is k or -1 (every position of the table, K = NP * ps,
    masked per query): the TPU kernel then reads each block of bk positions with one DMA per pool
    (row_gather.RowRun), each row once, instead of one row-group DMA per selection (G x the rows' bytes
    for 16-bit pools). Where the shapes do not allow runs (bk not a multiple of G or not dividing the
    page), the selections are gathered as usual: the result is the same either way."""
    if layer is not None and backend != "tpu":
        latent, rope, layer = latent[layer], rope[layer], None
    B, T, H, R = q_lat.shape
    Dr = q_rope.shape[-1]
    P, ps, _ = latent.shape[-3:]
    K = indices.shape[-1]
    NP = page_table.shape[1]
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        G = max(row_gather.check_pool(latent.dtype, ps, "sparse MLA"), row_gather.check_pool(rope.dtype, ps, "sparse MLA"))
        bk = min(config.block_k, K)
        Kp = -(-K // bk) * bk                          # padded selections: -1, never read
        in_order = in_order and K == NP * ps and bk % G == 0 and ps % bk == 0
        q_spec = lambda d: pl.BlockSpec((None, None, H, d), lambda b, t, j, lens: (b, t, 0, 0))  # noqa: E731
        # [B * T, 1, Kp], [B, 1, NP]: a block's last two dims must be whole (or (8, 128)-aligned) dims of the
        # array. The kernel turns positions into pages itself (_locate): an XLA gather of B * T * K page-table
        # entries costs a TPU a tile per entry (0.57 GiB a DeepSeek-V3.2 decode layer at 64 rows)
        sel_spec = pl.BlockSpec((None, 1, Kp), lambda b, t, j, lens: (b * T + t, 0, 0), memory_space=pltpu.SMEM)
        pt_spec = pl.BlockSpec((None, 1, NP), lambda b, t, j, lens: (b, 0, 0), memory_space=pltpu.SMEM)
        any_spec = pl.BlockSpec(memory_space=pl.ANY)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, T, Kp // bk),
            in_specs=[sel_spec, pt_spec, q_spec(R), q_spec(Dr), any_spec, any_spec],
            out_specs=pl.BlockSpec((None, None, H, R), lambda b, t, j, lens: (b, t, 0, 0)),
            scratch_shapes=(row_gather.run_scratch if in_order else functools.partial(row_gather.scratch, G=G))(
                [(R, latent.dtype), (Dr, rope.dtype)], bk)
            + [pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, R), jnp.float32)])
        idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, Kp - K)), constant_values=-1)
        return pl.pallas_call(
            functools.partial(_tpu_kernel, bk=bk, ps=ps, NP=NP, P=P, G=G, scale=scale, layer=layer, in_order=in_order),
            grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((B, T, H, R), jnp.float32),
            compiler_params=compiler_params("tpu", ("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="dsa_sparse_mla",
            cost_estimate=_cost(q_lat, q_rope, latent, rope, K, 1 if in_order else G),
        )(kv_lengths.astype(jnp.int32), idx.reshape(B * T, 1, Kp), page_table.astype(jnp.int32).reshape(B, 1, NP),
          q_lat, q_rope, latent, rope)
    rows, ok = physical_rows(indices.astype(jnp.int32), page_table.astype(jnp.int32), ps, P,
                             kv_lengths.astype(jnp.int32))               # [B, T, K]
    ok = ok.astype(jnp.int32)
    Hp = 1 << (H - 1).bit_length()
    for name, x in (("R", R), ("Dr", Dr), ("K", K)):
        if x & (x - 1):
            raise KernelUnsupported(f"the Triton sparse MLA kernel needs {name} a power of two; got {x}")
    padh = ((0, 0), (0, 0), (0, Hp - H), (0, 0))
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, K=K, scale=scale), grid=(B, T),
        in_specs=[pl.BlockSpec((None, None, K), lambda b, t: (b, t, 0)),
                  pl.BlockSpec((None, None, K), lambda b, t: (b, t, 0)),
                  pl.BlockSpec((None, None, Hp, R), lambda b, t: (b, t, 0, 0)),
                  pl.BlockSpec((None, None, Hp, Dr), lambda b, t: (b, t, 0, 0)),
                  pl.BlockSpec((P * ps, R), lambda b, t: (0, 0)),
                  pl.BlockSpec((P * ps, Dr), lambda b, t: (0, 0))],
        out_specs=pl.BlockSpec((None, None, Hp, R), lambda b, t: (b, t, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, Hp, R), jnp.float32),
        compiler_params=compiler_params("gpu", (), config.num_warps), interpret=interpret,
        name="dsa_sparse_mla", cost_estimate=_cost(q_lat, q_rope, latent, rope, K, 1),
    )(rows, ok, jnp.pad(q_lat, padh), jnp.pad(q_rope, padh), latent.reshape(P * ps, R),
      rope.reshape(P * ps, Dr))
    return out[:, :, :H]


def _cost(q_lat, q_rope, latent, rope, K, G):
    """Per query token and selected row: the score over R + Dr and the online-softmax update of the
    [H, R] accumulator (2 H (R + Dr) + 2 H R + 4 H flops, 2 H exp). Bytes: the queries, K gathered
    latent + rope rows (G rows a DMA: row_gather), the row ids / flags and the f32 output."""
    B, T, H, R = q_lat.shape
    Dr = q_rope.shape[-1]
    n = B * T * K
    rows = n * (G * (R * latent.dtype.itemsize + Dr * rope.dtype.itemsize) + 8)
    out = B * T * H * R * 4
    return cost(n * (2 * H * (R + Dr) + 2 * H * R + 4 * H), n * 2 * H, q_lat, q_rope, extra_bytes=rows + out)
