"""OpenAI-compatible HTTP server (FastAPI on uvicorn) over the AsyncEngine."""
from hybrid_jax.server.app import ServerConfig, build_app

__all__ = ["ServerConfig", "build_app"]
