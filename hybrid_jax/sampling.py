"""Sampling parameters (vLLM's shape) and on-device sampling.

Per-row temperature, top-k, top-p and seed are arrays, so one compiled step serves a batch whose
requests sample differently. `temperature == 0` is greedy. Which filters run at all (top-k, top-p)
is a static switch decided on the host from the batch, so a greedy batch never sorts the vocab.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybrid_jax.errors import InputError


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1               # -1 or 0: no top-k filter
    seed: int | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InputError(f"max_tokens must be a positive integer; got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise InputError(f"temperature must be a finite number >= 0; got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InputError(f"top_k must be -1 (off), 0 (off) or a positive integer; got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InputError(f"seed must be a non-negative integer; got {self.seed!r}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise InputError(f"stop_token_ids must be non-negative integers; got {bad}")


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static facts of a batch: which code paths the compiled sampler needs."""
    any_random: bool
    use_top_k: bool
    use_top_p: bool

    @staticmethod
    def of(params: list[SamplingParams]) -> "SamplerFlags":
        rnd = [p for p in params if p.temperature > 0]
        return SamplerFlags(any_random=bool(rnd), use_top_k=any(p.top_k > 0 for p in rnd),
                            use_top_p=any(p.top_p < 1.0 for p in rnd))


def sample(logits: jax.Array, keys: jax.Array, step: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, flags: SamplerFlags) -> jax.Array:
    """logits: [B, V] fp32; keys: [B] typed PRNG keys; step: scalar int; temperature, top_p: [B] f32;
    top_k: [B] int32 (<= 0 means off). Returns token ids [B] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not flags.any_random:
        return greedy
    V = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)
    x = logits / t[:, None]
    if flags.use_top_k or flags.use_top_p:
        sorted_x = -jnp.sort(-x, axis=-1)                                   # descending
        if flags.use_top_k:
            k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
            kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
            x = jnp.where(x < kth, -jnp.inf, x)
            sorted_x = jnp.where(jnp.arange(V)[None] < k[:, None], sorted_x, -jnp.inf)
        if flags.use_top_p:
            probs = jax.nn.softmax(sorted_x, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs                    # mass strictly above each entry
            keep = before < top_p[:, None]                                  # always keeps the top entry
            cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
            x = jnp.where(x < cutoff, -jnp.inf, x)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
    drawn = jax.vmap(jax.random.categorical)(step_keys, x).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
