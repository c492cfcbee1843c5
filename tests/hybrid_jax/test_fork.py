"""`n` > 1 by forking (engine/fork.py): the k requests of one ForkGroup prefill their prompt once, then
fork: each member gets its own row (a copy of the leader's recurrent state and conv windows) and shares
the leader's pages by reference. Greedy members equal one greedy request; seeded members equal the same
seeds sent ungrouped; the prompt is prefilled P - 1 + k tokens, not k * P; aborts of the leader or a
member, preemption under a small pool and the prefix cache fall back without a page leak."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import greedy_reference
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.fork import fork_plans
from hybrid_jax.engine.request import ForkGroup
from hybrid_jax.errors import InputError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint)


@pytest.fixture(scope="module")
def eng(llm):
    return _engine(llm)


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
               compilation_cache_dir=None, warmup="none")
    cfg.update(kw)
    return LLMEngine(llm, EngineConfig(**cfg))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 211, n).tolist()


def _add_group(eng, gid, prompt, k, params, seeds=None):
    """The k requests of one group, the leader first; returns their ids."""
    ids = [f"{gid}-{i}" for i in range(k)]
    for i, rid in enumerate(ids):
        sp = params if seeds is None else SamplingParams(**{**params.__dict__, "seed": seeds[i]})
        eng.add_request(rid, {"prompt_token_ids": prompt}, sp, group=ForkGroup(gid, i, k))
    return ids


def _run(eng, ids):
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    eng.flush_publishes()
    return [final[rid].token_ids for rid in ids]


def _idle(eng):
    eng.blocks.check()
    assert not eng.blocks.tables and not eng.scheduler.running and not eng.scheduler.waiting
    assert not eng.scheduler.forks._groups and not eng.scheduler.forks._member_of
    if eng.prefix is None:
        assert all(eng.blocks.used_units(g) == 0 for g in eng.blocks.groups)


def test_greedy_group_prefills_once_and_equals_one_request(llm, eng):
    prompt = _prompt(45)
    alone = eng.generate([{"prompt_token_ids": prompt}], GREEDY)[0].token_ids
    assert alone == greedy_reference(llm, prompt, 8)
    k, before, forked = 4, eng.metrics.prompt_tokens._value.get(), eng.scheduler.forks.forked
    ids = _add_group(eng, "g", prompt, k, GREEDY)
    assert _run(eng, ids) == [alone] * k
    assert eng.metrics.prompt_tokens._value.get() - before == len(prompt) - 1 + k     # not k * P
    assert eng.scheduler.forks.forked - forked == k - 1
    _idle(eng)


def test_members_share_the_leaders_pages_after_the_fork(eng):
    prompt, k = _prompt(150, seed=1), 4           # 149 tokens: two full pages of 64 and a partial one
    ids = _add_group(eng, "pages", prompt, k, GREEDY)
    bm, seen = eng.blocks, False
    while eng.has_unfinished():
        eng.step()
        reqs = [eng.requests.get(r) for r in ids]
        if not seen and all(q is not None and q.slot is not None and q.num_computed >= len(prompt) for q in reqs):
            seen = True
            for name, g in bm.groups.items():
                if not g.paged:
                    continue
                tables = [bm.table(r, name) for r in ids]
                full = (len(prompt) - 1) // g.page_tokens
                assert full >= 1
                for i in range(full):           # the leader's full pages: one page, k references
                    assert len({t[i] for t in tables}) == 1 and bm.refcount(name, tables[0][i]) == k
                # each writes its own copy of the partial last page: k private pages, not k * pages
                assert len({t[full] for t in tables}) == k
                assert bm.used_units(name) == full + k + sum(len(t) - full - 1 for t in tables)
    assert seen
    eng.flush_publishes()
    _idle(eng)


def test_seeded_members_equal_the_same_seeds_ungrouped(eng):
    prompt, k = _prompt(37, seed=2), 4
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95)
    seeds = [100 + i for i in range(k)]
    grouped = _run(eng, _add_group(eng, "seeded", prompt, k, sp, seeds))
    single = [eng.generate([{"prompt_token_ids": prompt}], SamplingParams(**{**sp.__dict__, "seed": s}))[0].token_ids
              for s in seeds]
    assert grouped == single
    assert len({tuple(t) for t in grouped}) > 1        # the seeds do differ: forked rows sample apart
    _idle(eng)


def test_forked_members_with_logits_processors_equal_them_ungrouped(eng):
    """A forked member's row is placed by the fork, not by admission: its processors' state (the
    prompt's tokens for the repetition penalty, the counts) is seeded all the same."""
    prompt, k = _prompt(41, seed=7), 3
    prompt[5:15] = prompt[20:30] = list(range(40, 50))       # repeated tokens: the penalties have work
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                        presence_penalty=0.7, frequency_penalty=0.4, logit_bias={3: 2.5})
    forked = eng.scheduler.forks.forked
    grouped = _run(eng, _add_group(eng, "procs", prompt, k, sp))
    assert eng.scheduler.forks.forked - forked == k - 1
    single = eng.generate([{"prompt_token_ids": prompt}], sp)[0].token_ids
    plain = eng.generate([{"prompt_token_ids": prompt}], GREEDY)[0].token_ids
    assert grouped == [single] * k and single[:8] != plain          # the processors took effect
    _idle(eng)


