"""One RoPE module for every family (hybrid_jax.layers.rope): the frequency schedules equal
transformers' (default, linear, dynamic NTK, YaRN with and without DeepSeek's mscale), Qwen3.5's
interleaved mRoPE equals transformers' and reduces to 1-D RoPE for text positions, both config
spellings (`rope_parameters`, legacy `rope_scaling` with `type`) give one spec in every family, a
rope_type not implemented is an error naming it, and whole models with YaRN / dynamic NTK RoPE match
transformers on a 300-token prompt (past the scaled length): logits within 1e-4 and 16 greedy tokens."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import BASE, make_checkpoint
from test_deepseek_v32 import make_checkpoint as make_v32
from hybrid_jax import LLM
from hybrid_jax.models.config_common import config_from_hf_dict
from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.rope import RopeSpec, frequencies, mrope_cos_sin, rope_cos_sin, softmax_scale
from release_formats import assert_matches_transformers, hf_load

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
DEEPSEEK_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _hf_freqs(rope: dict, seq_len=None, head_dim=16, prf=0.5, max_pos=128):
    from transformers import Qwen3NextConfig  # noqa: PLC0415
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415
    cfg = Qwen3NextConfig(head_dim=head_dim, max_position_embeddings=max_pos,
                          rope_parameters={**rope, "rope_theta": 5000.0, "partial_rotary_factor": prf})
    inv, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, None, seq_len=seq_len)
    return inv.numpy(), factor


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 3.0}, YARN,
                                  {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
                                  {**DEEPSEEK_YARN, "rope_type": "yarn", "mscale": 0.7}],
                         ids=["linear", "yarn", "yarn_untruncated", "yarn_mscale"])
def test_frequencies_equal_transformers(rope):
    spec = RopeSpec.parse({**rope, "rope_theta": 5000.0}, family="test", partial_rotary_factor=0.5,
                          max_position_embeddings=128)
    want, factor = _hf_freqs({k: v for k, v in rope.items() if k != "type"})
    np.testing.assert_allclose(np.asarray(frequencies(spec, 8)), want, rtol=1e-6)
    assert spec.attention_factor == pytest.approx(factor)


def test_dynamic_ntk_grows_the_base_per_row_past_the_trained_length():
    spec = RopeSpec.parse({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0}, family="test",
                          max_position_embeddings=128)
    got = np.asarray(frequencies(spec, 8, jnp.asarray([40, 128, 300, 1000])))
    base, _ = _hf_freqs({"rope_type": "dynamic", "factor": 2.0}, seq_len=128)
    np.testing.assert_allclose(got[0], base, rtol=1e-6)          # within the trained length: unchanged
    np.testing.assert_allclose(got[1], base, rtol=1e-6)
    for row, n in ((2, 300), (3, 1000)):
        np.testing.assert_allclose(got[row], _hf_freqs({"rope_type": "dynamic", "factor": 2.0}, seq_len=n)[0], rtol=1e-6)
    assert np.all(got[3, 1:] < got[2, 1:])


def test_deepseek_yarn_corrects_the_softmax_scale():
    spec = RopeSpec.parse(DEEPSEEK_YARN, family="test")
    m = 0.1 * 1.0 * np.log(40) + 1.0
    assert softmax_scale(spec, 24) == pytest.approx(24 ** -0.5 * m * m)
    assert spec.attention_factor == 1.0                          # mscale == mscale_all_dim: cos / sin unscaled
    assert softmax_scale(RopeSpec.parse(YARN, family="test"), 24) == 24 ** -0.5     # no mscale_all_dim: none


def test_interleaved_mrope_is_1d_rope_for_text_and_equals_transformers():
    """mRoPE with the three position axes equal (every text token) is exactly 1-D RoPE; with distinct
    (temporal, height, width) positions it equals transformers' Qwen3.5 rotary embedding."""
    from transformers import Qwen3_5TextConfig  # noqa: PLC0415
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding  # noqa: PLC0415
    section = [6, 5, 5]                                          # 16 frequencies: head_dim 128 x 0.25 / 2
    spec = RopeSpec.parse({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                           "mrope_section": section, "mrope_interleaved": True}, family="test")
    rng = np.random.default_rng(0)
    text = jnp.asarray(rng.integers(0, 5000, (2, 37)), jnp.int32)
    c3, s3 = mrope_cos_sin(jnp.stack([text] * 3), 32, spec)
    c1, s1 = rope_cos_sin(text, 32, spec)
    np.testing.assert_array_equal(np.asarray(c3), np.asarray(c1))
    np.testing.assert_array_equal(np.asarray(s3), np.asarray(s1))
    pos3 = rng.integers(0, 5000, (3, 2, 37))
    cfg = Qwen3_5TextConfig(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25, "mrope_section": section,
                                                           "mrope_interleaved": True})
    ref_c, ref_s = Qwen3_5TextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), torch.tensor(pos3))
    got_c, got_s = mrope_cos_sin(jnp.asarray(pos3, jnp.int32), 32, spec)
    np.testing.assert_allclose(np.asarray(got_c), ref_c.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_s), ref_s.numpy(), atol=1e-6)
    assert not np.allclose(np.asarray(got_c), np.asarray(mrope_cos_sin(jnp.stack([jnp.asarray(pos3[0])] * 3), 32,
                                                                       spec)[0]))     # the axes do matter


