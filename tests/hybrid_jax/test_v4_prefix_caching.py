"""Prefix caching for DeepSeek-V4 in the engine: every cache object of a compressed layer (paged
compressed entries, uncompressed tail with its count, sliding-window ring, CSA indexer entries, CSA
overlap state) is a kind the prefix cache stores, validates and restores. Reuse is token-identical to
no caching over random request orders; a hit really reads the store; a hash hit whose tail checkpoint
is gone, or whose window is evicted or offloaded, is refused with its reason and recomputed with the
same tokens; a tail closing into a stored entry block is a recorded `close_tail` event; the disk tier
restores V4 spans token-identically.

One plain LLM (the reference) and one with prefix caching (its engine) serve the whole module: each
compiles its step programs once (the tiny V4 config of test_deepseek_v4; entry pages of 64 tokens,
full-KV-free, so every boundary is a multiple of 64 tokens).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cache import segment_allocator as A
from cache.segments import Kind, SegState
from conftest import zero_stored_objects
from hybrid_jax import LLM, SamplingParams

SP = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
LP = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=5)   # every engine request: one program set
TOL = 1e-4                 # logprobs of the same tokens computed in other chunkings (test_deepseek_v4's bound)
V4_KINDS = ("compressed_kv", "indexer_keys", "uncompressed_tail", "swa_window", "csa_overlap")
TAILS = {"csa_tail": "compressed_sparse_attention", "csa_indexer_tail": "csa_indexer",
         "hca_tail": "heavily_compressed_attention"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from test_deepseek_v4 import make_checkpoint  # noqa: PLC0415  (sibling test module)
    return make_checkpoint(tmp_path_factory.mktemp("v4_prefix") / "m", seed=0)


@pytest.fixture(scope="module")
def base(checkpoint):
    return LLM(model=checkpoint, dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def cached(checkpoint):
    return LLM(model=checkpoint, dtype="float32", max_model_len=256, enable_prefix_caching=True, max_num_seqs=3,
               engine_config=dict(max_num_batched_tokens=32, compilation_cache_dir=None, warmup="none",
                                  prefix_block_size=16, prefix_checkpoint_interval=2))


@pytest.fixture()
def eng(cached):
    """The cached LLM's engine with an empty store and no disk tier."""
    e = cached.engine
    e.config = dataclasses.replace(e.config, kv_cache_dir=None)
    e.reset_prefix_cache()
    return e


def _workload(vocab, seed, shared=(70, 150), n=8):
    """Two families sharing a system prompt each, an exact repeat, a truncated copy and an unrelated prompt."""
    rng = np.random.default_rng(seed)
    fams = [rng.integers(0, vocab, k).tolist() for k in shared]
    out = [fams[i % 2] + rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for i in range(n)]
    return out + [out[0], out[3][:len(out[3]) - 5], rng.integers(0, vocab, 90).tolist()]


def _baseline(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], SP)]


def _run(eng, prompts, seed):
    """The shared prefix-caching driver (random order, random waves), with logprobs on every request."""
    from test_prefix_caching import _run as run_waves  # noqa: PLC0415  (sibling test module)
    return run_waves(eng, prompts, seed, sp=LP)


def _gen(eng, p):
    """One request alone -> (greedy tokens, top-5 logprobs [5, 5] of each sampled step)."""
    req = eng.add_request(f"r{len(p)}-{eng.cache_stats()['lookups']}", {"prompt_token_ids": p}, LP)
    while not req.finished:
        eng.step()
    eng.flush_publishes()
    return req.output_ids, np.asarray([[v for _, v in lp["top"]] for lp in req.logprobs])


def _one(eng, p):
    return _gen(eng, p)[0]


def _seg(pc, group, end):
    """The live segment of `group` ending at token `end` (a checkpoint, or the block ending there)."""
    segs = [s for s in pc.alloc.segments.values() if s.group == group and s.end == end]
    assert len(segs) == 1, (group, end, segs)
    return segs[0]


def test_reuse_is_token_identical_over_request_orders(base, cached):
    """Through LLM(..., enable_prefix_caching=True): real hits on every V4 object kind, same greedy tokens."""
    cached.engine.reset_prefix_cache()
    prompts = _workload(base.config.vocab_size, seed=1)
    want = _baseline(base, prompts)
    for seed in (0, 1):
        assert _run(cached.engine, prompts, seed) == want, f"order {seed}"
    st = cached.cache_stats()
    assert st["lcm"] == 64 and st["block_sizes"]["compressed_sparse_attention"] == 64     # 16 entries x rate 4
    assert st["block_sizes"]["heavily_compressed_attention"] == 64                          # 8 entries x rate 8
    assert st["passes"] >= 6 and st["tokens_reused"] >= 6 * 64, str(st)
    assert st["effective_reuse"] == pytest.approx(st["hit_rate"] * st["validation_pass_rate"])
    for kind in V4_KINDS:
        assert st["bytes_by_kind"][kind] > 0, kind
    assert set(st["bytes_by_group"]) == set(cached.engine.runner.cache.groups)