def test_aborts_of_the_leader_and_of_members(llm, eng):
    prompt, k = _prompt(90, seed=3), 4             # a 32-token budget: the leader prefills over 3 steps
    ref = greedy_reference(llm, prompt, 8)
    # the leader aborted mid-prefill: its members run as ordinary requests
    ids = _add_group(eng, "al", prompt, k, GREEDY)
    eng.step()
    assert [eng.requests[r].slot is None for r in ids[1:]] == [True] * (k - 1)   # waiting for the fork
    eng.abort_request(ids[0])
    assert _run(eng, ids[1:]) == [ref] * (k - 1)
    _idle(eng)
    # a member aborted before the fork, another after it
    ids = _add_group(eng, "am", prompt, k, GREEDY)
    eng.step()
    eng.abort_request(ids[1])
    while eng.requests[ids[2]].slot is None:
        eng.step()
    eng.abort_request(ids[2])
    assert _run(eng, [ids[0], ids[3]]) == [ref] * 2
    _idle(eng)


def test_preemption_under_a_small_pool_stays_exact(llm, tiny_checkpoint):
    probe = _engine(llm, max_num_seqs=4)
    rows = 5 * sum(g.row_nbytes() for g in probe.runner.abstract.groups.values())
    eng = _engine(llm, max_num_seqs=4, kv_cache_bytes=rows + (probe.runner.budget_bytes - rows) * 4 // 10)
    # six pages of 64 tokens: the forked members (a shared first page, private ones after it) and
    # `other` outgrow them while decoding 60 tokens, so the newest rows are preempted and recompute
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompt, other = _prompt(70, seed=4), _prompt(80, seed=5)
    eng.add_request("other", {"prompt_token_ids": other}, sp)
    ids = _add_group(eng, "pre", prompt, 3, sp)
    members = [eng.requests[r] for r in ids[1:]]
    outs = _run(eng, ["other"] + ids)
    assert eng.scheduler.forks.forked == 2
    assert sum(q.num_preemptions for q in members) > 0          # a forked member was preempted
    ref = greedy_reference(llm, prompt, 60)
    assert outs[1:] == [ref] * 3 and outs[0] == greedy_reference(llm, other, 60)
    _idle(eng)


def test_with_the_prefix_cache_members_fork_from_a_leader_that_hit(llm):
    eng = _engine(llm, enable_prefix_caching=True, prefix_block_size=32, prefix_checkpoint_interval=2)
    prompt = _prompt(100, seed=6)
    first = eng.generate([{"prompt_token_ids": prompt}], GREEDY)[0].token_ids
    before, hits = eng.metrics.prompt_tokens._value.get(), eng.metrics.prefix_hits._value.get()
    ids = _add_group(eng, "pc", prompt, 3, GREEDY)
    assert _run(eng, ids) == [first] * 3
    assert eng.metrics.prefix_hits._value.get() > hits
    assert eng.metrics.prompt_tokens._value.get() - before < len(prompt)      # hit, then forked
    eng.blocks.check()
    assert not eng.scheduler.running and not eng.scheduler.forks._groups


def test_fallbacks_and_refusals(eng):
    # a prompt of one token: no fork, every member computes its own
    ids = _add_group(eng, "one", [5], 3, GREEDY)
    assert len({tuple(t) for t in _run(eng, ids)}) == 1
    _idle(eng)
    with pytest.raises(InputError, match="group"):
        ForkGroup("x", 3, 3)
    eng.add_request("d-0", {"prompt_token_ids": [1, 2, 3]}, GREEDY, group=ForkGroup("d", 0, 2))
    with pytest.raises(InputError, match="another prompt"):
        eng.add_request("d-1", {"prompt_token_ids": [1, 2, 4]}, GREEDY, group=ForkGroup("d", 1, 2))
    with pytest.raises(InputError, match="already has a leader"):
        eng.add_request("d-2", {"prompt_token_ids": [1, 2, 3]}, GREEDY, group=ForkGroup("d", 0, 2))
    assert "d-1" not in eng.requests and "d-2" not in eng.requests
    _run(eng, ["d-0"])
    _idle(eng)


def test_fork_plans_pad_to_fixed_width():
    plans = fork_plans([(0, 1), (0, 2), (0, 3)], 2)
    assert [p[0].tolist() for p in plans] == [[0, 0], [0, -1]] and [p[1].tolist() for p in plans] == [[1, 2], [3, -1]]


def test_forking_after_warmup_compiles_nothing_new(llm):
    eng = _engine(llm, max_num_seqs=4, max_num_batched_tokens=8, warmup="minimal")
    eng.warmup()
    n0, compiled = eng.num_compiled(), eng.runner._programs.compiled()
    prompt = _prompt(20, seed=7)
    ids = _add_group(eng, "warm", prompt, 3, GREEDY)
    assert _run(eng, ids) == [greedy_reference(llm, prompt, 8)] * 3
    assert eng.scheduler.forks.forked == 2
    assert eng.blocks.copies_on_write > 0               # the members wrote their copies of the shared page
    # (jit caches are shared by engines: counts, not their values, are what this engine may not change)
    assert eng.runner._programs.compiled() == compiled and eng.num_compiled() == n0


def test_members_arriving_a_step_after_their_leader_still_fork(llm, eng):
    prompt, k = _prompt(20, seed=8), 3             # one chunk would take the whole prompt
    forked = eng.scheduler.forks.forked
    eng.add_request("late-0", {"prompt_token_ids": prompt}, GREEDY, group=ForkGroup("late", 0, k))
    eng.step()                                     # the leader stops at P - 1: two members may still come
    assert eng.requests["late-0"].num_computed == len(prompt) - 1
    for i in range(1, k):
        eng.add_request(f"late-{i}", {"prompt_token_ids": prompt}, GREEDY, group=ForkGroup("late", i, k))
    assert _run(eng, [f"late-{i}" for i in range(k)]) == [greedy_reference(llm, prompt, 8)] * k
    assert eng.scheduler.forks.forked - forked == k - 1
    _idle(eng)


def test_the_server_fan_out_ids_name_the_group():
    assert ForkGroup.from_request_id("cmpl-7-p0#2/4") == ForkGroup("cmpl-7-p0", 2, 4)
    assert ForkGroup.from_request_id("a#b#0/2") == ForkGroup("a#b", 0, 2)
    for rid in ("plain", "a#0/1", "a#4/4", "a#1/", "#1/2", "a#-1/2"):
        assert ForkGroup.from_request_id(rid) is None, rid


def test_data_parallel_sends_members_where_their_leader_went(llm):
    from hybrid_jax.engine.data_parallel import DataParallelEngine
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                       compilation_cache_dir=None, warmup="none")
    dp = DataParallelEngine([llm, llm], cfg)
    prompt = _prompt(30, seed=9)
    dp.add_request("busy", {"prompt_token_ids": [1, 2, 3]}, GREEDY)     # replica 0: the next goes to 1
    ids = [f"cmpl-1-p0#{i}/3" for i in range(3)]
    for rid in ids:                                # the server's fan-out: no group argument, tagged ids
        dp.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    assert dp.routed == [1, 3]
    outs = {o.request_id: o.token_ids for o in _drain(dp)}
    assert [outs[r] for r in ids] == [greedy_reference(llm, prompt, 8)] * 3
    assert dp.replicas[1].scheduler.forks.forked == 2


def _drain(eng):
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    return done
