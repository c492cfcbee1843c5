"""Prompt log-probabilities (SamplingParams.prompt_logprobs) scored in the engine's prefill chunks,
held to an independent computation: one full forward of the whole prompt (`LLM.logits`, no cache,
pages or chunks) and a log-softmax in float64. Prompts shorter and much longer than a chunk, on the
default family (Qwen3-Next: ragged and padded steps) and Kimi-Linear (padded steps, KDA + MLA state);
a row that asks beside one that does not; a prompt the prefix cache holds; preemption; the top n and
the whole vocabulary; no program compiled after warm-up. And include_stop_str_in_output with a stop
string split across tokens."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import random_prompt

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

TOL = 1e-5        # float32 rounding of a forward's sums (chunked vs whole-prompt)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from test_kimi_linear import make_checkpoint  # noqa: PLC0415  (sibling test module)
    return LLM(model=make_checkpoint(tmp_path_factory.mktemp("kimi_plp") / "m"), dtype="float32", max_model_len=512)


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=llm.max_model_len, decode_steps=4,
               compilation_cache_dir=None, warmup="none")
    return LLMEngine(llm, EngineConfig(**{**cfg, **kw}))



def _run(eng, prompts, sps):
    """Every request to its end; per request (final EngineOutput, the prompt_logprobs its outputs carried:
    a list per output that carried one)."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(rids, prompts, sps):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    final, carried = {}, {rid: [] for rid in rids}
    while len(final) < len(rids):
        for o in eng.step():
            if o.prompt_logprobs is not None:
                carried[o.request_id].append(o.prompt_logprobs)
            if o.finished:
                assert o.finish_reason != "error", o.error
                final[o.request_id] = o
    return [(final[r], carried[r]) for r in rids]


def _reference(llm, ids):
    """[T, V] float64 log-probabilities of one full forward of the prompt."""
    x = llm.logits(ids).astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _check(entries, ids, ref, n):
    """entries equal the reference: None first, then each token's logprob and the true top n."""
    assert len(entries) == len(ids) and entries[0] is None
    got = np.array([e["logprob"] for e in entries[1:]])
    want = np.array([ref[j - 1, ids[j]] for j in range(1, len(ids))])
    assert [e["token_id"] for e in entries[1:]] == ids[1:]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    for j in range(1, len(ids)):
        top = entries[j]["top"]
        assert len(top) == n and len({t for t, _ in top}) == n
        if not n:
            continue
        tids, vals = np.array([t for t, _ in top]), np.array([v for _, v in top])
        np.testing.assert_allclose(vals, ref[j - 1, tids], rtol=TOL, atol=TOL)
        assert np.all(np.diff(vals) <= 0), f"top {n} at token {j} is not best first"
        nth = np.sort(ref[j - 1])[::-1][n - 1]        # the true top n (up to ties within rounding)
        assert ref[j - 1, tids].min() >= nth - TOL, f"top {n} at token {j}"


@pytest.mark.parametrize("n_tokens", [9, 100])
def test_scores_equal_a_full_forward_short_and_over_many_chunks(llm, n_tokens):
    """9 tokens (one chunk of the 16-token budget) and 100 (seven chunks, each chunk's last position
    scoring the next chunk's first token)."""
    ids = random_prompt(n_tokens, llm.config.vocab_size, seed=n_tokens)
    eng, sp = _engine(llm), SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=5)
    (out, carried), = _run(eng, [ids], [sp])
    assert len(carried) == 1                      # once, in the first output
    _check(carried[0], ids, _reference(llm, ids), 5)
    assert eng.generate([{"prompt_token_ids": ids}], sp)[0].prompt_logprobs == carried[0]   # (its summary too)


def test_kimi_linear_scores_equal_a_full_forward(kimi):
    ids = random_prompt(70, kimi.config.vocab_size, seed=3)
    (_, carried), = _run(_engine(kimi), [ids], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4)])
    _check(carried[0], ids, _reference(kimi, ids), 4)


def test_offline_api_and_the_whole_vocabulary(llm):
    """LLM.generate's RequestOutput.prompt_logprobs; -1: every token of the vocabulary, best first;
    0: the chosen token only."""
    ids = random_prompt(40, llm.config.vocab_size, seed=5)
    ref = _reference(llm, ids)
    full, none, plain = llm.generate([{"prompt_token_ids": ids}] * 3, [
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=-1),
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0),
        SamplingParams(max_tokens=2, temperature=0)])
    _check(full.prompt_logprobs, ids, ref, llm.config.vocab_size)
    _check(none.prompt_logprobs, ids, ref, 0)
    assert plain.prompt_logprobs is None
    assert full.outputs[0].token_ids == none.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_row_that_asks_beside_one_that_does_not(llm):
    """Together (one ragged step of unequal rows) each gives what it gives alone (a padded step)."""
    a, b = random_prompt(50, llm.config.vocab_size, seed=11), random_prompt(23, llm.config.vocab_size, seed=12)
    sa = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=3)
    sb = SamplingParams(max_tokens=6, temperature=0.8, seed=4, ignore_eos=True)
    eng = _engine(llm, max_num_batched_tokens=64)
    (oa, ca), (ob, cb) = _run(eng, [a, b], [sa, sb])
    (oa1, ca1), = _run(eng, [a], [sa])
    (ob1, cb1), = _run(eng, [b], [sb])
    assert oa.token_ids == oa1.token_ids and ob.token_ids == ob1.token_ids
    assert cb == cb1 == []
    _check(ca[0], a, _reference(llm, a), 3)
    np.testing.assert_allclose([e["logprob"] for e in ca[0][1:]], [e["logprob"] for e in ca1[0][1:]],
                               rtol=TOL, atol=TOL)


