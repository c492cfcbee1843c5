"""Conformance of the Nemotron-H family (Mamba2 + GQA without positional encoding + relu2 MLP / MoE
blocks) with transformers' NemotronHForCausalLM on tiny random checkpoints, two layer patterns:
prefill logits (fp32, relative RMS), greedy tokens equal to HF generate on a short and a 300-token
prompt, decode after prefill and chunked prefill equal to full recompute, prefix caching and n-gram
speculative decoding equal to plain greedy, and the config's parsing and refusals."""
from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (assert_decode_and_chunks_equal_recompute, assert_logits_match_transformers, family_checkpoints,
                      hf_greedy, random_prompt)

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import config_from_hf_dict

TOL = 1e-4          # max abs logit error, fp32
REL_RMS = 1e-5      # RMS of the error over the RMS of the reference logits
BASE = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
            chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            eos_token_id=None, bos_token_id=None, pad_token_id=None, max_position_embeddings=1024,
            initializer_range=0.2)     # 10x the default: every mixer moves the logits (the states matter)
CONFIGS = {
    # the release's order of mixers: Mamba2 first, attention, MLP and MoE blocks between
    "m_star_mlp_moe": dict(hybrid_override_pattern="M*M-ME"),
    # attention first, one KV head per query head, MoE experts behind a latent projection, a clamped
    # time step, a conv without bias, Mamba2 heads of 16 in one group
    "latent_moe": dict(hybrid_override_pattern="*MEM", num_key_value_heads=4, moe_latent_size=16,
                       time_step_limit=(0.0, 0.05), use_conv_bias=False, mamba_num_heads=2, mamba_head_dim=16,
                       n_groups=1, n_group=1),
}


make_checkpoint, checkpoints, pair = family_checkpoints("NemotronHConfig", "NemotronHForCausalLM", BASE, CONFIGS, "nemotron_h")



def test_config_reads_the_pattern_and_declares_the_mamba2_group(checkpoints):
    llm = LLM(model=checkpoints["m_star_mlp_moe"], dtype="float32")
    cfg = llm.config
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "mlp", "linear_attention",
                               "moe")
    assert cfg.time_step_limit == (0.0, math.inf)          # saved by transformers as {"__float__": "Infinity"}
    cache = llm.new_cache(2, 100)
    assert set(cache.groups) == {"linear_attention", "full_attention"}
    rec = cache.groups["linear_attention"]
    assert rec.writer_abi.startswith("mamba2_ssd/") and rec.layer_ids == (0, 2, 4)
    assert rec.ssm.shape == (3, 2, 4, 8, 8) and rec.ssm.dtype == jnp.float32     # [L, B, H, dstate, headdim]
    assert rec.conv.shape == (3, 2, 3, 4 * 8 + 2 * 2 * 8)                       # [L, B, W-1, I + 2 G N]
    assert cache.groups["full_attention"].layer_ids == (1,)
    assert LLM(model=checkpoints["latent_moe"], dtype="float32").config.time_step_limit == (0.0, 0.05)


def _release_dict(**kw):
    d = dict(model_type="nemotron_h", vocab_size=97, hidden_size=32, num_hidden_layers=4,
             hybrid_override_pattern="M*-E", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
             conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             moe_shared_expert_intermediate_size=24)
    d.update(kw)
    return d


