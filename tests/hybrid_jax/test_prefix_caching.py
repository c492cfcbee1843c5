"""Prefix caching in the engine: validated reuse for every layer type of Qwen3-Next and
DeepSeek-V3.2, token-identical to no caching across request orders, evictions and partial hits;
a hit shares the stored pages (no byte copied) and copies only checkpoints; the version check inside
the compiled load; zero recompilations after warm-up; cache_stats."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache.prefix_store import load_checkpoints
from conftest import zero_stored_objects
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, max_model_len=256)


@pytest.fixture(scope="module")
def cached(tiny_checkpoint):
    """The same checkpoint with prefix caching: LLM.generate runs through its engine."""
    return LLM(model=tiny_checkpoint, max_model_len=256, enable_prefix_caching=True, max_num_seqs=4,
               engine_config=dict(max_num_batched_tokens=32, compilation_cache_dir=None, warmup="none",
                                  prefix_block_size=16, prefix_checkpoint_interval=2))


@pytest.fixture()
def eng(cached):
    """The cached LLM's engine, with an empty prefix store."""
    cached.engine.reset_prefix_cache()
    return cached.engine


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    from test_deepseek_v32 import make_checkpoint  # noqa: PLC0415  (sibling test module)
    return LLM(model=make_checkpoint(tmp_path_factory.mktemp("dsa_prefix") / "m"), dtype="float32", max_model_len=512)


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=llm.max_model_len, compilation_cache_dir=None,
               warmup="none", enable_prefix_caching=True, prefix_block_size=16, prefix_checkpoint_interval=2)
    cfg.update(kw)
    return LLMEngine(llm, EngineConfig(**cfg))


def _workload(vocab, seed, shared=(70, 150), n=10):
    """Two families of prompts sharing a system prompt each, exact repeats and truncated copies
    (partial hits), and unrelated prompts."""
    rng = np.random.default_rng(seed)
    fams = [rng.integers(0, vocab, k).tolist() for k in shared]
    out = []
    for i in range(n):
        fam = fams[i % 2]
        out.append(fam + rng.integers(0, vocab, int(rng.integers(1, 40))).tolist())
    out += [out[0], out[3][:len(out[3]) - 5], out[1][:shared[1] + 3], rng.integers(0, vocab, 90).tolist()]
    return out


def _baseline(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], SP)]


