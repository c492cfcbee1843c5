"""GLM-5 (`glm_moe_dsa`, DeepSeek-V3.2's family with GLM's indexer RoPE and defaults) against transformers'
GlmMoeDsaForCausalLM on tiny random checkpoints (save_pretrained): fp32 logits (relative RMS) and greedy
tokens equal to HF generate on a short and a 300-token prompt (far past index_topk, so the indexer
selects); decode after prefill equal to full recompute and chunked prefill to one-shot; prefix-cache hits,
n-gram speculation and the MTP drafter token-identical to plain greedy; the published GLM-5 config; the
config errors.

As in test_deepseek_v32.py, 32 indexer heads make an all-negative index score (a tie at 0 that torch.topk
breaks arbitrarily) practically impossible."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import family_checkpoints, hf_model, random_prompt

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import config_from_hf_dict

REL_RMS = 1e-5
# GLM-5's shape in miniature: n_group = topk_group = 1, one shared expert, the first layer dense, RoPE theta 1e6
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=1,
            topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            v_head_dim=12, qk_nope_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=32,
            first_k_dense_replace=1, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
            pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# shared_fssf: layers 1 and 2 run no indexer and attend over layer 0's Top-K (transformers' cross-layer sharing)
CONFIGS = {"glm5_mini": {}, "tied_bias": dict(index_topk=8, tie_word_embeddings=True, attention_bias=True,
                                              num_hidden_layers=2, first_k_dense_replace=0),
           "shared_fssf": dict(num_hidden_layers=4, indexer_types=["full", "shared", "shared", "full"])}
PUBLISHED = Path(__file__).parents[2] / "hybrid_jax" / "published_configs" / "glm_5.json"


make_checkpoint, checkpoints, pair = family_checkpoints("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", BASE, CONFIGS, "glm5")


@pytest.fixture(scope="module")
def glm(checkpoints):
    return LLM(model=checkpoints["glm5_mini"], dtype="float32", max_model_len=512)



def _rel_rms(got, ref):
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))


def test_config_reads_glm_defaults_and_layout(checkpoints):
    cfg = LLM(model=checkpoints["glm5_mini"], dtype="float32").config
    assert cfg.model_type == "glm_moe_dsa" and cfg.index_rope_interleaved
    assert cfg.layer_types == ("sparse_attention",) * 3 and cfg.mlp_layer_types == ("dense", "sparse", "sparse")
    assert cfg.rms_norm_eps == 1e-5 and cfg.latent_norm_eps == 1e-6          # transformers' GlmMoeDsaConfig
    assert cfg.rope.theta == 1e6
    from transformers import GlmMoeDsaConfig  # noqa: PLC0415
    hf = GlmMoeDsaConfig()                       # a config.json without the optional keys: transformers' defaults
    d = {k: getattr(hf, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                     "v_head_dim", "intermediate_size", "n_routed_experts", "num_experts_per_tok")}
    ours = config_from_hf_dict({**d, "model_type": "glm_moe_dsa"})
    for k in ("index_n_heads", "index_topk", "index_head_dim", "rms_norm_eps", "routed_scaling_factor",
              "max_position_embeddings", "moe_intermediate_size", "n_group", "topk_group", "n_shared_experts"):
        assert getattr(ours, k) == getattr(hf, k), k
    assert ours.mlp_layer_types == tuple(hf.mlp_layer_types)


def test_prefill_logits_match_transformers(pair):
    llm, hf = pair
    for n in (1, 9, 150, 300):                  # 150, 300 >> index_topk: the indexer selects
        ids = random_prompt(n, llm.config.vocab_size, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        err = _rel_rms(llm.logits(ids), ref)
        assert err < REL_RMS, f"T={n}: relative RMS logit error {err:.3e}"


def test_greedy_tokens_identical_to_hf_generate(pair):
    """A short prompt and a 300-token one."""
    llm, hf = pair
    prompts = [random_prompt(n, llm.config.vocab_size, seed=100 + n) for n in (5, 300)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_half_split_indexer_rope_would_differ(glm, checkpoints):
    """Negative control: the same weights with DeepSeek-V3.2's indexer RoPE select other keys and give
    other logits once the indexer selects (so the parameter is what makes the match above)."""
    from hybrid_jax.models import deepseek_v32 as m  # noqa: PLC0415
    ids = random_prompt(150, 97, seed=150)
    with torch.no_grad():
        ref = hf_model(checkpoints["glm5_mini"])(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    v32 = dataclasses.replace(glm.config, index_rope_interleaved=False)
    out = m.forward(v32, glm.params, m.new_cache(v32, 1, 256, jnp.float32), jnp.asarray([ids], jnp.int32),
                    jnp.asarray([150], jnp.int32), logits_at="all")
    assert _rel_rms(np.asarray(out.logits[0]), ref) > 100 * REL_RMS


def test_decode_equals_full_recompute_and_chunked_prefill(glm):
    """Prefill 40, a chunk of 30, then one token at a time: every position's logits equal the one-shot
    prefill's."""
    ids = random_prompt(90, 97, seed=7)
    gen = glm.generator
    full = glm.logits(ids)
    cache = gen.new_cache(1, 128)
    tok = np.zeros((1, 64), np.int32)
    tok[0, :40] = ids[:40]
    o = gen._forward(gen.params, cache, jnp.asarray(tok), jnp.asarray([40], jnp.int32))
    np.testing.assert_allclose(np.asarray(o.logits[0]), full[39], atol=1e-4, rtol=0)
    tok = np.zeros((1, 32), np.int32)
    tok[0, :30] = ids[40:70]
    o = gen._forward(gen.params, o.cache, jnp.asarray(tok), jnp.asarray([30], jnp.int32), logits_at="all")
    np.testing.assert_allclose(np.asarray(o.logits[0, :30]), full[40:70], atol=1e-4, rtol=0)
    cache = o.cache
    for i in range(70, 90):
        o = gen._forward(gen.params, cache, jnp.asarray([[ids[i]]], jnp.int32), jnp.asarray([1], jnp.int32))
        cache = o.cache
        np.testing.assert_allclose(np.asarray(o.logits[0]), full[i], atol=1e-4, rtol=0, err_msg=f"decode at {i}")
    assert int(cache.lengths[0]) == 90


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=llm.max_model_len, compilation_cache_dir=None,
               warmup="none")
    return LLMEngine(llm, EngineConfig(**{**cfg, **kw}))


SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids if hasattr(o, "outputs") else o.token_ids for o in outs]


def test_engine_chunked_prefill_and_prefix_hits_are_token_identical(glm):
    """The engine prefilling in 32-token chunks (ragged steps) gives the offline one-shot path's tokens;
    with prefix caching, prompts sharing a 140-token prefix hit the stored latent and indexer pages and
    still give the same tokens."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 97, 140).tolist()
    prompts = [shared + rng.integers(0, 97, k).tolist() for k in (3, 20, 41)] + [random_prompt(70, 97, 9)]
    prompts.append(prompts[1])
    want = _tokens(glm.generate([{"prompt_token_ids": p} for p in prompts], SP))
    assert _tokens(_engine(glm).generate([{"prompt_token_ids": p} for p in prompts], SP)) == want
    eng = _engine(glm, max_num_batched_tokens=64, enable_prefix_caching=True, prefix_block_size=16,
                  prefix_checkpoint_interval=1)
    got = [eng.generate([{"prompt_token_ids": p}], SP)[0].token_ids for p in prompts]   # one by one: later ones hit
    assert got == want
    st = eng.cache_stats()
    assert st["passes"] >= 3 and st["tokens_reused"] >= 3 * 128
    assert st["bytes_by_kind"]["compressed_kv"] > 0 and st["bytes_by_kind"]["indexer_keys"] > 0


def test_ngram_speculation_equals_plain_greedy(glm):
    from test_speculative import _plain, _spec  # noqa: PLC0415  (sibling test module)
    rng = np.random.default_rng(2)
    prompts = [(rng.integers(0, 97, 8).tolist() * 5)[:40], rng.integers(0, 97, 30).tolist()]   # one quotes itself
    got, dec = _spec(glm, prompts, {"method": "ngram", "num_speculative_tokens": 3, "rollback": "selection",
                                    "dynamic_k": False})
    assert got == _plain(glm, prompts)
    assert 0 < dec.stats()["accepted_tokens"] < dec.stats()["draft_tokens"]


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    """A two-layer GLM checkpoint plus an MTP layer model.layers.2.* in DeepSeek's layout (GLM-5's release
    has num_nextn_predict_layers 1); "copy" makes the block predict what the model does."""
    from test_mtp import with_deepseek_mtp  # noqa: PLC0415
    root = tmp_path_factory.mktemp("glm5_mtp")
    src = make_checkpoint(root / "src", seed=3, num_hidden_layers=2, first_k_dense_replace=1)
    return {"copy": with_deepseek_mtp(src, str(root / "copy")),
            "random": with_deepseek_mtp(src, str(root / "random"), mode="random")}


@pytest.mark.parametrize("kind", ["copy", "random"])
def test_mtp_drafting_equals_plain_greedy(glm_mtp, kind):
    from test_mtp import _mtp_equals_plain  # noqa: PLC0415
    llm = LLM(model=glm_mtp[kind], max_model_len=128)
    assert set(llm.params["mtp"]["layers"][0]) == {"input_norm", "post_norm", "attn", "moe"}
    _, _, st = _mtp_equals_plain(llm, seed=4)
    assert st["verify_steps"] > 0 and st["draft_tokens"] > 0
    if kind == "copy":
        assert st["acceptance_rate"] > 0.5, st


def test_published_glm5_config_parses():
    d = json.loads(PUBLISHED.read_text())
    cfg = config_from_hf_dict(d)
    assert cfg.model_type == "glm_moe_dsa" and cfg.num_hidden_layers == 78
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim == 256 and cfg.v_head_dim == 256
    assert cfg.index_n_heads == 32 and cfg.index_topk == 2048 and cfg.index_rope_interleaved
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == 1e6
    assert cfg.softmax_scale == pytest.approx(256 ** -0.5)            # no YaRN mscale
    assert cfg.eos_token_ids == tuple(d["eos_token_id"]) and cfg.routed_experts == 256
    from hybrid_jax.plan.planner import resolve_model  # noqa: PLC0415
    from hybrid_jax.plan.shapes import abstract_params, tree_nbytes  # noqa: PLC0415
    assert resolve_model("zai-org/GLM-5")[0] == "glm_5"
    # the release's announced size, 744B parameters (GLM-5's README), as this layout's shapes (no MTP layer)
    assert tree_nbytes(abstract_params(cfg, jnp.bfloat16)) / 2 == pytest.approx(744e9, rel=1e-3)


@pytest.mark.parametrize("extra,match", [
    ({"indexer_types": ["shared", "full", "full"]}, "layer 0 reuses"),
    ({"indexer_types": ["full", "full"]}, "3 entries"),
    ({"index_topk_pattern": "FFX"}, "only 'F' and 'S'"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"indexer_rope_interleave": "yes"}, "indexer_rope_interleave must be true or false"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"n_group": 3}, "n_group"),
])
def test_bad_configs_fail_clearly(extra, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf_dict({**BASE, "model_type": "glm_moe_dsa", **extra})


def test_shared_indexer_layers_keep_no_indexer(checkpoints):
    """A "shared" layer has no indexer weights in the checkpoint (every tensor is read) and no indexer keys
    in the cache; transformers' freq / offset schedule maps as it does there."""
    llm = LLM(model=checkpoints["shared_fssf"], dtype="float32")
    assert llm.config.layer_types == ("sparse_attention", "shared_sparse_attention", "shared_sparse_attention",
                                      "sparse_attention")
    assert ["idx_q" in lp["attn"] for lp in llm.params["layers"]] == [True, False, False, True]
    cache = llm.new_cache(1, 64)
    assert cache.groups["indexer"].layer_ids == (0, 3) and cache.groups["sparse_attention"].layer_ids == (0, 1, 2, 3)
    assert cache.groups["indexer"].keys.shape[0] == 2
    from transformers import GlmMoeDsaConfig  # noqa: PLC0415
    for extra in ({"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                  {"index_topk_pattern": "FSFF"}):
        hf = GlmMoeDsaConfig(**{**BASE, "num_hidden_layers": 4}, **extra)
        ours = config_from_hf_dict({**BASE, "model_type": "glm_moe_dsa", "num_hidden_layers": 4, **extra})
        assert ours.layer_types == tuple("shared_sparse_attention" if t == "shared" else "sparse_attention"
                                         for t in hf.indexer_types), extra


def test_shared_layers_in_the_engine_match_offline(checkpoints):
    """The shared-Top-K layers in the engine's ragged steps (chunked prefill, decode, prefix hits) give
    the offline path's tokens (which test_greedy_tokens_identical_to_hf_generate checks against HF)."""
    llm = LLM(model=checkpoints["shared_fssf"], dtype="float32", max_model_len=512)
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 97, 140).tolist()
    prompts = [shared + rng.integers(0, 97, k).tolist() for k in (3, 20)] + [random_prompt(70, 97, 9)]
    want = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], SP))
    eng = _engine(llm, max_num_batched_tokens=64, enable_prefix_caching=True, prefix_block_size=16,
                  prefix_checkpoint_interval=1)
    assert [eng.generate([{"prompt_token_ids": p}], SP)[0].token_ids for p in prompts] == want
    assert eng.cache_stats()["passes"] >= 1


