"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): N parallel residual streams.

A block reads one stream collapsed from the N by `pre` weights, and its output is spread back by
`post` weights while the N input streams are mixed by `comb`, a doubly-stochastic N x N matrix
(Sinkhorn-Knopp projection of a softmax):

  f = unweighted_rmsnorm(flatten(x)) fn^T                    x: [B, T, N, Hd] -> f: [B, T, (2+N)N]
  pre  = sigmoid(f_pre  * s0 + b_pre) + eps                  [B, T, N]
  post = 2 sigmoid(f_post * s1 + b_post)                     [B, T, N]
  comb = sinkhorn(softmax(f_comb * s2 + b_comb) + eps)       [B, T, N, N]  (col, then (row, col) x iters-1)
  block_in = sum_n pre_n x_n;   x'_k = post_k * block_out + sum_j comb[j, k] x_j
The hyper head collapses the streams once more before the final norm. All in fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def unweighted_rms(x, eps):
    """x: [..., D] -> x / rms(x) (fp32)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def sinkhorn(comb, iters: int, eps: float):
    """comb: [..., N, N] positive -> (approximately) doubly stochastic, as DeepSeek-V4 does it."""
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def body(_, c):       # a loop, not unrolled: 20 iterations x 2 per layer would dominate compile time
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    return jax.lax.fori_loop(0, iters - 1, body, comb)


def hc_weights(p: dict, x, *, iters: int, hc_eps: float, norm_eps: float):
    """p: fn [Hd*N, (2+N)N] (transposed), base [(2+N)N], scale [3]; x: [B, T, N, Hd].
    Returns (post [B, T, N], comb [B, T, N, N], collapsed [B, T, Hd])."""
    B, T, N, Hd = x.shape
    f = unweighted_rms(x.reshape(B, T, N * Hd), norm_eps) @ p["fn"].astype(jnp.float32)
    base, s = p["base"].astype(jnp.float32), p["scale"].astype(jnp.float32)
    pre = jax.nn.sigmoid(f[..., :N] * s[0] + base[:N]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(f[..., N:2 * N] * s[1] + base[N:2 * N])
    logits = f[..., 2 * N:].reshape(B, T, N, N) * s[2] + base[2 * N:].reshape(N, N)
    comb = sinkhorn(jax.nn.softmax(logits, axis=-1) + hc_eps, iters, hc_eps)
    collapsed = jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=2).astype(x.dtype)
    return post, comb, collapsed


def hc_merge(post, comb, block_out, x):
    """post [B, T, N], comb [B, T, N, N], block_out [B, T, Hd], x [B, T, N, Hd] -> new streams [B, T, N, Hd]."""
    dt = x.dtype
    mixed = jnp.einsum("btjk,btjd->btkd", comb.astype(dt), x)
    return post.astype(dt)[..., None] * block_out[:, :, None, :] + mixed


def hc_head(p: dict, x, *, hc_eps: float, norm_eps: float):
    """p: fn [N*Hd, N], base [N], scale [1]; x: [..., N, Hd] -> [..., Hd]."""
    lead = x.shape[:-2]
    flat = unweighted_rms(x.reshape(lead + (-1,)), norm_eps)
    pre = jax.nn.sigmoid((flat @ p["fn"].astype(jnp.float32)) * p["scale"].astype(jnp.float32)[0]
                         + p["base"].astype(jnp.float32)) + hc_eps
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)
