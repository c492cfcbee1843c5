"""An engine for a checkpoint directory (or the embedded default model): the model loaded, laid out
over its devices, and the engine's step programs compiled by its warm-up. What `hybrid-jax serve`
(every process of it) and `hybrid-jax bench` run."""
from __future__ import annotations

from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.data_parallel import DataParallelEngine
from hybrid_jax.engine.engine import LLMEngine


def build_engine(model: str | None, dtype: str, engine_config: EngineConfig,
                 parallel: dict | None = None) -> LLMEngine | DataParallelEngine:
    """model: a checkpoint directory or None; parallel: LLM's layout keywords (tensor_parallel_size,
    data_parallel_size, enable_expert_parallel). Warms up as engine_config.warmup says."""
    from hybrid_jax import LLM  # noqa: PLC0415  (hybrid_jax imports the engine)
    engine = LLM(model=model, dtype=dtype, **(parallel or {})).make_engine(engine_config)
    engine.warmup()
    return engine
