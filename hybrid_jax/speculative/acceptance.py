"""Which draft tokens a verify step keeps: greedy matching and rejection sampling, on device.

A verify step feeds [pending, d_1 .. d_k] (T = K + 1 positions, k <= K real drafts per row) and gets
the target's logits at every position; logits[:, j] is the distribution of the token after position j.

Greedy rows (temperature 0) keep the longest prefix of drafts equal to the target's argmax and then
the target's own argmax: the output is exactly what plain greedy decoding would produce.

Sampled rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft d_j is kept with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token is drawn from
norm(max(p_j - q_j, 0)); if all k are kept a bonus token is drawn from p_k. p is the target's
distribution after sampling.py's temperature / top-k / top-p processing, q the drafter's (a one-hot
for a deterministic drafter such as n-gram lookup, where the rule becomes "keep with probability
p(d)"). Every emitted token is then distributed exactly as under plain sampling from p.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_jax.sampling import SamplerFlags, _filter, greedy_tokens


def processed_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     flags: SamplerFlags) -> jax.Array:
    """sampling.py's processing at every position: logits [B, T, V] / temperature [B], then the top-k
    [B] and top-p [B] filters (-inf outside). Greedy rows are scaled by 1 (their argmax is unchanged)."""
    B, T, V = logits.shape
    t = jnp.where(temperature > 0, temperature, 1.0)
    x = logits.astype(jnp.float32) / t[:, None, None]
    if flags.use_top_k or flags.use_top_p:
        rep = lambda a: jnp.repeat(a, T)                     # noqa: E731  [B] -> [B*T]
        x = _filter(x.reshape(B * T, V), rep(top_k), rep(top_p), flags).reshape(B, T, V)
    return x


def step_keys(keys: jax.Array, step: jax.Array, salt: int) -> jax.Array:
    """Per-row keys of one speculative step. keys: [B] typed PRNG keys; step: [B] int32 (tokens the row
    has generated before this step); salt separates the streams of one step. Returns [B] keys."""
    k = jax.vmap(jax.random.fold_in)(keys, step.astype(jnp.int32))
    return jax.vmap(lambda kk: jax.random.fold_in(kk, salt))(k)


def greedy_accept(logits: jax.Array, draft: jax.Array, n_draft: jax.Array):
    """logits [B, K+1, V]; draft [B, K] int32; n_draft [B] int32 (<= K real drafts per row).
    Returns (n_accepted [B] int32, tokens [B, K+1] int32: the first n_accepted + 1 are the output)."""
    K = draft.shape[1]
    target = greedy_tokens(logits)                                          # [B, K+1]
    match = (draft == target[:, :K]) & (jnp.arange(K)[None] < n_draft[:, None])
    n_acc = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return n_acc, target          # kept drafts equal the target's argmax, so the target row is the output


def rejection_sample(p: jax.Array, draft: jax.Array, q: jax.Array | None, n_draft: jax.Array,
                     keys: jax.Array, step: jax.Array):
    """p [B, K+1, V] target probabilities; draft [B, K] int32; q [B, K, V] draft probabilities or None
    (a deterministic drafter: q is one-hot at the draft); n_draft [B] int32; keys [B] typed PRNG keys;
    step [B] int32. Returns (n_accepted [B] int32, tokens [B, K+1] int32: the first n_accepted + 1
    are the output)."""
    B, T, V = p.shape
    K = T - 1
    j = jnp.arange(K)[None]                                                  # [1, K]
    p_d = jnp.take_along_axis(p[:, :K], draft[..., None], axis=-1)[..., 0]  # [B, K]
    q_d = jnp.ones_like(p_d) if q is None else jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(step_keys(keys, step, 0))   # [B, K] in [0, 1)
    keep = (u * q_d < p_d) & (j < n_draft[:, None])
    n_acc = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    p_a = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]        # [B, V]
    rejected = n_acc < n_draft                                               # else: bonus from p_k
    d_a = jnp.take_along_axis(draft, jnp.minimum(n_acc, K - 1)[:, None], axis=1)[:, 0]
    if q is None:
        q_a = jax.nn.one_hot(d_a, V, dtype=p.dtype)
    else:
        q_a = jnp.take_along_axis(q, jnp.minimum(n_acc, K - 1)[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_a - q_a, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(total > 0, resid, p_a)        # p == q at the draft: measure zero, fall back to p
    final = jnp.where(rejected[:, None], resid, p_a)
    tok = jax.vmap(jax.random.categorical)(step_keys(keys, step, 1), jnp.log(final)).astype(jnp.int32)
    out = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
    out = jnp.where(jnp.arange(T)[None] == n_acc[:, None], tok[:, None], out)
    return n_acc, out


def accept(logits: jax.Array, draft: jax.Array, draft_probs: jax.Array | None, n_draft: jax.Array,
           keys: jax.Array, step: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           flags: SamplerFlags):
    """Per-row choice of rule: greedy rows match argmax, sampled rows rejection-sample.
    logits [B, K+1, V]; draft [B, K]; draft_probs [B, K, V] | None; n_draft, step [B] int32; keys [B];
    temperature, top_p [B] f32; top_k [B] int32. Returns (n_accepted [B], tokens [B, K+1])."""
    g_acc, g_tok = greedy_accept(logits, draft, n_draft)
    if not flags.any_random:
        return g_acc, g_tok
    p = jax.nn.softmax(processed_logits(logits, temperature, top_k, top_p, flags), axis=-1)
    s_acc, s_tok = rejection_sample(p, draft, draft_probs, n_draft, keys, step)
    rnd = temperature > 0
    return jnp.where(rnd, s_acc, g_acc), jnp.where(rnd[:, None], s_tok, g_tok)
