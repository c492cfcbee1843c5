"""Weights a layer multiplies by: plain arrays, or FP8 kept on the device with block scales.

`LLM(..., quantization="fp8")` keeps a pre-quantized checkpoint's linear weights as `Fp8Weight`
(1 byte per weight plus a float32 scale per block); every layer
multiplies through `linear(x, w)`, which dequantizes inside the jitted step, or reads
`dequantize(w, dtype)` where the weight enters an einsum or a gather. A fused projection whose
pieces were stored differently (an FP8 shared expert beside a bf16 router) is a `ColumnConcat` of
its column ranges. Plain arrays pass through both unchanged, so the layers have one code path.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hybrid_jax.parallel.context import MODEL, current, per_device, tensor_size
from pallas_kernels.grouped_matmul import dequantize_blocks, fp8_matmul


@flax.struct.dataclass
class Fp8Weight:
    """w: [..., K, N] float8_e4m3fn codes; scale: [..., ceil(K / bk), ceil(N / bn)] float32 with
    block = (bk, bn): the scale of inputs [i * bk, (i + 1) * bk) and outputs [j * bn, (j + 1) * bn)
    (edge blocks partial). value = code * scale."""
    w: jax.Array
    scale: jax.Array
    block: tuple[int, int] = flax.struct.field(pytree_node=False, default=(128, 128))
    # logical axes of w when it is split over a mesh (`parallel.Layout.annotate`; both codes and scales
    # split alike): how `linear` runs it per device. None on one device.
    axes: tuple | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    def take(self, idx: jax.Array) -> Fp8Weight:
        """Rows of the leading axis (experts): idx [...] -> Fp8Weight [..., K, N]."""
        return Fp8Weight(w=self.w[idx], scale=self.scale[idx], block=self.block)


@flax.struct.dataclass
class ColumnConcat:
    """A weight [..., K, sum(N_i)] held as column ranges of different kinds (arrays / Fp8Weight)."""
    parts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        return self.parts[0].shape[:-1] + (sum(p.shape[-1] for p in self.parts),)


Weight = jax.Array | Fp8Weight | ColumnConcat


def dequantize(w: Weight, dtype) -> jax.Array:
    """The weight's values as an array of `dtype` ([..., K, N]); plain arrays are only cast."""
    if isinstance(w, Fp8Weight):
        return dequantize_blocks(w.w, w.scale, w.block, dtype)
    if isinstance(w, ColumnConcat):
        return jnp.concatenate([dequantize(p, dtype) for p in w.parts], axis=-1)
    return w.astype(dtype)


def linear(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]; an Fp8Weight is dequantized to x's dtype first."""
    if isinstance(w, ColumnConcat):
        return jnp.concatenate([linear(x, p) for p in w.parts], axis=-1)
    if isinstance(w, Fp8Weight) and w.w.ndim == 2:
        return _fp8_linear(x, w)
    if isinstance(w, Fp8Weight):
        return x @ dequantize(w, x.dtype)
    return x @ w


def _fp8_linear(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x [..., K] @ an FP8 [K, N] weight (on TPU dequantized in VMEM, tile by tile). Split over a mesh
    (w.axes), on each device's block of it, as Megatron's linears run: rows split, each device multiplies
    its slice of x's features and the partial sums are all-reduced; columns split, the output columns
    stay split."""
    def op(x, codes, scale):
        return fp8_matmul(x, codes, scale, block=w.block)
    if w.axes is None or tensor_size() == 1:
        return op(x, w.w, w.scale)
    spec = current().spec(w.axes, w.w.shape, "an FP8 weight")
    lead = (None,) * (x.ndim - 1)
    if spec[0] is not None:
        def rows(x, codes, scale):
            return jax.lax.psum(op(x, codes, scale), MODEL)
        return per_device(rows, (lead + (w.axes[0],), w.axes, w.axes), None)(x, w.w, w.scale)
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.w.shape[1],), x.dtype)
    return per_device(op, (lead + (None,), w.axes, w.axes), lead + (w.axes[1],), out_like=out)(x, w.w, w.scale)


def take(w: Weight, idx: jax.Array) -> Weight:
    """Rows of a stacked weight's leading axis (the chosen experts): idx [...] -> [..., K, N]."""
    if isinstance(w, (Fp8Weight, ColumnConcat)):
        if isinstance(w, ColumnConcat):
            return ColumnConcat(tuple(take(p, idx) for p in w.parts))
        return w.take(idx)
    return w[idx]


def weight_bytes(params) -> int:
    """Bytes the parameters take on the device (every leaf, FP8 codes and scales included)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params))