@pytest.mark.parametrize("kw, words", [
    (dict(use_bias=True), "use_bias=true is not supported"),
    (dict(mamba_proj_bias=True), "mamba_proj_bias=true is not supported"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu' is not supported"),
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act 'gelu' is not supported"),
    (dict(sliding_window=128), "sliding_window=128 is not supported"),
    (dict(hybrid_override_pattern="M*-X"), "unknown layer characters \\['X'\\]"),
    (dict(layers_block_type=["mlp", "mlp", "mlp", "mlp"]), "disagrees with hybrid_override_pattern"),
    (dict(num_hidden_layers=5), "layer pattern has 4 layers; num_hidden_layers is 5"),
    (dict(time_step_limit=[0.1, 0.01]), "low <= high"),
    (dict(mamba_num_heads=3), "must be a multiple of n_groups=2"),
])
def test_fields_that_change_the_math_are_refused_by_name(kw, words):
    config_from_hf_dict(_release_dict())
    with pytest.raises(ConfigError, match=words):
        config_from_hf_dict(_release_dict(**kw))


def test_release_field_names_are_read():
    """The release's spellings (mamba_n_groups, mamba_d_conv, mamba_dt_limit, mamba_conv_bias) are read as
    transformers' backward-compatible names are."""
    d = _release_dict(mamba_n_groups=4, mamba_d_conv=3, mamba_dt_limit=[0.0, 0.2], mamba_conv_bias=False)
    for k in ("n_groups", "conv_kernel"):
        d.pop(k)
    cfg = config_from_hf_dict(d)
    assert (cfg.n_groups, cfg.conv_kernel, cfg.time_step_limit, cfg.use_conv_bias) == (4, 3, (0.0, 0.2), False)



def test_prefill_logits_match_transformers(pair):
    assert_logits_match_transformers(*pair, (1, 9, 75, 300), REL_RMS, TOL)



def test_greedy_tokens_identical_to_transformers(pair):
    """24 greedy tokens after a 12- and a 300-token prompt equal transformers' generate. With a finite
    time_step_limit the reference is transformers' full recompute instead: its cached decode (the torch
    selective_state_update) does not clamp dt while its prefill does, so its generate disagrees with its
    own forward (checked here too); this family clamps in both."""
    llm, hf = pair
    prompts = [random_prompt(12, llm.config.vocab_size, seed=112), random_prompt(300, llm.config.vocab_size, seed=300)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0))
    clamped = llm.config.time_step_limit != (0.0, math.inf)
    differ = []
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, len(p):].tolist()
        want = hf_greedy(hf, p, 24) if clamped else gen
        assert o.outputs[0].token_ids == want, f"prompt of {len(p)}"
        differ.append(gen != want)
    assert any(differ) == clamped     # the transformers inconsistency above is real on this checkpoint


def _with_mtp_block(src, dst):
    """A copy of checkpoint `src` as the Nemotron 3 Super release ships one: config.json with
    num_nextn_predict_layers = 1 (and its MTP layer pattern), and mtp.* tensors in a shard of their own,
    both shards named by a safetensors index."""
    import shutil  # noqa: PLC0415

    from safetensors.numpy import load_file, save_file  # noqa: PLC0415
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")))
    mtp = {"mtp.layers.0.enorm.weight": np.ones(32, np.float32), "mtp.layers.0.eh_proj.weight": np.zeros((32, 64),
                                                                                                  np.float32)}
    save_file(mtp, str(dst / "mtp.safetensors"))
    weight_map = {k: "model.safetensors" for k in load_file(str(dst / "model.safetensors"))}
    weight_map.update({k: "mtp.safetensors" for k in mtp})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_an_mtp_block_is_said_unloaded_and_drafting_with_it_refused(checkpoints, tmp_path, caplog):
    """Nemotron-H's MTP block (Nemotron 3 Super has one; the Nano release does not) is not implemented: a
    checkpoint carrying it loads the model with a warning that counts its mtp.* tensors, and asking to draft
    with it is an InputError naming the family, never a silent fallback."""
    from hybrid_jax.errors import InputError  # noqa: PLC0415
    path = _with_mtp_block(checkpoints["m_star_mlp_moe"], tmp_path / "with_mtp")
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(path), dtype="float32")
    assert any("MTP block (2 mtp.* tensors) is not loaded" in r.getMessage() and "nemotron_h" in r.getMessage()
               for r in caplog.records)
    plain = LLM(model=checkpoints["m_star_mlp_moe"], dtype="float32")
    sp = SamplingParams(max_tokens=6, temperature=0)
    prompt = [{"prompt_token_ids": random_prompt(12, 97, 3)}]
    assert llm.generate(prompt, sp)[0].outputs[0].token_ids == plain.generate(prompt, sp)[0].outputs[0].token_ids
    with pytest.raises(InputError, match="drafting with the MTP block is not supported for model_type 'nemotron_h'"):
        LLM(model=str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_decode_and_chunked_prefill_equal_full_recompute(pair):
    llm, _ = pair
    ids = random_prompt(90, llm.config.vocab_size, seed=7)
    assert_decode_and_chunks_equal_recompute(llm, ids, TOL)


def test_prefix_caching_and_speculative_decoding_equal_plain_greedy(checkpoints):
    """The Mamba2 state checkpoints and the KV pages serve a second pass of the same prompts (hits
    counted); n-gram speculation gives the plain greedy tokens, rolling back by selecting the state after
    the last accepted token (rebuilt from the verify's per-token parts, B not l2-normalised) or by
    replaying the accepted ones from the pre-verify cache."""
    path = checkpoints["m_star_mlp_moe"]
    base = [random_prompt(70, 97, 21), random_prompt(33, 97, 22)]
    prompts = [{"prompt_token_ids": p + p[:20] * 2} for p in base]            # repeats: n-gram drafts land
    sp = SamplingParams(max_tokens=24, temperature=0)
    cached = LLM(model=path, dtype="float32", enable_prefix_caching=True)
    plain = [o.outputs[0].token_ids for o in cached.generate(prompts, sp)]       # a cold cache: nothing reused
    assert cached.cache_stats()["hits"] == 0
    again = [o.outputs[0].token_ids for o in cached.generate(prompts, sp)]
    assert again == plain and cached.cache_stats()["hits"] >= 2
    for rollback in ("selection", "replay"):
        spec = LLM(model=path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                    "rollback": rollback})
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == plain, rollback
        assert spec.engine.spec_stats()["accepted_tokens"] > 0, rollback          # drafts were accepted


