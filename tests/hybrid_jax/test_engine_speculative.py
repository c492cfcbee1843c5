"""Speculative decoding in the continuous-batching engine (n-gram and draft-model drafts): greedy
output equal to plain decoding for both rollbacks while requests join and leave, verify steps
really run (and mostly reject on untrained models, which exercises the rollback), stats, metrics."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.errors import InputError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, max_model_len=256)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 211, int(k)).tolist() * 3 for k in rng.integers(5, 20, n)]


@pytest.mark.parametrize("rollback", ["selection", "replay"])
def test_engine_speculation_keeps_greedy_output(llm, rollback):
    prompts = _prompts(4)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    # decode_steps=1: every decode step asks the drafter (an untrained model rarely repeats itself)
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, decode_steps=1,
                                      compilation_cache_dir=None, warmup="none", speculative_config={
                                          "method": "ngram", "num_speculative_tokens": 3, "dynamic_k": False,
                                          "rollback": rollback}))
    got = [o.token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == want
    st = eng.spec_stats()
    assert st["enabled"] and st["verify_steps"] > 0 and st["row_verifies"] > 0
    assert st["accepted_tokens"] <= st["draft_tokens"]
    assert "hybrid_jax_spec_decode_acceptance_rate" in eng.metrics.render().decode()


def test_plain_chunks_of_short_requests_compile_only_the_width_they_fill(llm, tiny_checkpoint):
    """Offline n-gram speculation that finds no drafts decodes in plain chunks of up to 32 x fallback_steps
    iterations (at once when every prompt is cold for prompt lookup): for requests of 10 tokens the decode
    program is compiled 16 iterations wide, not 128 (each width is a whole-model compile), and the tokens
    are plain greedy decoding's."""
    rng = np.random.default_rng(11)
    prompts = [{"prompt_token_ids": rng.permutation(211)[:n].tolist()} for n in (9, 14)]    # nothing repeats
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)         # the host path
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    spec = LLM(model=tiny_checkpoint, max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "fallback_steps": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == want
    st = spec.engine.spec_stats()
    assert st["verify_steps"] == 0 and st["fallback_chunks"] >= 1
    widths = [dict(k.statics)["steps"] for k in spec.engine.runner.compiler.table.keys() if k.kind == "decode"]
    assert widths == [16]


def test_engine_draft_model_keeps_greedy_output(llm, tiny_checkpoint, checkpoints):
    """A draft model (another tiny checkpoint of the same vocabulary) drafts on device from cache rows
    kept in step with the target's; greedy output equals plain decoding."""
    prompts = _prompts(4, seed=3)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    eng = LLMEngine(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, decode_steps=2,
                                      compilation_cache_dir=None, warmup="none", speculative_config={
                                          "method": "draft_model", "model": checkpoints["all_linear_dense"],
                                          "num_speculative_tokens": 2, "dynamic_k": False}))
    assert [o.token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sp)] == want
    st = eng.spec_stats()
    assert st["verify_steps"] > 0 and st["draft_tokens"] > 0


def test_engine_speculation_rejects_bad_configs(llm, tmp_path):
    with pytest.raises(InputError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram"})
    with pytest.raises(InputError, match="checkpoint"):
        EngineConfig(speculative_config={"method": "draft_model", "model": str(tmp_path / "none"),
                                         "num_speculative_tokens": 2})


def test_engine_ngram_request_is_warm_started_from_its_prompt_tail():
    """A request whose prompt quotes itself drafts a full K at its first step, where the prior
    acceptance rate alone would draft nothing yet."""
    from types import SimpleNamespace  # noqa: PLC0415

    from hybrid_jax.engine.speculate import EngineSpeculator  # noqa: PLC0415
    walk = np.random.default_rng(0).permutation(200)[:40].tolist()
    q = SimpleNamespace(request_id="quote", all_ids=walk + walk[:20], remaining_tokens=50, params=SamplingParams(),
                        grammar=None, masked=False)
    sp = EngineSpeculator({"method": "ngram", "num_speculative_tokens": 8}, target_vocab=211, groups={})
    drafts, shadows = sp.plan([q])
    assert drafts[0].tolist() == walk[20:28] == shadows[0].tolist()
    fresh = EngineSpeculator({"method": "ngram", "num_speculative_tokens": 8}, target_vocab=211, groups={})
    assert fresh._tracker("quote").next_k(0, 8, fresh.spec.draft_cost) == 0     # no prompt seen: the prior
