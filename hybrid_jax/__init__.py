"""hybrid-jax: serving hybrid-attention LLMs (Gated DeltaNet, gated attention, MoE) in JAX.

    from hybrid_jax import LLM, SamplingParams
    llm = LLM()                          # the small trained model shipped in the package; or LLM(model=PATH)
    out = llm.generate("Hello", SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)
"""
from hybrid_jax.errors import CheckpointError, ConfigError, HybridJaxError, InputError
from hybrid_jax.llm import LLM, CompletionOutput, RequestOutput
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "HybridJaxError", "ConfigError",
           "CheckpointError", "InputError"]


def __getattr__(name):
    if name == "align":   # imported lazily: it pulls in torch/transformers only when used
        import importlib  # noqa: PLC0415
        return importlib.import_module("hybrid_jax.align")
    raise AttributeError(name)