def test_indexer_rope_interleave_false_reads_as_half_split():
    cfg = config_from_hf_dict({**BASE, "model_type": "glm_moe_dsa", "indexer_rope_interleave": False})
    assert not cfg.index_rope_interleaved
    assert config_from_hf_dict({**BASE, "model_type": "glm_moe_dsa", "index_topk_freq": 1}).num_hidden_layers == 3


# --- split over CPU devices (parallel_worker.py with 8 devices, as test_parallel_models.py) ------------

@pytest.fixture(scope="module")
def split_worker(tmp_path_factory):
    from multi_device import run_worker  # noqa: PLC0415
    ckpt = make_checkpoint(tmp_path_factory.mktemp("tp_glm5") / "m", seed=5, vocab_size=320)
    return run_worker("parallel_worker.py", ckpt, "glm_moe_dsa")


@pytest.mark.parametrize("layout", ["tp2", "tp4_ep"])
def test_split_generates_what_one_device_does(split_worker, layout):
    """MLA and indexer heads split (DeepSeek-V3.2's rules), experts by columns or whole: one device's
    greedy tokens and log-probabilities, with the prefix cache and n-gram speculation on."""
    one, split = split_worker["tp1"], split_worker[layout]
    assert split["tokens"] == one["tokens"] and split["again"] == one["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2 and split["pools_keep_shardings"] is True
    assert split["weights"]["device0"] < 0.75 * split["weights"]["total"]
    assert split["whole_matrices"] == ["layers/*/attn/idx_k", "layers/*/attn/kv_a", "layers/*/attn/q_a",
                                       "layers/*/moe/router"]


# --- hybrid-jax plan on a TPU topology (test_plan.py's pattern; compiled by libtpu, skipped without it) ----

def test_plan_compiles_split_on_a_tpu_topology():
    """GLM-5 in miniature planned for v6e:2x2 whole and split over 2 chips: its pools are DeepSeek's
    (MLA latent, indexer keys; whole on every chip), its heads' weights split, collectives in the split
    decode; its decode bytes are those of DeepSeek-V3.2 with the same shapes (the recombined family
    compiles the same program but for the indexer's RoPE)."""
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed")
    from hybrid_jax.plan import plan  # noqa: PLC0415
    tiny = dict(model_type="glm_moe_dsa", vocab_size=211, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                topk_group=1, index_n_heads=2, index_head_dim=32, index_topk=64, max_position_embeddings=1024)
    shapes = dict(max_num_seqs=4, max_model_len=256, chunk=64)
    cfg = config_from_hf_dict(tiny)
    p1, p2 = (plan("glm", "v6e:2x2", layers="full", tensor_parallel_size=n, config=cfg, **shapes) for n in (1, 2))
    assert {"mla_latent", "indexer_keys"} <= set(p1.memory.cache_by_kind)
    assert p2.sharded and p2.roofline.decode_collectives > 0
    assert p2.memory.cache_by_kind == p1.memory.cache_by_kind
    assert p1.memory.weights / 2 < p2.memory.weights < p1.memory.weights
    v32 = plan("v32", "v6e:2x2", layers="full", config=config_from_hf_dict(dict(tiny, model_type="deepseek_v32")),
               **shapes)
    assert p1.memory.weights == v32.memory.weights and p1.roofline.min_decode_bytes == v32.roofline.min_decode_bytes
    assert p1.roofline.decode_bytes == pytest.approx(v32.roofline.decode_bytes, rel=0.02)
