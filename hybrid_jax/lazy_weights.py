"""Host weights that are not read until a device asks for its part: loading a split model by slices.

A model split over a mesh is converted with `weights.on_host()`. There the checkpoint reader gives
each stored tensor as a `Stored` (a block of the memory-mapped file: nothing read), and the weight
conversions' re-layouts build expressions over them instead of arrays:

  Stored        a tensor in the file (any reshape of it is still one: the block is contiguous)
  Concat        `weights.concat(parts, axis)` (fused projections: gate | up, router | shared, ...)
  Stack         `weights.stack(parts, axis)` (an expert stack from per-expert tensors)
  Transpose     `.T`, `.transpose(...)`, `.swapaxes(a, b)`, `np.swapaxes(x, a, b)`
  Slice         `x[a:b, ...]` with unit steps
  Cast          `.astype(dtype)` / the run dtype `to_device` applies

`x.read(index)` (index: a tuple of slices, as `jax.make_array_from_callback` passes one per device)
reads only the elements of that part: a Concat reads the parts it overlaps, a Transpose reads the
permuted block, a Stored reads its rows in the file. So each device's slice of a weight is read from
the file alone, and a process reads only what its devices own. `points(coords)` reads single
elements (the weights' fingerprint). Anything else a conversion does with one (arithmetic, fancy
indexing, a reshape of an assembled weight) reads it whole (`np.asarray(x)`), as before: correct,
only not by parts. `Stored.counter` counts the bytes read from the file (the fingerprint's sampled
points aside).
"""
from __future__ import annotations

import math

import numpy as np


