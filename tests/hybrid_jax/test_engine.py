"""The continuous-batching engine: chunked prefill mixed with decode, row reuse, preemption when the
pages run out, stop conditions, logprobs, fairness; all equal to the offline generate path."""
from __future__ import annotations

import numpy as np
import pytest

from cache.block_manager import BlockManager, GroupGeometry
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.request import Request
from hybrid_jax.engine.scheduler import Scheduler
from conftest import greedy_reference


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint)


@pytest.fixture(scope="module")
def shared(llm):
    """One engine for most tests: its compiled steps are reused, and it is idle between tests."""
    return _engine(llm)


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
               compilation_cache_dir=None, warmup="none")
    cfg.update(kw)
    return LLMEngine(llm, EngineConfig(**cfg))


def _prompts(n, seed=0, lo=2, hi=90):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 211, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def _offline(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def test_engine_equals_full_recompute_with_queueing_chunking_and_row_reuse(llm, shared):
    """Nine prompts through four rows, 32-token chunks, pages handed out and back: every greedy token
    is the one a full recomputation picks; LLM.generate (the same core, run to completion, other
    chunks and waves) gives the same tokens."""
    prompts = _prompts(9)
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    eng = shared
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.token_ids for o in outs] == [greedy_reference(llm, p, 14) for p in prompts]
    assert [o.token_ids for o in outs] == _offline(llm, prompts, sp)
    eng.blocks.check()
    assert not eng.blocks.tables and all(eng.blocks.used_units(g) == 0 for g in eng.blocks.groups)


def test_seeded_sampling_is_independent_of_batching(shared):
    prompts = _prompts(5, seed=1)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11)
    together = [o.token_ids for o in shared.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    alone = [shared.generate([{"prompt_token_ids": p}], sp)[0].token_ids for p in prompts]
    assert together == alone
    other_seed = shared.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
        max_tokens=10, temperature=0.9, top_p=0.9, seed=12))[0].token_ids
    assert other_seed != alone[0]


def test_preemption_when_pages_run_out_recomputes_and_stays_exact(llm, shared):
    prompts = _prompts(4, seed=2, lo=40, hi=60)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    bm = shared.blocks
    # pages for about one and a half requests at full length (90 tokens): the newest must be preempted
    # (with two and a half, admission's headroom now keeps the third out until one finishes)
    held = {}
    for name, g in bm.groups.items():
        if g.paged:
            keep = int(1.5 * 90 / g.page_tokens) + 1
            held[name] = [bm.alloc_unit(name) for _ in range(bm.free_units(name) - keep)]
    before = shared.metrics.preemptions._value.get()
    try:
        outs = shared.generate([{"prompt_token_ids": p} for p in prompts], sp)
    finally:
        for name, pages in held.items():
            for p in pages:
                bm.release(name, p)
    assert shared.metrics.preemptions._value.get() > before
    assert [o.token_ids for o in outs] == _offline(llm, prompts, sp)
    bm.check()


def test_chunked_prefill_runs_beside_decodes(llm):
    eng = _engine(llm, max_num_batched_tokens=16)   # the plan only: nothing is compiled here
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short, long_ = _prompts(1, seed=3, lo=3, hi=4)[0], _prompts(1, seed=4, lo=120, hi=121)[0]
    eng.add_request("short", {"prompt_token_ids": short}, sp)
    first = eng.scheduler.schedule()
    assert [(p.request.request_id, p.num_tokens, p.sample) for p in first.rows] == [("short", len(short), True)]
    eng.requests["short"].num_computed = len(short)
    eng.requests["short"].output_ids.append(7)          # as if the step had sampled a token
    eng.add_request("long", {"prompt_token_ids": long_}, sp)
    plan = eng.scheduler.schedule()
    kinds = {p.request.request_id: p.num_tokens for p in plan.rows}
    assert kinds["short"] == 1 and 1 < kinds["long"] <= 15     # one decode + a prefill chunk, same step
    eng.scheduler.waiting.clear()


def test_stop_strings_and_stop_ids(shared):
    eng = shared
    p = _prompts(1, seed=5)[0]
    free = eng.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_id = free.token_ids[6]
    o = eng.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=20, temperature=0,
                                                               stop_token_ids=[stop_id]))[0]
    assert o.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1] and o.finish_reason == "stop"


def test_stop_string_truncates_text(tiny_checkpoint):
    from hybrid_jax.tokenizer import ByteTokenizer  # noqa: PLC0415
    llm = LLM(model=tiny_checkpoint, tokenizer="byte")
    eng = _engine(llm)
    prompt = {"prompt_token_ids": [97, 98, 99]}
    free = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    text = ByteTokenizer().decode(free.token_ids)
    needle = text[5:7]
    assert needle
    o = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[needle]))[0]
    assert o.finish_reason == "stop" and o.text == text[:text.index(needle)]


def test_logprobs_match_the_model(llm, shared):
    eng = shared
    p = _prompts(1, seed=6)[0]
    eng.add_request("x", {"prompt_token_ids": p}, SamplingParams(max_tokens=3, temperature=0, logprobs=3))
    got, toks = [], []
    while eng.has_unfinished():
        for out in eng.step():
            got += out.new_logprobs
            toks = out.token_ids
    assert len(got) == 3
    logits = llm.logits(p + toks[:2]).astype(np.float64)
    m = logits.max(-1, keepdims=True)
    ref = logits - m - np.log(np.sum(np.exp(logits - m), -1, keepdims=True))
    for j, e in enumerate(got):
        row = ref[len(p) - 1 + j]
        assert e["token_id"] == int(np.argmax(row))
        assert abs(e["logprob"] - row[e["token_id"]]) < 1e-4
        assert [t for t, _ in e["top"]] == list(np.argsort(-row)[:3])


