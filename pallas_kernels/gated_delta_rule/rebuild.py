"""The recurrent state after any one position of a window, rebuilt from the window's rank-one updates.

Token t of the gated delta rule decays the state and adds one outer product:
    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,    delta_t = beta_t (v_t - k_t^T exp(g_t) S_{t-1})
so, with G_t = g_1 + ... + g_t,
    S_a = exp(G_a) S_0 + sum_{t <= a} exp(G_a - G_t) k_t delta_t^T.
With a decay per key channel (KDA, g [B, T, HV, K]) exp(.) is a diagonal over the state's rows, and
the same sum holds row by row.
A kernel that emits delta_t [HV, V] per token (`output_deltas`) lets a speculative verify keep the
state after its last accepted token without writing the whole state [HV, K, V] after every token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.common import l2norm


def state_after(
    initial_state: jax.Array,   # [B, HV, K, V] f32: the state before the window
    k: jax.Array,               # [B, T, H, K]: the window's keys, as given to the kernel
    g: jax.Array,               # [B, T, HV] (or [B, T, HV, K] per channel): log decay, as given to the kernel
    deltas: jax.Array,          # [B, T, HV, V] f32: the kernel's per-token updates (output_deltas)
    idx: jax.Array,             # [B] int32 in [0, T): the position whose state to rebuild
    use_qk_l2norm_in_kernel: bool = False,
) -> jax.Array:
    """The state after position idx[b] of row b: [B, HV, K, V] f32."""
    B, T, H, K = k.shape
    HV, V = deltas.shape[2], deltas.shape[3]
    r = HV // H
    kf = l2norm(k) if use_qk_l2norm_in_kernel else k.astype(jnp.float32)
    G = jnp.cumsum(g.astype(jnp.float32), axis=1)                              # [B, T, HV(, K)]
    at = idx.reshape((B, 1) + (1,) * (G.ndim - 2))
    Ga = jnp.take_along_axis(G, at, axis=1)                                    # [B, 1, HV(, K)]
    t = jnp.arange(T).reshape((1, T) + (1,) * (G.ndim - 2))
    w = jnp.where(t <= at, jnp.exp(Ga - G), 0.0)                               # [B, T, HV(, K)]
    if G.ndim == 4:
        upd = jnp.einsum("bthrk,bthk,bthrv->bhrkv", w.reshape(B, T, H, r, K), kf, deltas.reshape(B, T, H, r, V),
                         precision="highest")
        return jnp.exp(Ga[:, 0])[..., None] * initial_state + upd.reshape(B, HV, K, V)
    upd = jnp.einsum("bthr,bthk,bthrv->bhrkv", w.reshape(B, T, H, r), kf, deltas.reshape(B, T, H, r, V),
                     precision="highest")
    return jnp.exp(Ga[:, 0])[..., None, None] * initial_state + upd.reshape(B, HV, K, V)
