"""DeepSeek checkpoints in their release layouts, against transformers on the dequantized weights
(fp32: every logit within 1e-4 and 16 greedy tokens identical, on a short and a 300-token prompt):

  DeepSeek-V4  DeepSeek's own unprefixed tensor names (`embed`, `head`, `hc_head_*`, `layers.N.attn.*`
               with `attn.kv_norm`, `layers.N.ffn.experts.E.w1/w2/w3`), FP8 attention and shared
               experts with float8_e8m0fnu `.scale` blocks, FP4 routed experts, and the legacy config
               keys (compress_ratios, num_hash_layers, qk_rope_head_dim, compress_rope_theta, YaRN
               under rope_scaling). At 300 tokens both HCA (rate 128) and the CSA indexer select.
  DeepSeek-V3.2  Hugging Face names, FP8 with power-of-two float32 `weight_scale_inv` (scale_fmt
               ue8m0), YaRN under rope_scaling (with the mscale correction of the softmax scale).
Both also load with quantization="fp8" (weights kept in FP8, logits equal the dequantized run's).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from test_deepseek_v4 import make_checkpoint as make_v4
from test_deepseek_v32 import make_checkpoint as make_v32

from hybrid_jax import LLM
from hybrid_jax.align import align
from hybrid_jax.layers.linear import Fp8Weight
from hybrid_jax.models.config_common import config_from_hf_dict
from release_formats import assert_matches_transformers, hf_load, quantize_release, read_config, write_reference

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
V4_LEGACY = dict(sliding_window=16, index_topk=8, hc_mult=2, max_position_embeddings=4096,   # on test_deepseek_v4's
                 compress_ratios=[0, 4, 128], num_hash_layers=1, qk_rope_head_dim=8, compress_rope_theta=40000.0,
                 rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
V4_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "scale_fmt": "ue8m0"}
V32 = dict(num_hidden_layers=2, max_position_embeddings=2560,          # test_deepseek_v32's model, and:
           rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def _release(root, src: str, **quantize) -> tuple[str, str]:
    """(the release written from transformers' checkpoint src, the float32 reference of its values)."""
    values = quantize_release(src, str(root / "release"), **quantize)
    write_reference(src, values, str(root / "ref"))
    return str(root / "release"), str(root / "ref")


def v4_release_name(name: str) -> str:
    """transformers' write-back of a V4 name -> the published checkpoint's."""
    name = name.removeprefix("model.")
    name = re.sub(r"^embed_tokens\.", "embed.", name)
    name = re.sub(r"^hc_head\.hc_", "hc_head_", name)
    return re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", name)


def v4_release(root) -> tuple[str, str]:
    """(DeepSeek-V4 in its release layout under root, the float32 reference of its values)."""
    modern = {"layer_types": None, "compress_rates": None, "mlp_layer_types": None, "partial_rotary_factor": None}
    src = make_v4(root / "src", seed=0, **{**V4_LEGACY, **modern})
    return _release(root, src, v4_names=True, rename=v4_release_name, quantization_config=V4_QUANT,
                    fp4=lambda n, a: re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", n) is not None,
                    fp8=lambda n, a: a.ndim == 2 and n.endswith(".weight") and "weights_proj" not in n
                    and (".attn." in n or ".shared_experts." in n),
                    config_update={**V4_LEGACY, "expert_dtype": "fp4", "rope_parameters": None, **modern})


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return v4_release(tmp_path_factory.mktemp("v4rel"))


def test_v4_release_names_formats_and_legacy_config(v4):
    release, ref = v4
    cfg = read_config(release)
    assert "compress_ratios" in cfg and "layer_types" not in cfg and "rope_parameters" not in cfg
    mine, theirs = config_from_hf_dict(cfg), config_from_hf_dict(read_config(ref))
    assert mine.layer_types == (SWA, CSA, HCA) and mine.mlp_layer_types == ("hash_moe", "moe", "moe")
    assert (mine.rope_compress.rope_type, mine.rope_compress.theta, mine.rope_dim("compress")) == ("yarn", 40000.0, 8)
    assert mine == theirs                      # the legacy keys mean what transformers makes of them
    llm = LLM(model=release, dtype="float32", max_model_len=512)
    assert_matches_transformers(llm, hf_load(ref))


def test_v4_release_kept_in_fp8_and_aligned(v4):
    """quantization="fp8" holds the FP8 and FP4 weights as FP8 codes, exactly; `hybrid-jax align` agrees
    with transformers on the dequantized weights at every layer, in both modes."""
    release = v4[0]
    kept = LLM(model=release, dtype="float32", quantization="fp8")
    layer = kept.params["layers"][1]
    assert isinstance(layer["attn"]["q_a"], Fp8Weight) and isinstance(layer["attn"]["o_a"], Fp8Weight)
    assert isinstance(layer["moe"]["gate_up"], Fp8Weight)
    ids = list(np.random.default_rng(3).integers(0, 97, 300))
    deq = LLM(model=release, dtype="float32")
    assert np.max(np.abs(kept.logits(ids) - deq.logits(ids))) < 1e-5
    for llm in (deq, kept):
        report = align(llm, ids[:40])
        assert report.first_divergent is None, str(report)
        assert len(report.rows) == 3 + 2


def v32_release(root) -> tuple[str, str]:
    """(DeepSeek-V3.2 FP8 with power-of-two scales and YaRN under root, the float32 reference)."""
    src = make_v32(root / "src", seed=1, **V32)
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "scale_fmt": "ue8m0"}
    return _release(root, src, quantization_config=q,
                    fp8=lambda n, a: a.ndim == 2 and n.endswith(".weight") and (".self_attn." in n or ".mlp." in n)
                    and not n.endswith("mlp.gate.weight") and "weights_proj" not in n,
                    config_update={"rope_scaling": V32["rope_scaling"], "rope_parameters": None})


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return v32_release(tmp_path_factory.mktemp("v32rel"))


def test_v32_fp8_release_with_yarn(v32):
    release, ref = v32
    llm = LLM(model=release, dtype="float32", max_model_len=512)
    assert llm.config.rope.rope_type == "yarn" and llm.config.softmax_scale > llm.config.qk_head_dim ** -0.5
    assert_matches_transformers(llm, hf_load(ref))
    kept = LLM(model=release, dtype="float32", quantization="fp8")
    attn = kept.params["layers"][0]["attn"]
    assert all(isinstance(attn[k], Fp8Weight) for k in ("q_a", "q_b", "kv_a", "w_uk", "w_uv", "o_proj", "idx_q"))
    ids = list(np.random.default_rng(4).integers(0, 97, 120))
    assert np.max(np.abs(kept.logits(ids) - llm.logits(ids))) < 1e-5
    report = align(kept, ids[:40])
    assert report.first_divergent is None, str(report)
