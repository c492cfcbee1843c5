"""Conformance of the Kimi-Linear family (Kimi Delta Attention + MLA without positional encoding +
DeepSeek MoE) with transformers' KimiLinearForCausalLM on tiny random checkpoints, two layer patterns:
prefill logits (fp32, 1e-4), 32 greedy tokens equal to HF generate, decode after prefill and chunked
prefill equal to full recompute, prefix caching and speculative decoding equal to plain greedy."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (assert_decode_and_chunks_equal_recompute, family_checkpoints, greedy_reference, hf_model,
                      random_prompt, stop_process)

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import config_from_hf_dict

TOL = 1e-4
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None, pad_token_id=None, max_position_embeddings=512,
            linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
CONFIGS = {
    "kda3_mla1": {},
    # MLA first, dense MLPs in two layers, KDA heads of 8; tie_word_embeddings set, which transformers' Kimi
    # does not read (it saves and uses its own head): the stored head is used
    "mla_first_tied": dict(num_hidden_layers=3, tie_word_embeddings=True, first_k_dense_replace=2,
                           linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 3,
                                               "kda_layers": [2, 3], "full_attn_layers": [1]}),
}


make_checkpoint, checkpoints, pair = family_checkpoints("KimiLinearConfig", "KimiLinearForCausalLM", BASE, CONFIGS, "kimi")



def test_config_reads_the_one_based_layer_lists(checkpoints):
    llm = LLM(model=checkpoints["mla_first_tied"], dtype="float32")
    cfg = llm.config
    assert cfg.layer_types == ("full_attention", "linear_attention", "linear_attention")
    assert cfg.mlp_layer_types == ("dense", "dense", "sparse")
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim) == (4, 8, 3)
    cache = llm.new_cache(2, 100)
    assert set(cache.groups) == {"linear_attention", "full_attention"}
    assert cache.groups["linear_attention"].writer_abi.startswith("kimi_delta_attention/")
    assert cache.groups["full_attention"].writer_abi.startswith("sparse_mla/")


def _release_dict(**kw):
    d = dict(model_type="kimi_linear", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, q_lora_rank=None,
             intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_token=2,
             linear_attn_config={"head_dim": 16, "num_heads": 2, "kda_layers": [1], "full_attn_layers": [2]})
    d.update(kw)
    return d


@pytest.mark.parametrize("kw, words", [
    (dict(q_lora_rank=24), "q_lora_rank=24 is not supported"),
    (dict(mla_use_nope=False), "mla_use_nope false"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func 'softmax'"),
    (dict(linear_attn_config={"head_dim": 16, "num_heads": 2, "kda_layers": [1], "full_attn_layers": [1]}),
     "must name each of the 2 layers once"),
    (dict(layer_types=["full_attention", "linear_attention"]), "disagrees with linear_attn_config"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
])
def test_fields_that_change_the_math_are_refused_by_name(kw, words):
    config_from_hf_dict(_release_dict())
    with pytest.raises(ConfigError, match=words):
        config_from_hf_dict(_release_dict(**kw))


def test_prefill_logits_match_transformers(pair):
    llm, hf = pair
    for n in (1, 9, 75, 150):
        ids = random_prompt(n, llm.config.vocab_size, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        got = llm.logits(ids)
        err = np.max(np.abs(got - ref))
        assert err < TOL, f"T={n}: max abs logit error {err:.3e}"


def test_greedy_32_tokens_identical_to_hf_generate(pair):
    llm, hf = pair
    prompts = [random_prompt(40, llm.config.vocab_size, seed=140)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, temperature=0))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_decode_and_chunked_prefill_equal_full_recompute(pair):
    llm, _ = pair
    ids = random_prompt(90, llm.config.vocab_size, seed=7)
    assert_decode_and_chunks_equal_recompute(llm, ids, TOL)


def test_prefix_caching_and_speculative_decoding_equal_plain_greedy(checkpoints):
    """The KDA state checkpoints and the MLA latent pages serve a second pass of the same prompts (hits
    counted; the prefill chunks ran as ragged steps, and the tokens are full recomputation's greedy ones);
    n-gram speculation, its prefill chunks ragged too, gives the plain greedy tokens, rolling back by
    selecting the state after the last accepted token or by replaying the accepted ones from the
    pre-verify cache."""
    path = checkpoints["kda3_mla1"]
    base = [random_prompt(70, 97, 21), random_prompt(33, 97, 22)]
    prompts = [{"prompt_token_ids": p + p[:20] * 2} for p in base]            # repeats: n-gram drafts land
    sp = SamplingParams(max_tokens=24, temperature=0)
    small = {"max_num_batched_tokens": 32}      # chunks beside other rows' chunks and decodes: ragged steps
    cached = LLM(model=path, dtype="float32", enable_prefix_caching=True, engine_config=small)
    plain = [o.outputs[0].token_ids for o in cached.generate(prompts, sp)]       # a cold cache: nothing reused
    assert cached.cache_stats()["hits"] == 0
    assert cached.engine.runner._ragged._cache_size() > 0      # prefill chunks ran ragged
    again = [o.outputs[0].token_ids for o in cached.generate(prompts, sp)]
    assert again == plain and cached.cache_stats()["hits"] >= 2
    assert plain == [greedy_reference(cached, p["prompt_token_ids"], 24) for p in prompts]
    for rollback in ("selection", "replay"):
        spec = LLM(model=path, dtype="float32", engine_config=small,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback})
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == plain, rollback
        assert spec.engine.spec_stats()["accepted_tokens"] > 0, rollback          # drafts were accepted
        assert spec.engine.runner._ragged._cache_size() > 0, rollback            # prefill chunks ran ragged


def test_ragged_steps_equal_the_padded_engine_and_transformers(checkpoints):
    """Prefill chunks beside decodes of unequal rows run as one flat batch (KDA on the packed chunked rule,
    MLA on the ragged tiles): the greedy tokens equal the padded [B, T] engine's and transformers'
    generate in float32, and the ragged program is what ran."""
    from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: PLC0415
    path = checkpoints["kda3_mla1"]
    llm, hf = LLM(model=path, dtype="float32"), hf_model(path)
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=192, compilation_cache_dir=None,
                       warmup="none")
    ragged, padded = LLMEngine(llm, cfg), LLMEngine(llm, cfg)
    padded.runner.ragged = False
    assert ragged.runner.ragged
    prompts = [random_prompt(n, 97, seed=300 + n) for n in (61, 7, 45, 23, 90)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a = [o.token_ids for o in ragged.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    b = [o.token_ids for o in padded.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, len(p):]
               .tolist() for p in prompts]
    assert a == b == ref
    assert ragged.runner._ragged._cache_size() > 0 and padded.runner._ragged._cache_size() == 0


def test_pallas_impl_matches_xla_in_the_model(checkpoints):
    llm = LLM(model=checkpoints["kda3_mla1"], dtype="float32")
    from hybrid_jax.models import kimi_linear as m  # noqa: PLC0415
    ids = random_prompt(40, 97, 3)
    tok = jnp.asarray([ids], jnp.int32)
    outs = [m.forward(llm.config, llm.params, m.new_cache(llm.config, 1, 48, jnp.float32), tok,
                      jnp.asarray([40], jnp.int32), logits_at="all", impl=impl).logits for impl in ("xla", "pallas")]
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), atol=TOL, rtol=0)


def test_engine_serves_it_like_offline(checkpoints):
    """The continuous-batching engine the server drives (slot rows over the shared pools, chunked prefill
    of 32 tokens, a third request queued behind two rows) gives the offline path's greedy tokens."""
    from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: PLC0415
    llm = LLM(model=checkpoints["mla_first_tied"], dtype="float32")
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=192,
                                      compilation_cache_dir=None, warmup="none"))
    prompts = [random_prompt(n, 97, seed=n) for n in (5, 70, 33)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def test_align_cli_against_transformers(checkpoints, capsys):
    from hybrid_jax.cli import main  # noqa: PLC0415
    assert main(["align", "--model", checkpoints["kda3_mla1"], "--tokens", "1,2,3,4,5,6,7,8,9"]) == 0
    out = capsys.readouterr().out
    assert "layer 2 (linear_attention)" in out and "layer 3 + final norm" in out and "all stages agree" in out


def test_the_server_serves_it_like_offline(checkpoints, tmp_path):
    """`hybrid-jax serve` on a Kimi-Linear checkpoint (its engine core in its own process): a completion
    and a streamed one give the offline greedy tokens; a malformed request is a 400 and it keeps serving."""
    from test_server import _free_port, _wait_ready  # noqa: PLC0415
    path, port = checkpoints["kda3_mla1"], _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hybrid_jax.cli", "serve", "--model", path, "--port", str(port),
                             "--dtype", "float32", "--max-num-seqs", "2", "--max-model-len", "256",
                             "--compilation-cache-dir", str(tmp_path / "cc")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, 300)
        prompts = [random_prompt(30, 97, 31), random_prompt(9, 97, 32)]
        sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        want = [o.outputs[0].token_ids
                for o in LLM(model=path, dtype="float32").generate([{"prompt_token_ids": p} for p in prompts], sp)]
        body = {"prompt": prompts[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want[0]
        assert httpx.post(url + "/v1/completions", json={"prompt": prompts[1], "max_tokens": -1}, timeout=30).status_code == 400
        streamed = []
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={**body, "prompt": prompts[1], "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0].get("token_ids") or []
        assert streamed == want[1]
    finally:
        stop_process(proc)
