"""Kimi Delta Attention in float64 numpy, token by token: what every KDA implementation is measured against
(tests/pallas_kernels/test_kda*.py). Inputs are drawn here too, with decays that reach both ends."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """Token by token in float64: S <- diag(exp(g_t)) S; delta = beta (v - S^T k); S += k delta^T; o = S^T q.
    Returns (o [B, T, HV, V], final [N, HV, K, V], states [B, T, HV, K, V], deltas [B, T, HV, V]); tokens in no
    sequence have o = 0, delta = 0 and the state before them."""
    q, k, v, g, beta = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, g, beta))
    B, T, Hq, K = q.shape
    HV, V = v.shape[2:]
    r = HV // Hq
    if use_qk_l2norm_in_kernel:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    q = q * (K ** -0.5 if scale is None else scale)
    if cu_seqlens is None:
        segments = [(b, 0, T, b) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens]
        segments = [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]
    N = len(segments)
    S0 = np.zeros((N, HV, K, V)) if initial_state is None else np.asarray(initial_state, np.float64)
    o, states, deltas = np.zeros((B, T, HV, V)), np.zeros((B, T, HV, K, V)), np.zeros((B, T, HV, V))
    final = S0.copy()
    for b, start, end, n in segments:
        for hv in range(HV):
            kk, qq = k[b, :, hv // r], q[b, :, hv // r]
            S = S0[n, hv].copy()
            for t in range(start, end):
                S = np.exp(g[b, t, hv])[:, None] * S
                delta = beta[b, t, hv] * (v[b, t, hv] - S.T @ kk[t])
                S = S + np.outer(kk[t], delta)
                o[b, t, hv], states[b, t, hv], deltas[b, t, hv] = S.T @ qq[t], S, delta
            final[n, hv] = S
    return o, final, states, deltas


def inputs(B, T, H, HV, K, V, seed=0, N=None):
    """(q, k, v, g, beta) float32 and an initial state [N or B, HV, K, V]: a fifth of the decays fast
    (g down to -20 a token: exp(-gc) of a chunk would overflow f32), the rest between -1e-4 and -0.5."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    fast = rng.random((B, T, HV, K)) < 0.2
    g = np.where(fast, -20.0 * rng.random((B, T, HV, K)), -np.exp(rng.uniform(np.log(1e-4), np.log(0.5), (B, T, HV, K))))
    beta = 1.0 / (1.0 + np.exp(-n(B, T, HV)))
    return (n(B, T, H, K), n(B, T, H, K), n(B, T, HV, V), g.astype(np.float32), beta.astype(np.float32)), \
        0.1 * n(N or B, HV, K, V)


def rel_rms(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))
