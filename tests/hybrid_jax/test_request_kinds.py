"""benchmarks/request_kinds.py against an in-process server whose warm-up ran to the end (warmup
"all", background included): every kind of request answers and passes its check, and none of them
waits on a compile (the compiler's stalls stay 0, no program is added to the table)."""
from __future__ import annotations

import sys
from pathlib import Path

from fastapi.testclient import TestClient

from hybrid_jax import LLM
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.async_engine import AsyncEngine
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.server.supervisor import EngineSupervisor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from request_kinds import format_outcomes, run_cases  # noqa: E402

MAX_MODEL_LEN = 128


def test_every_request_kind_answers_without_a_compile():
    engine = LLMEngine(LLM(), EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN,
                                           warmup="all", compilation_cache_dir=None))
    engine.warmup(background=False)
    compiled = engine.runner.compiler.table.keys()
    state = ServerState(ServerConfig(model_name="m", max_tokens_limit=MAX_MODEL_LEN, tool_call_parser="hermes"))
    ae = AsyncEngine(engine)
    ae.start()
    state.engine = EngineSupervisor(ae, state.metrics)
    try:
        with TestClient(build_app(state)) as c:
            def post(path, body):
                r = c.post(path, json={"model": "m", **body})
                return r.status_code, r.json()
            outs = run_cases(post, MAX_MODEL_LEN)
    finally:
        state.engine.shutdown()
    assert all(o.ok for o in outs), format_outcomes(outs)
    assert len(outs) == 12
    assert engine.runner.compiler.stats.stalls == 0
    assert engine.runner.compiler.table.keys() == compiled