QWEN = {**BASE, "model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"],
        "num_hidden_layers": 2}
V32 = dict(model_type="deepseek_v32", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=1, num_attention_heads=4, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
           kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, index_topk=16,
           index_head_dim=16, index_n_heads=32, first_k_dense_replace=1)
V4 = dict(model_type="deepseek_v4", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          head_dim=16, q_lora_rank=24, compress_ratios=[0, 4], qk_rope_head_dim=8)
QWEN35 = {"model_type": "qwen3_5", "text_config": {**QWEN, "model_type": "qwen3_5_text"}}


def _rope_of(d):
    cfg = config_from_hf_dict(d)
    return cfg.rope_compress if cfg.model_type == "deepseek_v4" else cfg.rope


def _with(d, **kw):
    if "text_config" in d:
        return {**d, "text_config": {**d["text_config"], **kw}}
    return {**d, **kw}


@pytest.mark.parametrize("base", [QWEN, V32, V4, QWEN35], ids=["qwen3_next", "deepseek_v32", "deepseek_v4", "qwen3_5"])
def test_both_spellings_and_unsupported_types_in_every_family(base):
    legacy = _rope_of(_with(base, rope_scaling=DEEPSEEK_YARN))
    assert legacy.rope_type == "yarn" and legacy.factor == 40
    new = _rope_of(_with(base, rope_parameters={**DEEPSEEK_YARN, "rope_type": DEEPSEEK_YARN["type"]}))
    assert new == legacy
    for bad in ({"rope_type": "longrope", "factor": 2.0}, {"type": "llama3", "factor": 8.0}):
        with pytest.raises(ConfigError, match=f"rope_type '{bad.get('rope_type', bad.get('type'))}'"):
            config_from_hf_dict(_with(base, rope_scaling=bad))
    with pytest.raises(ConfigError, match="low_freq_factor"):
        config_from_hf_dict(_with(base, rope_parameters={**YARN, "low_freq_factor": 1.0}))
    with pytest.raises(ConfigError, match="disagree"):
        config_from_hf_dict(_with(base, rope_parameters=YARN, rope_scaling={**YARN, "factor": 8.0}))


def test_deepseek_v4_has_no_dynamic_ntk():
    with pytest.raises(ConfigError, match="rope_type 'dynamic' is not supported for deepseek_v4"):
        config_from_hf_dict({**V4, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


@pytest.mark.parametrize("family,rope", [("qwen3_next", {"rope_scaling": YARN}),
                                         ("qwen3_next", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
                                                         "max_position_embeddings": 128}),
                                         ("deepseek_v32", {"rope_scaling": DEEPSEEK_YARN})],
                         ids=["qwen3_next_yarn", "qwen3_next_dynamic", "deepseek_v32_yarn"])
def test_scaled_rope_models_match_transformers_past_the_scaled_length(tmp_path, family, rope):
    if family == "qwen3_next":
        path = make_checkpoint(tmp_path / "m", seed=1, layer_types=QWEN["layer_types"], num_hidden_layers=2, **rope)
    else:
        path = make_v32(tmp_path / "m", num_hidden_layers=1, max_position_embeddings=2560, **rope)
    llm = LLM(model=path, dtype="float32", max_model_len=512)
    assert llm.config.rope.rope_type == (rope.get("rope_scaling") or rope.get("rope_parameters")).get(
        "rope_type", "yarn")
    assert_matches_transformers(llm, hf_load(path))
