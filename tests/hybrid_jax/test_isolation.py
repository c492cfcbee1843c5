"""One bad request never hurts another: admission checks against the model and engine limits, and a
step that fails anyway fails only the request it belongs to (or resets and goes on), with the
innocent requests' outputs identical to a run without the bad one."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax import LLM, InputError, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine import limits


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint)


@pytest.fixture(scope="module")
def engine(llm):
    return LLMEngine(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
                                       compilation_cache_dir=None, warmup="none"))


PROMPTS = [[5, 9, 13, 2, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [100, 3, 42], [7] * 40]


def _params(i):
    # greedy and seeded sampled rows together: a reset that changed any sampling would show up
    return SamplingParams(max_tokens=10 + i, temperature=0 if i % 2 else 0.8, top_k=20 if i == 2 else -1, seed=i,
                          ignore_eos=True)


def _run(engine, extra=()):
    """Runs PROMPTS (and `extra` (request id, prompt, params)) to completion; outputs by request id."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"ok{i}", {"prompt_token_ids": p}, _params(i))
    for rid, p, sp in extra:
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    done = {}
    for _ in range(500):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    return done


@pytest.fixture(scope="module")
def baseline(engine):
    return {rid: o.token_ids for rid, o in _run(engine).items()}


@pytest.mark.parametrize("kw,needle", [
    (dict(stop_token_ids=[10**12]), "outside the vocabulary"),
    (dict(stop_token_ids=[211]), "outside the vocabulary"),
    (dict(stop_token_ids=list(range(limits.MAX_STOP_TOKEN_IDS + 1))), "at most"),
    (dict(stop=["x"] * (limits.MAX_STOP_STRINGS + 1)), "at most"),
    (dict(stop=["x" * (limits.MAX_STOP_STRING_CHARS + 1)]), "at most"),
    (dict(top_p=1e-46), "rounds to 0"),
    (dict(temperature=1e39), "overflows float32"),
])
def test_admission_refuses_what_a_step_cannot_take(engine, kw, needle):
    with pytest.raises(InputError, match=needle):
        engine.add_request("bad", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4, **kw))
    assert "bad" not in engine.requests and not engine.has_unfinished()


def test_huge_top_k_means_the_whole_vocabulary(engine):
    outs = {}
    for k in (-1, 211, 10**12):
        engine.add_request(f"k{k}", {"prompt_token_ids": [4, 5, 6]},
                           SamplingParams(max_tokens=8, temperature=1.0, top_k=k, seed=3, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    assert outs["k211"] == outs["k-1"] == outs[f"k{10**12}"]


def test_attributable_failure_fails_only_that_request(engine, baseline, monkeypatch):
    outputs = engine.scheduler.outputs          # the host work on a request's tokens
    real = outputs.append

    def append(q, *a, **kw):
        if q.request_id == "bad":
            raise ValueError("poisoned row")
        return real(q, *a, **kw)

    monkeypatch.setattr(outputs, "append", append)
    done = _run(engine, [("bad", [3, 1, 4, 1, 5], SamplingParams(max_tokens=6, temperature=0))])
    assert done["bad"].finish_reason == "error" and "'bad'" in done["bad"].error
    assert "poisoned row" in done["bad"].error
    assert {rid: o.token_ids for rid, o in done.items() if rid != "bad"} == baseline
    assert all(o.error is None for rid, o in done.items() if rid != "bad")


@pytest.mark.parametrize("where", ["dispatch_decode", "land"])
def test_unattributable_failure_resets_and_the_requests_go_on(engine, baseline, monkeypatch, caplog, where):
    """A step fails when it is enqueued, or when its results are read back (a device error surfaces
    there, with the next step already enqueued): everything is reset and recomputed, outputs unchanged."""
    real = getattr(engine.runner, where)
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        out = real(*a, **kw)          # the pools were donated and written: the reset must rebuild them
        if calls["n"] == 2:
            raise RuntimeError("device fault")
        return out

    monkeypatch.setattr(engine.runner, where, flaky)
    with caplog.at_level("ERROR", logger="hybrid_jax.engine"):
        done = _run(engine)
    assert calls["n"] > 2
    assert "step state reset" in caplog.text and "device fault" in caplog.text
    assert {rid: o.token_ids for rid, o in done.items()} == baseline
    assert engine.metrics.step_failures.labels(attributable="false")._value.get() >= 1


@pytest.mark.parametrize("where", ["dispatch_mixed", "dispatch_decode"])
def test_a_request_that_always_breaks_a_step_fails_alone(engine, baseline, monkeypatch, where):
    """A request whose rows always break the device step (no host work names it) runs beside the
    innocents: the step fails, everyone is requeued, the suspects run alone, and only it fails."""
    real = getattr(engine.runner, where)

    def poisoned(rows, *a, **kw):
        reqs = [getattr(r, "request", r) for r in rows]
        if any(q.request_id == "poison" for q in reqs):
            raise RuntimeError("cannot run this row")
        return real(rows, *a, **kw)

    monkeypatch.setattr(engine.runner, where, poisoned)
    done = _run(engine, [("poison", [9, 9, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))])
    assert done["poison"].finish_reason == "error" and "ran alone" in done["poison"].error
    assert {rid: o.token_ids for rid, o in done.items() if rid != "poison"} == baseline
    assert all(o.error is None for rid, o in done.items() if rid != "poison")
    monkeypatch.undo()
    assert {rid: o.token_ids for rid, o in _run(engine).items()} == baseline     # and it serves as before


def test_gauges_are_read_at_scrape_time(engine):
    def value(name):
        for line in engine.metrics.render().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(name)

    for i in range(6):
        engine.add_request(f"q{i}", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=50, ignore_eos=True))
    assert value("hybrid_jax_num_requests_waiting") == 6        # queued, not yet stepped
    engine.step()
    assert value("hybrid_jax_num_requests_running") == 4
    assert value("hybrid_jax_generation_throughput_tokens_per_second") > 0
    for i in range(6):
        engine.abort_request(f"q{i}")
    assert value("hybrid_jax_num_requests_waiting") == 0
    assert value("hybrid_jax_num_requests_running") == 0
    assert value("hybrid_jax_kv_cache_usage_ratio") == 0
    assert value('hybrid_jax_request_success_total{finished_reason="abort"}') >= 6
    engine.metrics._recent.clear()              # as if 10 s went by: the idle throughput is 0, not stale
    assert value("hybrid_jax_generation_throughput_tokens_per_second") == 0
    assert np.isfinite(value("hybrid_jax_request_queue_time_seconds_sum"))


def test_reset_with_prefix_caching_keeps_outputs(llm, baseline, monkeypatch):
    """The reset rebuilds the prefix store with the pools (its pages lived there): the requests
    recompute, stored prefixes are gone, and every output is unchanged."""
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
                                      compilation_cache_dir=None, warmup="none", enable_prefix_caching=True,
                                      prefix_block_size=16, prefix_checkpoint_interval=1))
    assert {rid: o.token_ids for rid, o in _run(eng).items()} == baseline        # publishes prefixes
    real, calls = eng.runner.dispatch_decode, {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fault")
        return real(*a, **kw)

    monkeypatch.setattr(eng.runner, "dispatch_decode", flaky)
    old_store = eng.prefix
    assert {rid: o.token_ids for rid, o in _run(eng).items()} == baseline        # hits, then the reset
    assert eng.prefix is not old_store and calls["n"] > 3
    monkeypatch.undo()
    assert {rid: o.token_ids for rid, o in _run(eng).items()} == baseline