def _run(eng, prompts, seed, sp=SP):
    """Submits the prompts in a random order, in random-sized waves of concurrent requests."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts))
    got, i = {}, 0
    while i < len(order):
        wave = order[i:i + int(rng.integers(1, 4))]
        outs = eng.generate([{"prompt_token_ids": prompts[j]} for j in wave], sp)
        got.update({int(j): o.token_ids for j, o in zip(wave, outs)})
        i += len(wave)
    return [got[j] for j in range(len(prompts))]


@pytest.mark.parametrize("cap", [4_000_000, 150_000], ids=["roomy", "evicting"])
def test_qwen3_next_reuse_is_token_identical(qwen, eng, cap):
    prompts = _workload(qwen.config.vocab_size, seed=1)
    want = _baseline(qwen, prompts)
    eng.reset_prefix_cache(cap)
    for seed in (0, 1):
        assert _run(eng, prompts, seed) == want
    st = eng.cache_stats()
    assert st["effective_reuse"] == pytest.approx(st["hit_rate"] * st["validation_pass_rate"])
    assert st["bytes_by_group"].keys() == {"linear_attention", "full_attention"}
    assert st["bytes_by_kind"]["recurrent_state"] > 0 and st["bytes_by_kind"]["full_kv"] > 0
    if cap > 1_000_000:
        assert st["passes"] >= 8 and st["tokens_reused"] >= 8 * 64 and st["evictions"] == 0
    else:
        assert st["passes"] >= 2 and st["evictions"] > 0
        assert sum(st["bytes_by_group"].values()) <= cap


def test_deepseek_v32_reuse_is_token_identical(dsa, tmp_path):
    """MLA latent and indexer pages reused from the device store, then (after dropping it) from the
    disk tier."""
    prompts = _workload(dsa.config.vocab_size, seed=2, shared=(140, 200), n=4)
    want = _baseline(dsa, prompts)
    eng = _engine(dsa, max_num_batched_tokens=64, prefix_checkpoint_interval=1, kv_cache_dir=str(tmp_path))
    assert _run(eng, prompts, seed=3) == want
    st = eng.cache_stats()
    assert st["lcm"] == 128 and st["passes"] >= 4
    assert st["bytes_by_kind"]["compressed_kv"] > 0 and st["bytes_by_kind"]["indexer_keys"] > 0
    eng.step()
    eng.reset_prefix_cache()            # waits for the spans written behind, drops the device store
    assert _run(eng, prompts, seed=4) == want
    st = eng.cache_stats()
    assert st["disk"]["spans_restored"] >= 2 and st["passes"] >= 4


def test_a_hit_reads_the_store(qwen, eng):
    """Negative control: zeroing the stored blocks (versions untouched) changes the output of a
    request that hits, so the identity tests above really exercise reused data."""
    p = _workload(qwen.config.vocab_size, seed=4)[0]
    first = eng.generate([{"prompt_token_ids": p}], SP)[0].token_ids
    zero_stored_objects(eng)
    again = eng.generate([{"prompt_token_ids": p}], SP)[0].token_ids
    assert eng.cache_stats()["passes"] == 1
    assert again != first


def test_a_request_that_ends_at_its_publish_boundary_gets_its_token_before_the_copy(eng):
    """max_tokens 1: the step that computes the prompt's last chunk (a publish boundary) also ends
    the request. Its token comes out of that step with the publish still queued; the row and pages
    go back only after flush_publishes has copied the row's state into the store."""
    p = list(range(1, 97))                                    # 96 tokens: a boundary at 96 (blocks of 16)
    eng.add_request("one", {"prompt_token_ids": p}, SamplingParams(max_tokens=1, temperature=0))
    outs = []
    while not outs:
        outs = eng.step()
    assert outs[0].finished and len(outs[0].token_ids) == 1
    assert [x.request_id for x in eng.scheduler.prefix.pending] == ["one"] and not eng.has_unfinished()
    assert eng.blocks.free_rows() < eng.config.max_num_seqs   # its row waits for the copy
    eng.flush_publishes()
    assert not eng.scheduler.prefix.pending and eng.blocks.free_rows() == eng.config.max_num_seqs
    assert eng.prefix.lookup(p + [0]).boundary == 96          # published after the token went out


def test_version_changed_between_check_and_use_is_not_read(qwen, eng):
    """A concurrent writer rewrites the hit's checkpoint units after the host's check: the compiled
    load sees the new unit versions, writes nothing, and the engine recomputes (a 'version' miss)."""
    prompts = _workload(qwen.config.vocab_size, seed=5)[0:3:2]       # same family: the second hits
    want = _baseline(qwen, prompts)
    assert eng.generate([{"prompt_token_ids": prompts[0]}], SP)[0].token_ids == want[0]
    pc = eng.prefix

    def concurrent_write():
        pc.store.versions = {n: v + 1 for n, v in pc.store.versions.items()}
        pc.between_check_and_use = None
    pc.between_check_and_use = concurrent_write
    assert eng.generate([{"prompt_token_ids": prompts[1]}], SP)[0].token_ids == want[1]
    st = eng.cache_stats()
    assert st["misses_by_reason"].get("version") == 1 and st["passes"] == 0
    assert not any(pc.blocks.tables.values()), "a refused hit gives its shared pages back"


def test_compiled_load_refuses_stale_versions(qwen, eng):
    """load_checkpoints alone: with one expected version wrong, nothing is written and ok is False."""
    p = _workload(qwen.config.vocab_size, seed=6)[0]
    eng.generate([{"prompt_token_ids": p}], SP)
    pc = eng.prefix
    hit = pc.lookup(p)
    assert hit.ok
    _, plan, _ = pc._load_plan(hit)
    cache = jax.tree_util.tree_map(jnp.copy, eng.runner.cache)
    before = jax.tree_util.tree_map(np.asarray, cache.groups)
    unit, exp = plan["linear_attention"]
    assert int(unit) >= 0
    stale = dict(plan, linear_attention=(unit, exp + 1))
    out, ok = load_checkpoints(cache, pc.versions, jnp.int32(2), stale, jnp.int32(hit.boundary))
    assert not bool(ok)
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.tree_util.tree_map(np.asarray, out.groups))
    out, ok = load_checkpoints(cache, pc.versions, jnp.int32(2), plan, jnp.int32(hit.boundary))
    assert bool(ok)
    rec = out.groups["linear_attention"]
    np.testing.assert_array_equal(np.asarray(rec.ssm[:, 2]), np.asarray(rec.ssm[:, int(unit)]))


