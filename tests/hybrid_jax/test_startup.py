"""Start-up (engine/startup.py, compile.py, program_table.py, program_store.py): the ready set covers
every step traffic can make, so after the warm-up no request waits on a compile, whether the smaller
buckets exist yet or not; a step run padded in a larger bucket gives the tokens its own bucket gives;
the program store gives a restart every program without tracing, and misses when what determines a
program changes."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine import program_store
from hybrid_jax.engine.program_table import ProgramKey, ProgramTable
from hybrid_jax.engine.startup import plan


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint)


def _engine(llm, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
               compilation_cache_dir=None, warmup="none")
    cfg.update(kw)
    return LLMEngine(llm, EngineConfig(**cfg))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 211, n).tolist()


# one request of each kind a step can be shaped by: lengths (one token, a chunked prompt, several rows of
# unequal and equal lengths), logprobs, prompt logprobs, sampling options and logits processors
TRAFFIC = [
    ({"prompt_token_ids": _prompt(1, 1)}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
    ({"prompt_token_ids": _prompt(70, 2)}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
    ({"prompt_token_ids": _prompt(9, 3)}, SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)),
    ({"prompt_token_ids": _prompt(9, 4)}, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2,
                                                         ignore_eos=True)),
    ({"prompt_token_ids": _prompt(20, 5)}, SamplingParams(max_tokens=7, temperature=0.8, top_k=5, top_p=0.9, seed=3,
                                                          ignore_eos=True)),
    ({"prompt_token_ids": _prompt(20, 6)}, SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.3,
                                                          logit_bias={7: 5.0}, ignore_eos=True)),
]


def _run(eng, traffic=TRAFFIC, waves=((0, 1), (2, 3, 4, 5), (0, 2), (1, 4))):
    """The traffic in waves of concurrent requests (so steps of 1, 2 and 4 rows, prefill beside decode)."""
    out = []
    for wave in waves:
        got = eng.generate([traffic[i][0] for i in wave], [traffic[i][1] for i in wave])
        out += [(o.token_ids, [round(lp["logprob"], 4) for lp in (o.logprobs or [])]) for o in got]
    return out


def test_program_key_covers_only_larger_buckets_of_its_kind_and_options():
    a = ProgramKey.of("ragged", (8, 256), top_n=20)
    assert a.covers(ProgramKey.of("ragged", (2, 32), top_n=20))
    assert not a.covers(ProgramKey.of("ragged", (16, 32), top_n=20))       # more rows than it has
    assert not a.covers(ProgramKey.of("ragged", (2, 32), top_n=151))       # other options: another program
    assert not a.covers(ProgramKey.of("mixed", (2, 32), top_n=20))
    t = ProgramTable()
    for shape in ((8, 256), (4, 32), (8, 32)):
        t.add(ProgramKey.of("ragged", shape), object())
    assert t.cover(ProgramKey.of("ragged", (2, 16))).shape == (4, 32)      # the least padded work
    assert t.cover(ProgramKey.of("ragged", (8, 64))).shape == (8, 256)
    assert t.cover(ProgramKey.of("ragged", (16, 8))) is None


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
def test_ready_set_alone_serves_every_kind_of_step_as_its_own_buckets_do(llm, ragged):
    """warmup="minimal" builds the ready set only: every step runs padded in one of its programs, nothing
    compiles after it, and the tokens (and log-probabilities) are those of engines whose steps each ran
    in their own bucket. padded: a family without a ragged step (the mixed step's chunk cap follows what
    is compiled)."""
    ref = _engine(llm)
    ref.runner.ragged = ragged
    want = _run(ref)
    eng = _engine(llm, warmup="minimal")
    eng.runner.ragged = ragged
    eng.warmup()
    ready = eng.startup.plan.ready
    assert eng.startup.plan.background == [] and eng.runner.num_compiled() == len(ready)
    assert plan(eng.runner, "all").background        # (buckets it does not have)
    got = _run(eng)
    assert eng.runner.compiler.stats.stalls == 0 and eng.runner.num_compiled() == len(ready)
    assert got == want
    assert set(ref.runner.compiler.table.keys()) - set(ready)     # (the reference ran buckets ready has not)


def test_requests_during_the_background_compiles_never_wait_on_one(llm):
    """warmup="all": ready after the ready set; the rest compiles on a thread while requests run (padded
    until their own bucket exists); none stalls, and the plan is complete afterwards."""
    eng = _engine(llm, warmup="all")
    eng.warmup()
    assert eng.startup.progress.phase in ("ready", "complete")
    _run(eng)
    assert eng.wait_compiled(timeout=600)
    assert eng.runner.compiler.stats.stalls == 0
    p = eng.startup.plan
    assert set(eng.runner.compiler.table.keys()) == set(p.ready) | set(p.background)
    assert eng.startup.progress.phase == "complete" and eng.startup.progress.done == len(p.ready) + len(p.background)
    # with every bucket compiled, a one-row decode runs in its own program
    assert eng.runner.cover(ProgramKey.of("decode", (1,), **dict(p.ready[0].statics))).shape == (1,)


def test_a_step_the_table_cannot_serve_is_a_counted_stall(llm):
    eng = _engine(llm, warmup="minimal")
    eng.warmup()
    n = eng.runner.num_compiled()
    eng.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2, logprobs=-1))    # a V-wide top-n
    assert eng.runner.compiler.stats.stalls >= 1 and eng.runner.num_compiled() > n
    assert eng.runner.compiler.table.by_source()["on_demand"] >= 1


def test_a_restart_reads_every_program_from_the_store_without_tracing(llm, tmp_path):
    first = _engine(llm, warmup="all", compilation_cache_dir=str(tmp_path))
    first.warmup(background=False)
    n = first.runner.num_compiled()
    assert first.runner.compiler.table.by_source() == {"compiled": n}
    want = _run(first)
    again = _engine(llm, warmup="all", compilation_cache_dir=str(tmp_path))
    again.warmup(background=False)
    st = again.runner.compiler.stats
    assert again.runner.compiler.table.by_source() == {"store": n}
    assert st.lower_s == 0 and st.compile_s == 0 and again.runner.compiler.store.hits == n
    assert _run(again) == want


def test_the_store_key_changes_with_what_determines_a_program(llm, tmp_path, monkeypatch):
    """Another engine shape (its pools' and rows' arrays), other code, another backend flag: a miss."""
    a = _engine(llm, warmup="minimal", compilation_cache_dir=str(tmp_path))
    a.warmup()
    files = set(tmp_path.joinpath("hybrid_jax_programs").iterdir())
    b = _engine(llm, warmup="minimal", compilation_cache_dir=str(tmp_path), max_model_len=128)
    b.warmup()
    t = b.runner.compiler.table                       # every pool is shorter: every program that takes them
    assert {k.kind for k in t.keys() if t.get(k).source == "store"} == {"seed", "masks"}    # (rows' state only)
    monkeypatch.setattr(program_store, "code_fingerprint", lambda: "other code")
    c = _engine(llm, warmup="minimal", compilation_cache_dir=str(tmp_path))
    c.warmup()
    assert c.runner.compiler.store.hits == 0
    monkeypatch.undo()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    key = program_store.store_key({"x": 1}, {"kind": "decode"})
    monkeypatch.delenv("XLA_FLAGS")
    assert program_store.store_key({"x": 1}, {"kind": "decode"}) != key
    assert files < set(tmp_path.joinpath("hybrid_jax_programs").iterdir())


def test_a_stored_program_that_cannot_run_is_discarded_and_compiled_again(llm, tmp_path):
    """XLA:CPU has loaded an executable from the store that then fails at run time (a function of it not
    found). At the call (NOT_FOUND): the call compiles the program afresh, runs, and the entry is replaced.
    Late, the call having been dispatched asynchronously (INTERNAL: "Error dispatching computation: Function
    ... not found" when the step's tokens are read): the step's requests are recomputed and the program
    leaves the store and the table (compiled afresh when a step needs it again; without the drop the
    retried step failed again and a request with it). Either way the tokens are right."""
    first = _engine(llm, warmup="minimal", compilation_cache_dir=str(tmp_path))
    first.warmup()
    want = _run(first, waves=((0, 1),))
    again = _engine(llm, warmup="minimal", compilation_cache_dir=str(tmp_path))
    again.warmup()
    table = again.runner.compiler.table
    key = next(k for k in table.keys() if k.kind == "decode")

    class Unloadable:
        def __call__(self, *a, **kw):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function negate_power_fusion not found (type id: 1)")

    table.get(key).executable = Unloadable()
    assert _run(again, waves=((0, 1),)) == want
    assert table.get(key).source == "on_demand" and again.runner.compiler.store.rejected == 1

    third = _engine(llm, warmup="minimal", compilation_cache_dir=str(tmp_path))     # the store holds it again
    third.warmup()
    table = third.runner.compiler.table
    late = key
    assert table.get(late).source == "store"

    class Unreadable:
        def is_ready(self):
            return True

        def __array__(self, *a, **kw):
            raise jax.errors.JaxRuntimeError("INTERNAL: Error dispatching computation: Function add_select_fusion.2 "
                                             "not found (type id: 1)")

    real = table.get(late).executable
    table.get(late).executable = lambda *a, **kw: (Unreadable(), *real(*a, **kw)[1:])
    assert _run(third, waves=((0, 1),)) == want
    assert third.runner.compiler.store.rejected == 1
    assert table.get(late) is None or table.get(late).source == "on_demand"


_CHILD = """
import json, sys
import numpy as np
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
eng = LLMEngine(LLM(model=sys.argv[1]), EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                                                   compilation_cache_dir=sys.argv[2], warmup="minimal"))
eng.warmup(background=False)
prompts = [{"prompt_token_ids": np.random.default_rng(s).integers(3, 211, n).tolist()} for s, n in ((1, 1), (2, 40))]
outs = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
c = eng.runner.compiler
print(json.dumps({"tokens": [o.token_ids for o in outs], "sources": c.table.by_source(),
                  "jax_cache_hits": c.stats.jax_cache_hits, "rejected": c.store.rejected}))
"""


def test_programs_jax_cache_gave_are_not_stored_so_another_process_runs_what_it_loads(tiny_checkpoint, tmp_path):
    """JAX's persistent cache hands back a loaded executable, and XLA:CPU serializes one of those without
    all of its kernels: stored, it loaded in the next process and failed at its first call. Three
    processes share one JAX cache: the first compiles and stores; with the store emptied, the second
    gets every program from JAX's cache and stores none; the third gives the first's tokens (when the
    second stored its programs, the third loaded all six and every request failed)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    ccd = tmp_path / "ccd"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(ccd), "JAX_PLATFORMS": "cpu"}

    def child():
        r = subprocess.run([sys.executable, "-c", _CHILD, tiny_checkpoint, str(ccd)], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = child()
    assert first["jax_cache_hits"] == 0 and set(first["sources"]) == {"compiled"}
    shutil.rmtree(ccd / "hybrid_jax_programs")
    second = child()
    n = sum(second["sources"].values())
    assert second["jax_cache_hits"] == n and not list((ccd / "hybrid_jax_programs").glob("*.xprog"))
    third = child()
    assert third["rejected"] == 0 and third["tokens"] == first["tokens"] == second["tokens"]
