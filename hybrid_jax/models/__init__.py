"""Model families. Each family module provides the same functions:

  forward(cfg, params, cache, tokens [B, T], n_new [B], *, logits_at, impl, return_hidden)
      -> (logits, cache[, hidden])
  new_cache(cfg, batch_size, capacity, dtype) -> cache.ModelCache
  init_params(cfg, seed, dtype) -> params        (deterministic random init)
  convert_hf_weights(cfg, get, has, dtype, progress) -> params   (the one-time HF re-layout)
  final_norm(cfg, params, x) -> x                (the norm before the LM head; used by align)

`get_model(model_type)` returns the module; `config.config_from_hf_dict` picks the config class by
the same `model_type`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from hybrid_jax.errors import ConfigError

FAMILIES = {"qwen3_next": "hybrid_jax.models.qwen3_next"}
FAMILIES["deepseek_v32"] = "hybrid_jax.models.deepseek_v32"
FAMILIES["deepseek_v4"] = "hybrid_jax.models.deepseek_v4"


def get_model(model_type: str) -> ModuleType:
    try:
        return importlib.import_module(FAMILIES[model_type])
    except KeyError:
        raise ConfigError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}") from None
