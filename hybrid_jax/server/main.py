"""`hybrid-jax serve`: start uvicorn at once, load and warm the model on a background thread;
/health turns 200 when the engine is ready."""
from __future__ import annotations

import logging
import threading

import uvicorn

from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.async_engine import AsyncEngine
from hybrid_jax.server.app import ServerConfig, ServerState, build_app

log = logging.getLogger("hybrid_jax.server")


def load_engine(state: ServerState, model: str | None, dtype: str, engine_config: EngineConfig):
    try:
        from hybrid_jax import LLM  # noqa: PLC0415
        llm = LLM(model=model, dtype=dtype, max_model_len=None)
        engine = LLMEngine(llm, engine_config)
        engine.warmup()
        ae = AsyncEngine(engine)
        ae.start()
        state.engine = ae
        log.info("model ready (warm-up %.1f s, %d programs)", engine.warmup_seconds, engine.runner.num_compiled())
    except Exception as e:  # noqa: BLE001  (reported by /health)
        state.load_error = f"loading failed: {type(e).__name__}: {e}"
        log.error(state.load_error)


def serve(*, model: str | None, host: str, port: int, dtype: str, engine_config: EngineConfig,
          server_config: ServerConfig):
    state = ServerState(server_config)
    app = build_app(state)
    threading.Thread(target=load_engine, args=(state, model, dtype, engine_config), daemon=True).start()
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
