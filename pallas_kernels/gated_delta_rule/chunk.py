"""Chunked gated delta rule in plain XLA (the WY / UT form) — the fast path on CPU.

Inside a chunk of C tokens, with gc the cumulative log decay from the chunk start:
    A   = (I + tril(beta_i k_i.k_j exp(gc_i - gc_j), -1))^-1          [C, C]
    u   = A (beta v)        w = A (beta k exp(gc))
Across chunks, with h the state entering the chunk:
    v'  = u - w h
    o   = (q exp(gc)) h + tril(q_i.k_j exp(gc_i - gc_j)) v'
    h  <- exp(gc_last) h + (k exp(gc_last - gc))^T v'
The unit-lower-triangular inverse is built from matmuls only (block recursion down to 16 x 16
blocks, which are inverted by repeated squaring: (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... since
N is nilpotent): no triangular solve (which can starve jaxlib's CPU thread pool), and it lowers on
every backend.
Masks are applied to the exponent (a large negative) before the exp, never after.
CPU performance (benchmarks/gdn.py): at T = 8192, H = 16, K = V = 128 the path runs ~19 GFLOP of
matmuls at ~30 GFLOP/s. Two limits, both XLA:CPU's: a batched matmul of these small shapes reaches
~30-60 GFLOP/s (torch.bmm ~2x that), and the scan's batched matmuls run on one thread, so the
sequential part (6 K V FLOPs per token and head) is a floor that no reordering removes.
With cu_seqlens every sequence is padded to a multiple of C (varlen.chunk_layout) and the scan
resets the state at each sequence's first chunk and records it after each of its chunks.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule import varlen
from pallas_kernels.gated_delta_rule.common import check_inputs, default_scale, prepare

ABI = abi.GATED_DELTA_RULE   # writes state[N, HV, K, V] f32, like every other implementation

_HI = jax.lax.Precision.HIGHEST


def unit_lower_inverse_squaring(N: jax.Array) -> jax.Array:
    """(I + N)^-1 for strictly lower-triangular N: [..., C, C] -> [..., C, C] by repeated squaring:
    (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... since N is nilpotent; 2 (log2(C) - 1) C^3 matmuls."""
    C = N.shape[-1]
    eye = jnp.eye(C, dtype=N.dtype)
    P = -N
    inv = eye + P
    n = 2
    while n < C:
        P = jnp.matmul(P, P, precision=_HI)
        inv = jnp.matmul(inv, eye + P, precision=_HI)
        n *= 2
    return inv


def unit_lower_inverse(N: jax.Array, base: int = 16) -> jax.Array:
    """(I + N)^-1 for strictly lower-triangular N: [..., C, C] -> [..., C, C].

    Block recursion: with M = [[I + Na, 0], [B, I + Nd]],  M^-1 = [[Ia, 0], [-Id B Ia, Id]].
    Both diagonal halves are inverted in one batched call; blocks of `base` rows by repeated
    squaring. Costs ~C^3 / 2 multiply-adds in all, against 2 log2(C) C^3 for squaring the whole."""
    C = N.shape[-1]
    if C <= base or C % 2:
        return unit_lower_inverse_squaring(N)
    h = C // 2
    diag = unit_lower_inverse(jnp.stack([N[..., :h, :h], N[..., h:, h:]]), base)
    ia, id_ = diag[0], diag[1]
    low = -jnp.matmul(id_, jnp.matmul(N[..., h:, :h], ia, precision=_HI), precision=_HI)
    top = jnp.concatenate([ia, jnp.zeros_like(ia)], axis=-1)
    bottom = jnp.concatenate([low, id_], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def chunk_prepare(q, k, v, g, beta, C):
    """Intra-chunk work, all chunks at once (no sequential dependency).

    Inputs are fp32 and already scaled: q, k [B, T, H, K]; v [B, T, H, r, V]; g, beta [B, T, H, r]
    with T a multiple of C. Returns per-chunk tensors with the chunk axis N leading; q and k stay
    per key head (never repeated over the r value heads that share them), and the per-token decay
    factors are kept as vectors and applied to the small [C, V] / [C, C] operands instead of
    materialising scaled copies of q and k:
      qc, kc [N, B, H, C, K]
      u      [N, B, H, r, C, V]  A (beta v)
      w      [N, B, H, r, C, K]  A (beta exp(gc) k)
      attn   [N, B, H, r, C, C]  tril(q k^T exp(gc_i - gc_j))
      eg, dk [N, B, H, r, C]     exp(gc), exp(gc_last - gc)
      decay  [N, B, H, r]        exp(gc_last)
    """
    B, T, H, K = q.shape
    r, V = v.shape[3], v.shape[4]
    N = T // C
    qc = q.reshape(B, N, C, H, K).transpose(1, 0, 3, 2, 4)            # [N, B, H, C, K]
    kc = k.reshape(B, N, C, H, K).transpose(1, 0, 3, 2, 4)
    vc = v.reshape(B, N, C, H, r, V).transpose(1, 0, 3, 4, 2, 5)      # [N, B, H, r, C, V]
    gc = jnp.cumsum(g.reshape(B, N, C, H, r), axis=2).transpose(1, 0, 3, 4, 2)   # [N, B, H, r, C]
    bc = beta.reshape(B, N, C, H, r).transpose(1, 0, 3, 4, 2)          # [N, B, H, r, C]

    diff = gc[..., :, None] - gc[..., None, :]                         # [N, B, H, r, C, C]
    i = jnp.arange(C)
    strict = i[:, None] > i[None, :]
    causal = i[:, None] >= i[None, :]
    gamma_strict = jnp.exp(jnp.where(strict, diff, -1e30))
    gamma_causal = jnp.exp(jnp.where(causal, diff, -1e30))

    # q k^T and k k^T in one batched matmul: [q; k] k^T
    qkk = jnp.einsum("nbhck,nbhdk->nbhcd", jnp.concatenate([qc, kc], axis=3), kc, precision=_HI)
    qk, kk = qkk[:, :, :, None, :C], qkk[:, :, :, None, C:]           # [N, B, H, 1, C, C]
    A = unit_lower_inverse(bc[..., :, None] * kk * gamma_strict)
    attn = qk * gamma_causal
    eg = jnp.exp(gc)
    u = jnp.matmul(A * bc[..., None, :], vc, precision=_HI)            # column scaling of A, not of v
    w = jnp.matmul(A * (bc * eg)[..., None, :], kc[:, :, :, None], precision=_HI)
    return qc, kc, u, w, attn, eg, jnp.exp(gc[..., -1:] - gc), jnp.exp(gc[..., -1])


def chunk_scan(h0, qc, kc, u, w, attn, eg, dk, decay):
    """The sequential part: carry the state h [B, H, r, K, V] across chunks.
    Returns (o [N, B, H, r, C, V], final h)."""
    def step(h, xs):
        q_n, k_n, u_n, w_n, attn_n, eg_n, dk_n, decay_n = xs
        qh = jnp.einsum("bhck,bhrkv->bhrcv", q_n, h, precision=_HI) * eg_n[..., None]
        v_new = u_n - jnp.matmul(w_n, h, precision=_HI)
        o = qh + jnp.matmul(attn_n, v_new, precision=_HI)
        h = decay_n[..., None, None] * h + jnp.einsum("bhck,bhrcv->bhrkv", k_n, v_new * dk_n[..., None],
                                                      precision=_HI)
        return h, o
    h, o = jax.lax.scan(step, h0, (qc, kc, u, w, attn, eg, dk, decay))
    return o, h


def chunk_scan_varlen(h0, *parts_and_meta, scan=None):
    """chunk_scan (or `scan`, another rule's sequential part of the same form, e.g. KDA's) for a packed
    batch (B == 1): h0 [N, 1, H, r, K, V]; seq, first [NC].
    Returns (o [NC, 1, H, r, C, V], final states [N, 1, H, r, K, V])."""
    scan = scan or chunk_scan

    def step(carry, xs):
        h, finals = carry
        *parts, s, f = xs
        h = jnp.where(f, h0[s], h)
        o, h = scan(h, *(p[None] for p in parts))
        finals = finals.at[s].set(h)
        return (h, finals), o[0]
    (_, finals), o = jax.lax.scan(step, (jnp.zeros_like(h0[0]), h0), parts_and_meta)
    return o, finals


# Best chunk for XLA on CPU (measured by benchmarks/gdn.py, T = 8192, K = V = 128): the intra-chunk
# work grows with C, the sequential scan shrinks; 32 wins on CPU, 64 on the accelerators.
DEFAULT_CHUNK_SIZE = 32


@dataclasses.dataclass(frozen=True)
class ChunkRule:
    """A delta rule in chunked form, as `_chunk_xla` runs it: prepare(q, k, v, g, beta, C) is the
    intra-chunk work of all chunks at once (q, k [B, T, H, K]; v [B, T, H, r, V]; g [B, T, H, r] or, per
    channel, [B, T, H, r, K]; beta [B, T, H, r]) and returns the per-chunk parts scan(h0, *parts) carries
    the state [B, H, r, K, V] across, returning (o [N, B, H, r, C, V], final h). per_channel: g has a
    decay per key channel (Kimi Delta Attention, pallas_kernels.kda.chunk)."""
    prepare: Callable
    scan: Callable
    per_channel: bool = False


GATED_DELTA = ChunkRule(chunk_prepare, chunk_scan)


def chunk_gated_delta_rule_xla(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV]
    beta: jax.Array,         # [B, T, HV]
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    chunk_size: int | None = None,
):
    """Chunked form. Returns (o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] fp32 or None).
    T is padded up to a multiple of chunk_size with g = 0, beta = 0 (which leave the state unchanged);
    with cu_seqlens each sequence is padded so, and N is the number of sequences.
    A missing initial state becomes zeros before the jit boundary: one compilation serves both."""
    return run_chunked(GATED_DELTA, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens, chunk_size or DEFAULT_CHUNK_SIZE)


def run_chunked(rule: ChunkRule, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, chunk_size: int):
    """`rule` in chunked form over the inputs of `chunk_gated_delta_rule_xla` (g per channel with a
    per-channel rule); a missing initial state becomes zeros before the jit boundary."""
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=rule.per_channel)
    if initial_state is None:
        n = B if cu_seqlens is None else varlen.check_cu_seqlens(cu_seqlens)
        initial_state = jnp.zeros((n, HV, K, V), jnp.float32)
    return _chunk_xla(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_seqlens, chunk_size=chunk_size, rule=rule)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                             "chunk_size", "rule"))
def _chunk_xla(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV]
    beta: jax.Array,         # [B, T, HV]
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    rule: ChunkRule | None = None,
):
    rule = rule or GATED_DELTA
    B, T, H, K, HV, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=rule.per_channel)
    N = B if cu_seqlens is None else varlen.check_cu_seqlens(cu_seqlens)
    r = HV // H
    out_dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, default_scale(scale, K), use_qk_l2norm_in_kernel)
    C = chunk_size
    if cu_seqlens is None:
        pad = (-T) % C
        if pad:
            q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                                for x in (q, k, v, g, beta))
    else:
        src, pos, seq, first = varlen.chunk_layout(cu_seqlens, T, C)
        q, k, v, g, beta = (varlen.gather_tokens(x, src) for x in (q, k, v, g, beta))
    Tp = q.shape[1]
    h0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32)).reshape(N, H, r, K, V)
    parts = rule.prepare(q, k, v.reshape(B, Tp, H, r, V), g.reshape((B, Tp, H, r) + g.shape[3:]),
                         beta.reshape(B, Tp, H, r), C)
    if cu_seqlens is None:
        o, h = rule.scan(h0, *parts)
    else:
        o, h = chunk_scan_varlen(h0[:, None], *parts, seq, first, scan=rule.scan)
    # o: [NC, B, H, r, C, V] -> [B, NC, C, H, r, V]
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(B, Tp, HV, V)
    o = (o[:, :T] if cu_seqlens is None else varlen.scatter_back(o, pos)).astype(out_dtype)
    return o, (h.reshape(N, HV, K, V) if output_final_state else None)