def test_engine_serves_it_like_offline(checkpoints):
    """The continuous-batching engine (slot rows over the shared pools, chunked prefill of 32 tokens, a
    third request queued behind two rows) gives the offline path's greedy tokens."""
    from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: PLC0415
    llm = LLM(model=checkpoints["latent_moe"], dtype="float32")
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=192,
                                      compilation_cache_dir=None, warmup="none"))
    prompts = [random_prompt(n, 97, seed=n) for n in (5, 70, 33)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def test_saved_config_round_trips_through_transformers(checkpoints):
    """The config.json transformers wrote (layers_block_type, no num_hidden_layers) reads to the same
    sizes as the config transformers loads back."""
    from transformers import AutoConfig  # noqa: PLC0415
    path = checkpoints["latent_moe"]
    ref = AutoConfig.from_pretrained(path, local_files_only=True)
    with open(f"{path}/config.json") as f:
        cfg = config_from_hf_dict(json.load(f))
    assert list(cfg.layer_types) == list(ref.layers_block_type)
    assert (cfg.mamba_conv_dim, cfg.moe_latent_size, cfg.use_conv_bias) == (
        ref.mamba_num_heads * ref.mamba_head_dim + 2 * ref.n_groups * ref.ssm_state_size, ref.moe_latent_size, False)


def test_selection_rollback_keeps_the_state_after_the_last_kept_token(checkpoints):
    """A verify window of 6 tokens, cut back to its first n_keep (RecurrentGroup.truncate over the Mamba2
    parts), leaves the conv windows and SSM states of a forward over those n_keep tokens alone; n_keep = 0
    keeps the state before the window. The rebuild must not l2-normalise B (as Gated DeltaNet's keys)."""
    from hybrid_jax.models import nemotron_h as m  # noqa: PLC0415
    from hybrid_jax.speculative.rollback import rollback_by_selection  # noqa: PLC0415
    llm = LLM(model=checkpoints["m_star_mlp_moe"], dtype="float32")
    cfg, params = llm.config, llm.params
    ids = np.asarray([random_prompt(20, 97, 5), random_prompt(20, 97, 6), random_prompt(20, 97, 8)], np.int32)
    pre = m.forward(cfg, params, m.new_cache(cfg, 3, 64, jnp.float32), jnp.asarray(ids[:, :14]), jnp.full((3,), 14, jnp.int32))
    window = jnp.asarray(ids[:, 14:])
    out = m.forward(cfg, params, pre.cache, window, jnp.full((3,), 6, jnp.int32), per_token_states=True)
    n_keep = jnp.asarray([2, 6, 1], jnp.int32)
    cut = rollback_by_selection(out.cache, out.states, pre.cache.lengths, jnp.full((3,), 6, jnp.int32), n_keep)
    want = m.forward(cfg, params, pre.cache, window, n_keep).cache.groups["linear_attention"]
    got = cut.groups["linear_attention"]
    np.testing.assert_allclose(np.asarray(got.ssm), np.asarray(want.ssm), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.conv), np.asarray(want.conv), atol=1e-6, rtol=0)
    assert not np.allclose(np.asarray(got.ssm[:, 0]), np.asarray(out.cache.groups["linear_attention"].ssm[:, 0]))