def test_a_hit_shares_pages_and_copies_only_checkpoints(qwen, eng):
    """Zero-copy reuse: the request that hits lists the very pages the first request wrote (the store
    holds them by reference), and the compiled load writes no buffer the size of a page pool: the
    only bytes a hit moves are the checkpoint's."""
    from test_cache_in_place import cache_materializations  # noqa: PLC0415  (sibling test module)
    p = _workload(qwen.config.vocab_size, seed=9)[0]
    eng.generate([{"prompt_token_ids": p}], SP)
    pc = eng.prefix
    hit = pc.lookup(p)
    assert hit.ok and hit.boundary >= 32
    stored, plan, _ = pc._load_plan(hit)
    row = eng.blocks.take_row("probe")
    try:
        eng.runner.cache, got = pc.reuse(eng.runner.cache, row, "probe", p)
        n = got.boundary
        assert n == hit.boundary
        assert eng.blocks.table("probe", "full_attention") == stored["full_attention"]
        assert len(stored["full_attention"]) == n // pc.geometry.sizes["full_attention"]
        assert all(eng.blocks.refcount("full_attention", u) == 2 for u in stored["full_attention"])
    finally:
        eng.blocks.release_request("probe")
    kv = eng.runner.cache.groups["full_attention"]
    hlo = pc.store.load_program.lower(eng.runner.cache, pc.versions, jnp.int32(0), plan, jnp.int32(n)).compile().as_text()
    assert cache_materializations(hlo, [kv.k, kv.v]) == []


def test_no_recompilation_after_warmup(qwen):
    """Hits, misses, partial hits, evictions, branch-point and decode publishes after warm-up compile
    nothing new."""
    eng = _engine(qwen, max_num_seqs=2, max_num_batched_tokens=8, warmup="minimal", prefix_cache_bytes=40_000)
    eng.warmup()
    n0 = eng.num_compiled()
    assert eng.prefix.num_compiled() >= 2          # save and load (jit caches are shared across engines)
    prompts = _workload(qwen.config.vocab_size, seed=7, n=6)
    _run(eng, prompts, seed=0)
    st = eng.cache_stats()
    assert st["passes"] > 0 and st["misses_by_reason"].get("no_hit", 0) > 0 and st["evictions"] > 0, str(st)
    assert st["branch_points"] > 0 and st["decode_publishes"] > 0, str(st)     # the new boundaries too
    assert eng.num_compiled() == n0


def test_cannot_help_is_said_once(eng, caplog):
    with caplog.at_level(logging.WARNING, logger="hybrid_jax.prefix_cache"):
        eng.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7]}], SP)
        eng.generate([{"prompt_token_ids": [8, 9]}], SP)
    msgs = [r.getMessage() for r in caplog.records if "cannot reuse a prefix" in r.getMessage()]
    assert len(msgs) == 1 and "16 tokens" in msgs[0]


def test_llm_api_and_stats(qwen, cached):
    cached.engine.reset_prefix_cache()
    prompts = _workload(qwen.config.vocab_size, seed=8)[0:6:2]     # one family: the 2nd and 3rd hit
    outs = [cached.generate([{"prompt_token_ids": p}], SP)[0].outputs[0].token_ids for p in prompts]
    assert outs == _baseline(qwen, prompts)
    st = cached.cache_stats()
    for k in ("hit_rate", "validation_pass_rate", "effective_reuse", "misses_by_reason", "bytes_by_kind",
              "bytes_by_group"):
        assert k in st
    assert st["hits"] == 2 and st["lookups"] == 3
    assert qwen.cache_stats() == {"enabled": False}
