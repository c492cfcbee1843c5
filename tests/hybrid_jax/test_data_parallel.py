"""The data-parallel engine's front (hybrid_jax.engine.data_parallel): routing, request ownership and
the shared figures, with two replicas on this process's one device (the routing and stepping are the
same whatever devices the replicas hold). Replicas on their own devices, against one device, are in
test_parallel.py (8 CPU devices in a subprocess)."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.data_parallel import DataParallelEngine
from hybrid_jax.errors import ConfigError, InputError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint)


def _config(**kw):
    return EngineConfig(**{**dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  compilation_cache_dir=None, warmup="none"), **kw})


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, 211, int(k)).tolist()} for k in rng.integers(5, 40, n)]


def test_replicas_share_the_requests_and_answer_as_one_engine(llm):
    """Five prompts over two replicas: three and two (the least busy takes each), the greedy tokens
    of one engine, every request's counts in the one shared registry."""
    prompts = _prompts(5)
    one = [o.token_ids for o in LLMEngine(llm, _config()).generate(prompts, GREEDY)]
    dp = DataParallelEngine([llm, llm], _config())
    got = dp.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == one
    assert dp.routed == [3, 2]
    assert not dp.has_unfinished() and dp.requests == {}
    assert dp.metrics.registry.get_sample_value("hybrid_jax_requests_finished_total") == 5
    assert dp.metrics is dp.replicas[0].metrics is dp.replicas[1].metrics


def test_a_prompt_goes_where_its_prefix_is_cached_unless_that_replica_is_too_busy(llm):
    """Replica 0 caches a system prompt's prefix; with replica 0 one request busier, a prompt that
    extends the system prompt still goes to replica 0 (the hit), an unrelated one to replica 1; past
    max_imbalance the hit yields to the load."""
    system = np.random.default_rng(3).integers(0, 211, 130).tolist()
    dp = DataParallelEngine([llm, llm], _config(enable_prefix_caching=True, prefix_block_size=16,
                                                prefix_checkpoint_interval=1), max_imbalance=1)
    dp.generate([{"prompt_token_ids": system + [7, 8]}], GREEDY)
    assert dp.routed == [1, 0]
    dp.add_request("busy", {"prompt_token_ids": [1, 2, 3]}, GREEDY)                 # loads: 1, 0
    assert dp.route(system + [9, 10, 11]) == 0
    assert dp.route([5, 6, 7, 8]) == 1
    dp.add_request("busier", {"prompt_token_ids": [4, 5, 6]}, GREEDY)               # least busy: 1 -> loads 1, 1
    dp.add_request("busiest", {"prompt_token_ids": [6, 5, 4]}, GREEDY)              # tie: 0 -> loads 2, 1
    dp.add_request("more", {"prompt_token_ids": [9, 9, 9]}, GREEDY)                 # 1 -> loads 2, 2
    dp.add_request("again", {"prompt_token_ids": [8, 8, 8]}, GREEDY)                # 0 -> loads 3, 2
    assert dp.route(system + [9, 10, 11]) == 0                                      # 3 - 2 <= 1
    dp.replicas[0].add_request("direct", {"prompt_token_ids": [3, 3, 3]}, GREEDY)   # loads 4, 2
    assert dp.route(system + [9, 10, 11]) == 1
    dp.abort_all()
    assert not dp.has_unfinished()


def test_ids_are_unique_across_replicas_and_aborts_reach_the_owner(llm):
    dp = DataParallelEngine([llm, llm], _config())
    dp.add_request("a", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    dp.add_request("b", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(InputError, match="request id 'a' is already in use"):
        dp.add_request("a", {"prompt_token_ids": [4]}, GREEDY)
    assert set(dp.replicas[1].requests) == {"b"}
    dp.abort_request("b")
    assert dp.replicas[1].requests == {} and set(dp.requests) == {"a"}
    dp.abort_request("a")
    assert not dp.has_unfinished()
    dp.close()


def test_a_disk_tier_is_refused_and_one_replica_is_not_data_parallel(llm, tmp_path):
    with pytest.raises(ConfigError, match="kv_cache_dir is not supported with data_parallel_size > 1"):
        DataParallelEngine([llm, llm], _config(enable_prefix_caching=True, kv_cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="two or more replicas"):
        DataParallelEngine([llm], _config())