@pytest.mark.parametrize("rows", [1, 6, 100])
def test_ungated_relu2_experts_agree_on_every_moe_path(rows):
    """routed_experts with activation=relu2 (up [E, Hd, I], no gate half): the gather, dense and sorted
    forms equal a loop over each row's chosen experts in numpy."""
    from hybrid_jax.layers import mlp  # noqa: PLC0415
    rng = np.random.default_rng(rows)
    E, k, Hd, I = 8, 2, 16, 12
    x = rng.standard_normal((rows, Hd)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(rows)]).astype(np.int32)
    w = rng.random((rows, k)).astype(np.float32)
    up, dn = rng.standard_normal((E, Hd, I)).astype(np.float32), rng.standard_normal((E, I, Hd)).astype(np.float32)
    want = np.stack([sum(w[m, j] * (np.maximum(x[m] @ up[e], 0) ** 2) @ dn[e] for j, e in enumerate(idx[m]))
                     for m in range(rows)])
    for f in (mlp._routed_gather, mlp._routed_dense, mlp._routed_sorted):
        got = f(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), jnp.asarray(up), jnp.asarray(dn), act=mlp.relu2)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4, err_msg=f.__name__)


def test_pallas_impl_matches_xla_in_the_model(checkpoints):
    """The Mamba2 SSD kernels and the paged attention read through Pallas (interpreted on the CPU) give
    the XLA path's logits, prefill then a decode step."""
    from hybrid_jax.models import nemotron_h as m  # noqa: PLC0415
    llm = LLM(model=checkpoints["m_star_mlp_moe"], dtype="float32")
    cfg, params = llm.config, llm.params
    ids = random_prompt(40, 97, 3)
    outs = []
    for impl in ("xla", "pallas"):
        pre = m.forward(cfg, params, m.new_cache(cfg, 1, 48, jnp.float32), jnp.asarray([ids], jnp.int32),
                        jnp.asarray([40], jnp.int32), logits_at="all", impl=impl)
        dec = m.forward(cfg, params, pre.cache, jnp.asarray([[ids[0]]], jnp.int32), jnp.asarray([1], jnp.int32),
                        impl=impl)
        outs.append((np.asarray(pre.logits), np.asarray(dec.logits)))
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a, atol=TOL, rtol=0)


def test_routed_experts_are_stored_128_wide_with_zero_padding(checkpoints):
    """The experts' intermediate size is stored rounded up to 128 columns (a TPU tile's minor dimension;
    Nemotron-3-Nano's 1856 = 14.5 x 128), the added up columns and down rows zero, so relu2 leaves them
    out (the logits tests above hold the outputs to transformers')."""
    from hybrid_jax.models.nemotron_h_params import expert_columns  # noqa: PLC0415
    from hybrid_jax.plan.planner import resolve_model  # noqa: PLC0415
    assert expert_columns(resolve_model("nemotron_3_nano_30b_a3b")[1]) == 1920
    moe = LLM(model=checkpoints["m_star_mlp_moe"], dtype="float32").params["layers"][5]["moe"]
    up, down = np.asarray(moe["up"]), np.asarray(moe["down"])
    assert up.shape == (8, 32, 128) and down.shape == (8, 128, 32)
    assert np.any(up[..., :16]) and not np.any(up[..., 16:]) and not np.any(down[:, 16:])


# --- split over CPU devices (parallel_worker.py with 8 devices, as test_glm_moe_dsa.py) ----------------------

