"""Compiled single forwards of one model, for inspection (full-sequence logits, hidden states), and
the bucketing helpers.

Generation is the engine core's (hybrid_jax.engine): `LLM.generate` and the server are its clients.
`Generator` here runs one prompt through a fresh cache, which is what the conformance tests, the
alignment tool and `LLM.logits` compare against references. `make_batch` pads a batch of prompts to
its buckets for the speculative decoder's loops.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cache import ModelCache
from hybrid_jax.config import ModelConfig
from hybrid_jax.models import empty_cache, get_model
from hybrid_jax.sampling import SamplerFlags, SamplingParams


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass
class Batch:
    """Host-side arrays of one batch, already padded to its buckets."""
    tokens: np.ndarray        # [B, T] int32
    n_prompt: np.ndarray      # [B] int32
    max_new: np.ndarray       # [B] int32
    temperature: np.ndarray   # [B] f32
    top_k: np.ndarray         # [B] int32
    top_p: np.ndarray         # [B] f32
    seeds: np.ndarray         # [B] uint32
    stop_ids: np.ndarray      # [B, S] int32, -1 padded
    steps: int                # static: decode steps bucket
    capacity: int             # static: cache slots per row
    flags: SamplerFlags


def make_batch(prompts: list[list[int]], params: list[SamplingParams], eos_ids: tuple[int, ...],
               default_seeds: list[int]) -> Batch:
    n = len(prompts)
    B = bucket(n)
    T = bucket(max(len(p) for p in prompts), 16)
    steps = bucket(max(p.max_tokens for p in params), 16)
    tokens = np.zeros((B, T), np.int32)
    n_prompt = np.zeros((B,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
        n_prompt[i] = len(p)
    stops = [list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids)) for p in params]
    width = max(1, max(len(s) for s in stops))
    stop_ids = np.full((B, width), -1, np.int32)
    for i, s in enumerate(stops):
        stop_ids[i, :len(s)] = s

    def col(f, dtype, pad):
        out = np.full((B,), pad, dtype)
        out[:n] = [f(p) for p in params]
        return out

    # Unseeded rows draw from the caller's stream (a fresh seed per row and call), seeded rows from their own.
    seeds = np.zeros((B,), np.uint32)
    seeds[:n] = [(p.seed if p.seed is not None else int(d)) % 2**32 for p, d in zip(params, default_seeds)]
    return Batch(tokens=tokens, n_prompt=n_prompt, max_new=col(lambda p: p.max_tokens, np.int32, 0),
                 temperature=col(lambda p: p.temperature, np.float32, 0.0),
                 top_k=col(lambda p: p.top_k, np.int32, -1), top_p=col(lambda p: p.top_p, np.float32, 1.0),
                 seeds=seeds, stop_ids=stop_ids, steps=steps, capacity=T + steps, flags=SamplerFlags.of(params))


class Generator:
    """Jitted single forwards of one model over a fresh cache (no generation loop: that is the engine's)."""

    def __init__(self, cfg: ModelConfig, params: dict, dtype, impl: str = "auto"):
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
        logits, _ = self._forward(self.params, cache, jnp.asarray(padded), jnp.asarray([T], jnp.int32),
                                  logits_at="all")
        return np.asarray(logits[0, :T])

    def hidden_states(self, tokens: np.ndarray) -> list[np.ndarray]:
        """Residual stream after the embedding and after each layer: L + 1 arrays [T, Hd]."""
        T = len(tokens)
        cache = self.new_cache(1, T)
        fn = jax.jit(functools.partial(self.model.forward, self.cfg, logits_at="all", impl=self.impl,
                                       return_hidden=True))
        _, _, hidden = fn(self.params, cache, jnp.asarray(np.asarray(tokens, np.int32)[None]),
                          jnp.asarray([T], jnp.int32))
        return [np.asarray(h[0]) for h in hidden]
