"""Gated DeltaNet mixer (Qwen3-Next's linear attention).

Input projections grouped per key head, as Qwen3-Next's checkpoints store them: qkvz [Hd, H * (2K +
2rV)] holds, for each key head h, q_h | k_h | v_h | z_h (r = HV / H value heads per key head, value
head j belongs to key head j // r), and ba [Hd, H * 2r] b_h | a_h. A device that holds a slice of the
columns thus holds whole heads (hybrid_jax.parallel). Causal depthwise conv over the q|k|v channels
(in the same per-key-head grouping, C = H * (2K + rV)) with a (W-1)-token conv state, l2-normalised q/k, the gated
delta rule (chunked for prefill, recurrent for a decode step), gated RMSNorm, output projection.
Padding tokens (valid = False) get g = 0 and beta = 0, which leave the recurrent state untouched.

Speculative decoding: `fused_recurrent=True` runs the token-level kernel whatever T (a verify or
replay window numerically equal to T decode steps); `per_token_states=True` (implies it) also
returns what the state after any position is made from, so a verify step can roll back by selecting
the state after its last accepted token: the conv inputs (each position's conv window is a slice of
them) and the recurrence's per-token rank-one updates (`pallas_kernels.state_after`), rather than
T copies of the conv window and of the [HV, K, V] state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from cache.state import conv_state_after
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.norms import gated_rms_norm
from hybrid_jax.parallel.context import per_device


def causal_conv(x: jax.Array, conv_state: jax.Array, w: jax.Array, n_new: jax.Array, return_window: bool = False,
                bias: jax.Array | None = None, dilation: int = 1):
    """Depthwise causal conv (+ bias [C] when given) + SiLU.  x: [B, T, C]; conv_state: [B, S, C] with
    S = (W-1) * dilation (the taps are `dilation` positions apart; 1: S = W-1); w: [W, C]; n_new: [B].
    Returns (y [B, T, C], new conv_state [B, S, C]: the last S inputs up to each row's end) and,
    with return_window, the conv state and inputs [B, S+T, C] (`cache.state.conv_state_after` reads the state
    after any position from it)."""
    W = w.shape[0]
    T = x.shape[1]
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)       # [B, S+T, C]
    y = sum(window[:, j * dilation:j * dilation + T] * w[j] for j in range(W))
    if bias is not None:
        y = y + bias
    new_state = conv_state_after(window, n_new - 1, (W - 1) * dilation + 1)
    if return_window:
        return jax.nn.silu(y), new_state, window
    return jax.nn.silu(y), new_state


def _project(p: dict, x: jax.Array, H: int, HV: int, K: int, V: int):
    """x [..., Hd] -> (qkv [..., H * (2K + rV)] before the conv, grouped per key head; z [..., HV V];
    b, a [..., HV])."""
    r, lead = HV // H, x.shape[:-1]
    qkvz = linear(x, p["qkvz"]).reshape(lead + (H, 2 * K + 2 * r * V))
    ba = linear(x, p["ba"]).reshape(lead + (H, 2 * r))
    return (qkvz[..., :2 * K + r * V].reshape(lead + (-1,)), qkvz[..., 2 * K + r * V:].reshape(lead + (HV * V,)),
            ba[..., :r].reshape(lead + (HV,)), ba[..., r:].reshape(lead + (HV,)))


def _split_qkv(qkv: jax.Array, H: int, HV: int, K: int, V: int):
    """The conv's output qkv [..., H * (2K + rV)] (grouped per key head) -> q, k [..., H, K], v [..., HV, V]."""
    g = qkv.reshape(qkv.shape[:-1] + (H, 2 * K + (HV // H) * V))
    return g[..., :K], g[..., K:2 * K], g[..., 2 * K:].reshape(qkv.shape[:-1] + (HV, V))


def _gates(p: dict, b: jax.Array, a: jax.Array, valid: jax.Array):
    """beta and the log-decay g [..., HV] fp32, both 0 at padding tokens (valid [...] False): the
    state passes them unchanged."""
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + p["dt_bias"])
    return jnp.where(valid[..., None], beta, 0.0), jnp.where(valid[..., None], g, 0.0)


def _output(p: dict, o: jax.Array, z: jax.Array, eps: float, dtype, gate_act=jax.nn.silu) -> jax.Array:
    """Gated RMSNorm of the rule's output o [..., HV, V] by gate_act(z), then the output projection -> [..., Hd]."""
    o = gated_rms_norm(o.astype(dtype), z.reshape(o.shape), p["norm"], eps, act=gate_act)
    return linear(o.reshape(o.shape[:-2] + (-1,)), p["out_proj"])


_TOKENS_HEADS = (None, None, "heads", None)       # q, k [B, T, H, K]; v, o, deltas [B, T, HV, V]
_GATES = (None, None, "heads")                     # g, beta [B, T, HV]
_STATE = (None, "heads", None, None)               # [B, HV, K, V]


def _rule(kernel, q, k, v, g, beta, state, cu_seqlens=None, state_rows=None, **kw):
    """`kernel` (a pallas_kernels gated-delta-rule or KDA op) on q, k, v, g, beta with initial state `state`, run
    on each device's heads when the heads are split (`hybrid_jax.parallel`: a device's key heads and
    their value heads sit together, so the rule needs nothing from another device). state_rows [B]: `state`
    is a pool [P, HV, K, V] and these are the batch's rows of it (the recurrent op's state_indices)."""
    def fn(q, k, v, g, beta, state, cu, rows):
        pooled = {} if rows is None else {"state_indices": rows}
        return kernel(q, k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu, **pooled, **kw)
    n_out = 3 if kw.get("output_deltas") else 2
    g_axes = _GATES + (None,) * (g.ndim - 3)      # a decay per key channel (KDA): g [B, T, HV, K]
    return per_device(fn, (_TOKENS_HEADS,) * 3 + (g_axes, _GATES, _STATE, None, None),
                      (_TOKENS_HEADS, _STATE, _TOKENS_HEADS)[:n_out])(q, k, v, g, beta, state, cu_seqlens, state_rows)


def gated_deltanet(p: dict, x: jax.Array, valid: jax.Array, n_new: jax.Array, conv_state: jax.Array,
                   ssm_state: jax.Array, *, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                   head_v_dim: int, eps: float, impl: str = "auto", fused_recurrent: bool = False,
                   per_token_states: bool = False, state_rows: jax.Array | None = None, gate_act=jax.nn.silu):
    """x: [B, T, Hd]; valid: [B, T]; n_new: [B]; conv_state: [B, W-1, C]; ssm_state: [B, HV, K, V] fp32.
    gate_act: the output gate's activation (SiLU; Qwen4-Exp's output_gate_type may make it a sigmoid).
    state_rows [B]: ssm_state is a pool [P, HV, K, V] of which row state_rows[b] is row b's state; the
    returned ssm_state is the pool with those rows updated (in place by the token-by-token rule; the
    chunked rule and per_token_states run on the rows gathered).
    Returns (out [B, T, Hd], conv_state, ssm_state) and, with per_token_states, a dict of what the
    states after every position are made from: conv_window [B, W-1+T, C] (for `RecurrentGroup.truncate`);
    ssm0 [B, HV, K, V] (the state before the window), k [B, T, H, K], g [B, T, HV] and delta
    [B, T, HV, V] fp32 (for `pallas_kernels.state_after`, with use_qk_l2norm_in_kernel=True).
    Padding positions (past n_new) have g = 0 and delta = 0: their state is the last real one."""
    B, T, _ = x.shape
    H, HV, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    if state_rows is not None and (per_token_states or not (T == 1 or fused_recurrent)):
        pool = ssm_state
        out = gated_deltanet(p, x, valid, n_new, conv_state, pool[state_rows], num_k_heads=H, num_v_heads=HV,
                             head_k_dim=K, head_v_dim=V, eps=eps, impl=impl, fused_recurrent=fused_recurrent,
                             per_token_states=per_token_states, gate_act=gate_act)
        return (*out[:2], pool.at[state_rows].set(out[2]), *out[3:])
    qkv, z, b, a = _project(p, x, H, HV, K, V)
    if per_token_states:
        qkv, conv_state, conv_window = causal_conv(qkv, conv_state, p["conv"], n_new, return_window=True)
    else:
        qkv, conv_state = causal_conv(qkv, conv_state, p["conv"], n_new)
    q, k, v = _split_qkv(qkv, H, HV, K, V)
    beta, g = _gates(p, b, a, valid)
    if per_token_states:
        parts = {"conv_window": conv_window, "ssm0": ssm_state, "k": k, "g": g}
        o, ssm_state, parts["delta"] = _rule(pallas_kernels.fused_recurrent_gated_delta_rule, q, k, v, g, beta,
                                             ssm_state, output_deltas=True, use_qk_l2norm_in_kernel=True, impl=impl)
    elif T == 1 or fused_recurrent:
        o, ssm_state = _rule(pallas_kernels.fused_recurrent_gated_delta_rule, q, k, v, g, beta, ssm_state,
                             state_rows=state_rows, use_qk_l2norm_in_kernel=True, impl=impl)
    else:
        o, ssm_state = _rule(pallas_kernels.chunk_gated_delta_rule, q, k, v, g, beta, ssm_state,
                             use_qk_l2norm_in_kernel=True, impl=impl)
    out = _output(p, o, z, eps, x.dtype, gate_act)
    if per_token_states:
        return out, conv_state, ssm_state, parts
    return out, conv_state, ssm_state


def ragged_causal_conv(x: jax.Array, conv_state: jax.Array, w: jax.Array, seq: jax.Array, cu_seqlens: jax.Array,
                       bias: jax.Array | None = None, context_axis: str | None = None):
    """`causal_conv` over a ragged batch. x: [N, C] (sequence s owns rows cu_seqlens[s] ..
    cu_seqlens[s + 1] - 1; seq [N] each row's sequence); conv_state [S, W-1, C]; w [W, C]; bias [C] or None.
    Returns (y [N, C] after SiLU, new conv_state [S, W-1, C]: each sequence's last W-1 inputs; a
    sequence without tokens keeps its state). Each tap reads the sequence's own earlier input, or
    its conv state before the first one: never another sequence's.
    context_axis: inside `jax.shard_map` over that axis, x and seq are this device's span of the batch's rows
    (at least W - 1 of them) and cu_seqlens the whole batch's: `_ragged_conv_over_axis`."""
    if context_axis is not None:
        return _ragged_conv_over_axis(x, conv_state, w, seq, cu_seqlens, bias, context_axis)
    W, (N, C), S = w.shape[0], x.shape, conv_state.shape[0]
    ext = jnp.concatenate([conv_state.astype(x.dtype).reshape(S * (W - 1), C), x], axis=0)
    cu = cu_seqlens.astype(jnp.int32)

    def at(s, j):          # row of ext holding sequence s's input at step offset j (>= -(W-1))
        return jnp.where(j >= 0, S * (W - 1) + cu[s] + j, s * (W - 1) + (W - 1) + j)

    local = jnp.arange(N, dtype=jnp.int32) - cu[seq]
    y = sum(ext[at(seq, local - (W - 1) + t)] * w[t] for t in range(W))
    if bias is not None:
        y = y + bias
    n = cu[1:] - cu[:-1]
    u = jnp.arange(W - 1, dtype=jnp.int32)
    new_state = ext[at(jnp.arange(S, dtype=jnp.int32)[:, None], n[:, None] - (W - 1) + u[None, :])]
    return jax.nn.silu(y), new_state.astype(conv_state.dtype)


def _ragged_conv_over_axis(x, conv_state, w, seq, cu_seqlens, bias, axis: str):
    """`ragged_causal_conv` of a batch whose rows are split by position over mesh axis `axis` (inside shard_map:
    x [N, C] and seq [N] this device's span, cu_seqlens and conv_state whole). The sequence the span begins in,
    if it began before, takes its conv state from the device before: the last W-1 inputs of the sequence that
    device's span ends in (one [W-1, C] ppermute; a span of at least W-1 rows holds them all, or the piece began
    there and its state is the pool's). Each sequence's new state comes from the device of its last row.
    Returns (y [N, C], new conv_state [S, W-1, C] whole)."""
    W, N = w.shape[0], x.shape[0]
    if N < W - 1:
        raise ValueError(f"context parallelism needs at least {W - 1} rows per device for a width-{W} conv; got {N}")
    d, n_dev = jax.lax.axis_index(axis), jax.lax.psum(1, axis)
    cu = cu_seqlens.astype(jnp.int32)
    S, lo = cu.shape[0] - 1, d * N
    local = jnp.clip(cu - lo, 0, N)

    def at(pos):               # the sequence holding global position pos (clipped to a real one)
        return jnp.clip(jnp.searchsorted(cu[1:], pos, side="right"), 0, S - 1)
    _, ends = ragged_causal_conv(x, conv_state, w, seq, local, bias)
    halo = jax.lax.ppermute(ends[at(lo + N - 1)], axis, [(j, j + 1) for j in range(n_dev - 1)])
    first = at(lo)
    carried = (cu[first] < lo) & (cu[first + 1] > lo)
    state = conv_state.at[first].set(jnp.where(carried, halo.astype(conv_state.dtype), conv_state[first]))
    y, new = ragged_causal_conv(x, state, w, seq, local, bias)
    last = jnp.where(cu[1:] > cu[:-1], cu[1:] - 1, cu[:-1])
    owner = jnp.clip(last // N, 0, n_dev - 1)
    mine = (owner == d)[:, None, None]
    return y, jax.lax.psum(jnp.where(mine, new.astype(jnp.float32), 0.0), axis).astype(new.dtype)


def gated_deltanet_ragged(p: dict, x: jax.Array, seq: jax.Array, valid: jax.Array, cu_seqlens: jax.Array,
                          conv_state: jax.Array, ssm_state: jax.Array, *, num_k_heads: int, num_v_heads: int,
                          head_k_dim: int, head_v_dim: int, eps: float, impl: str = "auto", gate_act=jax.nn.silu,
                          context_axis: str | None = None):
    """`gated_deltanet` over a ragged batch (hybrid_jax.models.ragged): x [N, Hd]; seq [N], valid [N];
    cu_seqlens [S + 1]; conv_state [S, W-1, C]; ssm_state [S, HV, K, V] fp32 (row s: sequence s's).
    The chunked rule runs the packed sequences with `cu_seqlens` (each padded to the chunk size, no
    padding to the longest). Returns (out [N, Hd], conv_state, ssm_state).
    context_axis: inside `jax.shard_map` over that axis, the rows (x, seq, valid) split by position, the
    states and cu_seqlens whole: the conv and the rule run context-parallel (pallas_kernels.context_parallel),
    the states come back whole."""
    H, HV, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    qkv, z, b, a = _project(p, x, H, HV, K, V)
    qkv, conv_state = ragged_causal_conv(qkv, conv_state, p["conv"], seq, cu_seqlens, context_axis=context_axis)
    q, k, v = _split_qkv(qkv, H, HV, K, V)
    beta, g = _gates(p, b, a, valid)
    o, ssm_state = _rule(pallas_kernels.chunk_gated_delta_rule, q[None], k[None], v[None], g[None], beta[None],
                         ssm_state, cu_seqlens, use_qk_l2norm_in_kernel=True, impl=impl, context_axis=context_axis)
    return _output(p, o[0], z, eps, x.dtype, gate_act), conv_state, ssm_state
