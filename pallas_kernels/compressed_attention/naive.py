"""Token-level references of the DeepSeek-V4 compressed-attention ops: obviously right, slow.

compress_reference walks one row's tokens with `lax.scan`, appending each valid token to the tail and
pooling the tail into an entry the moment it is full (the CSA overlap state moves along with it), so it
checks the fast paths' whole-step bookkeeping (stream shifts, closed windows, tail, overlap) as well as
the pooling. attention_reference handles one query at a time (`vmap` over rows and queries): it
gathers that query's keys, masks them, and takes the softmax with the sink as one more logit.
Layouts: common.py and ops.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.compressed_attention.common import (
    dense_indices, n_windows, rms_norm, rope_interleaved, window_mask,
)


def pool_window(cur_kv, cur_gate, prev_kv, prev_gate, has_prev, bias, *, overlap: bool):
    """One entry before its norm: cur_kv, cur_gate [m, C] (raw gates); prev_kv, prev_gate [m, C/2] (gates
    biased) or None; has_prev bool -> [D] f32, sum over slots of softmax(gates) * kv per channel."""
    kv = cur_kv.astype(jnp.float32)
    g = cur_gate.astype(jnp.float32) + bias.astype(jnp.float32)
    if overlap:
        D = kv.shape[1] // 2
        pg = jnp.where(has_prev, prev_gate.astype(jnp.float32), -jnp.inf)
        kv = jnp.concatenate([prev_kv.astype(jnp.float32), kv[:, D:]], axis=0)      # [2m, D]
        g = jnp.concatenate([pg, g[:, D:]], axis=0)
    return jnp.sum(kv * jax.nn.softmax(g, axis=0), axis=0)


def _compress_row(kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, ov_kv, ov_gate, bias,
                  norm_w, freqs, *, rate, overlap, eps, rope_scale):
    T, C = kv_new.shape
    NW = n_windows(T, rate)
    D = C // 2 if overlap else C
    if not overlap:       # placeholders so the scan carry has one structure
        ov_kv = ov_gate = jnp.zeros((rate, 1), tail_kv.dtype)

    def step(carry, xs):
        tkv, tg, cnt, okv, og, closed, ents = carry
        x_kv, x_g, t = xs
        live = t < n_new
        slot = jnp.where(live, cnt, rate)                                            # rate: dropped
        tkv = tkv.at[slot].set(x_kv.astype(tkv.dtype), mode="drop")
        tg = tg.at[slot].set(x_g.astype(tg.dtype), mode="drop")
        cnt = cnt + live.astype(cnt.dtype)
        full = cnt == rate
        e = pool_window(tkv, tg, okv, og, entry_count + closed > 0, bias, overlap=overlap)
        ents = ents.at[jnp.where(full, closed, NW)].set(e, mode="drop")
        if overlap:
            okv = jnp.where(full, tkv[:, :D].astype(okv.dtype), okv)
            og = jnp.where(full, (tg[:, :D].astype(jnp.float32) + bias[:, :D].astype(jnp.float32)).astype(og.dtype),
                           og)
        closed = closed + full.astype(closed.dtype)
        cnt = jnp.where(full, 0, cnt)
        return (tkv, tg, cnt, okv, og, closed, ents), None

    init = (tail_kv, tail_gate, tail_count, ov_kv, ov_gate, jnp.zeros((), jnp.int32), jnp.zeros((NW, D), jnp.float32))
    (tkv, tg, cnt, okv, og, closed, ents), _ = jax.lax.scan(
        step, init, (kv_new, gate_new, jnp.arange(T, dtype=jnp.int32)))
    k = jnp.arange(NW, dtype=jnp.int32)
    ents = rms_norm(ents, norm_w, eps)
    ents = rope_interleaved(ents[None], ((entry_count + k) * rate)[None], freqs, rope_scale)[0]
    keep = (jnp.arange(rate) < cnt)[:, None]
    idx = jnp.where(k < closed, entry_count + k, -1)
    return ents.astype(kv_new.dtype), idx, jnp.where(keep, tkv, 0), jnp.where(keep, tg, 0), cnt, okv, og


@functools.partial(jax.jit, static_argnames=("rate", "overlap", "eps", "rope_scale"))
def compress_reference(kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv,
                       overlap_gate, bias, norm_w, freqs, *, rate: int, overlap: bool, eps: float,
                       rope_scale: float = 1.0):
    """Shapes as ops.compress_windows -> (entries [B, NW, D], index [B, NW], (tail_kv, tail_gate, tail_count),
    (overlap_kv, overlap_gate) or None)."""
    B = kv_new.shape[0]
    if not overlap:
        overlap_kv = overlap_gate = jnp.zeros((B, rate, 1), tail_kv.dtype)
    fn = jax.vmap(lambda *a: _compress_row(*a, bias, norm_w, freqs, rate=rate, overlap=overlap, eps=eps,
                                           rope_scale=rope_scale))
    ents, idx, tkv, tg, cnt, okv, og = fn(kv_new, gate_new, tail_kv, tail_gate, tail_count.astype(jnp.int32),
                                         n_new.astype(jnp.int32), entry_count.astype(jnp.int32),
                                         overlap_kv, overlap_gate)
    return ents, idx, (tkv, tg, cnt), ((okv, og) if overlap else None)


def _attend_one(q, keys, ok, sinks, scale):
    """q [H, D], keys [N, D] f32, ok [N] bool, sinks [H] -> [H, D] f32."""
    s = jnp.where(ok[None, :], jnp.dot(q.astype(jnp.float32), keys.T, precision=jax.lax.Precision.HIGHEST) * scale,
                  -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([s, sinks.astype(jnp.float32)[:, None]], axis=1), axis=1)
    return jnp.dot(p[:, :-1], keys, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("window", "scale", "rate"))
def attention_reference(q, kv, kv_positions, q_positions, entries, page_table, indices, entry_counts, sinks, *,
                        window: int, scale: float, rate: int | None = None):
    """Shapes as ops.compressed_sparse_read -> [B, T, H, D] f32. HCA (rate, no indices) reads its entries as
    per-query index lists of every closed window."""
    B, T = q.shape[:2]
    if entries is not None and indices is None:
        indices = dense_indices(q_positions, page_table.shape[1] * entries.shape[1], rate)
    ok_w = window_mask(kv_positions, q_positions, window)                          # [B, T, S]
    keys = jnp.broadcast_to(kv.astype(jnp.float32)[:, None], (B, T) + kv.shape[1:])
    if indices is not None:
        from pallas_kernels.sparse_attention.common import physical_rows  # noqa: PLC0415
        P, ps, D = entries.shape
        rows, ok_e = physical_rows(indices, page_table, ps, P, entry_counts)        # [B, T, K]
        ext = entries.reshape(P * ps, D)[rows].astype(jnp.float32)                  # [B, T, K, D]
        keys = jnp.concatenate([keys, ext], axis=2)
        ok_w = jnp.concatenate([ok_w, ok_e], axis=2)
    one = jax.vmap(jax.vmap(_attend_one, in_axes=(0, 0, 0, None, None)), in_axes=(0, 0, 0, None, None))
    return one(q, keys, ok_w, sinks, scale)
