"""Pallas sparse MLA: absorbed-form attention over only the selected positions of a paged latent cache.

  o_lat[b, t, h] = softmax_j(scale * (q_lat[h] . c[j] + q_rope[h] . k_rope[j])) @ c[j],
  j over indices[b, t, :] (readable ones; see common.py)

The caller absorbs W_uk into q (q_lat = q_nope @ W_uk) and W_uv into the output, so the kernel reads
R + Dr values per selected token and nothing per head. Softmax is online (running max, sum, and
accumulator [H, R] in f32), one selected token at a time.

The logical indices are turned into physical pool rows (page_table[b, j // ps] * ps + j % ps, with a
readable flag) by a tiny XLA prologue over [B, T, K] ints; unreadable rows point at row 0 and are
masked in the kernel, so no index reaches another request's pages.

Backends (both proven by `jax.export` tests):
  * TPU (Mosaic): grid (B, T, K / bk). The rows and flags are scalar-prefetched into SMEM; the pool
    is passed bk times, each BlockSpec's index_map picking one selected row, so every grid step
    DMAs bk scattered rows and the pipeline fetches step i + 1's rows while step i computes (the
    gather of the next block overlaps the compute of the current one). Running statistics live in
    VMEM scratch; the output block is resident across the K axis.
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
from pallas_kernels.kernel_params import compiler_params
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


def _tpu_kernel(rows_ref, ok_ref,                     # SMEM [B * T * K] int32
                ql_ref, qr_ref,                       # [H, R], [H, Dr]
                *refs, bk, K, T, scale):
    lat_refs, rp_refs = refs[:bk], refs[bk:2 * bk]    # bk x [1, R], bk x [1, Dr]
    o_ref, m_sc, l_sc, acc_sc = refs[2 * bk:]
    b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    q_lat, q_rope = ql_ref[...].astype(jnp.float32), qr_ref[...].astype(jnp.float32)
    m, l, acc = m_sc[...], l_sc[...], acc_sc[...]
    base = (b * T + t) * K + j * bk
    for i in range(bk):
        ok = ok_ref[base + i] == 1
        m, l, acc = _online_step(q_lat, q_rope, lat_refs[i][...].astype(jnp.float32),
                                 rp_refs[i][...].astype(jnp.float32), ok, scale, m, l, acc)
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


@functools.partial(jax.jit, static_argnames=("scale", "config", "backend", "interpret"))
def sparse_mla_pallas(q_lat, q_rope, latent, rope, page_table, indices, kv_lengths, *, scale: float,
                      config: SparseMLAConfig = SparseMLAConfig(), backend: str = "tpu",
                      interpret: bool = False):
    """q_lat [B, T, H, R], q_rope [B, T, H, Dr], latent [P, ps, R], rope [P, ps, Dr], page_table [B, NP],
    indices [B, T, K], kv_lengths [B] -> o_lat [B, T, H, R] f32."""
    B, T, H, R = q_lat.shape
    Dr = q_rope.shape[-1]
    P, ps, _ = latent.shape
    K = indices.shape[-1]
    rows, ok = physical_rows(indices.astype(jnp.int32), page_table.astype(jnp.int32), ps, P,
                             kv_lengths.astype(jnp.int32))               # [B, T, K]
    ok = ok.astype(jnp.int32)
    lat_flat, rp_flat = latent.reshape(P * ps, 1, R), rope.reshape(P * ps, 1, Dr)
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        bk = config.block_k if K % config.block_k == 0 else 1
        q_spec = lambda d: pl.BlockSpec((None, None, H, d), lambda b, t, j, *_: (b, t, 0, 0))  # noqa: E731

        def row_spec(i, d):
            return pl.BlockSpec((None, 1, d), lambda b, t, j, rows_, *_: (rows_[(b * T + t) * K + j * bk + i], 0, 0))
        in_specs = ([q_spec(R), q_spec(Dr)] + [row_spec(i, R) for i in range(bk)]
                    + [row_spec(i, Dr) for i in range(bk)])
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, T, K // bk), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, H, R), lambda b, t, j, *_: (b, t, 0, 0)),
            scratch_shapes=[pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, 1), jnp.float32),
                            pltpu.VMEM((H, R), jnp.float32)])
        return pl.pallas_call(
            functools.partial(_tpu_kernel, bk=bk, K=K, T=T, scale=scale), grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct((B, T, H, R), jnp.float32),
            compiler_params=compiler_params("tpu", ("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="dsa_sparse_mla",
        )(rows.reshape(-1), ok.reshape(-1), q_lat, q_rope, *([lat_flat] * bk), *([rp_flat] * bk))
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
        name="dsa_sparse_mla",
    )(rows, ok, jnp.pad(q_lat, padh), jnp.pad(q_rope, padh), lat_flat[:, 0], rp_flat[:, 0])
    return out[:, :, :H]