def test_a_hit_reads_the_store(eng):
    """A hit's logprobs equal the recomputed ones within TOL; with the stored objects zeroed (versions
    untouched) the same hit gives logprobs far outside it, so a hit really reads the store. (The tiny
    random model's greedy tokens barely depend on attention, so logprobs are compared, not tokens.)"""
    p = _workload(97, seed=2)[1][:129]                # stored at 128, one token left to compute
    first, lp_miss = _gen(eng, p)
    again, lp_hit = _gen(eng, p)
    assert eng.cache_stats()["passes"] == 1 and again == first
    np.testing.assert_allclose(lp_hit, lp_miss, atol=TOL, rtol=0)
    zero_stored_objects(eng)
    _, lp_zero = _gen(eng, p)
    assert eng.cache_stats()["passes"] == 2
    assert np.max(np.abs(lp_zero[0] - lp_miss[0])) > 100 * TOL


@pytest.mark.parametrize("group,how,why", [
    ("csa_tail", "evict", "uncompressed_tail checkpoint at 128 is missing"),
    ("hca_tail", "evict", "uncompressed_tail checkpoint at 128 is missing"),
    ("sliding_window", "evict", "swa_window checkpoint at 128 is missing"),
    ("sliding_window", "offload", "swa_window checkpoint at 128 is host, not resident"),
    ("csa_indexer_overlap", "evict", "csa_overlap checkpoint at 128 is missing"),
])
def test_a_hit_lacking_an_object_is_refused_and_recomputed(base, eng, group, how, why):
    """A prompt stored at 128: its entry blocks still hash-hit, but with one checkpoint evicted (or the ring
    offloaded off the device, where this cache cannot read it) no boundary is usable: the miss names the
    group and the object, and the request recomputes the same tokens. Stored again, it hits."""
    p = _workload(97, seed=3)[1][:129]           # published at 128 only (its 5 tokens reach no other grid point)
    want = _baseline(base, [p])[0]
    first, lp0 = _gen(eng, p)
    assert first == want
    pc = eng.prefix
    assert pc.lookup(p).ok and pc.lookup(p).boundary == 128
    seg = _seg(pc, group, 128)
    if how == "evict":                           # lost alone (the store's own evictions take the whole set)
        pc.store.alloc = A.evict(pc.alloc, seg.id)
        pc.store.release_unit(seg.id)
        pc.store.index = pc.index.prune(pc.alloc.segments)
    else:                                        # offload: the bytes leave the device store
        pc.store.alloc = A.transition(pc.alloc, seg.id, SegState.HOST)
        pc.store.release_unit(seg.id)
    miss = pc.lookup(p)
    assert not miss.ok and miss.hash_hit and miss.reason == "intersection" and miss.group == group
    assert why in miss.detail, miss.detail
    got, lp1 = _gen(eng, p)
    assert got == want
    np.testing.assert_allclose(lp1, lp0, atol=TOL, rtol=0)
    st = eng.cache_stats()
    assert st["misses_by_group"] == {f"{group}:intersection": 1} and st["passes"] == 0
    got, lp2 = _gen(eng, p)
    assert got == want and eng.cache_stats()["passes"] == 1
    np.testing.assert_allclose(lp2, lp0, atol=TOL, rtol=0)


def test_a_checkpoint_leaves_with_its_set(base, eng):
    """A resume point needs every group's checkpoint: when the store evicts one (here the ring), the
    others at its boundary leave with it instead of staying behind as dead weight."""
    p = _workload(97, seed=3)[1][:129]
    _gen(eng, p)
    pc = eng.prefix
    ckpt = [g for g, spec in ((s.name, s) for s in pc.specs) if spec.is_checkpoint]
    ids = {g: _seg(pc, g, 128).id for g in ckpt}
    before = eng.cache_stats()["evictions"]
    pc.store.drop_from_device(ids["sliding_window"])
    left = [s for s in pc.alloc.segments.values() if s.group in ckpt and s.end == 128]
    assert left == [] and eng.cache_stats()["evictions"] - before == len(ckpt)
    assert pc.lookup(p).boundary < 128
    assert sum(pc.blocks.used_units(g) for g in ckpt) == 0


def test_tail_closing_into_an_entry_block_is_a_recorded_event(base, eng):
    """A prompt stored at 64, then one continuing it stored at 128: each tail checkpoint at 64 is superseded
    by the entry block [64, 128) its next window closed into, by the named close_tail event."""
    rng = np.random.default_rng(4)
    a = rng.integers(0, 97, 100).tolist()[:70]      # its last grid point: 64
    b = a[:64] + rng.integers(0, 97, 90).tolist()
    want = _baseline(base, [a, b])
    assert _one(eng, a) == want[0]
    pc = eng.prefix
    tails = {g: _seg(pc, g, 64).id for g in TAILS}
    assert not pc.events and eng.cache_stats()["tail_closes"] == 0
    assert _one(eng, b) == want[1]
    st = eng.cache_stats()
    assert st["passes"] == 1 and st["tail_closes"] == 3
    got = {e.tail_group: e for e in pc.events}
    assert set(got) == set(TAILS)
    for g, e in got.items():
        entry = pc.alloc.get(e.entry_seg)
        assert (e.tail_seg, e.boundary, e.entry_group) == (tails[g], 64, TAILS[g])
        kind = Kind.INDEXER_KEYS if g == "csa_indexer_tail" else Kind.COMPRESSED_KV
        assert (entry.group, entry.kind, entry.start, entry.end) == (TAILS[g], kind, 64, 128)
        assert entry.state is SegState.DEVICE and tails[g] not in pc.alloc.segments
        assert _seg(pc, g, 128).kind is Kind.UNCOMPRESSED_TAIL       # b's own tail checkpoint stays
    with pytest.raises(A.IllegalTransition, match="does not hold the entry"):
        A.close_tail(pc.alloc, _seg(pc, "csa_tail", 128).id, got["csa_tail"].entry_seg)