def _norm(index, shape) -> tuple[slice, ...]:
    """index (slices, Ellipsis, or shorter) -> one slice with unit step per dimension, in range."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        if not isinstance(s, slice):
            raise TypeError(f"a lazy weight is read by slices; got {s!r}")
        a, b, step = s.indices(n)
        if step != 1:
            raise TypeError(f"a lazy weight is read by unit-step slices; got {s!r}")
        out.append(slice(a, max(a, b)))
    return tuple(out)


class Lazy(np.lib.mixins.NDArrayOperatorsMixin):
    """A host weight of `shape` and `dtype` whose elements are read on demand (see the module)."""
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read(self, index=()) -> np.ndarray:
        """The elements at `index` (slices) as a numpy array, reading only them."""
        return self._read(_norm(index, self.shape))

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:
        raise NotImplementedError

    def points(self, coords: tuple[np.ndarray, ...]) -> np.ndarray:
        """The elements at the points coords (one integer array per dimension, of equal length)."""
        return self._points(tuple(np.asarray(c, np.int64) for c in coords))

    def _points(self, coords):
        raise NotImplementedError

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):      # arithmetic reads the weight whole
        inputs = tuple(np.asarray(x) if isinstance(x, Lazy) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kw)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"

    # --- re-layouts that stay lazy ---------------------------------------------------------------
    def transpose(self, *axes):
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        perm = tuple(range(self.ndim))[::-1] if not axes else tuple(a % self.ndim for a in axes)
        return Transpose(self, perm)

    @property
    def T(self):  # noqa: N802
        return self.transpose()

    def swapaxes(self, a: int, b: int):
        perm = list(range(self.ndim))
        perm[a % self.ndim], perm[b % self.ndim] = perm[b % self.ndim], perm[a % self.ndim]
        return Transpose(self, tuple(perm))

    def astype(self, dtype, copy=True):
        dtype = np.dtype(dtype)
        return self if dtype == self.dtype else Cast(self, dtype)

    def __getitem__(self, index):
        try:
            index = _norm(index, self.shape)
        except TypeError:                 # fancy or integer indexing: read whole
            return np.asarray(self)[index]
        if all(s == slice(0, n) for s, n in zip(index, self.shape)):
            return self
        return Slice(self, index)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return np.asarray(self).reshape(shape)


def _shape_of(shape, shape_new) -> tuple[int, ...]:
    shape_new = list(shape_new)
    if -1 in shape_new:
        k = shape_new.index(-1)
        shape_new[k] = math.prod(shape) // max(1, math.prod(d for d in shape_new if d != -1))
    if math.prod(shape_new) != math.prod(shape):
        raise ValueError(f"cannot reshape {tuple(shape)} into {tuple(shape_new)}")
    return tuple(int(d) for d in shape_new)


class Stored(Lazy):
    """A contiguous block of a memory-mapped file: `view()` maps it without reading."""

    def __init__(self, view: np.ndarray, counter: list | None = None):
        self._view, self.shape, self.dtype = view, tuple(view.shape), view.dtype
        self.counter = counter if counter is not None else [0]

    def view(self) -> np.ndarray:
        return self._view

    def _read(self, index):
        out = np.array(self._view[index])
        self.counter[0] += out.nbytes
        return out

    def _points(self, coords):
        return np.array(self._view[coords])      # a sample (the fingerprint's): not counted

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return Stored(self._view.reshape(_shape_of(self.shape, shape)), self.counter)


class Transpose(Lazy):
    def __init__(self, base: Lazy, perm: tuple[int, ...]):
        self.base, self.perm = base, perm
        self.shape, self.dtype = tuple(base.shape[p] for p in perm), base.dtype

    def _read(self, index):
        inner = [None] * self.ndim
        for i, p in enumerate(self.perm):
            inner[p] = index[i]
        return self.base._read(tuple(inner)).transpose(self.perm)

    def _points(self, coords):
        inner = [None] * self.ndim
        for i, p in enumerate(self.perm):
            inner[p] = coords[i]
        return self.base._points(tuple(inner))


class Slice(Lazy):
    def __init__(self, base: Lazy, index: tuple[slice, ...]):
        self.base, self.start = base, tuple(s.start for s in index)
        self.shape, self.dtype = tuple(s.stop - s.start for s in index), base.dtype

    def _read(self, index):
        return self.base._read(tuple(slice(s.start + o, s.stop + o) for s, o in zip(index, self.start)))

    def _points(self, coords):
        return self.base._points(tuple(c + o for c, o in zip(coords, self.start)))


class Cast(Lazy):
    def __init__(self, base: Lazy, dtype: np.dtype):
        self.base, self.shape, self.dtype = base, base.shape, np.dtype(dtype)

    def _read(self, index):
        return self.base._read(index).astype(self.dtype)

    def _points(self, coords):
        return self.base._points(coords).astype(self.dtype)


class Concat(Lazy):
    def __init__(self, parts, axis: int):
        parts = [p if isinstance(p, Lazy) else Stored(np.asarray(p)) for p in parts]
        axis = axis % parts[0].ndim
        for p in parts:
            if p.ndim != parts[0].ndim or any(a != b for d, (a, b) in enumerate(zip(p.shape, parts[0].shape))
                                              if d != axis):
                raise ValueError(f"cannot concatenate {[q.shape for q in parts]} along axis {axis}")
        self.parts, self.axis = parts, axis
        self.offsets = np.cumsum([0] + [p.shape[axis] for p in parts])
        self.shape = parts[0].shape[:axis] + (int(self.offsets[-1]),) + parts[0].shape[axis + 1:]
        self.dtype = np.result_type(*[p.dtype for p in parts])

    def _read(self, index):
        a, s = self.axis, index[self.axis]
        out = []
        for p, lo in zip(self.parts, self.offsets[:-1]):
            b, e = max(s.start, lo), min(s.stop, lo + p.shape[a])
            if b < e:
                out.append(p._read(index[:a] + (slice(b - lo, e - lo),) + index[a + 1:]).astype(self.dtype))
        if not out:
            return np.zeros(tuple(x.stop - x.start for x in index), self.dtype)
        return np.concatenate(out, axis=a)

    def _points(self, coords):
        which = np.searchsorted(self.offsets, coords[self.axis], side="right") - 1
        out = np.empty(coords[0].shape, self.dtype)
        for k, p in enumerate(self.parts):
            m = which == k
            if m.any():
                c = tuple(x[m] - (self.offsets[k] if d == self.axis else 0) for d, x in enumerate(coords))
                out[m] = p._points(c)
        return out


class Stack(Lazy):
    def __init__(self, parts, axis: int = 0):
        parts = [p if isinstance(p, Lazy) else Stored(np.asarray(p)) for p in parts]
        if any(p.shape != parts[0].shape for p in parts):
            raise ValueError(f"cannot stack {[p.shape for p in parts]}")
        self.parts, self.axis = parts, axis % (parts[0].ndim + 1)
        self.shape = parts[0].shape[:self.axis] + (len(parts),) + parts[0].shape[self.axis:]
        self.dtype = np.result_type(*[p.dtype for p in parts])

    def _read(self, index):
        a, s = self.axis, index[self.axis]
        rest = index[:a] + index[a + 1:]
        got = [self.parts[k]._read(rest).astype(self.dtype) for k in range(s.start, s.stop)]
        if not got:
            return np.zeros(tuple(x.stop - x.start for x in index), self.dtype)
        return np.stack(got, axis=a)

    def _points(self, coords):
        out = np.empty(coords[0].shape, self.dtype)
        rest = coords[:self.axis] + coords[self.axis + 1:]
        for k, p in enumerate(self.parts):
            m = coords[self.axis] == k
            if m.any():
                out[m] = p._points(tuple(x[m] for x in rest))
        return out


def concat(parts, axis: int = 0) -> Lazy:
    return Concat(parts, axis)


def stack(parts, axis: int = 0) -> Lazy:
    return Stack(parts, axis)