# 8 Mamba2 heads in 4 groups (tp 2 and 4 both hold whole groups), 4 attention heads over 2 KV heads (kept
# twice at tp 4), 8 relu2 experts split by their columns (tp2, tp4) or whole (tp4_ep)
SPLIT = dict(hybrid_override_pattern="M*M-ME", vocab_size=320, mamba_num_heads=8, n_groups=4)


@pytest.fixture(scope="module")
def split_worker(tmp_path_factory):
    from multi_device import run_worker  # noqa: PLC0415
    return run_worker("parallel_worker.py", make_checkpoint(tmp_path_factory.mktemp("tp_nemotron") / "m", seed=7,
                                                            **SPLIT), "nemotron_h")


@pytest.mark.slow
@pytest.mark.parametrize("layout, devices", [("tp2", 2), ("tp4", 4), ("tp4_ep", 4)])
def test_split_generates_what_one_device_does(split_worker, layout, devices):
    """Mamba2 heads and groups, attention heads, the MLP and the experts split: one device's greedy tokens
    and log-probabilities, with the prefix cache (hits) and n-gram speculation on; each device holds its
    share of the Mamba2 states, heads and conv channels alike."""
    one, split = split_worker["tp1"], split_worker[layout]
    assert split["tokens"] == one["tokens"] and split["again"] == one["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2 and split["pools_keep_shardings"] is True
    conv_channels = 8 * 8 + 2 * 4 * 8                                     # I + 2 G N
    assert one["state_heads_on_device0"] == [[8, conv_channels]]
    assert split["state_heads_on_device0"] == [[8 // devices, conv_channels // devices]]
    assert split["weights"]["device0"] < 0.75 * split["weights"]["total"]
    # whole on every device: the router, and at most the KV projections (2 KV heads); every Mamba2, query,
    # MLP and expert matrix split
    assert set(split["whole_matrices"]) - {"layers/*/attn/k", "layers/*/attn/v"} == {"layers/*/moe/router"}


def test_fewer_mamba2_groups_than_devices_is_refused_by_name():
    """A device's Mamba2 heads must find their groups' B / C on it: tp must divide n_groups."""
    from hybrid_jax.parallel import ParallelConfig  # noqa: PLC0415
    cfg = config_from_hf_dict(_release_dict(num_attention_heads=4, mamba_num_heads=4, n_groups=2))
    ParallelConfig(tensor_parallel_size=2).check(cfg, 2)
    with pytest.raises(ConfigError, match=r"does not divide the model's Mamba2 groups \(n_groups = 2\)"):
        ParallelConfig(tensor_parallel_size=4).check(cfg, 4)


# --- hybrid-jax plan on a TPU topology (test_plan.py's pattern; compiled by libtpu, skipped without it) ----

@pytest.mark.slow
def test_plan_compiles_split_on_a_tpu_topology():
    """Nemotron-H in miniature planned for v6e:2x2 whole and split over 2 chips with the engine's layout
    (the SSD kernels per device: Mosaic refuses to be partitioned): every pool is split by heads (Mamba2
    state heads, conv channels by whole groups, 2 KV heads over 2 chips), so each chip holds half of each;
    the weights split but for the router and norms; the split decode step has collectives."""
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed")
    from hybrid_jax.plan import plan  # noqa: PLC0415
    tiny = dict(model_type="nemotron_h", vocab_size=256, hidden_size=64, hybrid_override_pattern="M*M-ME",
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
                mamba_head_dim=16, n_groups=4, ssm_state_size=16, conv_kernel=4, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=1,
                topk_group=1, max_position_embeddings=1024)
    cfg = config_from_hf_dict(tiny)
    p1, p2 = (plan("nemotron", "v6e:2x2", layers="full", tensor_parallel_size=n, config=cfg, max_num_seqs=4,
                   max_model_len=256, chunk=64) for n in (1, 2))
    assert not p1.sharded and p2.sharded and p2.roofline.decode_collectives > 0
    assert {"recurrent_state", "conv_state", "full_kv"} <= set(p1.memory.cache_by_kind)
    assert p2.memory.cache_by_kind == {k: v / 2 if k != "row_metadata" else v for k, v in p1.memory.cache_by_kind.items()}
    assert p1.memory.weights / 2 < p2.memory.weights < 0.55 * p1.memory.weights
