"""FP8 and FP4 releases read by parts (hybrid_jax.lazy_quantized): a block of a quantized tensor reads
only its codes and decodes exactly as the whole tensor does, and a split model's conversion of a
release (Qwen3-Next FP8, DeepSeek-V3.2 FP8, DeepSeek-V4 FP8 + FP4 experts; dequantized or kept in FP8)
gives the very weights, codes, block scales and blocks of the conversion that reads each tensor whole,
while leaving nearly every byte unread until a device asks for its part."""
from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import make_checkpoint
from test_deepseek_release import v4_release, v32_release
from test_quantized_checkpoints import QWEN, QWEN_FP8, SKIP, _fp8_selected

from hybrid_jax import quantization as qz
from hybrid_jax.layers.linear import ColumnConcat, Fp8Weight
from hybrid_jax.lazy_quantized import BlockScaled, Fp4Codes
from hybrid_jax.lazy_weights import Lazy, Stored
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import load_config
from hybrid_jax.weights import on_host, open_checkpoint
from release_formats import fp4_blocks, fp8_blocks, quantize_release

RNG = np.random.default_rng(0)


def _blocks(shape, n=16):
    for _ in range(n):
        lo = [int(RNG.integers(0, d)) for d in shape]
        yield tuple(slice(a, int(RNG.integers(a + 1, d + 1))) for a, d in zip(lo, shape))


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 257), (1, 1)])
def test_fp8_blocks_read_by_parts_decode_as_the_whole(shape):
    """Partial edge blocks, 3-D stacks, one element: each random block equals the whole tensor's decode
    there (values and the kept records) and reads exactly its own code bytes."""
    codes, scale = fp8_blocks(RNG.standard_normal(shape).astype(np.float32))
    whole = codes.astype(np.float32) * qz.scale_map(scale, shape, (128, 128))
    counter = [0]
    block = (1,) * (len(shape) - 2) + (128, 128)
    lazy = BlockScaled(Stored(codes, counter), scale.astype(np.float32), block)
    rec = BlockScaled(Stored(codes, [0]), scale.astype(np.float32), block, records=True)
    for index in _blocks(shape):
        before = counter[0]
        np.testing.assert_array_equal(lazy.read(index), whole[index])
        assert counter[0] - before == whole[index].size          # one byte per FP8 code
        np.testing.assert_array_equal(rec.read(index)["v"], whole[index])
    at = tuple(RNG.integers(0, d, 50) for d in shape)
    np.testing.assert_array_equal(lazy.points(at), whole[at])


def test_fp4_codes_read_by_parts_unpack_as_the_whole():
    """Odd starts and stops on the packed axis (half a byte): the codes and values of the whole unpack."""
    w = RNG.standard_normal((2, 40, 96)).astype(np.float32)
    packed, scale, _ = fp4_blocks(w)
    counter = [0]
    codes = Fp4Codes(Stored(packed, counter))
    values = qz.unpack_fp4(packed) * qz.scale_map(scale, codes.shape, (1, qz.FP4_BLOCK))
    lazy = BlockScaled(codes, np.asarray(scale, np.float32), (1, 1, qz.FP4_BLOCK))
    for index in [(slice(0, 2), slice(3, 9), slice(1, 6)), (slice(1, 2), slice(0, 40), slice(33, 96))] + list(
            _blocks(codes.shape)):
        np.testing.assert_array_equal(codes.read(index).astype(np.float32), qz.unpack_fp4(packed)[index])
        np.testing.assert_array_equal(lazy.read(index), values[index])
    before = counter[0]
    codes.read((slice(0, 1), slice(0, 1), slice(3, 6)))
    assert counter[0] - before == 2                               # codes 3..5 live in bytes 1 and 2
    at = tuple(RNG.integers(0, d, 50) for d in codes.shape)
    np.testing.assert_array_equal(codes.points(at).astype(np.float32), qz.unpack_fp4(packed)[at])


def _leaves(params):
    return jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, (Fp8Weight, ColumnConcat,
                                                                                          Lazy)))[0]


def _convert(path: str, quantization, lazy: bool):
    reader = open_checkpoint(path, quantization)
    cfg = load_config(path)
    if lazy:
        with on_host():
            params = get_model(cfg.model_type).convert_hf_weights(cfg, reader.get, reader.has, "float32")
    else:
        params = get_model(cfg.model_type).convert_hf_weights(cfg, reader.get, reader.has, "float32")
    return params, reader


def _host(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint8) if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn) else a


def assert_read_by_parts_like_whole(path: str, quantization):
    """The release converted for a split model (on the host, read by parts) against the conversion that
    reads every tensor whole: the same tree, every weight's values equal, every FP8 weight kept with the
    same codes, scales and blocks; and almost every checkpoint byte still unread after the conversion."""
    whole, _ = _convert(path, quantization, lazy=False)
    lazy, reader = _convert(path, quantization, lazy=True)
    read = reader.counter[0] / reader.total_bytes          # before anything below reads a weight
    assert jax.tree.structure(whole, is_leaf=lambda x: isinstance(x, Fp8Weight)) == \
        jax.tree.structure(lazy, is_leaf=lambda x: isinstance(x, Fp8Weight))
    kept = by_parts = total = 0
    for (path_w, w), (_, z) in zip(_leaves(whole), _leaves(lazy)):
        name = jax.tree_util.keystr(path_w)
        assert type(w) is type(z) or isinstance(z, (Lazy, np.ndarray)), name
        if isinstance(w, Fp8Weight):
            kept += 1
            assert z.block == w.block, name
            np.testing.assert_array_equal(_host(z.w), _host(w.w), err_msg=name)
            np.testing.assert_array_equal(np.asarray(z.scale), np.asarray(w.scale), err_msg=name)
            by_parts += z.w.nbytes if isinstance(z.w, Lazy) else 0
            total += z.w.nbytes
        else:
            for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(z, is_leaf=lambda x: isinstance(x, Lazy))):
                np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
                by_parts += b.nbytes if isinstance(b, Lazy) else 0
                total += b.nbytes
    return kept, by_parts / total, read


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazyq")
    src = make_checkpoint(root / "qsrc", seed=3, **QWEN)
    quantize_release(src, str(root / "qwen"), fp8=_fp8_selected(SKIP), quantization_config=QWEN_FP8)
    (root / "v32").mkdir()
    (root / "v4").mkdir()
    return {"qwen3_next": str(root / "qwen"), "deepseek_v32": v32_release(root / "v32")[0],
            "deepseek_v4": v4_release(root / "v4")[0]}


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v32", "deepseek_v4"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_split_conversion_of_a_release_reads_by_parts(releases, family, quantization):
    kept, share, read = assert_read_by_parts_like_whole(releases[family], quantization)
    print(f"{family} {quantization}: {share:.1%} of the weights' bytes by parts, {read:.1%} of the file read")
    assert (kept > 0) == (quantization == "fp8")
    assert share > 0.9, f"only {share:.0%} of the weights' bytes are read by parts"
    assert read < 0.1, f"{read:.0%} of the checkpoint was read before any device asked for its part"
