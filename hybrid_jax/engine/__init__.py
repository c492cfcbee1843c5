"""The serving engine: a host-side scheduler (plain Python) that decides each step's batch, and
jit-compiled steps over bucketed static shapes that run it on device.

    engine = LLMEngine(llm, EngineConfig(max_num_seqs=8))
    engine.add_request("r1", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():
            ...
"""
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.engine import LLMEngine
from hybrid_jax.engine.request import Request, RequestStatus

__all__ = ["EngineConfig", "LLMEngine", "Request", "RequestStatus"]
