"""Overlapped stepping (EngineConfig.async_scheduling): the engine enqueues a step before it reads
the tokens of the one before, feeding rows their last token from the device. Every output equals
the engine that reads each step before enqueuing the next: greedy and seeded sampling, stop token
ids (which end a row on the device), stop strings and max_tokens (checked by the host one step
late), aborts, preemption and prefix caching."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, tokenizer="byte")


def _engine(llm, overlap: bool, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
               compilation_cache_dir=None, warmup="none", async_scheduling=overlap)
    return LLMEngine(llm, EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def engines(llm):
    return {o: _engine(llm, o) for o in (True, False)}


def _prompts(n, seed=0, lo=2, hi=70):
    rng = np.random.default_rng(seed)
    return [rng.integers(97, 123, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def _run(eng, work, abort_at=None):
    """work: [(request id, prompt ids, SamplingParams)], all added at once; abort_at {step: id}.
    Returns ({id: (token_ids, finish_reason, text)}, the tokens each request was streamed)."""
    for rid, p, sp in work:
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    final, streamed, step = {}, {rid: [] for rid, _, _ in work}, 0
    while eng.has_unfinished():
        if abort_at and step in abort_at:
            eng.abort_request(abort_at[step])
        for o in eng.step():
            streamed[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = (o.token_ids, o.finish_reason, o.text)
        step += 1
    eng.blocks.check()
    assert not eng.blocks.tables
    return final, streamed


def _work(llm, engines):
    """Nine requests through four rows, each ending its own way."""
    p = _prompts(9, seed=3)
    free = engines[False].generate([{"prompt_token_ids": x} for x in p[:3]],
                                   SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stop_id = free[0].token_ids[9]           # ends request s on the device, inside a decode call
    text = free[1].text
    needle = text[6:8]                        # ends request t on the host, a step late
    return [("g", p[0], SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)),
            ("s", p[0], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])),
            ("t", p[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[needle])),
            ("r", p[2], SamplingParams(max_tokens=13, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)),
            ("lp", p[3], SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)),
            ("one", p[4], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)),
            ("a", p[5], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)),
            ("k", p[6], SamplingParams(max_tokens=9, temperature=1.0, top_k=5, seed=9, ignore_eos=True)),
            ("m", p[7] + p[8], SamplingParams(max_tokens=11, temperature=0, ignore_eos=True))], stop_id, needle


def test_overlapped_outputs_equal_the_unoverlapped_engine(llm, engines):
    work, stop_id, needle = _work(llm, engines)
    got = {o: _run(engines[o], work) for o in (True, False)}
    assert got[True] == got[False]
    final, streamed = got[True]
    assert final["s"][1] == "stop" and final["s"][0][-1] == stop_id
    assert final["t"][1] == "stop" and needle not in final["t"][2]
    assert final["g"][1] == final["a"][1] == "length" and len(final["g"][0]) == 17 and len(final["one"][0]) == 1
    assert all(streamed[rid] == final[rid][0] for rid in final)      # nothing past the end was streamed
    assert engines[True].overlapped > 0 and engines[False].overlapped == 0


def test_an_abort_while_its_tokens_are_in_flight(llm, engines):
    """Aborted after a few steps (its next step already enqueued): it is streamed nothing after the
    abort, its row and pages come back, and the others' outputs do not change."""
    work, _, _ = _work(llm, engines)
    got = {o: _run(engines[o], work, abort_at={5: "a"}) for o in (True, False)}
    for o in (True, False):
        final, streamed = got[o]
        assert "a" not in final and len(streamed["a"]) < 30
        assert {r: v for r, v in final.items()} == {r: v for r, v in got[not o][0].items()}
    # the unoverlapped engine had read one step more of "a" when the abort came; the overlapped one
    # never streams what it had not read
    a_on, a_off = got[True][1]["a"], got[False][1]["a"]
    assert a_on == a_off[:len(a_on)]


def test_preemption_and_prefix_caching_overlapped(llm):
    """Pages for fewer requests than the rows (preemptions recompute) and prefix caching (a step that
    reaches a publish point is read back before the next is enqueued): equal to the unoverlapped engine."""
    work = [(f"q{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
            for i, p in enumerate(_prompts(6, seed=8, lo=40, hi=60))]
    work += [(f"again{i}", work[i][1], work[i][2]) for i in range(2)]
    outs = {}
    for o in (True, False):
        eng = _engine(llm, o, enable_prefix_caching=True, prefix_block_size=16, prefix_checkpoint_interval=1,
                      kv_cache_bytes=None)
        bm, held = eng.blocks, {}
        for name, g in bm.groups.items():        # pages for about two and a half requests at full length
            if g.paged:
                keep = int(2.5 * 85 / g.page_tokens) + 1
                held[name] = [bm.alloc_unit(name) for _ in range(bm.free_units(name) - keep)]
        try:
            outs[o] = _run(eng, work)
        finally:
            for name, pages in held.items():
                for p in pages:
                    bm.release(name, p)
        assert eng.metrics.preemptions._value.get() > 0
        assert eng.points.decode_publishes > 0
        assert (eng.overlapped > 0) == o
    assert outs[True] == outs[False]


def test_an_idle_gap_after_an_abort_is_not_device_time(llm):
    """A request aborted with its next step in flight, then a second of nothing: that step is read back
    at the abort, so the device time the engine counts over the whole run stays within its wall time
    (read at the next request instead, the idle second would count as the device running)."""
    import time  # noqa: PLC0415
    eng = _engine(llm, True)
    eng.add_request("warm", {"prompt_token_ids": [100, 101, 102]}, SamplingParams(max_tokens=9, ignore_eos=True))
    while eng.has_unfinished():             # every program this test runs compiled before the clock starts
        eng.step()
    t0, d0 = time.perf_counter(), eng.runner.device_seconds
    eng.add_request("a", {"prompt_token_ids": [100, 101, 102]}, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.loop.flight is not None           # its next step is in flight
    eng.abort_request("a")
    assert eng.loop.flight is None and not eng.has_unfinished()
    time.sleep(1.0)
    eng.add_request("b", {"prompt_token_ids": [100, 101, 102]}, SamplingParams(max_tokens=9, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - t0
    assert 0 < eng.runner.device_seconds - d0 < wall - 0.9
