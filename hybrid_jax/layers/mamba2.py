"""Mamba2 mixer (Nemotron-H's Mamba2 layers), built from Gated DeltaNet's pieces.

With I = H P (H heads of head dim P), G groups of state size N and the conv over C = I + 2 G N channels:
  z | xBC | dt = x W_in                       [I | C | H] columns, as transformers' in_proj stores them
  xBC = silu(conv(xBC) + b_conv)              depthwise causal conv, conv state as GDN's (causal_conv)
  x_h | B | C  = xBC                          [I | G N | G N]; head h reads group h // (H / G)
  dt  = clamp(softplus(dt + dt_bias), limit)  A = -exp(A_log)
  y   = SSD(x, dt, A, B, C) + D x             (pallas_kernels.mamba2, chunked or token by token)
  out = (w * grouprms(y * silu(z))) W_out     the RMS over each of G groups of I / G channels
Padding tokens (valid = False) get dt = 0, which leaves the state untouched. The state is
[B, H, N, P] f32 (abi.MAMBA2_SSD; transformers keeps [B, H, P, N]).

Speculative decoding as in gated_deltanet: `fused_recurrent` runs token by token whatever T;
`per_token_states` also returns what the states after any position are made from (the conv window and
the per-token updates dt x), which `states_after` reads.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels
from cache.state import states_after as cache_states_after
from hybrid_jax.layers.gated_deltanet import causal_conv, ragged_causal_conv
from hybrid_jax.layers.linear import linear
from pallas_kernels.mamba2.common import NO_LIMIT, TimeStep, time_step


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba2 layer's sizes (transformers' NemotronHConfig: mamba_num_heads, mamba_head_dim, n_groups,
    ssm_state_size, conv_kernel, layer_norm_epsilon, time_step_limit)."""
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    eps: float
    time_step_limit: tuple[float, float] = NO_LIMIT

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size


def param_shapes(hidden: int, d: Mamba2Dims) -> dict[str, tuple[int, ...]]:
    """The parameters `mamba2_mixer` reads: in_proj [Hd, I + C + H] (transformers' in_proj.weight transposed),
    conv [W, C] (conv1d.weight [C, 1, W] as [W, C]), conv_bias [C], dt_bias, A_log, D [H], norm [I],
    out_proj [I, Hd]."""
    return {"in_proj": (hidden, d.inner + d.conv_dim + d.num_heads), "conv": (d.conv_kernel, d.conv_dim),
            "conv_bias": (d.conv_dim,), "dt_bias": (d.num_heads,), "A_log": (d.num_heads,), "D": (d.num_heads,),
            "norm": (d.inner,), "out_proj": (d.inner, hidden)}


def group_gated_rms_norm(y: jax.Array, z: jax.Array, w: jax.Array, groups: int, eps: float, dtype) -> jax.Array:
    """Nemotron-H's gated norm: y * silu(z), RMS-normalised over each of `groups` equal slices of the last
    axis, in f32, cast to dtype, times w. y, z: [..., I]; w [I]."""
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    g = h.reshape(h.shape[:-1] + (groups, -1))
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return w * g.reshape(h.shape).astype(dtype)


def _split(proj: jax.Array, d: Mamba2Dims):
    """in_proj's output [..., I + C + H] -> (z [..., I], xBC [..., C], dt [..., H])."""
    return proj[..., :d.inner], proj[..., d.inner:d.inner + d.conv_dim], proj[..., d.inner + d.conv_dim:]


def _heads(xbc: jax.Array, d: Mamba2Dims):
    """The conv's output [B, T, C] -> x [B, T, H, P], B, C [B, T, G, N]."""
    lead, gn = xbc.shape[:-1], d.n_groups * d.state_size
    x = xbc[..., :d.inner].reshape(lead + (d.num_heads, d.head_dim))
    b = xbc[..., d.inner:d.inner + gn].reshape(lead + (d.n_groups, d.state_size))
    c = xbc[..., d.inner + gn:].reshape(lead + (d.n_groups, d.state_size))
    return x, b, c


