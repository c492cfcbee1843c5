"""The logits processors (presence / frequency / repetition penalties, min_p, min_tokens, logit_bias)
inside the compiled steps: the pure functions equal a NumPy reference of vLLM's definitions, and the
engine's tokens equal that reference replayed over the model's own logits, alone or beside
unprocessed rows, through preemption and prefix-cache hits, with no program compiled after warm-up."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.prompt_logprobs import prompt_width
from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplerFlags
from test_cache_in_place import cache_materializations   # noqa: PLC2701  (sibling test module's reader)
from hybrid_jax.logits_processors import (SEED_WIDTH, ProcState, RowState, apply_min_p, note_tokens, processed,
                                          seed_row, seeds)


def reference(logits, prompt, out, p: SamplingParams, stop_ids=()):
    """vLLM's processors before sampling, in NumPy, for one row: logits [V] -> [V]."""
    x = np.asarray(logits, np.float32).copy()
    V = x.shape[0]
    if len(out) < p.min_tokens:
        x[list(stop_ids)] = -np.inf
    for t, v in (p.logit_bias or {}).items():
        x[t] += v
    cnt = np.bincount(np.asarray(out, np.int64), minlength=V).astype(np.float32)
    seen = (cnt > 0) | np.isin(np.arange(V), prompt)
    x = np.where(seen, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    return x - p.frequency_penalty * cnt - p.presence_penalty * (cnt > 0)


def _state(rows, V, S=4, NB=8):
    return RowState(last=jnp.zeros((rows,), jnp.int32), procs=ProcState.empty(rows, V, NB, S),
                    allowed=jnp.full((rows, (V + 31) // 32), -1, jnp.int32))


def _seeded(state, row, prompt, out, p, stop, NB=8):
    seed = jax.jit(seed_row)
    for s in seeds(row, prompt, out, p, np.asarray(stop, np.int32), NB):
        state = seed(state, s)
    return state


CASES = [SamplingParams(repetition_penalty=1.7), SamplingParams(presence_penalty=1.5),
         SamplingParams(frequency_penalty=-0.7), SamplingParams(logit_bias={3: 5.0, 40: -100.0}),
         SamplingParams(min_tokens=6, max_tokens=10),
         SamplingParams(repetition_penalty=0.8, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 2.5},
                        min_tokens=3)]


@pytest.mark.parametrize("p", CASES, ids=["repetition", "presence", "frequency", "bias", "min_tokens", "all"])
def test_each_processor_equals_the_numpy_reference(p):
    """Seeded from a prompt longer than one seeding call, then counted token by token as a decode does:
    the processed logits equal the reference at every step; rows without processors are untouched."""
    V, R = 53, 4
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V // 2, SEED_WIDTH + 37).tolist()      # two seeding calls, half the vocabulary
    out = rng.integers(0, V, 5).tolist()
    stop = [9, 11, -1, -1]
    st = _seeded(_state(R, V), 2, prompt, out, p, stop)
    st = _seeded(st, 1, [1, 2, 3], [4, 4, 4], SamplingParams(presence_penalty=2.0), [-1] * 4)  # another row
    rows, on = jnp.asarray([2, 1, 0, 3]), jnp.asarray([True, False, False, False])
    f = jax.jit(processed)
    for step in range(8):
        logits = rng.normal(0, 3, (4, V)).astype(np.float32)
        got = np.asarray(f(jnp.asarray(logits), st, rows, on, jnp.full((4,), len(out), jnp.int32)))
        np.testing.assert_allclose(got[0], reference(logits[0], prompt, out, p, stop[:2]), rtol=1e-6, atol=1e-5)
        np.testing.assert_array_equal(got[1:], logits[1:])
        tok = int(rng.integers(0, V))
        st = note_tokens(st, rows, on, jnp.asarray([tok, 5, -1, 6]))
        out.append(tok)
    assert int(st.last[2]) == tok and int(st.last[1]) == 5


def test_a_row_starts_over_when_seeded_again():
    V = 31
    p = SamplingParams(frequency_penalty=1.0)
    st = _seeded(_state(2, V), 0, [1, 2], [3, 3, 3], p, [-1] * 4)
    st = _seeded(st, 0, [5], [], SamplingParams(repetition_penalty=2.0), [-1] * 4)
    logits = np.linspace(-2, 2, V, dtype=np.float32)[None]
    got = np.asarray(processed(jnp.asarray(logits), st, jnp.asarray([0]), jnp.asarray([True]),
                               jnp.zeros((1,), jnp.int32)))
    np.testing.assert_allclose(got[0], reference(logits[0], [5], [], SamplingParams(repetition_penalty=2.0)), rtol=1e-6)


def test_min_p_equals_the_numpy_reference():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, (3, 40)).astype(np.float32)
    min_p = np.asarray([0.0, 0.1, 0.6], np.float32)
    got = np.asarray(apply_min_p(jnp.asarray(x), jnp.asarray(min_p)))
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.where(probs < min_p[:, None] * probs.max(-1, keepdims=True), -np.inf, x)
    np.testing.assert_array_equal(got, want)


# --- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, tokenizer="byte")


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
               compilation_cache_dir=None, warmup="none")
    return LLMEngine(llm, EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def eng(llm):
    return _engine(llm)


def _prompts(n, seed=0, lo=5, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(97, 123, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def _replay(llm, prompt, p: SamplingParams, stop_ids=()):
    """Greedy tokens of the reference processors over the model's logits, recomputed per token."""
    out = []
    for _ in range(p.max_tokens):
        t = int(np.argmax(reference(llm.logits(prompt + out)[-1], prompt, out, p, stop_ids)))
        out.append(t)
        if t in stop_ids and len(out) >= p.min_tokens:
            break
    return out


def _gen(eng, prompts, params):
    return [o.token_ids for o in eng.generate([{"prompt_token_ids": x} for x in prompts], params)]


PENALTIES = [dict(repetition_penalty=3.0), dict(presence_penalty=2.0), dict(frequency_penalty=1.5),
             dict(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4, logit_bias={100: 3.0})]


@pytest.mark.parametrize("kw", PENALTIES, ids=["repetition", "presence", "frequency", "all"])
def test_greedy_penalised_equals_the_replayed_reference(llm, eng, kw):
    """Mixed steps and decode calls of 4 iterations (each sees the tokens of the ones before it): the
    tokens equal the reference replayed over the model's logits, and differ from the unpenalised."""
    prompt = _prompts(1, seed=4)[0]
    p = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, **kw)
    got = _gen(eng, [prompt], p)[0]
    assert got == _replay(llm, prompt, p)
    plain = _gen(eng, [prompt], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))[0]
    assert got != plain


def test_a_strong_repetition_penalty_never_repeats(eng):
    prompt = _prompts(1, seed=5)[0]
    got = _gen(eng, [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                             repetition_penalty=100.0, presence_penalty=2.0))[0]
    assert len(set(got)) == len(got)


def test_logit_bias_forces_and_forbids(eng):
    prompt = _prompts(1, seed=6)[0]
    plain = _gen(eng, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    forced = _gen(eng, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                logit_bias={150: 100}))[0]
    assert forced == [150] * 10
    banned = _gen(eng, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                logit_bias={t: -100 for t in set(plain)}))[0]
    assert not set(banned) & set(plain)


def test_min_tokens_holds_back_stop_ids_and_stop_strings(llm, eng):
    prompt = _prompts(1, seed=7)[0]
    plain = _gen(eng, [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = plain[1]                         # ends the unconstrained request at its second token
    p = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop], min_tokens=6)
    got = _gen(eng, [prompt], p)[0]
    assert len(got) >= 6 and stop not in got[:5]
    assert got == _replay(llm, prompt, p, stop_ids=[stop])
    assert _gen(eng, [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0] == plain[:2]
    # a stop string completed before min_tokens does not end the request
    text = eng.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3, temperature=0,
                                                                       ignore_eos=True))[0].text
    assert text

    def run(**kw):
        return eng.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0,
                                                                           ignore_eos=True, stop=[text], **kw))[0]
    o = run()
    assert o.finish_reason == "stop" and len(o.token_ids) < 5
    o = run(min_tokens=5)
    assert len(o.token_ids) >= 5 and o.token_ids == plain[:len(o.token_ids)]


