"""Grouped matmul over FP8 block-scaled weights: the routed experts of a MoE layer whose weights stay FP8.

  out[r] = xs[r] @ dequant(w[g(r)]),  g(r) the group of row r (rows sorted by group, `group_sizes` rows
  each, as `lax.ragged_dot` takes them); dequant(w)[k, n] = bf16(float32(code[k, n]) * scale[k // bk, n // bn])

Rows past sum(group_sizes) are zero. The XLA path is `lax.ragged_dot` over the dequantized weights: it
materialises every expert in the compute dtype (and an f32 copy on the way), which for DeepSeek-V3.2
is ~70 GB of temporaries and five times the weights' bytes per step. The TPU kernel dequantizes each
weight tile in VMEM instead, so the weights cross HBM once, as FP8.

TPU kernel (Mosaic): megablox's schedule (`jax.experimental.pallas.ops.tpu.megablox`): the sorted rows
are cut in tiles of tm; a work item is (row tile, group) for every group with rows in the tile, in row
order; grid (N / tn, items, K / tk). Each step loads a [tm, tk] block of rows and the group's [tk, tn]
FP8 block, dequantizes its (tk / bk) x (tn / bn) scale blocks (the group's scales sit in SMEM) and
accumulates in f32; at the last K step the rows of the tile that belong to the item's group are
stored. Each weight block is read once per item: a group whose rows straddle t tile boundaries is read
t + 1 times (the cost estimate counts the worst case, tiles + min(groups, rows) - 1 items: a group with no
row has no item, so a decode step's few rows read only the experts they chose).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import dispatch
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.kernel_params import compiler_params


def dequantize_blocks(w: jax.Array, scale: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """w [..., K, N] FP8 codes, scale [..., ceil(K / bk), ceil(N / bn)] f32 -> values [..., K, N] in dtype."""
    K, N = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2)[..., :K, :], block[1], axis=-1)[..., :N]
    return (w.astype(jnp.float32) * s).astype(dtype)


def _xla(xs, w, scale, group_sizes, *, block):
    return jax.lax.ragged_dot(xs, dequantize_blocks(w, scale, block, xs.dtype), group_sizes)


def _row_tile(R: int, E: int) -> int:
    """Rows per tile. Smaller tiles waste fewer MXU rows on groups of a few rows (decode) but cut more
    groups at tile boundaries, each cut a second read of that group's weights: 64 rows keep the re-reads
    of a decode step under 3% of the weights (DeepSeek-V3.2: 512 rows, 256 experts) and its MXU work
    under the time the weights take to read; many rows per group (prefill) take 128. One group (a plain
    matmul) takes up to 512 rows a tile: the weight is read once per row tile."""
    if E == 1:
        return min(512, max(16, 1 << (R - 1).bit_length()))
    return 64 if R <= 64 * E else 128


def _col_tile(n: int, b: int) -> int:
    for t in (512, 256, 128):
        if t % b == 0 and n % t == 0:
            return t
    raise KernelUnsupported(f"the TPU FP8 grouped matmul needs dimensions that are multiples of 128; got {n}")


def _tpu_kernel(offsets_ref, groups_ref, tiles_ref,          # scalar prefetch: megablox's group metadata
                x_ref, w_ref, s_ref,                          # [tm, tk], [tk, tn] FP8, SMEM [K / bk, N / bn]
                o_ref, acc_ref, *, tm, tk, tn, bk, bn, nk):
    n, i, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    for a in range(tk // bk):
        xa = x[:, a * bk:(a + 1) * bk]
        for b in range(tn // bn):
            s = s_ref[kk * (tk // bk) + a, n * (tn // bn) + b]
            wab = (w_ref[a * bk:(a + 1) * bk, b * bn:(b + 1) * bn].astype(jnp.float32) * s).astype(x.dtype)
            acc_ref[:, b * bn:(b + 1) * bn] += jnp.dot(xa, wab, preferred_element_type=jnp.float32)

    @pl.when(kk == nk - 1)
    def _():
        g = groups_ref[i]
        rows = tiles_ref[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])
        o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), o_ref[...])


def _pallas(xs, w, scale, group_sizes, *, block, backend="tpu", interpret=False):
    if backend != "tpu":
        raise KernelUnsupported("the FP8 grouped matmul has a TPU kernel only")
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
    from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata  # noqa: PLC0415
    R, K = xs.shape
    E, _, N = w.shape
    bk, bn = block
    if K % bk or N % bn or bk % 128 or bn % 128:
        raise KernelUnsupported(f"the TPU FP8 grouped matmul needs K, N multiples of the scale blocks {block}, "
                                f"themselves multiples of 128; got K={K}, N={N}")
    tm, tk, tn = _row_tile(R, E), _col_tile(K, bk), _col_tile(N, bn)
    Rp = -(-R // tm) * tm
    xp = jnp.pad(xs, ((0, Rp - R), (0, 0)))
    sizes = group_sizes.astype(jnp.int32)
    (offsets, groups, tiles), items = make_group_metadata(group_sizes=sizes, m=Rp, tm=tm,
                                                          start_group=jnp.zeros((), jnp.int32),
                                                          num_nonzero_groups=E, visit_empty_groups=False)
    nk = K // tk
    live = min(E, R)                  # groups that can hold rows: at most one per row (a decode step: R << E)
    max_items = Rp // tm + live - 1
    itemsize = jnp.dtype(xs.dtype).itemsize
    cost = pl.CostEstimate(flops=2 * max_items * tm * K * N, transcendentals=0,
                           bytes_accessed=int(Rp * K * itemsize * (N // tn) + max_items * K * N
                                              + live * scale.shape[1] * scale.shape[2] * 4 + Rp * N * itemsize))
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, tm=tm, tk=tk, tn=tn, bk=bk, bn=bn, nk=nk),
        out_shape=jax.ShapeDtypeStruct((Rp, N), xs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(N // tn, items, nk),
            in_specs=[pl.BlockSpec((tm, tk), lambda n, i, kk, offs, gs, ts: (ts[i], kk)),
                      pl.BlockSpec((None, tk, tn), lambda n, i, kk, offs, gs, ts: (gs[i], kk, n)),
                      pl.BlockSpec((None, K // bk, N // bn), lambda n, i, kk, offs, gs, ts: (gs[i], 0, 0),
                                   memory_space=pltpu.SMEM)],
            out_specs=pl.BlockSpec((tm, tn), lambda n, i, kk, offs, gs, ts: (ts[i], n)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)]),
        compiler_params=compiler_params("tpu", ("parallel", "arbitrary", "arbitrary")),
        interpret=interpret, name="fp8_grouped_matmul", cost_estimate=cost,
    )(offsets, groups, tiles, xp, w, scale.astype(jnp.float32))
    # rows no group covers (padding, and past sum(group_sizes)) were never stored
    return jnp.where((jnp.arange(R) < jnp.sum(sizes))[:, None], out[:R], 0).astype(xs.dtype)


def fp8_grouped_matmul(xs: jax.Array, w: jax.Array, scale: jax.Array, group_sizes: jax.Array, *,
                       block: tuple[int, int] = (128, 128), impl: str = "auto") -> jax.Array:
    """xs [R, K] (rows sorted by group), w [E, K, N] float8_e4m3fn, scale [E, ceil(K / bk), ceil(N / bn)]
    f32, group_sizes [E] int32 -> [R, N] in xs's dtype (module docstring). impl: see pallas_kernels.dispatch;
    "reference" and "xla" are both the ragged_dot over dequantized weights."""
    R, K = xs.shape
    if w.ndim != 3 or w.shape[1] != K:
        raise ValueError(f"w must be [E, K={K}, N]; got {w.shape}")
    E, _, N = w.shape
    want = (E, -(-K // block[0]), -(-N // block[1]))
    if scale.shape != want:
        raise ValueError(f"scale must be {want} for blocks {block}; got {scale.shape}")
    if group_sizes.shape != (E,):
        raise ValueError(f"group_sizes must be [{E}]; got {group_sizes.shape}")
    xla = functools.partial(_xla, block=block)
    return dispatch.run("fp8_grouped_matmul", impl, (xs, w, scale, group_sizes), reference=xla, xla=xla,
                        pallas=lambda: functools.partial(_pallas, block=block))


def _matmul_xla(x, w, scale, *, block):
    return x @ dequantize_blocks(w, scale, block, x.dtype)


def _matmul_pallas(x, w, scale, *, block, backend="tpu", interpret=False):
    x2 = x.reshape(-1, x.shape[-1])
    out = _pallas(x2, w[None], scale[None], jnp.full((1,), x2.shape[0], jnp.int32), block=block, backend=backend,
                  interpret=interpret)
    return out.reshape(*x.shape[:-1], w.shape[1])


def fp8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, block: tuple[int, int] = (128, 128),
               impl: str = "auto") -> jax.Array:
    """x [..., K] @ an FP8 block-scaled weight w [K, N] (scale [ceil(K / bk), ceil(N / bn)] f32) -> [..., N] in
    x's dtype: the grouped matmul with one group. The XLA path dequantizes the weight and multiplies
    (`x @ dequantize_blocks(...)`); on TPU the kernel dequantizes tiles in VMEM, where XLA would write the
    weight out in f32 and bf16 first (five times its FP8 bytes of traffic per step)."""
    K, N = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match w [{K}, {N}]")
    want = (-(-K // block[0]), -(-N // block[1]))
    if scale.shape != want:
        raise ValueError(f"scale must be {want} for blocks {block}; got {scale.shape}")
    xla = functools.partial(_matmul_xla, block=block)
    return dispatch.run("fp8_matmul", impl, (x, w, scale), reference=xla, xla=xla,
                        pallas=lambda: functools.partial(_matmul_pallas, block=block))
