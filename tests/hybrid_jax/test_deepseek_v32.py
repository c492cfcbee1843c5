"""Conformance of the DeepSeek-V3.2 family (MLA + DSA sparse attention + DeepSeek MoE) with transformers'
DeepseekV32ForCausalLM on tiny random checkpoints: prefill logits (fp32, 1e-4), 32 greedy tokens equal
to HF generate, decode after prefill equal to full recompute, with prompts far longer than index_topk
so that the indexer really selects.

The index score sum_h w_h relu(.) is exactly 0 for a key whose every head is negative; ties at the
K-th place are broken by position here and arbitrarily by torch.topk, so the configs use 32 indexer
heads, which makes an all-negative key (p = 2^-32) practically impossible."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import family_checkpoints, random_prompt

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import config_from_hf_dict

TOL = 1e-4
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            v_head_dim=12, qk_nope_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=32,
            first_k_dense_replace=1, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
            pad_token_id=None, routed_scaling_factor=2.5)
CONFIGS = {"topk16_moe": {}, "topk8_tied_bias": dict(index_topk=8, tie_word_embeddings=True, attention_bias=True,
                                                     num_hidden_layers=2, first_k_dense_replace=0)}


make_checkpoint, checkpoints, pair = family_checkpoints("DeepseekV32Config", "DeepseekV32ForCausalLM", BASE, CONFIGS, "dsv32")



def test_config_maps_layer_types_and_dense_first_layers(checkpoints):
    llm = LLM(model=checkpoints["topk16_moe"], dtype="float32")
    cfg = llm.config
    assert cfg.layer_types == ("sparse_attention",) * 3
    assert cfg.mlp_layer_types == ("dense", "sparse", "sparse")
    cache = llm.new_cache(2, 100)
    assert set(cache.groups) == {"sparse_attention", "indexer"}
    assert cache.groups["sparse_attention"].writer_abi.startswith("sparse_mla/")
    assert cache.groups["indexer"].writer_abi.startswith("dsa_indexer/")


def test_prefill_logits_match_transformers(pair):
    llm, hf = pair
    for n in (1, 9, 75, 150):                 # 75, 150 >> index_topk: the indexer selects
        ids = random_prompt(n, llm.config.vocab_size, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        got = llm.logits(ids)
        err = np.max(np.abs(got - ref))
        assert err < TOL, f"T={n}: max abs logit error {err:.3e}"


def test_greedy_32_tokens_identical_to_hf_generate(pair):
    llm, hf = pair
    prompts = [random_prompt(n, llm.config.vocab_size, seed=100 + n) for n in (5, 40, 110)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, temperature=0))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_incremental_decode_equals_full_recompute(pair):
    llm, _ = pair
    ids = random_prompt(90, llm.config.vocab_size, seed=7)
    gen = llm.generator
    full = llm.logits(ids)
    cache = gen.new_cache(1, 128)
    tok = np.zeros((1, 64), np.int32)
    tok[0, :40] = ids[:40]
    _o = gen._forward(gen.params, cache, jnp.asarray(tok), jnp.asarray([40], jnp.int32))
    logits, cache = _o.logits, _o.cache
    np.testing.assert_allclose(np.asarray(logits[0]), full[39], atol=TOL, rtol=0)
    tok = np.zeros((1, 32), np.int32)
    tok[0, :30] = ids[40:70]
    _o = gen._forward(gen.params, cache, jnp.asarray(tok), jnp.asarray([30], jnp.int32), logits_at="all")
    logits, cache = _o.logits, _o.cache
    np.testing.assert_allclose(np.asarray(logits[0, :30]), full[40:70], atol=TOL, rtol=0)
    for i in range(70, 90):
        _o = gen._forward(gen.params, cache, jnp.asarray([[ids[i]]], jnp.int32), jnp.asarray([1], jnp.int32))
        logits, cache = _o.logits, _o.cache
        np.testing.assert_allclose(np.asarray(logits[0]), full[i], atol=TOL, rtol=0, err_msg=f"decode at {i}")
    assert int(cache.lengths[0]) == 90
    assert float(cache.groups["sparse_attention"].hit_rate[0]) == 1.0      # everything is on device


def test_padding_rows_do_not_leak(checkpoints):
    """A right-padded batch gives each row the logits it gets alone."""
    llm = LLM(model=checkpoints["topk16_moe"], dtype="float32")
    from hybrid_jax.models import deepseek_v32 as m  # noqa: PLC0415
    a, b = random_prompt(50, 97, 1), random_prompt(23, 97, 2)
    tok = np.zeros((2, 64), np.int32)
    tok[0, :50], tok[1, :23] = a, b
    cache = m.new_cache(llm.config, 2, 96, jnp.float32)
    _o = m.forward(llm.config, llm.params, cache, jnp.asarray(tok), jnp.asarray([50, 23], jnp.int32))
    logits = _o.logits
    np.testing.assert_allclose(np.asarray(logits[0]), llm.logits(a)[-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(logits[1]), llm.logits(b)[-1], atol=TOL, rtol=0)


def test_pallas_impl_matches_xla_in_the_model(checkpoints):
    llm = LLM(model=checkpoints["topk8_tied_bias"], dtype="float32")
    from hybrid_jax.models import deepseek_v32 as m  # noqa: PLC0415
    ids = random_prompt(40, 97, 3)
    tok = jnp.asarray([ids], jnp.int32)
    outs = [m.forward(llm.config, llm.params, m.new_cache(llm.config, 1, 48, jnp.float32), tok,
                      jnp.asarray([40], jnp.int32), logits_at="all", impl=impl).logits for impl in ("xla", "pallas")]
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), atol=TOL, rtol=0)


def test_fp8_indexer_cache_runs_and_stays_close(checkpoints):
    llm = LLM(model=checkpoints["topk16_moe"], dtype="float32")
    from hybrid_jax.models import deepseek_v32 as m  # noqa: PLC0415
    ids = jnp.asarray([random_prompt(60, 97, 4)], jnp.int32)
    n = jnp.asarray([60], jnp.int32)
    _o = m.forward(llm.config, llm.params, m.new_cache(llm.config, 1, 64, jnp.float32), ids, n)
    ref = _o.logits
    c8 = m.new_cache(llm.config, 1, 64, jnp.float32, index_dtype=jnp.float8_e4m3fn)
    assert c8.groups["indexer"].keys.dtype == jnp.float8_e4m3fn and c8.groups["indexer"].scale is not None
    _o = m.forward(llm.config, llm.params, c8, ids, n)
    got, c8 = _o.logits, _o.cache
    assert np.all(np.isfinite(np.asarray(got)))
    assert np.corrcoef(np.asarray(got[0]), np.asarray(ref[0]))[0, 1] > 0.99


def test_bad_configs_fail_clearly():
    d = {**BASE, "model_type": "deepseek_v32", "layer_types": ["indexed_attention", "full_attention", "x"]}
    with pytest.raises(ConfigError, match="unknown layer type"):
        config_from_hf_dict(d)
    d = {**BASE, "model_type": "deepseek_v32", "n_group": 3}
    with pytest.raises(ConfigError, match="n_group"):
        config_from_hf_dict(d)
    d = {**BASE, "model_type": "deepseek_v32", "rope_parameters": {"rope_type": "longrope", "factor": 4.0}}
    with pytest.raises(ConfigError, match="longrope"):      # (YaRN is supported: test_rope.py)
        config_from_hf_dict(d)


def test_engine_serves_deepseek_v32_like_offline(checkpoints):
    """The continuous-batching engine (slot rows over the shared paged pools, chunked prefill,
    queueing) gives the offline path's greedy tokens, and reports the sparse hit rate."""
    from hybrid_jax import SamplingParams  # noqa: PLC0415
    from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: PLC0415
    llm = LLM(model=checkpoints["topk16_moe"])
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=192,
                                      compilation_cache_dir=None, warmup="none"))
    prompts = [random_prompt(n, 97, seed=n) for n in (5, 70, 33)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    ref = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == ref
    rate = eng.metrics.sparse_hit_rate._value.get()
    assert 0.0 <= rate <= 1.0