def mamba2_mixer(p: dict, x: jax.Array, valid: jax.Array, n_new: jax.Array, conv_state: jax.Array,
                 ssm_state: jax.Array, *, dims: Mamba2Dims, impl: str = "auto", fused_recurrent: bool = False,
                 per_token_states: bool = False, state_rows: jax.Array | None = None):
    """x: [B, T, Hd]; valid: [B, T]; n_new: [B]; conv_state: [B, W-1, C]; ssm_state: [B, H, N, P] f32.
    state_rows [B]: ssm_state is a pool [P, H, N, P] of which row state_rows[b] is row b's state (updated in
    place by the token-by-token rule; the chunked one and per_token_states run on the rows gathered).
    fused_recurrent: token by token whatever T (a verify window equal to T decode steps).
    Returns (out [B, T, Hd], conv_state, ssm_state) and, with per_token_states (token by token), a dict of
    what the states after every position are made from: conv_window [B, W-1+T, C], ssm0 [B, H, N, P] (the
    state before the window), k [B, T, G, N] (B), g [B, T, H] (dt A) and delta [B, T, H, P] (dt x) f32;
    `states_after` reads it. Padding positions have g = 0 and delta = 0."""
    T, d = x.shape[1], dims
    recurrent = T == 1 or fused_recurrent or per_token_states
    if state_rows is not None and (per_token_states or not recurrent):
        pool = ssm_state
        out = mamba2_mixer(p, x, valid, n_new, conv_state, pool[state_rows], dims=d, impl=impl,
                           fused_recurrent=fused_recurrent, per_token_states=per_token_states)
        return (*out[:2], pool.at[state_rows].set(out[2]), *out[3:])
    z, xbc, dt = _split(linear(x, p["in_proj"]), d)
    xbc, conv_state, window = causal_conv(xbc, conv_state, p["conv"], n_new, return_window=True, bias=p["conv_bias"])
    xs, b, c = _heads(xbc, d)
    dt = jnp.where(valid[..., None], time_step(dt, p["dt_bias"], TimeStep(True, d.time_step_limit)), 0.0)
    A = -jnp.exp(p["A_log"].astype(jnp.float32))
    kw = dict(D=p["D"], initial_state=ssm_state, output_final_state=True, impl=impl)
    if per_token_states:
        parts = {"conv_window": window, "ssm0": ssm_state, "k": b, "g": dt * A}
        y, ssm_state, parts["delta"] = pallas_kernels.fused_recurrent_mamba2(xs, dt, A, b, c, output_deltas=True, **kw)
    elif recurrent:
        y, ssm_state = pallas_kernels.fused_recurrent_mamba2(xs, dt, A, b, c, state_indices=state_rows, **kw)
    else:
        y, ssm_state = pallas_kernels.chunk_mamba2(xs, dt, A, b, c, **kw)
    y = group_gated_rms_norm(y.reshape(y.shape[:2] + (d.inner,)), z, p["norm"], d.n_groups, d.eps, x.dtype)
    out = linear(y, p["out_proj"])
    if per_token_states:
        return out, conv_state, ssm_state, parts
    return out, conv_state, ssm_state


def mamba2_mixer_ragged(p: dict, x: jax.Array, seq: jax.Array, valid: jax.Array, cu_seqlens: jax.Array,
                        conv_state: jax.Array, ssm_state: jax.Array, *, dims: Mamba2Dims, impl: str = "auto"):
    """`mamba2_mixer` over a ragged batch (hybrid_jax.models.ragged): x [N, Hd]; seq [N], valid [N];
    cu_seqlens [S + 1]; conv_state [S, W-1, C]; ssm_state [S, H, N, P] f32 (row s: sequence s's). The chunked
    rule runs the packed sequences with `cu_seqlens`. Returns (out [N, Hd], conv_state, ssm_state)."""
    d = dims
    z, xbc, dt = _split(linear(x, p["in_proj"]), d)
    xbc, conv_state = ragged_causal_conv(xbc, conv_state, p["conv"], seq, cu_seqlens, bias=p["conv_bias"])
    xs, b, c = _heads(xbc, d)
    dt = jnp.where(valid[..., None], time_step(dt, p["dt_bias"], TimeStep(True, d.time_step_limit)), 0.0)
    A = -jnp.exp(p["A_log"].astype(jnp.float32))
    y, ssm_state = pallas_kernels.chunk_mamba2(xs[None], dt[None], A, b[None], c[None], D=p["D"],
                                               initial_state=ssm_state, output_final_state=True,
                                               cu_seqlens=cu_seqlens, impl=impl)
    y = group_gated_rms_norm(y[0].reshape(y.shape[1], d.inner), z, p["norm"], d.n_groups, d.eps, x.dtype)
    return linear(y, p["out_proj"]), conv_state, ssm_state


def states_after(parts: dict, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer's states after position idx[b] of each row ([B] int32, in [0, T)) from the parts
    `mamba2_mixer(..., per_token_states=True)` returned: (conv [B, W-1, C], ssm [B, H, N, P] f32).
    cache.state.states_after with no l2norm on k (Mamba2's B), as `RecurrentGroup.truncate` runs it for a
    group written under abi.MAMBA2_SSD."""
    return cache_states_after(parts, idx, l2norm_keys=False)
