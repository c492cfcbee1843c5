"""Block-scaled quantized tensors read by parts: FP8 and FP4 checkpoints loaded into a split model.

Inside `weights.on_host()` the checkpoint reader gives a quantized tensor as a `BlockScaled` (nothing
read): its codes (a `lazy_weights.Stored` of float8_e4m3fn, or `Fp4Codes` over packed e2m1 bytes), its
block scales (small: read whole) and the block. Reading a part reads only that part's codes:

  BlockScaled(codes, scale, block)            float32 values (code * scale), the dequantized load
  BlockScaled(..., records=True)              `weights.QUANTIZED` records (value, per-element scale),
                                              the kept-in-FP8 load (`quantization="fp8"`)

Both flow through the conversions' lazy re-layouts (concat, stack, transposes, slices). For a weight
kept in FP8, `fp8_parts(x)` follows those re-layouts back to the codes and the block scales: the
codes as a lazy re-layout of the stored codes (read by parts onto each device, still FP8) and the
scales re-laid alike (whole blocks only), so `weights.to_device_linear` builds the `Fp8Weight` without
reading the weight. A re-layout that cuts through scale blocks gives None (the weight is then read
whole, as before).

Shapes: codes [..., O, I] (Fp4Codes over packed [..., O, I / 2]); scale [..., ceil(O / bo),
ceil(I / bi)]; `block` has one entry per dimension (1 on the leading ones).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from hybrid_jax.lazy_weights import Concat, Lazy, Slice, Stack, Stored, Transpose
from hybrid_jax.quantization import FP4_VALUES

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
RECORDS = np.dtype([("v", np.float32), ("s", np.float32)])      # = weights.QUANTIZED


class Fp4Codes(Lazy):
    """Packed e2m1 codes [..., O, I / 2] (two per byte, low nibble first) as float8_e4m3fn [..., O, I]
    (every e2m1 value is an e4m3 one): reads only the bytes of the part asked for."""

    def __init__(self, packed: Stored):
        self.packed = packed
        self.shape = tuple(packed.shape[:-1]) + (2 * packed.shape[-1],)
        self.dtype = E4M3

    def _read(self, index):
        s = index[-1]
        lo, hi = s.start // 2, (s.stop + 1) // 2
        b = self.packed._read(index[:-1] + (slice(lo, hi),)).view(np.uint8)
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))
        off = s.start - 2 * lo
        return FP4_VALUES[codes[..., off:off + s.stop - s.start]].astype(E4M3)

    def _points(self, coords):
        b = self.packed._points(coords[:-1] + (coords[-1] // 2,)).view(np.uint8)
        return FP4_VALUES[np.where(coords[-1] % 2 == 0, b & 0x0F, b >> 4)].astype(E4M3)


def _scale_part(scale: np.ndarray, block: tuple[int, ...], index) -> np.ndarray:
    """The per-element scale of the part `index` (slices, one per dimension) of a tensor whose block
    scale is `scale` [ceil(d / b) per dimension]."""
    s = scale[tuple(slice(x.start // b, -(-x.stop // b)) for x, b in zip(index, block))]
    for d, (x, b) in enumerate(zip(index, block)):
        if b > 1:
            off = x.start - (x.start // b) * b
            s = np.repeat(s, b, axis=d)[(slice(None),) * d + (slice(off, off + x.stop - x.start),)]
    return s


class BlockScaled(Lazy):
    """A quantized tensor (codes [...], block scale, block per dimension) read by parts: float32 values,
    or with records=True the QUANTIZED records the kept-in-FP8 load carries (a zero scale recorded as 1,
    as `weights.Reader.get` does)."""

    def __init__(self, codes: Lazy, scale: np.ndarray, block: tuple[int, ...], records: bool = False):
        if len(block) != codes.ndim or scale.shape != tuple(-(-n // b) for n, b in zip(codes.shape, block)):
            raise ValueError(f"scale {scale.shape} with blocks {block} does not cover codes {codes.shape}")
        self.codes, self.scale, self.block, self.records = codes, np.asarray(scale, np.float32), block, records
        self.shape, self.dtype = codes.shape, (RECORDS if records else np.dtype(np.float32))

    def _read(self, index):
        return self._decoded(self.codes._read(index), _scale_part(self.scale, self.block, index))

    def _points(self, coords):
        return self._decoded(self.codes._points(coords), self.scale[tuple(c // b for c, b in zip(coords, self.block))])

    def _decoded(self, codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """codes and their per-element scale -> values, or the records (a zero scale recorded as 1)."""
        v = codes.astype(np.float32) * scale
        if not self.records:
            return v
        out = np.empty(v.shape, RECORDS)
        out["v"], out["s"] = v, np.where(scale == 0, 1.0, scale)
        return out


class Unquantized(Lazy):
    """A weight that is not quantized, as QUANTIZED records marked so (scale 0), to sit in a fused
    projection beside quantized ones (`weights.concat`)."""

    def __init__(self, base: Lazy):
        self.base, self.shape, self.dtype = base, base.shape, RECORDS

    def _read(self, index):
        out = np.zeros(tuple(s.stop - s.start for s in index), RECORDS)
        out["v"] = self.base._read(index)
        return out

    def _points(self, coords):
        out = np.zeros(coords[0].shape, RECORDS)
        out["v"] = self.base._points(coords)
        return out


def fp8_parts(x: Lazy):
    """(codes: Lazy float8_e4m3fn, scale: np.ndarray, block: tuple per dimension) of a weight of QUANTIZED
    records built by lazy re-layouts of `BlockScaled` records, with its codes re-laid the same way;
    None when a re-layout cuts through a scale block (or mixes in a part that is not quantized)."""
    if isinstance(x, BlockScaled):
        return (x.codes, x.scale, x.block) if x.records else None
    if isinstance(x, Transpose):
        got = fp8_parts(x.base)
        if got is None:
            return None
        codes, scale, block = got
        return Transpose(codes, x.perm), scale.transpose(x.perm), tuple(block[p] for p in x.perm)
    if isinstance(x, Slice):
        got = fp8_parts(x.base)
        if got is None:
            return None
        codes, scale, block = got
        index = tuple(slice(a, a + n) for a, n in zip(x.start, x.shape))
        for s, b, full in zip(index, block, codes.shape):
            if s.start % b or (s.stop % b and s.stop != full):
                return None
        return (Slice(codes, index), scale[tuple(slice(s.start // b, -(-s.stop // b)) for s, b in zip(index, block))],
                block)
    if isinstance(x, Concat):
        got = [fp8_parts(p) for p in x.parts]
        if any(g is None for g in got):
            return None
        a = x.axis
        if any(g[2][:a] + g[2][a + 1:] != got[0][2][:a] + got[0][2][a + 1:] for g in got):
            return None
        # along the axis: a block that divides every part's block and every part's size but the last's
        g = math.gcd(*[b[2][a] for b in got], *[p.shape[a] for p in x.parts[:-1]])
        scales = [_reblock(sc, blk[a], a, g, p.shape[a]) for (_, sc, blk), p in zip(got, x.parts)]
        block = got[0][2][:a] + (g,) + got[0][2][a + 1:]
        return Concat([c for c, _, _ in got], a), np.concatenate(scales, axis=a), block
    if isinstance(x, Stack):
        got = [fp8_parts(p) for p in x.parts]
        if any(g is None for g in got) or any(g[2] != got[0][2] for g in got):
            return None
        block = got[0][2]
        return (Stack([g[0] for g in got], x.axis), np.stack([g[1] for g in got], axis=x.axis),
                block[:x.axis] + (1,) + block[x.axis:])
    return None


def _reblock(scale: np.ndarray, block: int, axis: int, g: int, n: int) -> np.ndarray:
    """scale over blocks of `block` along `axis` (of a dimension of n) as a scale over blocks of g (g
    divides block)."""
    return np.take(scale, (np.arange(math.ceil(n / g)) * g) // block, axis=axis)


def constant(x: np.ndarray, group: int, axis: int) -> np.ndarray | None:
    """x's every group-th entry along axis, if spread over their groups (the last one partial) they
    give x; else None."""
    n = x.shape[axis]
    first = np.take(x, np.arange(0, n, group), axis=axis)
    return first if np.array_equal(np.take(np.repeat(first, group, axis=axis), np.arange(n), axis=axis), x) else None


def kept_blocks(codes: Lazy, scale: np.ndarray, block: tuple[int, ...], sizes: tuple[int, ...]):
    """(scale per (bk, bn) block of the last two dimensions, (bk, bn)): bk the largest of `sizes` and bn
    the largest of `sizes` or 1 over which the scale is constant, as `weights._kept` picks them from the
    weight read whole (each check made on the scale at the blocks' common divisor, which spreads to
    the elements exactly). None when there is no such bk, a leading dimension is blocked, or a scale is
    0 (its codes do not give its zero values)."""
    if any(b != 1 for b in block[:-2]) or not np.all(scale != 0):
        return None
    out, picked = scale, []
    for a, choices in ((codes.ndim - 2, sizes), (codes.ndim - 1, sizes + (1,))):
        for b in choices:
            h = math.gcd(block[a], b)
            got = constant(_reblock(out, block[a], a, h, codes.shape[a]), b // h, a)
            if got is not None:
                out = got
                picked.append(b)
                break
        else:
            return None
    return np.ascontiguousarray(out), tuple(picked)


def as_values(x: Lazy) -> Lazy | None:
    """The float32 values of lazy QUANTIZED records (their "v" field), still read by parts; None when
    `x` is not built from `BlockScaled` records by lazy re-layouts."""
    if isinstance(x, BlockScaled):
        return BlockScaled(x.codes, x.scale, x.block) if x.records else None
    if isinstance(x, Unquantized):
        return x.base.astype(np.float32)
    if isinstance(x, (Transpose, Slice)):
        base = as_values(x.base)
        if base is None:
            return None
        return Transpose(base, x.perm) if isinstance(x, Transpose) else \
            Slice(base, tuple(slice(a, a + n) for a, n in zip(x.start, x.shape)))
    if isinstance(x, (Concat, Stack)):
        parts = [as_values(p) for p in x.parts]
        if any(p is None for p in parts):
            return None
        return type(x)(parts, x.axis)
    return None


def column_pieces(x: Lazy) -> list[tuple[bool, Lazy]]:
    """Lazy QUANTIZED records [..., K, N] cut along N into runs of quantized columns and of columns that
    are not ((True, records) / (False, records)), following fused projections (a concat along N, or
    a transposed concat of [out, in] pieces); an empty list where a run mixes both."""
    pieces = _pieces(x)
    kinds = [_kind(p) for p in pieces]
    if any(k is None for k in kinds):
        return []
    runs: list[tuple[bool, list]] = []
    for k, p in zip(kinds, pieces):
        if runs and runs[-1][0] == k:
            runs[-1][1].append(p)
        else:
            runs.append((k, [p]))
    return [(k, ps[0] if len(ps) == 1 else Concat(ps, -1)) for k, ps in runs]


def _pieces(x: Lazy) -> list[Lazy]:
    last = x.ndim - 1
    if isinstance(x, Concat) and x.axis == last:
        return [q for p in x.parts for q in _pieces(p)]
    if isinstance(x, Transpose) and isinstance(x.base, Concat) and x.base.axis == x.perm[last]:
        return [q for p in x.base.parts for q in _pieces(Transpose(p, x.perm))]
    return [x]


def _kind(x: Lazy) -> bool | None:
    """True: quantized blocks throughout; False: not quantized throughout; None: neither."""
    if isinstance(x, BlockScaled):
        return True if x.records else None
    if isinstance(x, Unquantized):
        return False
    parts = [x.base] if isinstance(x, (Transpose, Slice)) else list(x.parts) if isinstance(x, (Concat, Stack)) else []
    kinds = {_kind(p) for p in parts}
    return kinds.pop() if len(kinds) == 1 else None
