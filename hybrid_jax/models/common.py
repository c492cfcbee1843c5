"""Pieces every model family's forward shares: where the new tokens sit (`token_positions`), the step's
output (`finish_step`, `finish_ragged`) and the LM head (`lm_head`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cache import ModelCache
from hybrid_jax.models.contract import StepOutput


@dataclasses.dataclass
class LayerStep:
    """One forward's working state, shared by its layers' mixers as they run (traced values); each
    family's step adds what its mixers read and collect."""
    cache: ModelCache
    positions: jax.Array           # [B, T] (a ragged batch: [N])
    valid: jax.Array               # [B, T] (a ragged batch: [N])
    n_new: jax.Array               # [B]
    impl: str


def token_positions(cache: ModelCache, T: int, n_new: jax.Array):
    """Row b's new tokens sit at cache.lengths[b] + t; only t < n_new[b] are real.
    Returns (positions [B, T] int32, valid [B, T] bool)."""
    t = jnp.arange(T, dtype=jnp.int32)
    return cache.lengths[:, None] + t[None, :], t[None, :] < n_new[:, None]


def finish_step(cfg, params: dict, cache: ModelCache, groups: dict, x: jax.Array, n_new: jax.Array, *,
                final_norm, logits_at: str, hidden=None, final_hidden: jax.Array | None = None,
                per_token: list | None = None) -> StepOutput:
    """The step's output: the updated cache (lengths += n_new, version bumped where written) and the
    logits, [B, V] at each row's last real token (logits_at="last") or [B, T, V] ("all"); `hidden` and
    `final_hidden` passed through; per_token (a forward with per_token_states: each recording layer's
    per-token states, in layer order) stacked over the layers into `states` ({} when no layer recorded).
    x: [B, T, Hd] residual stream after the last layer."""
    new = cache.replace(groups=groups, lengths=cache.lengths + n_new,
                        version=cache.version + (n_new > 0).astype(jnp.int32))
    if logits_at == "last":
        x = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
    x = final_norm(cfg, params, x)
    out = StepOutput(logits=lm_head(params, x), cache=new, hidden=hidden, final_hidden=final_hidden)
    if per_token is not None:
        out = out.replace(states=jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_token) if per_token else {})
    return out


def finish_ragged(cfg, params: dict, cache: ModelCache, groups: dict, x: jax.Array, batch, *, final_norm,
                  return_final_hidden: bool) -> StepOutput:
    """`finish_step` for a ragged batch (hybrid_jax.models.ragged.RaggedBatch): x [1, N, Hd] after the
    last layer; logits [S, V] at each sequence's last token, `final_hidden` [N, Hd] with return_final_hidden."""
    flat = x[0]
    out = finish_step(cfg, params, cache, groups, flat[batch.last_index()][:, None], batch.n_new,
                      final_norm=final_norm, logits_at="all")
    return out.replace(logits=out.logits[:, 0], final_hidden=flat if return_final_hidden else None)


def lm_head(params: dict, x: jax.Array) -> jax.Array:
    """Logits f32 [..., V] of final-normed hidden states x [..., Hd]: the LM head (the embedding's
    transpose when tied)."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(x, head, preferred_element_type=jnp.float32)
