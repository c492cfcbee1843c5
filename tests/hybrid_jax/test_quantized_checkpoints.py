"""Block-quantized checkpoints (FP8 weights with block scales, DeepSeek-V4's packed FP4 experts):
the reader decodes them exactly (partial edge blocks, low nibble first), a quantized release runs like
transformers on its dequantized weights (fp32: logits within 1e-4, 16 greedy tokens identical on a
short and a 300-token prompt), the kept-on-device mode (quantization="fp8") stays within bf16
tolerance of the dequantized run in about half the device bytes of bf16, and every malformed
release fails at load with an error naming the key."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from conftest import make_checkpoint
from hybrid_jax import LLM, CheckpointError, ConfigError
from hybrid_jax.align import align
from hybrid_jax.layers.linear import ColumnConcat, Fp8Weight, dequantize, weight_bytes
from hybrid_jax.weights import open_checkpoint, to_device_linear
from release_formats import (
    assert_matches_transformers,
    fp4_blocks,
    fp8_blocks,
    fp8_dequantize,
    hf_load,
    quantize_release,
    read_config,
    save,
    write_config,
    write_reference,
)

# Qwen3-Next-FP8's layout: every linear weight FP8 in 128 x 128 blocks except the routers and the
# listed modules (in_proj_ba is kept in bf16 here, so fused projections mix both kinds).
SKIP = ["lm_head", "model.embed_tokens", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba"]
QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": SKIP}
# Linear weights dominate (as in a real model), so the device bytes reflect the weights' format.
QWEN = dict(vocab_size=64, tie_word_embeddings=True, num_experts=8, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                             "full_attention"], mlp_only_layers=[1])


def _fp8_selected(skip):
    def select(name, a):
        module = name.rsplit(".", 1)[0]
        return name.endswith(".weight") and a.ndim == 2 and not any(module.endswith(s) for s in skip)
    return select


@pytest.fixture(scope="module")
def qwen_release(tmp_path_factory):
    """(FP8 release dir, float32 reference dir of its dequantized weights)."""
    root = tmp_path_factory.mktemp("qfp8")
    src = make_checkpoint(root / "src", seed=3, **QWEN)
    values = quantize_release(src, str(root / "fp8"), fp8=_fp8_selected(SKIP), quantization_config=QWEN_FP8)
    write_reference(src, values, str(root / "ref"))
    return str(root / "fp8"), str(root / "ref")


@pytest.fixture(scope="module")
def qwen_pair(qwen_release):
    return LLM(model=qwen_release[0], dtype="float32", max_model_len=512), hf_load(qwen_release[1])


def test_fp8_blocks_decode_exactly_with_partial_edge_blocks(tmp_path):
    """A [300, 200] tensor in 128 x 128 blocks (edge blocks 44 x 72): every element is its code times
    its own block's scale, in both modes; the kept weight holds the same values."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 200)).astype(np.float32) * np.exp(rng.standard_normal((300, 1)))
    codes, scale = fp8_blocks(w)
    assert scale.shape == (3, 2)
    save(str(tmp_path), {"proj.weight": codes, "proj.weight_scale_inv": scale})
    write_config(str(tmp_path), {"quantization_config": QWEN_FP8})
    want = fp8_dequantize(codes, scale)
    np.testing.assert_array_equal(open_checkpoint(str(tmp_path)).get("proj.weight"), want)
    assert np.max(np.abs(want - w) / np.abs(w).max()) < 2 ** -4          # e4m3: 3 mantissa bits
    kept = to_device_linear(open_checkpoint(str(tmp_path), "fp8").get("proj.weight").T, jnp.float32)
    assert isinstance(kept, Fp8Weight) and kept.w.dtype == jnp.float8_e4m3fn and kept.block == (128, 128)
    assert kept.scale.shape == (2, 3)                                   # [in blocks, out blocks]
    np.testing.assert_array_equal(np.asarray(dequantize(kept, jnp.float32)), want.T)


def test_fp4_codes_unpack_low_nibble_first(tmp_path):
    """Bytes 0x21 and 0xF9 hold codes (1, 2) and (9, 15): 0.5, 1.0, -0.5, -6.0 times the block's scale."""
    packed = np.zeros((2, 16), np.uint8)
    packed[0, 0], packed[0, 1] = 0x21, 0xF9
    packed[1] = 0x77                                                  # 6.0 everywhere
    scale = np.array([[0.25], [2.0 ** -3]], np.float32)
    save(str(tmp_path), {"e.weight": packed.view(np.int8), "e.scale": scale.astype(ml_dtypes.float8_e8m0fnu)})
    write_config(str(tmp_path), {"quantization_config": {**QWEN_FP8, "expert_dtype": "fp4"}})
    got = open_checkpoint(str(tmp_path)).get("e.weight")
    assert got.shape == (2, 32)
    np.testing.assert_array_equal(got[0, :4], np.array([0.5, 1.0, -0.5, -6.0]) * 0.25)
    np.testing.assert_array_equal(got[1], np.full(32, 6.0 / 8))
    # and a random FP4 tensor decodes to the values its encoder meant
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    packed, scale, values = fp4_blocks(w)
    save(str(tmp_path), {"e.weight": packed, "e.scale": scale})
    np.testing.assert_array_equal(open_checkpoint(str(tmp_path)).get("e.weight"), values)


