"""Prefix reuse on the patterns of real traffic (Qwen3-Next): a shared system prompt, multi-turn
conversations, a tree of branching prompts. The request that finds a prompt's blocks cached beyond any
Gated DeltaNet checkpoint publishes one where it branches off, so the next request sharing that prefix
resumes there; a decoding request publishes at the resume grid's points, so the next turn of a
conversation resumes after the previous answer. Outputs stay token-identical to no caching over random
request orders, with and without evictions."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, max_model_len=256)


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, compilation_cache_dir=None,
               warmup="none", enable_prefix_caching=True, prefix_block_size=16, prefix_checkpoint_interval=8)
    cfg.update(kw)
    return LLMEngine(llm, EngineConfig(**cfg))


def _one(eng, prompt, sp=SP):
    """One request alone, to its end, its publishes flushed; returns the Request."""
    req = eng.add_request(f"r{eng.cache_stats()['lookups']}-{len(prompt)}", {"prompt_token_ids": prompt}, sp)
    while not req.finished:
        eng.step()
    eng.flush_publishes()
    return req


def _greedy(llm, prompt, max_tokens=6):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids


def test_third_request_resumes_at_the_branch_point(qwen):
    """Checkpoints every 8 x 16 tokens and at a prompt's last block: the first request (120 tokens)
    leaves one at 112 only, so the second finds the 96 shared tokens' blocks but no checkpoint among
    them (a miss) and stops its prefill at 96 to publish one; the third resumes there. The branch
    checkpoint outlives the second request's own publish further along the chain."""
    eng = _engine(qwen)
    rng = np.random.default_rng(0)
    system = rng.integers(1, 211, 100).tolist()
    prompts = [system + rng.integers(1, 211, 20).tolist() for _ in range(3)]
    reqs = [_one(eng, p) for p in prompts]
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 96]
    st = eng.cache_stats()
    assert st["branch_points"] == 1 and st["misses_by_reason"] == {"no_hit": 1, "intersection": 1}
    assert [r.output_ids for r in reqs] == [_greedy(qwen, p) for p in prompts]
    # without the branch point the third request would have missed too
    plain = _engine(qwen)
    plain.prefix._branch = lambda *a: 0
    assert [_one(plain, p).num_cached_tokens for p in prompts] == [0, 0, 0]


def test_chunk_ends_inside_a_prompt_are_published_as_spares(qwen):
    """prefix_publish_chunk_ends: the first request's prefill chunks (32 tokens of budget) end at 32, 64
    and 96 inside its prompt; those grid points are published as spares, so the second request, which
    shares 100 tokens with it, resumes at 96 at once (without them it misses: the test above). No chunk
    is cut for them, and the tokens are those of no caching."""
    eng = _engine(qwen, prefix_publish_chunk_ends=True)
    rng = np.random.default_rng(0)
    system = rng.integers(1, 211, 100).tolist()
    prompts = [system + rng.integers(1, 211, 20).tolist() for _ in range(3)]
    reqs = [_one(eng, p) for p in prompts]
    assert [r.num_cached_tokens for r in reqs] == [0, 96, 96]
    assert [r.output_ids for r in reqs] == [_greedy(qwen, p) for p in prompts]


@pytest.mark.parametrize("mode", ["serving", "offline"])
def test_next_turn_resumes_after_the_answer(qwen, mode):
    """Turn 1: a 40-token prompt and 30 tokens of answer, so 69 tokens go through the model; the
    decode stops on the grid point 64 and publishes it (offline: only that last one; serving: 48 and
    64). Turn 2 = turn 1 + its answer + a new message resumes at 64, after most of the answer. The
    prompt's own end (32) stays beside the answer's, as a spare: the same prompt sent again (a
    regenerate) resumes there."""
    eng = _engine(qwen, run_to_completion=mode == "offline")
    rng = np.random.default_rng(1)
    p1 = rng.integers(1, 211, 40).tolist()
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    t1 = _one(eng, p1, sp)
    assert t1.output_ids == _greedy(qwen, p1, 30)      # stopping on the grid changes no token
    pts = sorted(s.end for s in eng.prefix.alloc.segments.values() if s.group == "linear_attention")
    assert pts == [32, 64]           # 48 was retired as the chain grew; 32, the prompt's end, is a spare
    assert eng.cache_stats()["decode_publishes"] == (2 if mode == "serving" else 1)
    p2 = p1 + t1.output_ids + rng.integers(1, 211, 10).tolist()
    t2 = _one(eng, p2)
    assert t2.num_cached_tokens == 64
    assert t2.output_ids == _greedy(qwen, p2)
    again = _one(eng, p1, sp)
    assert again.num_cached_tokens == 32 and again.output_ids == t1.output_ids


