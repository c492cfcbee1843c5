"""The server in this process, for tests: an engine core on its own thread (AsyncEngine), supervised as
`hybrid-jax serve` runs it, behind the app, with a FastAPI TestClient (the official OpenAI client can
reach the same app through httpx's ASGI transport)."""
from __future__ import annotations

import contextlib

from fastapi.testclient import TestClient

from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.async_engine import AsyncEngine
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.server.supervisor import EngineSupervisor


@contextlib.contextmanager
def serving(llm, engine: EngineConfig, server: ServerConfig, headers: dict | None = None):
    """Yields (client, app, state) of an app serving `llm` with these configurations; shuts it down after."""
    state = ServerState(server)
    ae = AsyncEngine(LLMEngine(llm, engine))
    ae.start()
    state.engine = EngineSupervisor(ae, state.metrics)
    app = build_app(state)
    try:
        with TestClient(app, headers=headers or {}) as c:
            yield c, app, state
    finally:
        state.engine.shutdown()
