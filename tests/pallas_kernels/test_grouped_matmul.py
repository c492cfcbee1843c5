"""The FP8 grouped matmul (MoE experts kept in FP8): the TPU kernel, interpreted on this host, against the
ragged_dot over dequantized weights, for groups that are empty, straddle row tiles, or leave rows over."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import dequantize_blocks, fp8_grouped_matmul, fp8_matmul


def _case(R, E, K, N, seed=0):
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.normal(size=(R, K)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(E, K, N)), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, size=(E, K // 128, N // 128)), jnp.float32)
    return xs, w, scale


@pytest.mark.parametrize("sizes", [(10, 0, 25, 5), (0, 0, 40, 0), (3, 7, 0, 20), (70, 1, 0, 9), (5, 5, 5, 5)])
def test_kernel_matches_ragged_dot_over_dequantized_weights(sizes):
    xs, w, scale = _case(sum(sizes) if sum(sizes) == 80 else 80, 4, 256, 384)
    gs = jnp.asarray(sizes, jnp.int32)
    want = np.asarray(fp8_grouped_matmul(xs, w, scale, gs, impl="xla"), np.float32)
    got = np.asarray(fp8_grouped_matmul(xs, w, scale, gs, impl="pallas"), np.float32)
    # the same bf16 products; only the f32 accumulation order differs (K tiles)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    assert not got[sum(sizes):].any()                        # rows past the groups are zero, as ragged_dot's


def test_xla_path_is_ragged_dot_over_dequantized_weights():
    import jax  # noqa: PLC0415
    xs, w, scale = _case(16, 2, 128, 256)
    gs = jnp.asarray([9, 7], jnp.int32)
    ref = jax.lax.ragged_dot(xs, dequantize_blocks(w, scale, (128, 128), xs.dtype), gs)
    np.testing.assert_array_equal(np.asarray(fp8_grouped_matmul(xs, w, scale, gs), np.float32),
                                  np.asarray(ref, np.float32))


def test_bad_shapes_are_value_errors():
    xs, w, scale = _case(8, 2, 128, 256)
    with pytest.raises(ValueError, match="scale"):
        fp8_grouped_matmul(xs, w, scale[:, :, :1], jnp.asarray([4, 4], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        fp8_grouped_matmul(xs, w, scale, jnp.asarray([8], jnp.int32))


def test_fp8_matmul_kernel_matches_dequantize_then_matmul():
    xs, w, scale = _case(2 * 37, 1, 256, 384, seed=3)
    x = xs.reshape(2, 37, 256)
    want = np.asarray(fp8_matmul(x, w[0], scale[0], impl="xla"), np.float32)
    np.testing.assert_array_equal(want, np.asarray(x @ dequantize_blocks(w[0], scale[0], (128, 128), x.dtype),
                                                   np.float32))
    got = np.asarray(fp8_matmul(x, w[0], scale[0], impl="pallas"), np.float32)
    assert got.shape == (2, 37, 384)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