def test_min_tokens_holds_back_every_stop_id(llm, eng):
    """More stop ids than the steps' static width (EngineConfig.max_stop_ids, which the device stops
    at): min_tokens masks every one, and the request ends at the last of them after min_tokens."""
    prompt = _prompts(1, seed=7)[0]
    plain = _gen(eng, [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    V = llm.config.vocab_size
    stops = [t for t in range(V - 1, 0, -1) if t not in plain][:eng.config.max_stop_ids] + [plain[1]]
    p = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=stops, min_tokens=6)
    got = _gen(eng, [prompt], p)
    eos = [t for t in eng.runner.eos_ids if t < V]      # (the byte tokenizer's EOS may lie past this vocabulary)
    assert got[0] == _replay(llm, prompt, p, stop_ids=stops + eos)
    assert plain[1] not in got[0][:5] and len(got[0]) >= 6


def test_min_p_keeps_only_likely_tokens(eng):
    """Sampled at temperature 2: each token's probability at that temperature is at least min_p x the
    most likely's (logprobs are the model's own distribution, as vLLM returns them)."""
    prompt = _prompts(1, seed=8)[0]
    T, m = 1.0, 0.8

    def ratios(min_p):
        o = eng.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=40, temperature=T, seed=3,
                                                                        min_p=min_p, logprobs=1, ignore_eos=True))[0]
        return np.asarray([(d["logprob"] - d["top"][0][1]) / T for d in o.logprobs])
    assert np.all(ratios(m) >= np.log(m) - 1e-4)
    assert np.any(ratios(0.0) < np.log(m))         # the filter did something


