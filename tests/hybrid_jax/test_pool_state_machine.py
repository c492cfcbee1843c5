"""Pages and units are never leaked: a hypothesis state machine drives one engine (paged pools, prefix
caching with a disk tier, a pool small enough to preempt) through admissions, steps, finishes, aborts,
prefix hits, evictions and offloads, and after every rule checks the block manager against what holds
its units: every page's reference count is the number of block tables listing it plus one if the
prefix store holds it, the free lists hold exactly the units nobody references, the store stays under
its byte cap, and every running request's pages cover the tokens it has computed. When the machine
stops, finishing every request leaves only the store's units in use, and dropping the store none.
Prefix blocks of 32 tokens on a resume grid of 16 make hits that end inside a page, whose page the
request then writes: copy-on-write under preemption. No step may fail (reserve before you schedule)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

VOCAB = 211


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    llm = LLM(model=tiny_checkpoint, max_model_len=160)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=160, compilation_cache_dir=None,
               warmup="none", enable_prefix_caching=True, prefix_block_size=32, prefix_checkpoint_interval=2,
               prefix_cache_bytes=60_000, kv_cache_dir=str(tmp_path_factory.mktemp("kv")))
    probe = LLMEngine(llm, EngineConfig(**cfg))
    rows = 5 * sum(g.row_nbytes() for g in probe.runner.abstract.groups.values())
    # pages for about 1.6 requests of 160 tokens beside rows for 4: preemption happens
    cfg["kv_cache_bytes"] = rows + (probe.runner.budget_bytes - rows) * 4 // 10
    return LLMEngine(llm, EngineConfig(**cfg))


def check_units(eng):
    """Every unit's count = block tables listing it + the store's hold; free lists exact; cap kept."""
    bm, pc = eng.blocks, eng.prefix
    bm.check()
    held = {}
    for g, u in pc.store.units.values():
        held[(g, u)] = held.get((g, u), 0) + 1
    assert all(n == 1 for n in held.values()), "the store holds a unit twice"
    for name, geo in bm.groups.items():
        for u in range(geo.first_unit, geo.first_unit + geo.num_units):
            listed = sum(t[name].count(u) for t in bm.tables.values()) if geo.paged else 0
            assert bm.refcount(name, u) == listed + held.get((name, u), 0), (name, u)
    assert pc.alloc.device_weighted_bytes <= pc.config.cap_bytes
    for q in eng.scheduler.running:
        for name, geo in bm.groups.items():
            if geo.paged:
                assert len(bm.table(q.request_id, name)) >= geo.pages_for(q.num_computed), (q.request_id, name)
    rows = [q.slot for q in eng.scheduler.running]
    assert len(set(rows)) == len(rows) and all(r is not None for r in rows)


def _machine(eng, seen):
    rng = np.random.default_rng(0)
    # 85 tokens: past the checkpoints at 32 and 64, so a request branching off it publishes at 80
    families = [rng.integers(0, VOCAB, n).tolist() for n in (40, 85)]

    class PoolMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.n = 0

        @rule(fam=st.integers(0, 2), extra=st.integers(1, 75), max_tokens=st.integers(1, 12), seed=st.integers(0, 99))
        def add(self, fam, extra, max_tokens, seed):
            r = np.random.default_rng(seed)
            head = families[fam] if fam < 2 else []
            ids = head + r.integers(0, VOCAB, extra).tolist()
            max_tokens = min(max_tokens, 160 - len(ids))
            self.n += 1
            eng.add_request(f"r{self.n}", {"prompt_token_ids": ids},
                            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

        @precondition(lambda self: eng.has_unfinished())
        @rule(times=st.integers(1, 4))
        def step(self, times):
            for _ in range(times):
                eng.step()

        @precondition(lambda self: bool(eng.requests))
        @rule(pick=st.integers(0, 100))
        def abort(self, pick):
            ids = sorted(eng.requests)
            eng.abort_request(ids[pick % len(ids)])

        @rule(group=st.sampled_from(["full_attention", "linear_attention"]), n=st.integers(1, 3))
        def evict(self, group, n):
            eng.flush_publishes()
            eng.prefix.reclaim(group, n)

        @rule()
        def offload(self):
            """Everything the store holds alone leaves the device (to disk where a span holds it)."""
            eng.flush_publishes()
            eng.prefix.disk.flush()
            for g in ("full_attention", "linear_attention"):
                eng.prefix.reclaim(g, 1000)

        @invariant()
        def units_add_up(self):
            check_units(eng)

        @invariant()
        def no_step_failed(self):
            """Reserve before you schedule: a step never fails (for want of a page, a copy-on-write's
            included), so the pools and the prefix store are never rebuilt."""
            failed = {k: eng.metrics.step_failures.labels(attributable=k)._value.get() for k in ("true", "false")}
            assert failed == {"true": 0, "false": 0}, failed

        def teardown(self):
            while eng.has_unfinished():
                eng.step()
            eng.flush_publishes()
            check_units(eng)
            assert not eng.blocks.tables and eng.blocks.free_rows() == eng.blocks.num_rows
            store = {(g, u) for g, u in eng.prefix.store.units.values()}
            for name, geo in eng.blocks.groups.items():
                in_use = {(name, u) for u in range(geo.first_unit, geo.first_unit + geo.num_units)
                          if eng.blocks.refcount(name, u)}
                assert in_use <= store, f"{name}: units in use with no request and not in the store"
            st = eng.cache_stats()
            for k in ("passes", "reclaimed", "offloads", "evictions", "branch_points"):
                seen[k] = seen.get(k, 0) + st[k]
            seen["decode_publishes"] = st["decode_publishes"]     # the engine's count, not the store's
            seen["copies_on_write"] = eng.blocks.copies_on_write
            eng.reset_prefix_cache()
            for name in eng.blocks.groups:
                assert eng.blocks.used_units(name) == 0, name
    return PoolMachine


def test_pages_are_never_leaked(engine):
    seen: dict[str, int] = {}
    preempted = engine.metrics.preemptions._value.get()
    machine = _machine(engine, seen)
    machine.TestCase.settings = settings(max_examples=8, stateful_step_count=30, deadline=None, derandomize=True,
                                         suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()
    # the machine went where it says it goes: hits, preemptions, the store letting go of units
    assert seen["passes"] > 0 and seen["reclaimed"] + seen["offloads"] > 0, seen
    assert seen["branch_points"] > 0 and seen["decode_publishes"] > 0 and seen["copies_on_write"] > 0, seen
    assert engine.metrics.preemptions._value.get() > preempted
