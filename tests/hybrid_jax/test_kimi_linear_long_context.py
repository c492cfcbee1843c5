"""Kimi-Linear at its released max_model_len (1,048,576; issue 54: a 300-token prompt asked for 25.9 GB and
`generate` returned an empty "error" output): the MLA read follows the context the rows hold, not the page
table's span. Proven with the compiler's figures for the step at the release's attention shapes (nothing of
that size runs), and by serving a miniature of the released config at the LLM's defaults."""
from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from conftest import released_config, step_temp_bytes, greedy_reference, save_random_checkpoint

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import config_from_hf_dict

RELEASED = pathlib.Path(__file__).parents[2] / "hybrid_jax" / "published_configs" / "kimi_linear_48b_a3b_instruct.json"
PROMPT = 300
LONG, SHORT = 1 << 20, 4096


def _released(**overrides) -> dict:
    return released_config(RELEASED, **overrides)


def _temp_bytes(fam, cfg, params, capacity: int, ragged: bool) -> int:
    """The compiled step's temporaries for a PROMPT-token prompt on one row of `capacity` tokens."""
    return step_temp_bytes(fam, cfg, params, capacity, ragged, PROMPT)


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_step_temporaries_do_not_grow_with_max_model_len(ragged):
    """The release's attention shapes (hidden 2304, 32 heads, latent 512, nope 128, shared key 64; KDA 32 x 128)
    in one KDA and one MLA layer, vocabulary and experts cut: the step's temporaries for a 300-token prompt
    are the same at 4k and 1M tokens of table. A read spanning the table scores every query against every
    position: one [300, 32, 1M] f32 score tensor alone is 40 GB (the old dense read: 123 GB)."""
    cfg = config_from_hf_dict(_released(vocab_size=512, num_hidden_layers=2, num_experts=8, intermediate_size=256,
                                        moe_intermediate_size=64,
                                        linear_attn_config={**_released()["linear_attn_config"], "kda_layers": [1],
                                                            "full_attn_layers": [2]}))
    assert (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.max_position_embeddings) == (32, 512, LONG)
    fam = get_model("kimi_linear")
    params = jax.eval_shape(lambda: fam.init_params(cfg, seed=0))
    short, long = (_temp_bytes(fam, cfg, params, cap, ragged) for cap in (SHORT, LONG))
    assert long <= 1.05 * short + (1 << 20), (short, long)
    assert long < PROMPT * cfg.num_attention_heads * LONG * 4 / 100, long


def test_a_miniature_of_the_release_serves_a_300_token_prompt_at_the_default_max_model_len(tmp_path):
    """The released config (1,048,576-token max_model_len, MLA without positional encoding, the release's first
    five layers: KDA, KDA, KDA, MLA, KDA) with small widths, loaded with the LLM's defaults: a 300-token
    prompt gets its tokens (those of full recomputation), not an empty "error" output."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: PLC0415
    d = _released(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
                  num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  num_experts=8, num_experts_per_token=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                      "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]})
    path = save_random_checkpoint(KimiLinearForCausalLM, KimiLinearConfig(**d), tmp_path / "kimi", seed=3)
    llm = LLM(model=path, dtype="float32")
    assert llm.max_model_len == LONG
    prompt = np.random.default_rng(4).integers(0, 256, PROMPT).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    o = out.outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 6
    assert o.token_ids == greedy_reference(llm, prompt, 6)