def test_fp8_release_matches_transformers_on_its_dequantized_weights(qwen_pair):
    llm, hf = qwen_pair
    assert_matches_transformers(llm, hf)


def test_fp8_kept_on_device(qwen_release, qwen_pair):
    """quantization="fp8": linear weights stay FP8 (fused projections of mixed pieces split by column);
    fp32 logits equal the dequantized run's to 1e-5; in bf16 they are as far from the fp32 logits as
    the dequantized bf16 run is (bf16's tolerance); the weights take <= 0.55x the device bytes of bf16."""
    path = qwen_release[0]
    deq32 = qwen_pair[0]
    kept32 = LLM(model=path, dtype="float32", quantization="fp8")
    gdn, moe = kept32.params["layers"][0]["gdn"], kept32.params["layers"][0]["moe"]
    assert isinstance(gdn["out_proj"], Fp8Weight) and isinstance(moe["gate_up"], Fp8Weight)
    assert isinstance(gdn["qkvz"], Fp8Weight)                # q|k|v|z FP8; b|a not converted: float
    assert type(gdn["ba"]) is type(gdn["norm"])
    assert isinstance(moe["in_proj"], ColumnConcat)          # router | shared gate float, shared gate_up FP8
    ids = list(np.random.default_rng(5).integers(0, 64, 300))
    ref = deq32.logits(ids)
    assert np.max(np.abs(kept32.logits(ids) - ref)) < 1e-5
    deq16 = LLM(model=path, dtype="bfloat16")
    kept16 = LLM(model=path, dtype="bfloat16", quantization="fp8")
    err_kept, err_deq = (np.max(np.abs(m.logits(ids) - ref)) for m in (kept16, deq16))
    assert 0 < err_kept <= 1.5 * err_deq, (err_kept, err_deq)   # bf16's own error, no more
    ratio = weight_bytes(kept16.params) / weight_bytes(deq16.params)
    assert ratio <= 0.55, ratio
    report = align(kept32, ids[:40])            # against transformers on the dequantized weights
    assert report.first_divergent is None, str(report)


def test_align_cli_on_a_quantized_release(qwen_release, capsys):
    from hybrid_jax.cli import main  # noqa: PLC0415
    assert main(["align", "--model", qwen_release[0], "--tokens", "3,1,4,1,5,9,2,6", "--quantization", "fp8"]) == 0
    assert "all stages agree" in capsys.readouterr().out


def _copy_release(src, dst):
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return dst


def test_malformed_releases_fail_at_load_naming_the_key(qwen_release, tmp_path):
    from safetensors.torch import load_file, save_file  # noqa: PLC0415
    good = qwen_release[0]
    w = "model.layers.0.linear_attn.out_proj.weight"
    # an unknown quant_method / key / activation scheme: ConfigError naming it
    for i, (q, msg) in enumerate((({**QWEN_FP8, "quant_method": "awq"}, "quant_method 'awq'"),
                                  ({**QWEN_FP8, "group_size": 64}, "group_size"),
                                  ({**QWEN_FP8, "activation_scheme": "static"}, "activation_scheme"))):
        d = _copy_release(good, str(tmp_path / f"q{i}"))
        write_config(d, {**read_config(d), "quantization_config": q})
        with pytest.raises(ConfigError, match=msg):
            LLM(model=d)
    tensors = load_file(os.path.join(good, "model.safetensors"))
    assert tensors[w].dtype == torch.float8_e4m3fn

    def damaged(name, edit):
        d = str(tmp_path / name)
        os.makedirs(d)
        save_file(edit(dict(tensors)), os.path.join(d, "model.safetensors"))
        write_config(d, read_config(good))
        return d

    def wrong_shape(t):
        t[w + "_scale_inv"] = torch.ones(2, 2)
        return t
    with pytest.raises(CheckpointError, match=f"{w}_scale_inv.*shape"):
        LLM(model=damaged("shape", wrong_shape))
    with pytest.raises(CheckpointError, match=f"scale of quantized tensor '{w}'"):
        LLM(model=damaged("missing", lambda t: {k: v for k, v in t.items() if k != w + "_scale_inv"}))
    # an FP8 tensor in a module modules_to_not_convert names
    d = _copy_release(good, str(tmp_path / "skip"))
    cfg = read_config(d)
    cfg["quantization_config"]["modules_to_not_convert"] = SKIP + ["out_proj"]
    write_config(d, cfg)
    with pytest.raises(CheckpointError, match="modules_to_not_convert"):
        LLM(model=d)
    # FP8 tensors without a quantization_config; kept mode on a checkpoint that has none
    d = _copy_release(good, str(tmp_path / "noq"))
    cfg = read_config(d)
    del cfg["quantization_config"]
    write_config(d, cfg)
    with pytest.raises(CheckpointError, match="no quantization_config"):
        LLM(model=d)
    with pytest.raises(ConfigError, match="no quantization_config"):
        LLM(model=qwen_release[1], quantization="fp8")
    with pytest.raises(ConfigError, match="quantization 'int4'"):
        LLM(model=good, quantization="int4")
    assert json.loads(open(os.path.join(good, "config.json")).read())["quantization_config"] == QWEN_FP8
