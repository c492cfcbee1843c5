"""Token-level reference of the gated delta rule: one `lax.scan` step per token.

For every token t and value head hv (key head h = hv // (HV // H)):
    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t
The slowest and simplest form; every other implementation is tested against it.
With cu_seqlens (packed batch, B == 1) the state is reset to sequence n's initial state at the
first token of sequence n, and the state after its last token is its final state.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule import varlen
from pallas_kernels.gated_delta_rule.common import check_inputs, default_scale, per_token_output, prepare

ABI = abi.GATED_DELTA_RULE   # writes state[N, HV, K, V] f32, like every other implementation


def decay(S, g_t):
    """S * exp(g_t), the decay broadcast over the state's trailing axes: g_t [B, H, r] (one per head,
    Gated DeltaNet) scales the whole [K, V] state, g_t [B, H, r, K] (one per key channel, KDA) its rows."""
    a = jnp.exp(g_t)
    return S * a.reshape(a.shape + (1,) * (S.ndim - a.ndim))


def _update(S, q_t, k_t, v_t, g_t, b_t):
    # S: [B, H, r, K, V]; q_t, k_t: [B, H, K]; v_t: [B, H, r, V]; b_t: [B, H, r]; g_t: [B, H, r] or,
    # per channel, [B, H, r, K]
    S = decay(S, g_t)
    kv = jnp.einsum("bhk,bhrkv->bhrv", k_t, S, precision="highest")
    delta = (v_t - kv) * b_t[..., None]
    S = S + k_t[:, :, None, :, None] * delta[:, :, :, None, :]
    o_t = jnp.einsum("bhk,bhrkv->bhrv", q_t, S, precision="highest")
    return S, o_t, delta


def _per_token(S, delta, keep: str | None):
    return {"states": S, "deltas": delta}.get(keep)


def _step(S, xs, keep: str | None, update):
    S, o_t, delta = update(S, *xs)
    return S, (o_t, _per_token(S, delta, keep))


def _step_varlen(carry, xs, S0, keep: str | None, update):
    # carry: S [1, ...], finals [N, ...]; S0: [N, ...] (the state in the update's layout)
    S, finals = carry
    q_t, k_t, v_t, g_t, b_t, seq, first, valid = xs
    S = jnp.where(first, S0[seq][None], S)
    S, o_t, delta = update(S, q_t, k_t, v_t, g_t, b_t)
    finals = finals.at[seq].set(jnp.where(valid, S[0], finals[seq]))
    o_t = jnp.where(valid, o_t, 0.0)
    return (S, finals), (o_t, _per_token(S, jnp.where(valid, delta, 0.0), keep))


STATIC = ("scale", "output_final_state", "output_all_states", "use_qk_l2norm_in_kernel", "output_deltas")


def recurrent_gated_delta_rule(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV]  log decay, <= 0
    beta: jax.Array,         # [B, T, HV]
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    output_all_states: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    output_deltas: bool = False,
    *,
    update=_update,
    k_major: bool = False,
    per_channel: bool = False,
):
    """Token-level scan. Returns (o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] fp32 or None,
    and, with output_all_states, the state after every token [B, T, HV, K, V] fp32, or, with
    output_deltas, every token's state update delta [B, T, HV, V] fp32 (see `rebuild`).
    N = B, or the number of sequences with cu_seqlens.
    update(S, q_t, k_t, v_t, g_t, b_t) -> (S, o_t, delta) is one token's step (shapes as `_update`'s;
    `fused_recurrent` passes its own); k_major: it carries the state as [B, H, K, r, V] instead of
    [B, H, r, K, V]; per_channel: g is [B, T, HV, K], a decay per key channel (Kimi Delta Attention,
    pallas_kernels.kda), and g_t [B, H, r, K]."""
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=per_channel)
    keep = per_token_output(output_all_states, output_deltas)
    N = B if cu_seqlens is None else varlen.check_cu_seqlens(cu_seqlens)
    r = HV // H
    out_dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, default_scale(scale, K), use_qk_l2norm_in_kernel)
    S0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    S0 = S0.reshape(N, H, r, K, V)
    layout = (lambda S: jnp.swapaxes(S, -3, -2)) if k_major else (lambda S: S)   # its own inverse
    S0 = layout(S0)
    xs = (jnp.moveaxis(q, 1, 0), jnp.moveaxis(k, 1, 0),
          jnp.moveaxis(v.reshape(B, T, H, r, V), 1, 0),
          jnp.moveaxis(g.reshape((B, T, H, r) + g.shape[3:]), 1, 0), jnp.moveaxis(beta.reshape(B, T, H, r), 1, 0))
    if cu_seqlens is None:
        S, (o, per_tok) = jax.lax.scan(functools.partial(_step, keep=keep, update=update), S0, xs)
        final = S
    else:
        seq, first, valid = varlen.token_layout(cu_seqlens, T)
        step = functools.partial(_step_varlen, S0=S0, keep=keep, update=update)
        (_, final), (o, per_tok) = jax.lax.scan(step, (jnp.zeros_like(S0[:1]), S0),
                                              xs + (seq, first, valid))
    o = jnp.moveaxis(o, 0, 1).reshape(B, T, HV, V).astype(out_dtype)
    final = layout(final).reshape(N, HV, K, V) if output_final_state else None
    if keep == "states":
        return o, final, layout(jnp.moveaxis(per_tok, 0, 1)).reshape(B, T, HV, K, V)
    if keep == "deltas":
        return o, final, jnp.moveaxis(per_tok, 0, 1).reshape(B, T, HV, V)
    return o, final


naive_recurrent_gated_delta_rule = jax.jit(recurrent_gated_delta_rule, static_argnames=STATIC)
