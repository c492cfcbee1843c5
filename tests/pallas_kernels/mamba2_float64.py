"""A float64 numpy recurrence of Mamba2's SSD rule, written in Mamba2's own terms (transformers' state layout
[headdim, dstate], heads repeating their group's B / C, dt processed as mamba_ssm does), independent of the
gated delta rule mapping the implementations share; and the random inputs the Mamba2 tests draw."""
from __future__ import annotations

import math

import numpy as np


def rel_rms(x, ref) -> float:
    """||x - ref|| / ||ref||, in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def inputs(B, T, H, G, P, N, seed=0, init=True, n_states=None):
    """x [B, T, H, P]; raw dt [B, T, H] (softplus(dt + dt_bias) spans ~0.02 .. 3); A [H] = -exp(U(-1, 2.5)),
    one head decaying fast (A = -40: exp(dt A) ~ 0 within a token or two); B, C [B, T, G, N]; D, dt_bias [H];
    h0 [n_states or B, H, P, N] (transformers' layout, abi.MAMBA2_SSD's) or None. All float32 numpy."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    A = -np.exp(rng.uniform(-1.0, 2.5, H)).astype(np.float32)
    A[0] = -40.0
    h0 = (0.5 * f(n_states or B, H, P, N)) if init else None
    return dict(x=f(B, T, H, P), dt=(f(B, T, H) - 1.0), A=A, B=f(B, T, G, N) * 0.5, C=f(B, T, G, N) * 0.5,
                D=f(H), dt_bias=(0.5 * f(H))), h0


def time_step(dt, dt_bias, softplus=True, limit=(0.0, math.inf)):
    dt = dt.astype(np.float64) + (0.0 if dt_bias is None else dt_bias.astype(np.float64))
    if softplus:
        dt = np.logaddexp(0.0, dt)
    return np.clip(dt, limit[0], limit[1])


def scan(x, dt, A, B, C, D=None, h0=None):
    """One sequence: x [T, H, P], dt [T, H] processed, B, C [T, G, N]; h0 [H, P, N] or None.
    Returns (y [T, H, P], final [H, P, N]) in float64, the state carried as transformers does."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    r = H // G
    h = np.zeros((H, P, N)) if h0 is None else np.asarray(h0, np.float64).copy()
    y = np.zeros((T, H, P))
    for t in range(T):
        Bh = np.repeat(B[t].astype(np.float64), r, axis=0)              # [H, N]
        Ch = np.repeat(C[t].astype(np.float64), r, axis=0)
        dA = np.exp(dt[t] * A.astype(np.float64))                       # [H]
        h = dA[:, None, None] * h + (dt[t][:, None] * x[t].astype(np.float64))[:, :, None] * Bh[:, None, :]
        y[t] = np.einsum("hpn,hn->hp", h, Ch)
        if D is not None:
            y[t] += D.astype(np.float64)[:, None] * x[t]
    return y, h


def reference(x, dt, A, B, C, D=None, dt_bias=None, softplus=True, limit=(0.0, math.inf), h0=None, cu_seqlens=None):
    """The batch (rows independent) or, with cu_seqlens, the packed sequences of row 0 (tokens of no
    sequence give 0). Returns (y [B, T, H, P], final [N, H, P, N_state]) in float64."""
    d = time_step(np.asarray(dt), None if dt_bias is None else np.asarray(dt_bias), softplus, limit)
    x, A, B, C = (np.asarray(a) for a in (x, A, B, C))
    D = None if D is None else np.asarray(D)
    if cu_seqlens is None:
        outs = [scan(x[b], d[b], A, B[b], C[b], D, None if h0 is None else h0[b]) for b in range(x.shape[0])]
        return np.stack([o[0] for o in outs]), np.stack([o[1] for o in outs])
    y = np.zeros(x.shape)
    finals = []
    for n in range(len(cu_seqlens) - 1):
        a, b = cu_seqlens[n], cu_seqlens[n + 1]
        y_n, f_n = scan(x[0, a:b], d[0, a:b], A, B[0, a:b], C[0, a:b], D, None if h0 is None else h0[n])
        y[0, a:b] = y_n
        finals.append(f_n)
    return y, np.stack(finals)
