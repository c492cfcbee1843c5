"""Reserve before you schedule (issue: copy-on-write ran out of pages under ordinary load): the
shipped default model, prefix caching on, a KV budget of 22 pages of 64 tokens for 10 concurrent
prompts of 150-300 words (the issue's 4.1 MB held 33: with admission's headroom nothing is preempted
there in 120 tokens). Publishes while decoding share a request's last page with the prefix store, so
nearly every decode step past a grid point writes a shared page and needs a private copy; the
pool is so small that those copies compete with growth and preemption. Every step's pages, its
copies included, are taken when it is scheduled, so no step fails (the engine's step-failure
counter, which counted a reset of the pools and the prefix store per failure, stays 0) and the
greedy tokens equal those of an engine without prefix caching and with room for every request."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

SP = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    import os  # noqa: PLC0415
    words = open(os.path.join(os.path.dirname(__file__), "..", "data", "kjv_heldout.txt")).read().split()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(10):
        n = int(rng.integers(150, 300))
        s = int(rng.integers(0, len(words) - n))
        out.append(" ".join(words[s:s + n]))
    return out


def test_copy_on_write_never_runs_dry_under_load(prompts):
    llm = LLM()
    tight = LLMEngine(llm, EngineConfig(max_num_seqs=8, max_model_len=1024, kv_cache_bytes=3_400_000,
                                        enable_prefix_caching=True, warmup="none", compilation_cache_dir=None))
    outs = tight.generate(prompts, SP)
    failed = {k: tight.metrics.step_failures.labels(attributable=k)._value.get() for k in ("true", "false")}
    assert failed == {"true": 0, "false": 0}, failed
    # it went where the issue went: shared pages written (copies), pools short (preemption)
    assert tight.blocks.copies_on_write > 20 and tight.metrics.preemptions._value.get() > 0
    assert tight.cache_stats()["passes"] > 0
    roomy = LLMEngine(llm, EngineConfig(max_num_seqs=10, max_model_len=1024, warmup="none", compilation_cache_dir=None))
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(prompts, SP)]