def test_a_cached_prompt_is_scored_whole(llm):
    """With the prompt already in the prefix cache, a request that asks takes nothing from it (every
    token scored, equal to the uncached scores) and still publishes; one that does not ask hits."""
    ids = random_prompt(80, llm.config.vocab_size, seed=21)
    eng = _engine(llm, enable_prefix_caching=True, prefix_block_size=16, prefix_checkpoint_interval=2)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    asks = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    (o0, _), = _run(eng, [ids], [plain])
    eng.flush_publishes()
    hits = eng.metrics.prefix_hits._value.get()
    (o1, c1), = _run(eng, [ids], [asks])
    eng.flush_publishes()
    assert eng.metrics.prefix_hits._value.get() == hits          # it took nothing
    (o2, _), = _run(eng, [ids], [plain])
    assert eng.metrics.prefix_hits._value.get() > hits            # the prompt was (and is) cached
    assert o0.token_ids == o1.token_ids == o2.token_ids
    _check(c1[0], ids, _reference(llm, ids), 2)
    (_, c3), = _run(_engine(llm), [ids], [asks])
    np.testing.assert_allclose([e["logprob"] for e in c1[0][1:]], [e["logprob"] for e in c3[0][1:]],
                               rtol=TOL, atol=TOL)


def test_preemption_neither_loses_nor_duplicates_entries(llm):
    """Pages for about one and a half requests: the newest are preempted and recomputed from their
    tokens; every asking request still gets each prompt token's entry once, in one output."""
    prompts = [random_prompt(n, llm.config.vocab_size, seed=30 + n) for n in (57, 52, 47, 41)]
    sps = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=None if i == 1 else 1)
           for i in range(len(prompts))]
    eng = _engine(llm, max_num_batched_tokens=32)
    bm, held = eng.blocks, {}
    for name, g in bm.groups.items():
        if g.paged:
            keep = int(1.5 * 90 / g.page_tokens) + 1
            held[name] = [bm.alloc_unit(name) for _ in range(bm.free_units(name) - keep)]
    try:
        got = _run(eng, prompts, sps)
    finally:
        for name, pages in held.items():
            for p in pages:
                bm.release(name, p)
    assert eng.metrics.preemptions._value.get() > 0
    for p, sp, (o, carried) in zip(prompts, sps, got):
        if sp.prompt_logprobs is None:
            assert carried == []
            continue
        assert len(carried) == 1
        _check(carried[0], p, _reference(llm, p), 1)


def test_no_program_compiled_after_warmup(llm):
    eng = _engine(llm, max_num_seqs=2, max_num_batched_tokens=8, warmup="minimal")
    eng.warmup()
    n0 = eng.num_compiled()
    a, b = random_prompt(30, llm.config.vocab_size, seed=41), random_prompt(13, llm.config.vocab_size, seed=42)
    got = _run(eng, [a, b, a], [SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=20),
                                SamplingParams(max_tokens=9, temperature=0),
                                SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0)])
    _check(got[0][1][0], a, _reference(llm, a), 20)
    assert eng.num_compiled() == n0


def test_include_stop_str_in_output_with_a_stop_string_split_across_tokens():
    """vLLM's semantics: the stop string that ends the output stays in the text (and ends it); off, the
    text ends before it. The stop string here spans two tokens' text."""
    llm = LLM()
    tok = llm.tokenizer
    prompt = "Once upon a time"
    free = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    ends = [len(tok.decode(ids[:k])) for k in range(1, len(ids) + 1)]
    text = free.outputs[0].text
    # a boundary between two tokens of at least 2 characters each, past the first few
    k = next(k for k in range(3, len(ids) - 1) if ends[k] - ends[k - 1] >= 2 and ends[k + 1] - ends[k] >= 2
             and text.find(text[ends[k] - 2:ends[k] + 2]) == ends[k] - 2)
    stop = text[ends[k] - 2:ends[k] + 2]
    at = ends[k] - 2
    kept, cut = llm.generate([prompt, prompt], [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])])
    assert kept.outputs[0].text == text[:at + len(stop)] and kept.outputs[0].text.endswith(stop)
    assert cut.outputs[0].text == text[:at]
    assert kept.outputs[0].finish_reason == cut.outputs[0].finish_reason == "stop"
    assert kept.outputs[0].token_ids == cut.outputs[0].token_ids == ids[:k + 2]
