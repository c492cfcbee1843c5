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

Qwen4-Exp's gated residual (`gated_residual`) keeps N streams too, with other math: the streams are
RMS-normed each (a (1 + w) weight over all N * Hd channels), the block reads the mean over the streams of
a per-channel sigmoid gate (a rank-r mixer: up(silu(down(normed) / N))) times the normed stream, and its
output is added to each raw stream with a weight 2 sigmoid(inject(normed) / N): `hc_merge` with no comb
(the streams are not mixed). Its final mixer is the same read without the injection weights.
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
    """post [B, T, N], comb [B, T, N, N] (None: the streams are not mixed), block_out [B, T, Hd], x [B, T, N, Hd]
    -> new streams [B, T, N, Hd]."""
    dt = x.dtype
    mixed = x if comb is None else jnp.einsum("btjk,btjd->btkd", comb.astype(dt), x)
    return post.astype(dt)[..., None] * block_out[:, :, None, :] + mixed


def hc_head(p: dict, x, *, hc_eps: float, norm_eps: float):
    """p: fn [N*Hd, N], base [N], scale [1]; x: [..., N, Hd] -> [..., Hd]."""
    lead = x.shape[:-2]
    flat = unweighted_rms(x.reshape(lead + (-1,)), norm_eps)
    pre = jax.nn.sigmoid((flat @ p["fn"].astype(jnp.float32)) * p["scale"].astype(jnp.float32)[0]
                         + p["base"].astype(jnp.float32)) + hc_eps
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)


def normed_streams(x, w, eps):
    """Qwen4-Exp's grouped RMSNorm: each stream of x [..., N, Hd] normalised alone, times (1 + w), w [N * Hd]."""
    return (unweighted_rms(x, eps) * (1.0 + w.astype(jnp.float32).reshape(x.shape[-2:]))).astype(x.dtype)


def gated_residual(p: dict, x, *, eps: float):
    """Qwen4-Exp's read of the streams x [..., N, Hd] (p: norm [N*Hd], down [N*Hd, r], up [r, N*Hd] and,
    except in the final mixer, inject [N*Hd, N]). Returns (block input [..., Hd], the injection weights
    [..., N] or None) -- `hc_merge(weights, None, block_out, x)` adds the block's output back."""
    lead, (N, Hd) = x.shape[:-2], x.shape[-2:]
    normed = normed_streams(x, p["norm"], eps).reshape(lead + (N * Hd,))
    gate = jax.nn.sigmoid(jax.nn.silu((normed @ p["down"]) / N) @ p["up"]).reshape(lead + (N, Hd))
    block_in = jnp.mean(gate * normed.reshape(lead + (N, Hd)), axis=-2)
    if "inject" not in p:
        return block_in, None
    return block_in, 2.0 * jax.nn.sigmoid((normed @ p["inject"]) / N)
