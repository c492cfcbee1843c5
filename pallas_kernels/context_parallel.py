"""Context parallelism for the chunked linear-attention rules: one prefill's tokens split by position over
a mesh axis, for every rule whose state update is affine in the state (Gated DeltaNet, Kimi Delta
Attention, Mamba2's SSD), with any implementation of the rule (reference, XLA, Pallas) unchanged.

Why it works. Such a rule carries a state h [K, V] per value head through the tokens, and a span of
tokens maps it affinely, h -> M h + b (M [K, K]: the decays times I minus the delta rule's corrections;
for Mamba2 a scalar decay), while each token's output is o0 + p h (o0 [V] its output from a zero state,
p [K]). Run the rule over a span with the value columns extended by K zero columns and the entering
state extended by the identity,

    v' = [v | 0]      h0' = [0 | I]    ->    o' = [o0 | p]      final' = [b | M]

(the state is linear in (h0, v), so the identity's columns carry M and the outputs' extra columns carry
p). A device holding positions [d TL, (d + 1) TL) therefore:

1. runs the rule once over its span with V + K value columns (a piece of a sequence that starts in the
   span enters with [h0 | 0] instead: its map is the constant b, and its p is 0);
2. all-gathers one map per device -- that of the piece its span ends in -- and folds, in device order,
   the maps of the devices before it that carry the sequence its span begins in: its incoming state
   h_in (at most P - 1 products [K, K] x [K, V]);
3. corrects that piece's outputs, o = o0 + p h_in (one matmul per token, no sequential work), and
   its final state, b + M h_in; each sequence's final state comes from the device its last token is on
   (a sum over the axis of the owners' states).

A span holds at most one piece that began before it (its first) and one that goes on after it (its
last), so one map per device is all the axis exchanges, whatever the number of sequences packed.
Cost on each device: the rule over T / P tokens with V + K value columns instead of V (twice the value
columns at K = V), the fold and the correction. The outputs equal one device's to rounding: the spans
cut chunks where one device would not, and the sums are taken in another order.

Shapes (the gated delta rule's, inside `jax.shard_map` over `axis`, tokens split by position):
  q, k [B, TL, H, K]   v [B, TL, HV, V]   g [B, TL, HV] (or [B, TL, HV, K])   beta [B, TL, HV]  local spans
  initial_state [N, HV, K, V] f32, cu_seqlens [N + 1] int32 (global positions)   replicated
  returns o [B, TL, HV, V] (local span), final [N, HV, K, V] f32 (replicated)
Without cu_seqlens each of the B rows is one sequence of P * TL tokens; with them B == 1.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

_HI = jax.lax.Precision.HIGHEST

Rule = Callable  # rule(q, k, v, g, beta, initial_state, cu_seqlens) -> (o, final [N, HV, K, V] f32)


def _apply(M, h, b):
    """M h + b over [..., K, K] x [..., K, V]."""
    return jnp.einsum("...kj,...jv->...kv", M, h, precision=_HI) + b


def _extended(h0: jax.Array, carried: jax.Array) -> jax.Array:
    """The entering states with K identity columns: [0 | I] where `carried` (the piece began on an
    earlier device), [h0 | 0] elsewhere. h0 [N, HV, K, V], carried [N] bool -> [N, HV, K, V + K]."""
    N, HV, K, _ = h0.shape
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (N, HV, K, K))
    c = carried[:, None, None, None]
    return jnp.concatenate([jnp.where(c, 0.0, h0), jnp.where(c, eye, 0.0)], axis=-1)


def chunked_over_axis(rule: Rule, q, k, v, g, beta, initial_state, cu_seqlens, *, axis: str):
    """`rule` over a sequence split by position over mesh axis `axis` (module docstring); call it inside
    `jax.shard_map` with the token arrays split along T and the state and cu_seqlens replicated.
    Returns (o [B, TL, HV, V] in v.dtype, final [N, HV, K, V] f32)."""
    B, TL, HV, V = v.shape
    K = q.shape[-1]
    d = jax.lax.axis_index(axis)
    n_dev = jax.lax.psum(1, axis)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    h0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    lo, hi = d * TL, (d + 1) * TL
    if cu_seqlens is None:
        carried = jnp.broadcast_to(d > 0, (N,))
        local_cu = None
    else:
        cu = cu_seqlens.astype(jnp.int32)
        carried = (cu[:-1] < lo) & (cu[1:] > lo)                  # began before the span, goes on in it
        local_cu = local_cu_seqlens(cu, TL, axis)
    # in v's dtype: a bf16 model's span reads and writes bf16 (p is then rounded as o is, once more than on
    # one device); f32 inputs stay exact
    v_ext = jnp.concatenate([v, jnp.zeros((B, TL, HV, K), v.dtype)], axis=-1)
    o_ext, f_ext = rule(q, k, v_ext, g, beta, _extended(h0, carried), local_cu)
    o0, p = o_ext[..., :V].astype(jnp.float32), o_ext[..., V:].astype(jnp.float32)
    b, M = f_ext[..., :V], f_ext[..., V:]

    if cu_seqlens is None:
        # every row is carried through every device: gather all rows' maps, fold those before d
        Ms, bs = jax.lax.all_gather(M, axis), jax.lax.all_gather(b, axis)          # [P, B, HV, K, K|V]
        h_in, final = jnp.zeros_like(b), jnp.zeros_like(b)
        for j in range(n_dev):
            final = _apply(Ms[j], final, bs[j])
            h_in = jnp.where(j < d, final, h_in)
        o = o0 + jnp.einsum("bthk,bhkv->bthv", p, h_in, precision=_HI)
        return o.astype(v.dtype), final

    # packed: the piece the span ends in may go on; the one it begins in may have come from before
    def piece_at(pos):                     # the sequence holding global position pos, and whether any does
        n = jnp.clip(jnp.searchsorted(cu[1:], pos, side="right"), 0, N - 1)
        return n, (cu[n] <= pos) & (pos < cu[n + 1])
    n_out, _ = piece_at(hi - 1)
    Ms = jax.lax.all_gather(M[n_out], axis)                                         # [P, HV, K, K]
    bs = jax.lax.all_gather(b[n_out], axis)                                         # [P, HV, K, V]
    n_in = jnp.clip(jnp.searchsorted(cu[1:], lo, side="right"), 0, N - 1)
    has_in = carried[n_in]
    h_in = jnp.zeros((HV, K, V), jnp.float32)
    for j in range(n_dev):                 # devices before d ending in the piece d begins in
        hi_j = (j + 1) * TL
        n_j, inside = piece_at(hi_j - 1)
        use = (j < d) & has_in & inside & (n_j == n_in) & (cu[n_in + 1] > hi_j)
        h_in = jnp.where(use, _apply(Ms[j], h_in, bs[j]), h_in)
    o = o0 + jnp.einsum("bthk,hkv->bthv", p, h_in, precision=_HI)
    mine = b.at[n_in].set(jnp.where(has_in, _apply(M[n_in], h_in, b[n_in]), b[n_in]))
    nonempty = cu[1:] > cu[:-1]
    owner = jnp.clip(jnp.where(nonempty, cu[1:] - 1, cu[:-1]) // TL, 0, n_dev - 1)    # the device of the last token
    final = jax.lax.psum(jnp.where((owner == d)[:, None, None, None], mine, 0.0), axis)
    return o.astype(v.dtype), final


def split_over(rule: Rule, mesh, axis: str) -> Rule:
    """`rule` as a function of whole (global) arrays that runs context-parallel over `axis` of `mesh`:
    the token arrays split by position (T must be a multiple of the axis size; with cu_seqlens, pad with
    tokens outside every sequence), the state and cu_seqlens replicated. Returns (o, final)."""
    def run(q, k, v, g, beta, initial_state, cu_seqlens):
        n_dev = mesh.shape[axis]
        if q.shape[1] % n_dev:
            raise ValueError(f"context parallelism over {n_dev} devices needs T a multiple of {n_dev}; got T = "
                             f"{q.shape[1]}")
        tok = P(None, axis)
        args = (q, k, v, g, beta, initial_state, cu_seqlens)
        specs = (tok,) * 5 + (None if initial_state is None else P(), None if cu_seqlens is None else P())

        def body(q, k, v, g, beta, h0, cu):
            return chunked_over_axis(rule, q, k, v, g, beta, h0, cu, axis=axis)
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=False)(*args)
    return run


def run_rule(rule, args: tuple, context_axis: str | None, output_final_state: bool):
    """What a chunked op returns: rule(*args) on one device, or its context-parallel form over
    `context_axis` (rule called with output_final_state on: the maps are its final states).
    rule(q, k, v, g, beta, h0, cu, final=bool) -> (o, final or None)."""
    if context_axis is None:
        return rule(*args)
    o, final = chunked_over_axis(lambda *a: rule(*a, final=True), *args, axis=context_axis)
    return o, (final if output_final_state else None)


def local_cu_seqlens(cu_seqlens, span: int, context_axis: str | None):
    """The packed batch's boundaries in this device's span of `span` positions (cu_seqlens itself without
    a context axis): positions before the span become 0, after it `span`."""
    if cu_seqlens is None or context_axis is None:
        return cu_seqlens
    lo = jax.lax.axis_index(context_axis) * span
    return jnp.clip(cu_seqlens.astype(jnp.int32) - lo, 0, span)
