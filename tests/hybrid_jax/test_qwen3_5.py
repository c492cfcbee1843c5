"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) from its multimodal release layout: config from `text_config`,
text weights under `model.language_model.*` (the vision tower skipped, with a log line), split Gated
DeltaNet projections, gated attention, fused 3-D experts, tied embeddings, and an FP8 release. Each
runs like transformers in fp32: every logit within 1e-4 and 16 greedy tokens identical, on a short
and a 300-token prompt."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from hybrid_jax import LLM
from hybrid_jax.align import align
from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.linear import Fp8Weight
from hybrid_jax.models.config_common import config_from_hf_dict
from release_formats import (
    assert_matches_transformers,
    hf_load,
    load,
    quantize_release,
    read_config,
    save,
    write_config,
    write_reference,
)

LIN, FULL = "linear_attention", "full_attention"
TEXT = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, layer_types=[LIN, LIN, FULL, LIN], max_position_embeddings=1024,
            mamba_ssm_dtype="float32", attn_output_gate=True, mtp_num_hidden_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)


def _write(path, moe: bool, seed: int, tie: bool):
    """A random Qwen3.5 written by transformers (multimodal: vision tower included)."""
    from transformers import (  # noqa: PLC0415
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )
    torch.manual_seed(seed)
    text = dict(TEXT, tie_word_embeddings=tie)
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=VISION,
                                                                    tie_word_embeddings=tie))
    else:
        text.update(intermediate_size=96)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION,
                                                              tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval().save_pretrained(str(path))
    return str(path)


def _fuse_experts(src: str, dst: str):
    """The release layout of Qwen3.5-MoE: per-layer experts.gate_up_proj [E, 2I, Hd], down_proj [E, Hd, I]."""
    t = load(src)
    out, layers = {}, {}
    for k, v in t.items():
        head, sep, rest = k.partition(".mlp.experts.")
        if not sep:
            out[k] = v
            continue
        e, kind = rest.split(".")[:2]
        layers.setdefault(head, {}).setdefault(kind, {})[int(e)] = v
    for head, kinds in layers.items():
        E = len(kinds["gate_proj"])
        out[head + ".mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([kinds["gate_proj"][e], kinds["up_proj"][e]], 0) for e in range(E)])
        out[head + ".mlp.experts.down_proj"] = np.stack([kinds["down_proj"][e] for e in range(E)])
    save(dst, out)
    write_config(dst, read_config(src))
    return dst


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    dense = _write(root / "dense", moe=False, seed=0, tie=True)
    moe_src = _write(root / "moe_src", moe=True, seed=1, tie=False)
    moe = _fuse_experts(moe_src, str(root / "moe"))
    fp8_src = _write(root / "fp8_src", moe=False, seed=2, tie=False)
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens", "model.visual"]}
    values = quantize_release(fp8_src, str(root / "fp8"), quantization_config=q, fp8=lambda n, a: (
        n.startswith("model.language_model.layers.") and n.endswith(".weight") and a.ndim == 2))
    write_reference(fp8_src, values, str(root / "fp8_ref"))
    return {"dense": (dense, dense), "moe": (moe, moe_src), "fp8": (str(root / "fp8"), str(root / "fp8_ref"))}


def test_config_is_the_text_model_of_the_multimodal_checkpoint(releases):
    cfg = config_from_hf_dict(read_config(releases["moe"][0]))
    assert cfg.model_type == "qwen3_5_moe" and cfg.layer_types == (LIN, LIN, FULL, LIN)
    assert cfg.num_experts == 4 and all(cfg.is_moe_layer(i) for i in range(4)) and cfg.norm_topk_prob
    assert cfg.rope.mrope_section == (2, 1, 1) and cfg.rope.mrope_interleaved and cfg.rotary_dim == 8
    dense = config_from_hf_dict(read_config(releases["dense"][0]))
    assert dense.tie_word_embeddings and dense.num_experts == 0 and dense.intermediate_size == 96
    d = read_config(releases["dense"][0])
    for key, value, msg in (("mamba_ssm_dtype", "bfloat16", "mamba_ssm_dtype 'bfloat16'"),
                            ("attn_output_gate", False, "attn_output_gate")):
        with pytest.raises(ConfigError, match=msg):
            config_from_hf_dict({**d, "text_config": {**d["text_config"], key: value}})
    with pytest.raises(ConfigError, match="text_config"):
        config_from_hf_dict({k: v for k, v in d.items() if k != "text_config"})


@pytest.mark.parametrize("name", ["dense", "moe", "fp8"])
def test_release_matches_transformers(releases, name, caplog):
    path, ref = releases[name]
    with caplog.at_level(logging.INFO, logger="hybrid_jax.models.qwen3_5"):
        llm = LLM(model=path, dtype="float32", max_model_len=512)
    assert "model.visual" in caplog.text                        # the vision tower is skipped, and says so
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    assert_matches_transformers(llm, hf_load(ref))
    ids = list(np.random.default_rng(9).integers(0, 97, 40))
    if name == "fp8":
        llm = LLM(model=path, dtype="float32", quantization="fp8")
        assert isinstance(llm.params["layers"][0]["gdn"]["qkvz"], Fp8Weight)
    report = align(llm, ids)                    # hybrid-jax align: every layer, against transformers
    assert report.first_divergent is None and len(report.rows) == 4 + 2, str(report)
