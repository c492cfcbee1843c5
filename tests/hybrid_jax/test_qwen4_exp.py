"""Conformance of the Qwen4-Exp family (Gated DeltaNet + QSA-indexed gated attention, MoE, hyper-connections,
PLE) with transformers' Qwen4ExpForCausalLM on tiny random checkpoints, two layouts: prefill logits (fp32,
relative RMS) at T = 1 / 9 / 75 / 300 with the indexer really selecting at the longer ones, greedy tokens
equal to transformers on a short and a 300-token prompt, decode and chunked prefill equal to full
recompute, the n-gram hash equal to transformers' at the release's vocabulary and table sizes (64-bit
products), and the config's parsing and refusals."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (assert_decode_and_chunks_equal_recompute, assert_logits_match_transformers, family_checkpoints,
                      hf_greedy, random_prompt, rel_rms)

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.ple import ngram_hash, ngram_ids, shifted_tokens
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import config_from_hf_dict

TOL = 1e-4          # max abs logit error, fp32
REL_RMS = 1e-5      # RMS of the error over the RMS of the reference logits
LIN, IDX = "linear_attention", "indexed_attention"
EOS = 1             # random prompts over 97 ids hold it now and then: the n-gram context restarts there
BASE = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            hc_count=3, hc_lowrank=8, ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
            make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2, indexer_n_heads=8, indexer_kv_heads=1,
            indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, eos_token_id=EOS, bos_token_id=None,
            pad_token_id=None, max_position_embeddings=1024, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
CONFIGS = {
    # the release's alternation, PLE on both linear layers, two KV heads
    "ple_qsa": dict(num_hidden_layers=4, layer_types=[LIN, IDX, LIN, IDX], ple_layer_ids=[1, 3]),
    # indexed attention first, a sigmoid output gate, 4-grams (dilation 4), two streams, blocks of 8, RoPE over
    # the whole head (no partial factor), one PLE layer
    "sigmoid_4gram": dict(num_hidden_layers=3, layer_types=[IDX, LIN, LIN], ple_layer_ids=[3], output_gate_type="sigmoid",
                          ngram_size=4, heads_per_ngram=1, ple_embed_dim=24, hc_count=2, indexer_budget=16,
                          indexer_compress_ratio=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}


def make_checkpoint(path, seed=0, **overrides):
    """A random Qwen4-Exp written by transformers, its norms moved off their initial values and its PLE
    convs (initialised to zero) drawn at random, so that every part moves the logits."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: PLC0415
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("ple.conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


_, checkpoints, pair = family_checkpoints("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", BASE, CONFIGS, "qwen4_exp",
                                         make=make_checkpoint)



def _logits(llm, cfg, ids):
    """Full-prompt logits of `llm`'s weights run under `cfg` (a config changed from the checkpoint's)."""
    family = get_model(cfg.model_type)
    cache = family.new_cache(cfg, 1, 320, jnp.float32)
    tok = jnp.asarray([ids], jnp.int32)
    out = family.forward(cfg, llm.generator.params, cache, tok, jnp.asarray([len(ids)], jnp.int32), logits_at="all")
    return np.asarray(out.logits[0])


def test_prefill_logits_match_transformers(pair):
    assert_logits_match_transformers(*pair, (1, 9, 75, 300), REL_RMS, TOL)


def test_each_part_moves_the_logits(pair):
    """Negative controls on the same weights: reading every complete block (no selection), dropping the PLE
    layers or swapping the output gate changes the 300-token logits far beyond the tolerance, so the
    agreement above is the indexer's selection, PLE's and the gate's, not a part too small to matter."""
    llm, hf = pair
    cfg, ids = llm.config, random_prompt(300, llm.config.vocab_size, seed=300)
    ref = llm.logits(ids)
    assert 300 > cfg.indexer_budget + cfg.indexer_compress_ratio    # the indexer reads a part of the prompt
    variants = {"no selection": dataclasses.replace(cfg, indexer_budget=1024),
                "gate": dataclasses.replace(cfg, output_gate="silu" if cfg.output_gate == "sigmoid" else "sigmoid")}
    for name, c in variants.items():
        assert rel_rms(_logits(llm, c, ids), ref) > 100 * REL_RMS, name
    np.testing.assert_allclose(_logits(llm, cfg, ids), ref, atol=TOL, rtol=0)     # the helper itself agrees
    params = llm.generator.params
    saved = [lp.pop("ple") for lp in params["layers"] if "ple" in lp]
    try:
        assert rel_rms(_logits(llm, dataclasses.replace(cfg, ple_layers=(), ple_ranks=()), ids), ref) > 100 * REL_RMS
    finally:
        for i, p in zip(cfg.ple_layers, saved):
            params["layers"][i]["ple"] = p



def test_the_blocked_qsa_walk_matches_transformers(pair, monkeypatch):
    """The indexer's walk in blocks of 8 positions (10 blocks for 75 tokens, each folded into the running
    Top-K) and the sparse read in query blocks of 4 give transformers' logits: the same selection and
    attention as one pass over the whole context (the defaults: 512 positions, 16 queries)."""
    from hybrid_jax.layers import qsa  # noqa: PLC0415
    llm, hf = pair
    ids = random_prompt(75, llm.config.vocab_size, seed=75)
    monkeypatch.setattr(qsa, "QSA_BLOCK_KEYS", 8)
    monkeypatch.setattr(qsa, "QSA_BLOCK_Q", 4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    got = _logits(llm, llm.config, ids)
    assert rel_rms(got, ref) < REL_RMS and np.max(np.abs(got - ref)) < TOL


def test_greedy_tokens_identical_to_transformers(pair):
    """16 greedy tokens after a 12- and a 300-token prompt equal transformers' (its full recompute, one
    forward per token: the reference without its cache)."""
    llm, hf = pair
    prompts = [random_prompt(12, llm.config.vocab_size, seed=112), random_prompt(300, llm.config.vocab_size, seed=301)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16), f"prompt of {len(p)}"


def test_decode_and_chunked_prefill_equal_full_recompute(pair):
    llm, _ = pair
    ids = random_prompt(90, llm.config.vocab_size, seed=7)
    ids[41] = ids[75] = EOS                       # an EOS inside a chunk and inside the decode
    assert_decode_and_chunks_equal_recompute(llm, ids, TOL)


def test_ngram_hash_equals_transformers_at_release_sizes():
    """The n-gram rows of every head, for token ids over the release's 248,320-token vocabulary with EOS
    restarts, equal transformers' Qwen4ExpTextNGramEmbedding (built on the meta device: its tables of ~20M
    rows per head are never allocated; its lookup replaced by one returning the rows) for the third PLE
    layer (rank 2): 64-bit products of ids and multipliers, primes above 20,000,000."""
    from transformers import Qwen4ExpTextConfig  # noqa: PLC0415
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m  # noqa: PLC0415
    text = Qwen4ExpTextConfig(num_hidden_layers=4, ple_layer_ids=[1, 2, 3], eos_token_id=248044, indexer_n_heads=4,
                              indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=8, indexer_compress_ratio=4)
    with torch.device("meta"):
        emb = m.Qwen4ExpTextNGramEmbedding(text, text.hidden_size, layer_idx=2, ple_layer_index=2)
    emb.layer_multipliers = m._build_layer_multipliers(text.vocab_size, text.ngram_size, 2, text.seed)
    emb.ngram_heads_vocab_sizes = torch.tensor(emb.head_vocab_sizes)
    emb.ngram_heads_offsets = torch.tensor(emb.head_offsets)

    class Rows(torch.nn.Module):
        weight = torch.zeros(1)

        def forward(self, ids):
            return ids.unsqueeze(-1)
    emb.ngram_embedding = Rows()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, text.vocab_size, (2, 40))
    tokens[0, [0, 5, 6, 20]] = 248044
    tokens[1, -5:] = text.vocab_size - 1
    with torch.no_grad():
        want = emb(torch.tensor(tokens), cache=None).numpy()                                  # [B, T, heads]
    cfg = config_from_hf_dict(dict(text.to_dict(), model_type="qwen4_exp_text"))
    h = ngram_hash(cfg, 2)
    assert h.primes == tuple(emb.head_vocab_sizes) and min(h.primes) > 20_000_000
    hist = jnp.concatenate([jnp.zeros((2, 2), jnp.int32), jnp.asarray(tokens, jnp.int32)], axis=1)
    got = ngram_ids(h, shifted_tokens(hist, jnp.asarray([-2, -2]), 3, 248044))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_the_multimodal_release_layout_runs_its_text_model(tmp_path, caplog):
    """Qwen4ExpForConditionalGeneration's checkpoint (text model under model.language_model.*, a vision
    tower beside it, config under text_config): the text model is loaded, the vision tower skipped with a
    log line, and text-only logits equal transformers'."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration  # noqa: PLC0415
    torch.manual_seed(3)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    model = Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(text_config={**BASE, **CONFIGS["ple_qsa"]},
                                                            vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path))
    ids = random_prompt(75, 97, seed=5)
    with caplog.at_level("INFO"):
        llm = LLM(model=str(tmp_path), dtype="float32")
        got = llm.logits(ids)
    assert llm.config.model_type == "qwen4_exp" and "vision tower (model.visual.*) is not loaded" in caplog.text
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert rel_rms(got, ref) < REL_RMS


def test_config_reads_the_layers_and_declares_the_groups(checkpoints):
    llm = LLM(model=checkpoints["ple_qsa"], dtype="float32")
    cfg = llm.config
    assert cfg.layer_types == (LIN, IDX, LIN, IDX) and cfg.ple_layers == (0, 2) and cfg.qsa_block_topk == 2
    cache = llm.new_cache(2, 100)
    assert set(cache.groups) == {"linear_attention", "ple", "full_attention", "indexer"}
    ple = cache.groups["ple"]
    assert ple.ctx.shape == (2, 2, 2) and ple.conv.shape == (2, 2, 3 * 3, 3 * 32)     # [L, B, c], [L, B, 3n, N Hd]
    assert cache.groups["indexer"].keys.shape[-1] == 16 and cache.groups["indexer"].layer_ids == (1, 3)


def _release_dict(**kw):
    text = {k: v for k, v in BASE.items() if k not in ("initializer_range",)}
    text.update(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, ple_layer_ids=[1])
    text.update(kw)
    return {"model_type": "qwen4_exp", "text_config": text, "vision_config": {"depth": 1}}


@pytest.mark.parametrize("kw, words", [
    (dict(hc_count=1), "hc_count must be > 1"),
    (dict(output_gate_type="gelu"), "output_gate_type 'gelu' is not supported"),
    (dict(indexer_kv_heads=2), "indexer_kv_heads=2 is not supported"),
    (dict(indexer_budget=6), "indexer_budget must be a multiple"),
    (dict(indexer_head_dim=None), "missing \\['indexer_head_dim'\\]"),
    (dict(ple_layer_ids=[2]), "ple_layer_ids \\[2\\] are not linear_attention layers"),
    (dict(ple_layer_ids=[0]), "are not in \\[1, 4\\]"),
    (dict(eos_token_id=None), "PLE layers need eos_token_id"),
    (dict(ple_embed_dim=30), "ple_embed_dim=30 must be a positive multiple"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "unknown layer type"),
    (dict(indexer_head_dim=4), "must fit the QSA index head"),
    (dict(ple_layer_ids=["1"]), "ple_layer_ids must be"),
])
def test_fields_that_change_the_math_are_refused_by_name(kw, words):
    cfg = config_from_hf_dict(_release_dict())
    assert cfg.layer_types == (LIN, IDX, LIN, IDX)          # the release's "full_attention" is the indexed layer
    with pytest.raises(ConfigError, match=words):
        config_from_hf_dict(_release_dict(**kw))


def _zero_stored_ple(engine):
    """Zeroes the PLE checkpoint units the engine's prefix store holds (conftest.zero_stored_objects, one group)."""
    from cache.prefix_store import stored_fields  # noqa: PLC0415
    ids = [u for g, u in engine.prefix.store.units.values() if g == "ple"]
    assert ids, "the store holds no PLE checkpoint"
    cache = engine.runner.cache
    g = cache.groups["ple"]
    g = g.replace(**{f: getattr(g, f).at[(slice(None),) * ax + (jnp.asarray(ids),)].set(0)
                     for f, ax in stored_fields(g).items()})
    engine.runner.cache = cache.replace(groups={**cache.groups, "ple": g})


def test_prefix_caching_and_speculative_decoding_equal_plain_greedy(checkpoints):
    """The Gated DeltaNet and PLE states are checkpointed together and, with the KV and indexer-key pages,
    serve a second pass of the same prompts (hits counted); n-gram speculation gives the plain greedy
    tokens, a rejected draft undone by replay (the PLE state is rewritten in place: it cannot be selected,
    so "auto" picks replay and an explicit "selection" is refused)."""
    path = checkpoints["ple_qsa"]
    base = [random_prompt(70, 97, 21), random_prompt(33, 97, 22)]
    prompts = [{"prompt_token_ids": p + p[:20] * 2} for p in base]            # repeats: n-gram drafts land
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cached = LLM(model=path, dtype="float32", enable_prefix_caching=True)
    plain = [o.outputs[0].token_ids for o in cached.generate(prompts, sp)]       # a cold cache: nothing reused
    assert cached.cache_stats()["hits"] == 0
    again = [o.outputs[0].token_ids for o in cached.generate(prompts, sp)]
    assert again == plain and cached.cache_stats()["hits"] >= 2
    _zero_stored_ple(cached.engine)            # negative control: a hit reads the PLE state the store holds
    assert [o.outputs[0].token_ids for o in cached.generate(prompts, sp)] != plain
    spec = LLM(model=path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == plain
    stats = spec.engine.spec_stats()
    # drafts were verified and rejected (this random checkpoint does not continue the prompt's repeats), each
    # rejection restoring the pre-verify PLE, recurrent and KV state and replaying the kept token: a PLE state
    # left as the verify wrote it (after the rejected drafts) would change the next tokens
    assert stats["rollback"] == "replay" and stats["draft_tokens"] > 0 and stats["replays"] > 0
    with pytest.raises(Exception, match="selection"):
        LLM(model=path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "rollback": "selection"})


def test_an_mtp_block_is_never_silently_dropped_and_mtp_drafting_is_refused(checkpoints, tmp_path, caplog):
    """transformers 5.25's Qwen4-Exp has no MTP module (it ignores `mtp.*` on load, as for Qwen3-Next, whose
    releases carry one; its config class has no MTP field), so there is no reference for the block's math
    here: a checkpoint carrying `mtp.*` tensors (and mtp_num_hidden_layers) loads its model, unchanged, with
    a warning naming the unloaded block; drafting with it (speculative method "mtp") is an InputError."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from safetensors.numpy import load_file, save_file  # noqa: PLC0415

    from hybrid_jax.errors import InputError  # noqa: PLC0415
    src = checkpoints["ple_qsa"]
    path = shutil.copytree(src, tmp_path / "with_mtp")
    (f,) = path.glob("*.safetensors")
    tensors = load_file(str(f))
    tensors["mtp.fc.weight"] = np.ones((32, 64), np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = np.ones((32,), np.float32)
    save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    ids = random_prompt(20, 97, seed=9)
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(path), dtype="float32")
    assert "MTP block (2 mtp.* tensors) is not loaded" in caplog.text
    np.testing.assert_array_equal(llm.logits(ids), LLM(model=src, dtype="float32").logits(ids))
    with pytest.raises(InputError, match="drafting with the MTP block is not supported for model_type 'qwen4_exp"):
        LLM(model=str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def _cycling_checkpoint(path) -> str:
    """The "ple_qsa" checkpoint with the mixers' and experts' output projections scaled by 0.02 and the PLE
    value and conv by 0.1: the next token then follows mostly the current one and its n-gram, so greedy
    text falls into recurring runs that n-gram drafts continue (the random checkpoint's own text never
    repeats, and its drafts are all rejected), with PLE still moving the choice."""
    from transformers import Qwen4ExpForCausalLM  # noqa: PLC0415
    make_checkpoint(path / "src", seed=0, **CONFIGS["ple_qsa"])
    model = Qwen4ExpForCausalLM.from_pretrained(str(path / "src")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj", "down_proj.weight")):
                p.mul_(0.02)
            elif name.endswith(("ple.value_proj.weight", "ple.conv1d.weight")):
                p.mul_(0.1)
    model.save_pretrained(str(path / "cycling"))
    return str(path / "cycling")


def test_ngram_speculation_with_accepted_drafts_equals_plain_greedy(tmp_path):
    """Drafts that land: n-gram speculation (3 drafts every step) on text with recurring runs accepts some
    drafts and rejects others, and gives the plain greedy tokens. A verify that accepts a part of its drafts
    must leave the PLE state (n-gram context and conv window), the Gated DeltaNet state and the KV / indexer
    pages as after the kept tokens only; PLE moves these greedy choices (dropping it changes them)."""
    path = _cycling_checkpoint(tmp_path)
    prompts = [{"prompt_token_ids": random_prompt(30, 97, 50 + s)} for s in range(3)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(model=path, dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    spec = LLM(model=path, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "dynamic_k": False})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == want
    stats = spec.engine.spec_stats()
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"] and stats["replays"] > 0, stats
    cfg = plain.config
    ids = prompts[0]["prompt_token_ids"] + want[0]
    no_ple = dataclasses.replace(cfg, ple_layers=(), ple_ranks=())
    params = plain.generator.params
    saved = [lp.pop("ple") for lp in params["layers"] if "ple" in lp]
    try:
        without = _logits(plain, no_ple, ids).argmax(-1)
    finally:
        for i, p in zip(cfg.ple_layers, saved):
            params["layers"][i]["ple"] = p
    assert (without[29:-1] != np.asarray(want[0])).any()

