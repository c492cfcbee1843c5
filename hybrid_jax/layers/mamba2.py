"""Mamba2 mixer (Nemotron-H's Mamba2 layers), built from Gated DeltaNet's pieces.

With I = H P (H heads of head dim P), G groups of state size N and the conv over C = I + 2 G N channels:
  z | xBC | dt = x W_in                       per group g: z_g | x_g | B_g | C_g | dt_g (its H / G heads)
  xBC = silu(conv(xBC) + b_conv)              depthwise causal conv, conv state as GDN's (causal_conv)
  x_h | B | C  = xBC                          per group g: x_g | B_g | C_g; head h reads group h // (H / G)
  dt  = clamp(softplus(dt + dt_bias), limit)  A = -exp(A_log)
  y   = SSD(x, dt, A, B, C) + D x             (pallas_kernels.mamba2, chunked or token by token)
  out = (w * grouprms(y * silu(z))) W_out     the RMS over each of G groups of I / G channels
Padding tokens (valid = False) get dt = 0, which leaves the state untouched. The state is
[B, H, P, N] f32, transformers' layout (abi.MAMBA2_SSD v3).

Group-major layout: in_proj's columns and the conv's channels are stored group by group (`group_major`
re-lays transformers' [z | x | B | C | dt] and [x | B | C] once, at conversion), so a device holding a
contiguous 1/tp of them holds whole groups, each with its heads and the B / C they read: with the groups
split over the tensor axis (tp dividing n_groups; hybrid_jax.parallel), the mixer runs without moving
activations up to its row-parallel out_proj, and the SSD kernels run per device on their heads.

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
from hybrid_jax.parallel.context import per_device
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
    """The parameters `mamba2_mixer` reads: in_proj [Hd, I + C + H] (transformers' in_proj.weight transposed,
    columns group-major), conv [W, C] (conv1d.weight [C, 1, W] as [W, C], channels group-major), conv_bias
    [C], dt_bias, A_log, D [H], norm [I], out_proj [I, Hd]."""
    return {"in_proj": (hidden, d.inner + d.conv_dim + d.num_heads), "conv": (d.conv_kernel, d.conv_dim),
            "conv_bias": (d.conv_dim,), "dt_bias": (d.num_heads,), "A_log": (d.num_heads,), "D": (d.num_heads,),
            "norm": (d.inner,), "out_proj": (d.inner, hidden)}


def _released_blocks(d: Mamba2Dims, with_z_dt: bool) -> list[list[tuple[int, int]]]:
    """Per group, the (start, stop) ranges of its pieces in transformers' order: [z | x | B | C | dt] for
    in_proj (with_z_dt), [x | B | C] for the conv."""
    I, GN, h, N = d.inner, d.n_groups * d.state_size, d.num_heads // d.n_groups, d.state_size
    hp, x0 = h * d.head_dim, I if with_z_dt else 0
    b0, c0, dt0 = x0 + I, x0 + I + GN, x0 + I + 2 * GN
    out = []
    for g in range(d.n_groups):
        blocks = [(x0 + g * hp, x0 + (g + 1) * hp), (b0 + g * N, b0 + (g + 1) * N), (c0 + g * N, c0 + (g + 1) * N)]
        if with_z_dt:
            blocks = [(g * hp, (g + 1) * hp)] + blocks + [(dt0 + g * h, dt0 + (g + 1) * h)]
        out.append(blocks)
    return out


def group_major(a, d: Mamba2Dims, axis: int, concat, with_z_dt: bool):
    """transformers' in_proj rows / columns ([z | x | B | C | dt] along `axis`, with_z_dt) or conv channels
    ([x | B | C]) in the group-major order the mixer reads: per group g, z_g | x_g | B_g | C_g | dt_g (x_g | B_g
    | C_g). Unit-step slices joined by `concat` (weights.concat keeps a weight read by parts lazy)."""
    def cut(lo, hi):
        idx = [slice(None)] * a.ndim
        idx[axis] = slice(lo, hi)
        return a[tuple(idx)]
    return concat([cut(lo, hi) for blocks in _released_blocks(d, with_z_dt) for lo, hi in blocks], axis)


def group_gated_rms_norm(y: jax.Array, z: jax.Array, w: jax.Array, groups: int, eps: float, dtype) -> jax.Array:
    """Nemotron-H's gated norm: y * silu(z), RMS-normalised over each of `groups` equal slices of the last
    axis, in f32, cast to dtype, times w. y, z: [..., I]; w [I]."""
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    g = h.reshape(h.shape[:-1] + (groups, -1))
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return w * g.reshape(h.shape).astype(dtype)


def _split(proj: jax.Array, d: Mamba2Dims):
    """in_proj's output [..., I + C + H] (group-major) -> (z [..., I], xBC [..., C] group-major, dt [..., H])."""
    lead, h, hp = proj.shape[:-1], d.num_heads // d.n_groups, d.inner // d.n_groups
    g = proj.reshape(lead + (d.n_groups, -1))
    z, xbc, dt = g[..., :hp], g[..., hp:-h], g[..., -h:]
    return z.reshape(lead + (d.inner,)), xbc.reshape(lead + (d.conv_dim,)), dt.reshape(lead + (d.num_heads,))


def _heads(xbc: jax.Array, d: Mamba2Dims):
    """The conv's output [..., C] (group-major) -> x [..., H, P], B, C [..., G, N]."""
    lead, hp, N = xbc.shape[:-1], d.inner // d.n_groups, d.state_size
    g = xbc.reshape(lead + (d.n_groups, -1))
    x = g[..., :hp].reshape(lead + (d.num_heads, d.head_dim))
    return x, g[..., hp:hp + N], g[..., hp + N:]