def patterns(rng, answer, vocab=(1, 211), systems=5, leaves=3):
    """Prompts of the three traffic patterns: `systems` prompts sharing a system prompt, a trunk with two
    branches of `leaves` leaves each, and two 3-turn conversations whose turns carry the previous
    answer (`answer(prompt)`: its greedy tokens). Token ids are drawn from range(*vocab)."""
    def draw(n):
        return rng.integers(*vocab, n).tolist()
    system = draw(70)
    out = [system + draw(int(rng.integers(5, 30))) for _ in range(systems)]
    trunk = draw(50)
    for _ in range(2):
        branch = trunk + draw(20)
        out += [branch + draw(int(rng.integers(5, 20))) for _ in range(leaves)]
    for _ in range(2):
        p = draw(30)
        for _ in range(3):
            out.append(p)
            p = p + answer(p) + draw(8)
    return out


@pytest.mark.parametrize("cap", [4_000_000, 150_000], ids=["roomy", "evicting"])
def test_traffic_patterns_are_token_identical(qwen, cap):
    """The three patterns, in random orders and random waves of concurrent requests, give the tokens
    of no caching, with reuse at branch points and after answers, and (small cap) evictions."""
    from test_prefix_caching import _run  # noqa: PLC0415  (sibling test module)
    prompts = patterns(np.random.default_rng(2), lambda p: _greedy(qwen, p, 20))
    want = [_greedy(qwen, p) for p in prompts]
    eng = _engine(qwen, prefix_cache_bytes=cap, prefix_checkpoint_interval=4)
    for seed in (0, 1):
        assert _run(eng, prompts, seed) == want, f"order {seed}"
    st = eng.cache_stats()
    assert st["passes"] >= 6 and st["branch_points"] >= 1
    if cap < 1_000_000:
        assert st["evictions"] + st["refused_publishes"] > 0


def test_hits_resume_inside_a_page_on_the_checkpoint_grid(qwen):
    """Pages of 64 tokens, Gated DeltaNet checkpoints on a 16-token grid: the blocks of the first
    request are indexed at their interior points, so the second finds all 96 tokens of the shared
    system prompt that lie on the grid (not just the 64 of its whole pages), publishes a checkpoint at
    96 and the third resumes there: it lists the first request's page holding tokens 64-127 and copies
    it before writing its own token 96 into it. Outputs equal no caching's."""
    eng = _engine(qwen, prefix_block_size=64, prefix_checkpoint_interval=8)
    st = eng.cache_stats()
    assert (st["lcm"], st["resume_grid"]) == (64, 16)
    rng = np.random.default_rng(3)
    system = rng.integers(1, 211, 100).tolist()
    prompts = [system + rng.integers(1, 211, 30).tolist() for _ in range(3)]
    reqs = [_one(eng, prompts[0]), _one(eng, prompts[1])]
    cow = eng.blocks.copies_on_write
    reqs.append(_one(eng, prompts[2]))
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 96]
    assert eng.blocks.copies_on_write == cow + 1          # the shared page the third request wrote into
    assert [r.output_ids for r in reqs] == [_greedy(qwen, p) for p in prompts]
    # the same with pages as the grid: the shared prompt's whole pages end at 64, nothing is stored there
    coarse = _engine(qwen, prefix_block_size=64, prefix_checkpoint_interval=8, prefix_checkpoint_grid=64)
    assert [_one(coarse, p).num_cached_tokens for p in prompts] == [0, 0, 64]


@pytest.mark.parametrize("credit", [True, False], ids=["hit_credit", "plain_lru"])
def test_a_branch_point_that_serves_many_outlives_one_off_prefixes(qwen, monkeypatch, credit):
    """Under a small cap, a shared system prompt's branch point (hit by several requests) and its pages
    survive a run of unrelated prompts published after them, so the next request of the family still
    resumes there; with plain LRU (no credit for hits) they are the first to go."""
    from cache import segment_allocator as A  # noqa: PLC0415
    if not credit:
        monkeypatch.setattr(A, "HIT_CREDIT_CAP", 0)
    eng = _engine(qwen, prefix_cache_bytes=140_000)
    rng = np.random.default_rng(4)
    system = rng.integers(1, 211, 60).tolist()
    family = [system + rng.integers(1, 211, 20).tolist() for _ in range(6)]
    got = [_one(eng, p).num_cached_tokens for p in family[:5]]
    assert got == [0, 0, 48, 48, 48]
    for _ in range(6):
        _one(eng, rng.integers(1, 211, 40).tolist())
    assert eng.cache_stats()["evictions"] > 0
    assert _one(eng, family[5]).num_cached_tokens == (48 if credit else 0)


