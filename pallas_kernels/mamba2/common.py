"""Shared pieces of the Mamba2 (SSD) implementations: input checks, the time step, the D skip term, and
the mapping onto the gated delta rule's arguments.

Mamba2's layer hands its scan (mamba_ssm's `mamba_chunk_scan_combined` / `selective_state_update`):
  x  [B, T, H, P]    the head inputs (P = head dim)
  dt [B, T, H]       the raw time step (before dt_bias, softplus and the clamp)
  A  [H]             the continuous decay, negative (A = -exp(A_log))
  Bm, Cm [B, T, G, N] the input and output projections of G groups (N = state size), head h reads
                     group h // (H // G)
  D  [H]             the skip term, y += D x
and the rule, per token and head, with dt the processed time step:
  h <- exp(dt A) h + B (dt x)^T          h [N, P]
  y  = h^T C + D x
This is the gated delta rule (pallas_kernels.gated_delta_rule) without the delta correction, with
q = C, k = B, v = x, g = dt A, beta = dt, scale 1 and no l2norm; the state is GDN's [N, HV, K, V]
layout, here [N, H, dstate, headdim]; the ops (ops.py) hold it as transformers does, [N, H, headdim, dstate]
(abi.MAMBA2_SSD). The gated RMSNorm and z belong to the layer.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule import varlen

NO_LIMIT = (0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class TimeStep:
    """How the raw dt becomes the step: dt + bias (when given), softplus (when `softplus`), then
    clamped to `limit` (transformers' time_step_limit; the default leaves a softplus'd dt alone)."""
    softplus: bool = False
    limit: tuple[float, float] = NO_LIMIT


@dataclasses.dataclass(frozen=True)
class RuleArgs:
    """Mamba2's inputs as the gated delta rule's: q = C, k = B [B, T, G, N]; v = x [B, T, H, P];
    g = dt A, beta = dt [B, T, H] f32."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def check_inputs(x, dt, A, Bm, Cm, D=None, dt_bias=None, initial_state=None, cu_seqlens=None) -> int:
    """Validates shapes; returns N (B, or the number of sequences with cu_seqlens). Raises ValueError
    naming the problem."""
    if x.ndim != 4:
        raise ValueError(f"x must be [B, T, H, P]; got {x.shape}")
    B, T, H, P = x.shape
    if dt.shape != (B, T, H):
        raise ValueError(f"dt must be [B, T, H] = {(B, T, H)}; got {dt.shape}")
    if A.shape != (H,):
        raise ValueError(f"A must be [H] = ({H},); got {A.shape}")
    if Bm.ndim != 4 or Bm.shape[:2] != (B, T) or Cm.shape != Bm.shape:
        raise ValueError(f"B and C must both be [B, T, G, N] with B={B}, T={T}; got B {Bm.shape}, C {Cm.shape}")
    G, N = Bm.shape[2], Bm.shape[3]
    if H % G:
        raise ValueError(f"heads H={H} must be a multiple of the groups G={G}")
    for name, a in (("D", D), ("dt_bias", dt_bias)):
        if a is not None and a.shape != (H,):
            raise ValueError(f"{name} must be [H] = ({H},); got {a.shape}")
    n = B if cu_seqlens is None else varlen.check_cu_seqlens(cu_seqlens)
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs a packed batch with B == 1; got B={B}")
    if initial_state is not None and initial_state.shape != (n, H, P, N):
        raise ValueError(f"initial_state must be [N, H, headdim, dstate] = {(n, H, P, N)}; got {initial_state.shape}")
    return n


def time_step(dt, dt_bias, step: TimeStep) -> jax.Array:
    """The processed time step [B, T, H] f32: (dt + dt_bias), softplus'd, clamped to step.limit."""
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if step.softplus:
        dt = jax.nn.softplus(dt)
    lo, hi = step.limit
    if lo > 0.0 or hi < math.inf:
        dt = jnp.clip(dt, lo, hi)
    return dt


def as_rule_args(x, dt, A, Bm, Cm, dt_bias, step: TimeStep) -> RuleArgs:
    """The gated delta rule's arguments for Mamba2's inputs (module docstring)."""
    dt = time_step(dt, dt_bias, step)
    return RuleArgs(q=Cm, k=Bm, v=x, g=dt * A.astype(jnp.float32), beta=dt)


def with_skip(y, x, D, cu_seqlens) -> jax.Array:
    """y + D x [B, T, H, P] in x.dtype (y as the rule returns it); tokens of no sequence (a packed batch's
    tail) stay 0."""
    out = y.astype(jnp.float32)
    if D is not None:
        skip = D.astype(jnp.float32)[:, None] * x.astype(jnp.float32)
        if cu_seqlens is not None:
            _, _, valid = varlen.token_layout(cu_seqlens, x.shape[1])
            skip = jnp.where(valid[None, :, None, None], skip, 0.0)
        out = out + skip
    return out.astype(x.dtype)
