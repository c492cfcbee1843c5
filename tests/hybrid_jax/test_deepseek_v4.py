"""Conformance of the DeepSeek-V4 family (sliding window + CSA / HCA compressed attention, mHC streams,
hash / Top-K MoE) with transformers' DeepseekV4ForCausalLM on tiny random checkpoints: prefill logits
(fp32, 1e-4) at every tail length mod each compress rate, 32 greedy tokens equal to HF generate,
decode after prefill equal to one long prefill (logits and every cache object) for every tail
length, padding that leaves the cache exact, and clear config errors.

Ties: the indexer's score sum_h w_h relu(q_h . k) is exactly 0 for an entry whose every head is
negative, and tied entries at the K-th place are broken by position here, arbitrarily by torch.topk.
The configs use 32 indexer heads, which makes an all-negative entry (p = 2^-32) practically impossible;
index_topk is below the number of closed windows of the longer prompts, so the indexer really selects.
Norms, sinks, biases, hc base / scale and position biases are perturbed so none is trivially 1 or 0,
and the hash layers get a random token -> experts table (transformers initialises it to zeros).
Cache objects computed along different paths (one prefill vs prefill + decode, a batch row vs the row
alone) are compared exactly for counts and lengths and within 1e-5 for floats (the same math in other
matmul shapes); a row that adds no token must not change by a single bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import random_prompt

from cache import put_rows, take_rows
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.errors import ConfigError
from hybrid_jax.models.config_common import config_from_hf_dict

TOL = 1e-4
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
BASE = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8, sliding_window=6, o_groups=2,
            o_lora_rank=12, index_n_heads=32, index_head_dim=16, index_topk=3, hc_mult=3, hc_sinkhorn_iters=5,
            layer_types=[SWA, CSA, HCA], compress_rates={CSA: 4, HCA: 8}, mlp_layer_types=["hash_moe", "moe", "moe"],
            partial_rotary_factor=0.5, eos_token_id=None, bos_token_id=None, pad_token_id=None)
CONFIGS = {
    # rates 4 / 8, window 6: every mod-4 and mod-8 tail occurs in the prompts below
    "mixed": {},
    # YaRN on the compress rope, tied embeddings, sigmoid router, rates 2 / 6, window 5
    "yarn_tied": dict(num_hidden_layers=2, layer_types=[HCA, CSA], compress_rates={CSA: 2, HCA: 6},
                      sliding_window=5, index_topk=4, mlp_layer_types=["moe", "hash_moe"], tie_word_embeddings=True,
                      scoring_func="sigmoid",
                      hc_mult=2, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 16}),
}


def make_checkpoint(path, seed=0, **overrides):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: PLC0415
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**BASE, **overrides})
    model = DeepseekV4ForCausalLM(cfg).eval()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(E)[:k] for _ in range(p.shape[0])]))
            elif any(s in name for s in ("norm", "bias", "sinks", "base", "scale")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4")
    return {k: make_checkpoint(root / k, seed=i, **kw) for i, (k, kw) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def pairs(checkpoints):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    torch.set_num_threads(2)
    return {k: (LLM(model=p, dtype="float32"),
                AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, local_files_only=True).eval())
            for k, p in checkpoints.items()}



def _leaves(cache):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(cache)}


def _rows_dense(cache):
    """The cache with every paged group's pool read through its page table ([L, B, NP * ps, D] entries,
    no page table), so a sub-cache of rows compares with a cache of its own rows."""
    groups = {}
    for name, g in cache.groups.items():
        if hasattr(g, "page_table"):
            L, _, ps, D = g.entries.shape
            B, NP = g.page_table.shape
            g = g.replace(entries=g.entries[:, g.page_table].reshape(L, B, NP * ps, D),
                          page_table=jnp.zeros((B, 0), jnp.int32))
        groups[name] = g
    return cache.replace(groups=groups)


def _assert_caches_close(a, b, atol=1e-5, what=""):
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys()
    for k in la:
        if la[k].dtype.kind in "iub":
            np.testing.assert_array_equal(la[k], lb[k], err_msg=f"{what} {k}")
        else:
            np.testing.assert_allclose(la[k], lb[k], atol=atol, rtol=0, err_msg=f"{what} {k}")


def test_config_and_cache_groups(checkpoints):
    llm = LLM(model=checkpoints["mixed"], dtype="float32")
    cfg = llm.config
    assert cfg.layer_types == (SWA, CSA, HCA) and cfg.mlp_layer_types == ("hash_moe", "moe", "moe")
    assert (cfg.csa_rate, cfg.hca_rate, cfg.rope_dim("main")) == (4, 8, 8)
    cache = llm.new_cache(2, 40)
    kinds = {k: g.kind for k, g in cache.groups.items()}
    assert kinds == {"sliding_window": "swa_window", CSA: "compressed_kv", "csa_tail": "uncompressed_tail",
                     "csa_overlap": "csa_overlap", "csa_indexer": "indexer_entries",
                     "csa_indexer_tail": "uncompressed_tail", "csa_indexer_overlap": "csa_overlap",
                     HCA: "compressed_kv", "hca_tail": "uncompressed_tail"}
    assert cache.groups[CSA].entries.shape == (1, 2, 16, 16)          # [L, P, ps, D]: pages of 64 // 4 entries
    assert cache.groups[CSA].page_table.tolist() == [[0], [1]]        # [B, NP]: 10 entries a row fit one page
    assert cache.groups[HCA].entries.shape == (1, 2, 8, 16)           # pages of 64 // 8 entries
    assert {cache.groups[n].closes_into for n in ("csa_tail", "csa_indexer_tail", "hca_tail")} == {
        CSA, "csa_indexer", HCA}
    assert cache.groups["hca_tail"].kv.shape == (1, 2, 8, 16)          # [L, B, rate, D]
    assert cache.groups["sliding_window"].kv.shape == (3, 2, 6, 16)    # every layer, [L, B, W, D]
    assert cfg.rope_compress.rope_type == "default"
    assert LLM(model=checkpoints["yarn_tied"], dtype="float32").config.rope_compress.rope_type == "yarn"


WIDTH, CAP = 48, 64      # one prefill shape [1, 48] and one decode shape [1, 1] per model: few compiles


def _step(gen, cache, ids, width=WIDTH):
    """One forward of len(ids) real tokens right-padded to `width` -> (logits [len(ids), V], cache)."""
    tok = np.zeros((1, width), np.int32)
    tok[0, :len(ids)] = ids
    _o = gen._forward(gen.params, cache, jnp.asarray(tok), jnp.asarray([len(ids)], jnp.int32), logits_at="all")
    logits, cache = _o.logits, _o.cache
    return np.asarray(logits[0, :len(ids)]), cache


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match_transformers(pairs, name):
    """Every position's logits are compared, so each prompt checks every prefix; the prompt lengths put the
    prompt's end at every tail length mod each compress rate (and one that closes no window). The prompts
    are prefixes of one: transformers' causal logits of a prefix are those of the long prompt's first rows."""
    llm, hf = pairs[name]
    gen = llm.generator
    lcm = int(np.lcm(llm.config.csa_rate, llm.config.hca_rate))
    ids = random_prompt(44, llm.config.vocab_size, seed=44)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    for n in [1] + list(range(45 - lcm, 45)):
        err = np.max(np.abs(_step(gen, gen.new_cache(1, CAP), ids[:n])[0] - ref[:n]))
        assert err < TOL, f"{name} T={n}: max abs logit error {err:.3e}"


GREEDY_PROMPTS = (13, 30)     # LLM.generate buckets them as [2, 32] with capacity 64 (the padding test reuses it)


def test_greedy_32_tokens_identical_to_hf_generate(pairs):
    llm, hf = pairs["mixed"]
    prompts = [random_prompt(n, llm.config.vocab_size, seed=100 + n) for n in GREEDY_PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, temperature=0))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist(), f"prompt of {len(p)}"


def test_ngram_speculation_equals_plain_greedy(pairs, checkpoints):
    """The window ring, tails and entry counts are rewritten in place, so a rejected draft can only be
    undone by replay: the default rollback resolves to it, greedy output equals plain decoding (with
    rollback by selection it did not: rejected tokens stayed in the ring), and an explicit
    "selection" is refused at construction."""
    from hybrid_jax.errors import InputError  # noqa: PLC0415
    llm, _ = pairs["mixed"]
    rng = np.random.default_rng(7)
    prompts = [np.tile(rng.integers(0, 97, 5), 6).tolist() for _ in range(2)] + [random_prompt(20, 97, seed=8)]
    sp = SamplingParams(max_tokens=20, temperature=0)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    spec = LLM(model=checkpoints["mixed"], dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = spec.spec_stats()
    assert stats["rollback"] == "replay" and stats["verify_steps"] > 0 and stats["replays"] > 0
    with pytest.raises(InputError, match="sliding_window"):
        LLM(model=checkpoints["mixed"], dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "rollback": "selection"})


def test_decode_after_prefill_equals_one_long_prefill(pairs):
    """Prefill P tokens (P = 16 .. 23: every tail length mod 4 and mod 8), a chunk of 3, then 5 single-token
    decodes: each step's logits equal the long prefill's, and so does every cache object at the end."""
    llm, _ = pairs["mixed"]
    gen = llm.generator
    for P in range(16, 24):
        ids = random_prompt(P + 8, 97, seed=P)
        full, full_cache = _step(gen, gen.new_cache(1, CAP), ids)
        logits, cache = _step(gen, gen.new_cache(1, CAP), ids[:P])
        np.testing.assert_allclose(logits[-1], full[P - 1], atol=TOL, rtol=0)
        logits, cache = _step(gen, cache, ids[P:P + 3])
        np.testing.assert_allclose(logits, full[P:P + 3], atol=TOL, rtol=0)
        for i in range(P + 3, P + 8):
            logits, cache = _step(gen, cache, ids[i:i + 1], width=1)
            np.testing.assert_allclose(logits[0], full[i], atol=TOL, rtol=0, err_msg=f"P={P}, i={i}")
        assert int(cache.groups["csa_tail"].count[0]) == (P + 8) % 4
        assert int(cache.groups["hca_tail"].count[0]) == (P + 8) % 8
        assert int(cache.groups[HCA].count[0]) == (P + 8) // 8
        _assert_caches_close(cache, full_cache.replace(version=cache.version), what=f"P={P}")


def _shuffled_pages(llm, page_tokens, seed):
    """A one-row cache whose compressed entries sit in pages of `page_tokens` tokens, spread over a pool
    three times larger than the row needs, in a random order: only reads and writes through the page
    table can find them."""
    from cache.compressed import init_compressed_groups  # noqa: PLC0415
    cfg = llm.config
    groups = init_compressed_groups(batch_size=3, capacity=CAP, dtype=jnp.float32, window=cfg.sliding_window,
                                    head_dim=cfg.head_dim, all_layers=tuple(range(cfg.num_hidden_layers)),
                                    csa_layers=cfg.layers_of(CSA), csa_rate=cfg.csa_rate, index_dim=cfg.index_head_dim,
                                    hca_layers=cfg.layers_of(HCA), hca_rate=cfg.hca_rate, entry_page_tokens=page_tokens)
    rng = np.random.default_rng(seed)
    for name, g in groups.items():
        if hasattr(g, "page_table"):
            NP = g.page_table.shape[1]
            groups[name] = g.replace(page_table=jnp.asarray(rng.permutation(3 * NP)[:NP][None], jnp.int32),
                                     count=g.count[:1])
        else:
            groups[name] = g.replace(**{f: jnp.take(getattr(g, f), jnp.asarray([0]), axis=ax)
                                        for f, ax in g.row_fields().items()})
    ref = llm.generator.new_cache(1, CAP)
    return ref.replace(groups=groups)


def test_entries_are_read_and_written_through_the_page_table(pairs):
    """Pages of 8 tokens (2 CSA entries, 1 HCA entry), scattered at random over a larger pool: prefill then
    decode gives the logits of the default layout, and the same entries, read through the table."""
    llm, _ = pairs["mixed"]
    gen = llm.generator
    for P in (17, 22):
        ids = random_prompt(P + 4, 97, seed=200 + P)
        want, want_cache = _step(gen, gen.new_cache(1, CAP), ids)
        cache = _shuffled_pages(llm, 8, seed=P)
        assert cache.groups[CSA].page_table.shape == (1, 8) and cache.groups[HCA].page_table.shape == (1, 8)
        logits, cache = _step(gen, cache, ids[:P])
        np.testing.assert_allclose(logits, want[:P], atol=TOL, rtol=0)
        for i in range(P, P + 4):
            logits, cache = _step(gen, cache, ids[i:i + 1], width=1)
            np.testing.assert_allclose(logits[0], want[i], atol=TOL, rtol=0, err_msg=f"P={P}, i={i}")
        got, ref = _rows_dense(cache), _rows_dense(want_cache)
        for name in (CSA, HCA, "csa_indexer"):
            n = int(ref.groups[name].count[0])
            assert int(got.groups[name].count[0]) == n
            np.testing.assert_allclose(np.asarray(got.groups[name].entries[:, :, :n]),
                                       np.asarray(ref.groups[name].entries[:, :, :n]), atol=1e-5, rtol=0)


def test_padding_leaves_the_cache_exact_and_rows_move(pairs):
    """A right-padded batch (one forward over [2, 32]): each row's logits and cache equal
    the ones it gets alone; a row with n_new = 0 keeps every cache object bit for bit; take_rows /
    put_rows (the engine's slot moves, with a reset row) carry every group."""
    llm, _ = pairs["mixed"]
    gen = llm.generator
    rows = [random_prompt(21, 97, 1), random_prompt(10, 97, 2)]
    tok = np.zeros((2, 32), np.int32)
    for r, ids in enumerate(rows):
        tok[r, :len(ids)] = ids
    _o = gen._forward(gen.params, gen.new_cache(2, CAP), jnp.asarray(tok), jnp.asarray([21, 10]))
    logits, batch = _o.logits, _o.cache
    for r, ids in enumerate(rows):
        ref_logits, ref = _step(gen, gen.new_cache(1, CAP), ids)
        np.testing.assert_allclose(np.asarray(logits[r]), ref_logits[-1], atol=TOL, rtol=0)
        _assert_caches_close(_rows_dense(take_rows(batch, jnp.asarray([r]))).replace(version=ref.version),
                             _rows_dense(ref), what=f"row {r}")
    before = _leaves(_rows_dense(take_rows(batch, jnp.asarray([1]))))
    tok2 = np.zeros((2, 32), np.int32)
    tok2[0, :3] = [5, 6, 7]
    _o = gen._forward(gen.params, jax.tree_util.tree_map(jnp.copy, batch), jnp.asarray(tok2), jnp.asarray([3, 0]))
    after = _o.cache
    after_row = _leaves(_rows_dense(take_rows(after, jnp.asarray([1]))))
    for k in before:                              # row 1 added nothing: not one bit moves
        np.testing.assert_array_equal(before[k], after_row[k], err_msg=k)
    sub = take_rows(batch, jnp.asarray([1, 0]), reset=jnp.asarray([False, True]))
    assert int(sub.groups[CSA].count[0]) == 10 // 4 and int(sub.groups[CSA].count[1]) == 0
    assert int(sub.groups["hca_tail"].count[0]) == 10 % 8 and int(sub.lengths[1]) == 0
    assert not np.any(np.asarray(sub.groups["hca_tail"].kv[:, 1]))          # the reset row is empty
    back = put_rows(batch, jnp.asarray([1, 0]), take_rows(batch, jnp.asarray([1, 0])))
    _assert_caches_close(back.replace(version=batch.version), batch, atol=0)


def test_bad_configs_fail_clearly():
    d = {**BASE, "model_type": "deepseek_v4", "layer_types": [SWA, "full_attention", CSA]}
    with pytest.raises(ConfigError, match="unknown layer type.*full_attention"):
        config_from_hf_dict(d)
    d = {**BASE, "model_type": "deepseek_v4", "mlp_layer_types": ["moe", "dense", "moe"]}
    with pytest.raises(ConfigError, match="dense"):
        config_from_hf_dict(d)
    d = {**BASE, "model_type": "deepseek_v4", "rope_parameters": {"rope_type": "longrope"}}
    with pytest.raises(ConfigError, match="longrope"):
        config_from_hf_dict(d)
    d = {**BASE, "model_type": "deepseek_v4", "o_groups": 3}
    with pytest.raises(ConfigError, match="o_groups"):
        config_from_hf_dict(d)


def test_init_params_has_the_converted_layout(pairs):
    """init_params (the random model) and convert_hf_weights give the same tree of shapes and dtypes."""
    from hybrid_jax.models import deepseek_v4 as m  # noqa: PLC0415
    for llm, _ in pairs.values():
        mine = m.init_params(llm.config, seed=0)
        shape = (lambda t: jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), t))
        assert shape(mine) == shape(llm.params)


def test_legacy_config_keys_map_like_transformers():
    d = {**{k: v for k, v in BASE.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types",
                                                          "partial_rotary_factor")},
         "model_type": "deepseek_v4", "compress_ratios": [0, 4, 128], "num_hash_layers": 1, "qk_rope_head_dim": 4,
         "compress_rate_csa": 4, "compress_rate_hca": 16}
    cfg = config_from_hf_dict(d)
    assert cfg.layer_types == (SWA, CSA, HCA) and cfg.mlp_layer_types == ("hash_moe", "moe", "moe")
    assert (cfg.csa_rate, cfg.hca_rate, cfg.rope_dim("main"), cfg.rope_dim("compress")) == (4, 16, 4, 4)
    with pytest.raises(ConfigError, match="compress_ratios.*64"):
        config_from_hf_dict({**d, "compress_ratios": [0, 4, 64]})
