"""Compiled single forwards of one model, for inspection (full-sequence logits, hidden states), and
the bucketing helpers.

Generation is the engine core's (hybrid_jax.engine): `LLM.generate` and the server are its clients.
`Generator` here runs one prompt through a fresh cache, which is what the conformance tests, the
alignment tool and `LLM.logits` compare against references.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cache import ModelCache
from hybrid_jax.models import empty_cache, get_model
from hybrid_jax.models.config_common import FamilyConfig


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


class Generator:
    """Jitted single forwards of one model over a fresh cache (no generation loop: that is the engine's)."""

    def __init__(self, cfg: FamilyConfig, params: dict, dtype, impl: str = "auto"):
        self.cfg, self.params, self.dtype, self.impl = cfg, params, dtype, impl
        self.model = get_model(cfg.model_type)
        self._forward = jax.jit(self._forward_fn, static_argnames=("logits_at",), donate_argnums=(1,))

    # --- traced functions ------------------------------------------------------------------------
    def _forward_fn(self, params, cache, tokens, n_new, logits_at="last"):
        return self.model.forward(self.cfg, params, cache, tokens, n_new, logits_at=logits_at, impl=self.impl)

    # --- host API --------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, capacity: int) -> ModelCache:
        return empty_cache(self.cfg, batch_size, capacity, self.dtype)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Full-sequence logits of one prompt: tokens [T] -> [T, V] fp32 (conformance, alignment)."""
        T = len(tokens)
        padded = np.zeros((1, bucket(T, 16)), np.int32)
        padded[0, :T] = tokens
        cache = self.new_cache(1, padded.shape[1])
        out = self._forward(self.params, cache, jnp.asarray(padded), jnp.asarray([T], jnp.int32), logits_at="all")
        return np.asarray(out.logits[0, :T])

    def hidden_states(self, tokens: np.ndarray) -> list[np.ndarray]:
        """Residual stream after the embedding and after each layer: L + 1 arrays [T, Hd]."""
        T = len(tokens)
        cache = self.new_cache(1, T)
        fn = jax.jit(functools.partial(self.model.forward, self.cfg, logits_at="all", impl=self.impl,
                                       return_hidden=True))
        out = fn(self.params, cache, jnp.asarray(np.asarray(tokens, np.int32)[None]), jnp.asarray([T], jnp.int32))
        return [np.asarray(h[0]) for h in out.hidden]