def test_logprobs_minus_one_is_the_whole_distribution(llm, shared):
    """logprobs=-1 (vLLM's spelling): every token's log-probability, most likely first, as the model gives
    them; beside a request asking for 2, which keeps its 2."""
    eng = shared
    p = _prompts(1, seed=8)[0]
    eng.add_request("all", {"prompt_token_ids": p}, SamplingParams(max_tokens=2, temperature=0, logprobs=-1))
    eng.add_request("two", {"prompt_token_ids": p}, SamplingParams(max_tokens=2, temperature=0, logprobs=2))
    got = {"all": [], "two": []}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_logprobs
    ref = llm.logits(p).astype(np.float64)[-1]
    ref = ref - ref.max() - np.log(np.sum(np.exp(ref - ref.max())))
    top = got["all"][0]["top"]
    assert sorted(t for t, _ in top) == list(range(llm.config.vocab_size))
    vals = np.asarray([v for _, v in top])
    assert np.all(np.diff(vals) <= 0)
    np.testing.assert_allclose(vals, ref[[t for t, _ in top]], atol=1e-4, rtol=0)
    assert [t for t, _ in got["two"][0]["top"]] == [t for t, _ in top[:2]]


def test_fcfs_admission_order():
    blocks = BlockManager([GroupGeometry("kv", "full_kv", page_tokens=16, num_units=64, unit_nbytes=1)], num_rows=2)
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, blocks=blocks)
    reqs = [Request(str(i), [1] * 5, SamplingParams(max_tokens=4), seed=0) for i in range(4)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert [p.request.request_id for p in plan.rows] == ["0", "1"]
    s.release(reqs[0])
    plan = s.schedule()
    assert "2" in [p.request.request_id for p in plan.rows] and "3" not in [p.request.request_id for p in plan.rows]


def test_prompt_whose_last_chunk_is_one_token(llm, shared):
    # 33 tokens with a 32-token budget: the second chunk is a single prompt token, which must not
    # be taken for a decode (nothing has been sampled yet)
    p = _prompts(1, seed=9, lo=33, hi=34)[0]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert shared.generate([{"prompt_token_ids": p}], sp)[0].token_ids == _offline(llm, [p], sp)[0]


def test_copy_on_write_copies_pages_and_nothing_else(shared):
    """The device side of copy-on-write (`BlockManager.reserve` picks the pages): the copy holds the
    shared page's bytes in every paged field and every other page is untouched."""
    import jax  # noqa: PLC0415
    runner = shared.runner
    kv = runner.cache.groups["full_attention"]
    rng = np.random.default_rng(0)
    filled = kv.replace(k=jax.numpy.asarray(rng.normal(size=kv.k.shape), kv.k.dtype),
                        v=jax.numpy.asarray(rng.normal(size=kv.v.shape), kv.v.dtype))
    runner.cache = runner.cache.replace(groups={**runner.cache.groups, "full_attention": filled})
    before = {f: np.asarray(getattr(filled, f)) for f in ("k", "v")}
    runner.copy_on_write({"full_attention": [(3, 5), (0, 1)]})
    after = runner.cache.groups["full_attention"]
    for f, a in before.items():
        got = np.asarray(getattr(after, f))
        np.testing.assert_array_equal(got[:, 5], a[:, 3])
        np.testing.assert_array_equal(got[:, 1], a[:, 0])
        others = [p for p in range(a.shape[1]) if p not in (1, 5)]
        np.testing.assert_array_equal(got[:, others], a[:, others])


def test_mixed_steps_are_ragged_and_equal_the_padded_path(llm):
    """Prefill chunks beside decodes run as one flat token-major batch (no padding to the longest row)
    and give the tokens the padded [B, T] step gives; the scheduler's chunk cap is then the token
    budget itself, not budget / rows. (A step whose padding would cost nothing, e.g. one row, stays
    padded: `dispatch_mixed`.)"""
    prompts = _prompts(6, seed=5, lo=20, hi=80)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ragged, padded = _engine(llm), _engine(llm)
    padded.runner.ragged = False
    # padded, token buckets 8 and 32: one row may take 32-token chunks, four rows only 8; ragged: 32
    assert ragged.runner.ragged and ragged.runner.chunk_cap(4) == 32
    assert padded.runner.chunk_cap(1) == 32 and padded.runner.chunk_cap(4) == 8
    a = [o.token_ids for o in ragged.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    b = [o.token_ids for o in padded.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert a == b == [greedy_reference(llm, p, 10) for p in prompts]
    assert ragged.runner._ragged._cache_size() > 0 and padded.runner._ragged._cache_size() == 0


def test_each_step_splits_into_device_wait_and_host_time(shared):
    """Every step that ran is counted, its wall time split into the wait for the device and the host's
    part; the device's time (overlapping the host's: the next step is enqueued before this one is read)
    and the host's are each within the steps' wall time, and /metrics carries both."""
    import time  # noqa: PLC0415
    m = shared.metrics
    steps, host, dev = m.steps, m.host_seconds, m.device_seconds
    t0 = time.perf_counter()
    shared.generate([{"prompt_token_ids": p} for p in _prompts(3, seed=4)],
                    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - t0
    ran = m.steps - steps
    assert ran >= 3                                      # prefill chunks and decode steps
    assert m.device_seconds > dev and m.host_seconds > host
    assert (m.device_seconds - dev) <= wall and (m.host_seconds - host) <= wall
    text = m.render().decode()
    count = next(float(x.split()[1]) for x in text.splitlines() if x.startswith("hybrid_jax_step_host_seconds_count"))
    assert count == m.steps and "hybrid_jax_device_busy_ratio" in text and 0 < m.device_busy() <= 1