def test_disk_tier_restores_v4_spans(base, eng, tmp_path):
    """With kv_cache_dir: spans of every V4 group go to disk; after the device store is dropped they come
    back (entries as pages, window / tail / overlap as checkpoints) with the same tokens."""
    prompts = _workload(97, seed=5, shared=(140, 70), n=4)
    want = _baseline(base, prompts)
    eng.config = dataclasses.replace(eng.config, kv_cache_dir=str(tmp_path))
    try:
        eng.reset_prefix_cache()
        assert [_one(eng, p) for p in prompts] == want
        eng.prefix.disk.flush()
        spans = eng.cache_stats()["disk"]["entries"]
        assert spans >= 2
        eng.reset_prefix_cache()          # the device store is gone; the spans stay on disk
        assert [_one(eng, p) for p in prompts] == want
        st = eng.cache_stats()
        assert st["disk"]["spans_restored"] >= 2 and st["disk"]["tokens_restored"] >= 128 and st["passes"] >= 4
    finally:
        eng.config = dataclasses.replace(eng.config, kv_cache_dir=None)
        eng.reset_prefix_cache()


def _serve(eng, p, max_tokens):
    req = eng.add_request(f"t{eng.cache_stats()['lookups']}-{len(p)}", {"prompt_token_ids": p},
                          SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while not req.finished:
        eng.step()
    eng.flush_publishes()
    return req


def test_traffic_patterns_branch_points_and_answers(base, eng):
    """Real traffic on V4's objects (entry pages, tails, window ring, overlap state): requests sharing a
    100-token system prompt (checkpoints every 128 tokens and at each prompt's end) publish the branch
    point 96 (on the 16-token grid, inside the 64-token entry pages, which the hit shares and copies
    before writing) and resume there; the second turn of a conversation resumes after the first answer (the decode
    stopped on the grid point 128 and published), the third after the second's, at 160: inside an entry
    page, with the window, tails and overlap state checkpointed there; outputs equal no caching's."""
    rng = np.random.default_rng(5)
    system = rng.integers(0, 97, 100).tolist()
    prompts = [system + rng.integers(0, 97, int(rng.integers(70, 100))).tolist() for _ in range(3)]
    reqs = [_serve(eng, p, 5) for p in prompts]
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 96]
    assert eng.cache_stats()["resume_grid"] == 16
    assert eng.cache_stats()["branch_points"] == 1
    p1 = rng.integers(0, 97, 100).tolist()
    t1 = _serve(eng, p1, 40)
    p2 = p1 + t1.output_ids + rng.integers(0, 97, 8).tolist()
    t2 = _serve(eng, p2, 20)                  # 148 + 20 tokens: 167 fed, the last grid point 160
    assert t2.num_cached_tokens == 128
    p3 = p2 + t2.output_ids + rng.integers(0, 97, 8).tolist()
    t3 = _serve(eng, p3, 5)
    assert t3.num_cached_tokens == 160
    got = [r.output_ids for r in reqs + [t1, t2, t3]]
    want = [o.outputs[0].token_ids for o in base.generate(
        [{"prompt_token_ids": p} for p in prompts + [p1, p2, p3]],
        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 5, 5, 40, 20, 5)])]
    assert got == want


@pytest.mark.parametrize("cap", [4_000_000, None], ids=["roomy", "evicting"])
def test_traffic_patterns_are_token_identical(base, eng, cap):
    """The three patterns on V4's objects, in random orders and random waves of concurrent requests,
    give the tokens of no caching, with reuse at branch points and after answers; with the engine's
    own small cap (about four checkpoint sets) with evictions too."""
    default = eng.prefix.config.cap_bytes
    from test_prefix_traffic import patterns  # noqa: PLC0415  (sibling test module)
    prompts = patterns(np.random.default_rng(9), lambda p: _baseline(base, [p])[0], vocab=(0, 97), systems=4,
                       leaves=2)
    want = _baseline(base, prompts)
    eng.reset_prefix_cache(cap)
    try:
        for seed in (0, 1):
            assert _run(eng, prompts, seed) == want, f"order {seed}"
        st = eng.cache_stats()
    finally:
        eng.reset_prefix_cache(default)
    assert st["passes"] >= 6 and st["branch_points"] >= 1, str(st)
    if cap is None:
        assert st["evictions"] + st["reclaimed"] > 0, str(st)