_TOKENS = (None, None, "heads", None)          # x, y, deltas [B, T, H, P]; B, C [B, T, G, N] (G split as heads)
_STEP = (None, None, "heads")                  # dt [B, T, H]
_STATE = (None, "heads", None, None)           # [B, H, P, N]


def _ssd(kernel, xs, dt, A, b, c, D, state, cu_seqlens=None, state_rows=None, **kw):
    """`kernel` (chunk_mamba2 or fused_recurrent_mamba2) on each device's heads and groups when they are
    split (a device's heads read only its own groups' B / C: `group_major`)."""
    def fn(xs, dt, A, b, c, D, state, cu, rows):
        pooled = {} if rows is None else {"state_indices": rows}
        return kernel(xs, dt, A, b, c, D=D, initial_state=state, output_final_state=True, cu_seqlens=cu,
                      **pooled, **kw)
    n_out = 3 if kw.get("output_deltas") else 2
    return per_device(fn, (_TOKENS, _STEP, ("heads",), _TOKENS, _TOKENS, ("heads",), _STATE, None, None),
                      (_TOKENS, _STATE, _TOKENS)[:n_out])(xs, dt, A, b, c, D, state, cu_seqlens, state_rows)


def mamba2_mixer(p: dict, x: jax.Array, valid: jax.Array, n_new: jax.Array, conv_state: jax.Array,
                 ssm_state: jax.Array, *, dims: Mamba2Dims, impl: str = "auto", fused_recurrent: bool = False,
                 per_token_states: bool = False, state_rows: jax.Array | None = None):
    """x: [B, T, Hd]; valid: [B, T]; n_new: [B]; conv_state: [B, W-1, C]; ssm_state: [B, H, P, N] f32.
    state_rows [B]: ssm_state is a pool [rows, H, P, N] of which row state_rows[b] is row b's state (updated in
    place by the token-by-token rule; the chunked one and per_token_states run on the rows gathered).
    fused_recurrent: token by token whatever T (a verify window equal to T decode steps).
    Returns (out [B, T, Hd], conv_state, ssm_state) and, with per_token_states (token by token), a dict of
    what the states after every position are made from: conv_window [B, W-1+T, C], ssm0 [B, H, P, N] (the
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
    if per_token_states:
        parts = {"conv_window": window, "ssm0": ssm_state, "k": b, "g": dt * A}
        y, ssm_state, parts["delta"] = _ssd(pallas_kernels.fused_recurrent_mamba2, xs, dt, A, b, c, p["D"],
                                            ssm_state, output_deltas=True, impl=impl)
    elif recurrent:
        y, ssm_state = _ssd(pallas_kernels.fused_recurrent_mamba2, xs, dt, A, b, c, p["D"], ssm_state,
                            state_rows=state_rows, impl=impl)
    else:
        y, ssm_state = _ssd(pallas_kernels.chunk_mamba2, xs, dt, A, b, c, p["D"], ssm_state, impl=impl)
    y = group_gated_rms_norm(y.reshape(y.shape[:2] + (d.inner,)), z, p["norm"], d.n_groups, d.eps, x.dtype)
    out = linear(y, p["out_proj"])
    if per_token_states:
        return out, conv_state, ssm_state, parts
    return out, conv_state, ssm_state


def mamba2_mixer_ragged(p: dict, x: jax.Array, seq: jax.Array, valid: jax.Array, cu_seqlens: jax.Array,
                        conv_state: jax.Array, ssm_state: jax.Array, *, dims: Mamba2Dims, impl: str = "auto",
                        context_axis: str | None = None):
    """`mamba2_mixer` over a ragged batch (hybrid_jax.models.ragged): x [N, Hd]; seq [N], valid [N];
    cu_seqlens [S + 1]; conv_state [S, W-1, C]; ssm_state [S, H, P, N] f32 (row s: sequence s's). The chunked
    rule runs the packed sequences with `cu_seqlens`. Returns (out [N, Hd], conv_state, ssm_state).
    context_axis: context-parallel, as `gated_deltanet_ragged`'s."""
    d = dims
    z, xbc, dt = _split(linear(x, p["in_proj"]), d)
    xbc, conv_state = ragged_causal_conv(xbc, conv_state, p["conv"], seq, cu_seqlens, bias=p["conv_bias"],
                                         context_axis=context_axis)
    xs, b, c = _heads(xbc, d)
    dt = jnp.where(valid[..., None], time_step(dt, p["dt_bias"], TimeStep(True, d.time_step_limit)), 0.0)
    A = -jnp.exp(p["A_log"].astype(jnp.float32))
    y, ssm_state = _ssd(pallas_kernels.chunk_mamba2, xs[None], dt[None], A, b[None], c[None], p["D"], ssm_state,
                        cu_seqlens=cu_seqlens, impl=impl, context_axis=context_axis)
    y = group_gated_rms_norm(y[0].reshape(y.shape[1], d.inner), z, p["norm"], d.n_groups, d.eps, x.dtype)
    return linear(y, p["out_proj"]), conv_state, ssm_state


def states_after(parts: dict, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer's states after position idx[b] of each row ([B] int32, in [0, T)) from the parts
    `mamba2_mixer(..., per_token_states=True)` returned: (conv [B, W-1, C], ssm [B, H, P, N] f32).
    cache.state.states_after with no l2norm on k (Mamba2's B) and value-major states, as
    `RecurrentGroup.truncate` runs it for a group written under abi.MAMBA2_SSD."""
    return cache_states_after(parts, idx, l2norm_keys=False, value_major=True)