def test_decode_publishes_write_the_disk_tier_only_at_span_ends(qwen, tmp_path):
    """With a disk tier (spans of 2 x 16 tokens), a 20-token prompt answered with 60 tokens (79 of them
    fed to the model) publishes its prompt at 16, then on the device at 32, 48 and 64 while decoding,
    and writes spans behind at 16 (the prompt's), 32 and 64, not at 48: a long
    answer does not rewrite its last span at every grid point (which once flooded a server's disk
    writer)."""
    eng = _engine(qwen, prefix_checkpoint_interval=2, kv_cache_dir=str(tmp_path))
    req = _one(eng, np.random.default_rng(6).integers(1, 211, 20).tolist(),
               SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    assert len(req.output_ids) == 60
    eng.prefix.disk.flush()
    st = eng.cache_stats()
    assert st["decode_publishes"] == 3 and st["disk"]["writes"] == 3, st["disk"]


@pytest.mark.parametrize("victims", ["own_first", "lru"])
def test_conversations_resume_after_each_answer_inside_pages(qwen, monkeypatch, victims):
    """Pages of 64 tokens, a 16-token grid, as many conversations as checkpoint units, served in turn:
    every later turn resumes at the last grid point its previous turn fed to the model, inside a page;
    a chain's partial page stored at one turn is replaced by the longer copy the next stores, not kept
    beside it; and with every unit in use a turn's publishes take the units of the checkpoints its own
    chain supersedes. Taking the least recently used unit instead takes another conversation's (the
    next one to come back), and later turns miss."""
    from cache import segment_allocator as A  # noqa: PLC0415
    from cache.prefix_retention import RetentionPolicy  # noqa: PLC0415
    if victims == "lru":
        monkeypatch.setattr(RetentionPolicy, "victims", lambda self, alloc: A.eviction_order(alloc))
    eng = _engine(qwen, prefix_block_size=64, prefix_checkpoint_interval=8)
    units = eng.cache_stats()["pools"]["linear_attention"]["total"]
    rng = np.random.default_rng(7)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    convs = [rng.integers(1, 211, int(rng.integers(20, 40))).tolist() for _ in range(units)]
    want, got = [], []
    for turn in range(3):
        for c, p in enumerate(convs):
            req = _one(eng, p, sp)
            assert req.output_ids == _greedy(qwen, p, 20)
            if turn:
                got.append(req.num_cached_tokens)
            want.append((len(p) + len(req.output_ids) - 1) // 16 * 16)   # the last grid point it fed
            convs[c] = p + req.output_ids + rng.integers(1, 211, 8).tolist()
    st = eng.cache_stats()
    if victims == "lru":
        assert got != want[:len(got)] and st["reclaimed"] > 0
        return
    assert got == want[:len(got)] and any(b % 64 for b in got)
    assert st["pools"]["linear_attention"]["used"] == units and st["evictions"] == 0   # (spares were reclaimed)
    assert st["retired_pages"] > 0
    pages = [s.start for s in eng.prefix.alloc.segments.values() if s.group == "full_attention"]
    assert len(pages) == units * 2 and len(set(pages)) == 2        # each chain: [0, 64) and [64, end)


def test_a_prompt_shared_in_part_resumes_at_its_spare_point(qwen):
    """Pages of 64 tokens, a 16-token grid: a 100-token prompt publishes at 96 (its last grid point) and
    at 64, its last LCM point, as a spare; the next prompt shares only its first 80 tokens (a second
    branch off a trunk) and resumes at the spare instead of computing everything, then publishes its
    branch point 80. Without the spare it would resume at 0."""
    rng = np.random.default_rng(8)
    p0 = rng.integers(1, 211, 100).tolist()
    p1 = p0[:80] + rng.integers(1, 211, 30).tolist()
    got = {}
    for spare in (True, False):
        eng = _engine(qwen, prefix_block_size=64, prefix_checkpoint_interval=8)
        if not spare:
            eng.prefix.spare_point = lambda n: 0
        _one(eng, p0)
        r1 = _one(eng, p1)
        got[spare] = r1.num_cached_tokens
        assert r1.output_ids == _greedy(qwen, p1)
        assert eng.cache_stats()["branch_points"] == 1
    assert got == {True: 64, False: 0}