def test_a_mixed_batch_gives_what_each_gives_alone(llm):
    eng = _engine(llm)
    ps = _prompts(4, seed=9)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=2.0),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True, presence_penalty=1.0, min_p=0.1),
              SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True)]
    together = _gen(eng, ps, params)
    alone = [_gen(eng, [x], p)[0] for x, p in zip(ps, params)]
    assert together == alone


def test_preemption_and_prefix_hits_keep_the_counts(llm):
    """A penalised request recomputed after preemption, or resumed from the prefix cache, gives the
    tokens of one that ran uninterrupted on a fresh engine."""
    ps = _prompts(6, seed=10, lo=40, hi=60)
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.5)
    ref = _engine(llm)
    want = [_gen(ref, [x], p)[0] for x in ps]
    eng = _engine(llm, enable_prefix_caching=True, prefix_block_size=16, prefix_checkpoint_interval=1)
    bm, held = eng.blocks, {}
    for name, g in bm.groups.items():        # pages for about two and a half requests at full length
        if g.paged:
            keep = int(2.5 * 85 / g.page_tokens) + 1
            held[name] = [bm.alloc_unit(name) for _ in range(bm.free_units(name) - keep)]
    try:
        got = _gen(eng, ps + ps[:2], [p] * 8)
    finally:
        for name, pages in held.items():
            for x in pages:
                bm.release(name, x)
    assert eng.metrics.preemptions._value.get() > 0
    assert eng.cache_stats()["tokens_reused"] > 0
    assert got == want + want[:2]


def test_no_programs_compiled_after_warmup_with_processors(llm):
    eng = _engine(llm, max_num_seqs=2, max_num_batched_tokens=8, warmup="minimal")
    eng.warmup()
    n0 = eng.num_compiled()
    ps = _prompts(3, seed=11)
    _gen(eng, ps, [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, presence_penalty=1.0,
                                  logit_bias={3: 1.0}, min_tokens=2),
                   SamplingParams(max_tokens=9, temperature=0.7, seed=1, min_p=0.2, ignore_eos=True),
                   SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)])
    assert eng.num_compiled() == n0


def test_the_steps_update_the_counts_in_place(eng):
    """The rows' state ([max_num_seqs + 1, V] counts) is donated to the mixed and decode programs: they
    update it in place, no copy of it per step (a step that kept its input copied it whole)."""
    runner = eng.runner
    counts = runner.slot_last.procs.counts
    assert counts.shape[0] == 5             # no batch bucket (1, 2, 4, ...) has this many rows
    B, z, off = 2, np.zeros((2,), np.int32), SamplerFlags(False, False, False)
    r = runner.inputs.rows([], B)
    decode = runner._decode.lower(runner.params, runner.cache, runner.slot_last, r, z, z.astype(bool),
                                  np.full((B, 8), -1, np.int32), z + 8, None, None, steps=4, flags=off, top_n=0)
    mixed = runner._mixed.lower(runner.params, runner.cache, runner.slot_last, r, z.astype(bool),
                                np.zeros((B, 8), np.int32), z, z.astype(bool), None, None, flags=off, top_n=0,
                                targets=np.full((B, 8), -1, np.int32), prompt_n=prompt_width([], 64))
    for lowered in (decode, mixed):
        assert cache_materializations(lowered.compile().as_text(), [], whole_only=[counts]) == []


def test_refused_with_speculative_decoding(llm):
    eng = _engine(llm, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    for kw, name in [(dict(presence_penalty=1.0), "presence_penalty"), (dict(min_p=0.1), "min_p"),
                     (dict(logit_bias={1: 1.0}), "logit_bias"), (dict(min_tokens=1), "min_tokens")]:
        with pytest.raises(InputError, match=f"'{name}' is not supported with speculative decoding"):
            eng.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(**kw))
