"""Host weights read by parts (hybrid_jax.lazy_weights): every re-layout a weight conversion uses reads,
for any block of slices, exactly numpy's values of the assembled array, and only the bytes of that
block from the stored tensors."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hybrid_jax.layers.mlp import interleave_gate_up
from hybrid_jax.lazy_weights import Lazy, Stored, concat, stack
from hybrid_jax.parallel.placement import lazy_gate_up

RNG = np.random.default_rng(0)


def _stored(*shape, counter):
    a = RNG.standard_normal(shape).astype(ml_dtypes.bfloat16)
    return a, Stored(a, counter)


def _expressions():
    """(numpy value, lazy weight, counter) of the conversions' shapes of re-layout."""
    c = [0]
    g, G = _stored(12, 8, counter=c)          # gate [I, Hd]
    u, U = _stored(12, 8, counter=c)
    k, K = _stored(6, 8, counter=c)
    e3, E3 = _stored(3, 10, 8, counter=c)     # fused experts [E, 2I, Hd]
    return c, [
        (np.concatenate([g, u], 0).T, concat([G, U], 0).T),                       # dense gate | up
        (np.stack([np.concatenate([g, u], 0).T, np.concatenate([u, g], 0).T]),    # per-expert stack
         stack([concat([G, U], 0).T, concat([U, G], 0).T])),
        (np.swapaxes(e3, 1, 2), np.swapaxes(E3, 1, 2)),                            # fused 3-D experts
        (np.concatenate([g, k, u], 0).T.astype(np.float32), concat([G, K, U], 0).T.astype(np.float32)),
        (k.reshape(2, 3, 8)[:, 1:], K.reshape(2, 3, 8)[:, 1:]),                  # a reshape of a stored tensor
    ]


def _blocks(shape, n=12):
    for _ in range(n):
        idx = []
        for d in shape:
            a = int(RNG.integers(0, d))
            idx.append(slice(a, int(RNG.integers(a, d + 1))))
        yield tuple(idx)


def test_every_block_reads_numpys_values_and_only_its_bytes():
    counter, cases = _expressions()
    for want, lazy in cases:
        assert isinstance(lazy, Lazy) and lazy.shape == want.shape and lazy.dtype == want.dtype
        for idx in _blocks(want.shape):
            before = counter[0]
            got = lazy.read(idx)
            assert got.dtype == want.dtype and np.array_equal(got, want[idx])
            assert counter[0] - before == want[idx].size * 2       # every stored tensor is bfloat16
        assert np.array_equal(np.asarray(lazy), want)


def test_points_and_fallbacks():
    counter, cases = _expressions()
    for want, lazy in cases:
        at = tuple(RNG.integers(0, d, 20) for d in want.shape)
        assert np.array_equal(lazy.points(at), want[at])
        assert np.array_equal(lazy[..., 0], want[..., 0])                      # integer index: read whole
    want, lazy = cases[0]
    assert np.array_equal(lazy * 2, want * 2)                                   # arithmetic reads whole
    assert np.array_equal(lazy.reshape(-1), want.reshape(-1))


@pytest.mark.parametrize("n", [2, 3])
def test_gate_up_laid_out_per_device_stays_lazy(n):
    _, cases = _expressions()
    want, lazy = cases[0]                       # [Hd, 2I] with I = 12
    got = lazy_gate_up(lazy, n)
    assert isinstance(got, Lazy) and np.array_equal(np.asarray(got), interleave_gate_up(want, n))


def test_bad_reads_are_named():
    _, cases = _expressions()
    with pytest.raises(TypeError, match="unit-step"):
        cases[0][1].read((slice(0, 4, 2),))
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat([np.zeros((2, 3)), np.zeros((2, 4))], 0)
