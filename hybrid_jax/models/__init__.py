"""Model families, in one registry: `model_type` -> (the family module, its config.json parser).

Each family module builds a `contract.ModelFamily` named FAMILY: forward (returns a
`contract.StepOutput`), new_cache, init_params, convert_hf_weights, final_norm, its layer-type
registry (layer type -> mixer + cache groups) and its optional capabilities (deferred KV writes, the
MTP block) as fields that are None when absent. `get_model(model_type)` returns it;
`config_parser(model_type)` the parser that `config_common.config_from_hf_dict` runs.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import jax

from hybrid_jax.errors import ConfigError
from hybrid_jax.models.contract import ModelFamily


@dataclasses.dataclass(frozen=True)
class Registered:
    """Where a model type's code lives (imported on first use): `module` defines FAMILY;
    `parser` is "module:function", the function mapping a config.json dict to the family's config."""
    module: str
    parser: str


REGISTRY: dict[str, Registered] = {
    "qwen3_next": Registered("hybrid_jax.models.qwen3_next", "hybrid_jax.models.qwen3_next_config:qwen3_next_config"),
    "deepseek_v32": Registered("hybrid_jax.models.deepseek_v32", "hybrid_jax.models.deepseek_v32_config:deepseek_v32_config"),
    "deepseek_v4": Registered("hybrid_jax.models.deepseek_v4", "hybrid_jax.models.deepseek_v4_config:deepseek_v4_config"),
    "glm_moe_dsa": Registered("hybrid_jax.models.glm_moe_dsa", "hybrid_jax.models.glm_moe_dsa_config:glm_moe_dsa_config"),
    "kimi_linear": Registered("hybrid_jax.models.kimi_linear", "hybrid_jax.models.kimi_linear_config:kimi_linear_config"),
    "nemotron_h": Registered("hybrid_jax.models.nemotron_h", "hybrid_jax.models.nemotron_h_config:nemotron_h_config"),
}
for _t in ("qwen4_exp", "qwen4_exp_text"):        # the multimodal release (text model only) and text-only checkpoints
    REGISTRY[_t] = Registered("hybrid_jax.models.qwen4_exp", "hybrid_jax.models.qwen4_exp_config:qwen4_exp_config")
for _t in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):    # multimodal and text-only checkpoints
    REGISTRY[_t] = Registered("hybrid_jax.models.qwen3_5", "hybrid_jax.models.qwen3_5_config:qwen3_5_config")


def _registered(model_type: str) -> Registered:
    try:
        return REGISTRY[model_type]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown model_type {model_type!r}; supported: {sorted(REGISTRY)}") from None


def get_model(model_type: str) -> ModelFamily:
    """The family of `model_type` (ConfigError naming it when unknown)."""
    return importlib.import_module(_registered(model_type).module).FAMILY


def config_parser(model_type: str) -> Callable[[dict], object]:
    """The function that maps a config.json dict of `model_type` to its family's config dataclass."""
    module, fn = _registered(model_type).parser.split(":")
    return getattr(importlib.import_module(module), fn)


@functools.lru_cache(maxsize=64)
def _cache_program(cfg, batch_size: int, capacity: int, dtype):
    model = get_model(cfg.model_type)
    return jax.jit(lambda: model.new_cache(cfg, batch_size, capacity, dtype))


def empty_cache(cfg, batch_size: int, capacity: int, dtype):
    """`get_model(cfg.model_type).new_cache(cfg, batch_size, capacity, dtype)` as one compiled
    program per shape, for the per-request allocations of the generate and speculative loops. Built
    eagerly, a cache is one dispatch per leaf: 1.2-1.4 ms per batch-1 request on the benchmark CPU,
    against 0.08 ms for the compiled program."""
    return _cache_program(cfg, batch_size, capacity, dtype)()
