"""Qwen4-Exp at its released max_model_len (262,144; issue 54): the QSA read (indexer scoring and the sparse
attention) follows the context the rows hold, not the page table's span. Proven with the compiler's figures
for the step at the release's attention and indexer shapes (nothing of that size runs), and by serving a
miniature of the released config, with the release's block and Top-K geometry, at the LLM's defaults."""
from __future__ import annotations

import pathlib

import jax
from conftest import released_config, step_temp_bytes, hf_greedy, hf_model, random_prompt, save_random_checkpoint

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import config_from_hf_dict

RELEASED = pathlib.Path(__file__).parents[2] / "hybrid_jax" / "published_configs" / "qwen4_exp_reconstructed.json"
PROMPT = 300
LONG, SHORT = 1 << 18, 4096


def _released(**overrides) -> dict:
    return released_config(RELEASED, **overrides)


def _temp_bytes(fam, cfg, params, capacity: int, ragged: bool) -> int:
    """The compiled step's temporaries for a PROMPT-token prompt on one row of `capacity` tokens."""
    return step_temp_bytes(fam, cfg, params, capacity, ragged, PROMPT)


def test_step_temporaries_do_not_grow_with_max_model_len():
    """The release's attention (24 heads, 2 KV heads of 256) and indexer (4 heads of 128, budget 2048 in
    blocks of 4) in one Gated DeltaNet + one indexed layer, vocabulary, experts and PLE table cut: the
    padded and the ragged step's temporaries for a 300-token prompt are the same at 4k and 256k tokens of
    table, and below a tenth of the [300, 24, 256k] f32 scores a read spanning the table would hold (7.5 GB;
    what remains is the step's other layers and the (512 + 1) x 4 gathered K / V rows per query block)."""
    cfg = config_from_hf_dict(_released(vocab_size=512, num_hidden_layers=2, num_experts=16, ple_layer_ids=[1],
                                        layer_types=["linear_attention", "full_attention"],
                                        ngram_vocab_size_base=4096, split_ngram_parts=2))
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.max_position_embeddings) == (24, 256, LONG)
    assert (cfg.indexer_budget, cfg.indexer_compress_ratio, cfg.qsa_block_topk) == (2048, 4, 512)
    fam = get_model("qwen4_exp")
    params = jax.eval_shape(lambda: fam.init_params(cfg, seed=0))
    for ragged in (False, True):
        short, long = (_temp_bytes(fam, cfg, params, cap, ragged) for cap in (SHORT, LONG))
        assert long <= 1.05 * short + (1 << 20), (ragged, short, long)
        assert long < PROMPT * cfg.num_attention_heads * LONG * 4 / 10, (ragged, long)


def test_a_miniature_of_the_release_serves_a_300_token_prompt_at_the_default_max_model_len(tmp_path):
    """The released config (262,144-token max_model_len, indexer budget 2048 in blocks of 4, the release's
    first four layers: three Gated DeltaNet, the second with PLE, then an indexed layer) at small widths,
    loaded with the LLM's defaults: a 300-token prompt gets transformers' greedy tokens."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: PLC0415
    d = _released(vocab_size=256, hidden_size=32, num_hidden_layers=4, layer_types=_released()["layer_types"][:4],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_lowrank=8,
                  ple_embed_dim=32, heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8,
                  split_ngram_parts=2, indexer_n_heads=2, indexer_head_dim=16, eos_token_id=1,
                  initializer_range=0.1)
    d.pop("architectures")
    d.pop("model_type")
    path = save_random_checkpoint(Qwen4ExpForCausalLM, Qwen4ExpTextConfig(**d), tmp_path / "q4", seed=3)
    llm = LLM(model=path, dtype="float32")
    assert llm.max_model_len == LONG
    assert (llm.config.indexer_budget, llm.config.indexer_compress_ratio) == (2048, 4)
    prompt = random_prompt(PROMPT, 256, seed=4)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    o = out.outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 6
    assert o.token_ids == hf_greedy(hf_model(path), prompt, 6)
