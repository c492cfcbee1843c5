"""The offline API: prompt forms, batching, sampling parameters, seeds, stop conditions."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, dtype="float32", max_num_seqs=4)


@pytest.fixture(scope="module")
def default_llm():
    return LLM()


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, 211, n).tolist()


def test_batched_prompts_of_different_lengths_equal_one_at_a_time(llm):
    prompts = [{"prompt_token_ids": _ids(n, n)} for n in (3, 17, 40, 9, 64, 1)]
    sp = SamplingParams(max_tokens=12, temperature=0)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_outputs_keep_prompt_order_and_fields(llm):
    prompts = [{"prompt_token_ids": _ids(n, n)} for n in (30, 2, 11)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0))
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    p = {"prompt_token_ids": _ids(8, 1)}
    a = llm.generate(p, SamplingParams(max_tokens=16, temperature=1.0, seed=5))[0].outputs[0].token_ids
    b = llm.generate(p, SamplingParams(max_tokens=16, temperature=1.0, seed=5))[0].outputs[0].token_ids
    c = llm.generate(p, SamplingParams(max_tokens=16, temperature=1.0, seed=6))[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_top_k_1_is_greedy(llm):
    p = {"prompt_token_ids": _ids(8, 2)}
    greedy = llm.generate(p, SamplingParams(max_tokens=10, temperature=0))[0].outputs[0].token_ids
    k1 = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3))[0].outputs[0].token_ids
    tiny_p = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=3))[0].outputs[0].token_ids
    assert k1 == greedy
    assert tiny_p == greedy


def test_mixed_sampling_params_in_one_batch(llm):
    ps = [{"prompt_token_ids": _ids(6, i)} for i in range(3)]
    sps = [SamplingParams(max_tokens=5, temperature=0), SamplingParams(max_tokens=9, temperature=0.7, seed=1),
           SamplingParams(max_tokens=2, temperature=0)]
    outs = llm.generate(ps, sps)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 9, 2]
    assert outs[0].outputs[0].token_ids == llm.generate(ps[0], sps[0])[0].outputs[0].token_ids


def test_stop_token_ids_end_generation(llm):
    p = {"prompt_token_ids": _ids(8, 4)}
    free = llm.generate(p, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].token_ids
    stop = free[5]
    first = free.index(stop)
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == free[:first + 1]
    assert out.finish_reason == "stop"


def test_default_model_generates_text_and_stops_at_max_tokens(default_llm):
    out = default_llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == default_llm.tokenizer.encode("Hello")
    assert len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].text == default_llm.tokenizer.decode(out.outputs[0].token_ids)


def test_default_model_is_deterministic():
    a = LLM().generate("abc", SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    b = LLM().generate("abc", SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    assert a == b


def test_string_prompt_without_tokenizer_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=2))


def test_speculative_config_runs_through_llm_and_keeps_greedy_output(llm, tiny_checkpoint):
    """LLM(speculative_config=...) speculates in its engine (the counters move) and keeps the greedy
    tokens; the exactness tests, on-device loop and verify step, are in test_speculative.py (the
    verify step here: it compiles in less than half the time of the on-device loop)."""
    from hybrid_jax.errors import InputError  # noqa: PLC0415
    spec = LLM(model=tiny_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "dynamic_k": False, "device_loop": False})
    prompts = [{"prompt_token_ids": _ids(24, s) * 3} for s in (1, 2)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == \
           [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    st = spec.spec_stats()
    assert st["enabled"] and st["row_verifies"] + st["fallback_chunks"] > 0 and st["draft_time_s"] > 0
    assert llm.spec_stats() == {"enabled": False}
    with pytest.raises(InputError, match="num_speculative_tokens|method"):
        LLM(model=tiny_checkpoint, speculative_config={"method": "nonsense"})


def test_compiled_empty_cache_equals_new_cache_and_is_fresh_each_call(llm):
    """empty_cache (the per-request allocation) builds what the model's new_cache builds, and a new
    set of buffers every call: requests donate their caches, so two may never share one."""
    import jax  # noqa: PLC0415
    from hybrid_jax.models import empty_cache, get_model  # noqa: PLC0415
    cfg = llm.config
    ref = get_model(cfg.model_type).new_cache(cfg, 2, 48, llm.dtype)
    a, b = empty_cache(cfg, 2, 48, llm.dtype), empty_cache(cfg, 2, 48, llm.dtype)
    ra, ta = jax.tree_util.tree_flatten(a)
    rr, tr = jax.tree_util.tree_flatten(ref)
    assert ta == tr
    for x, y in zip(ra, rr):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(ra, jax.tree_util.tree_leaves(b)):
        assert x.unsafe_buffer_pointer() != y.unsafe_buffer_pointer()
