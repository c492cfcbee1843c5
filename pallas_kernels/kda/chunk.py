"""Chunked Kimi Delta Attention in plain XLA (the WY / UT form with a decay per key channel), the fast
path on CPU.

Inside a chunk of C tokens, with gc [C, K] the cumulative log decay from the chunk start (per value
head and key channel, non-increasing along the chunk):
    P_x[i, j] = sum_d x_i[d] k_j[d] exp(gc_i[d] - gc_j[d])          for x in {q, k}, j <= i
    A   = (I + tril(beta_i P_k[i, j], -1))^-1
    u   = A (beta v)        w = A (beta k exp(gc))
Across chunks, with h [K, V] the state entering the chunk:
    v'  = u - w h
    o   = (q exp(gc)) h + tril(P_q) v'
    h  <- diag(exp(gc_last)) h + (k exp(gc_last - gc))^T v'
Gated DeltaNet's scalar decay factors out of P (exp(gc_i - gc_j) multiplies a plain q k^T); a decay per
channel does not, and exp(-gc) over a chunk overflows f32 when a channel decays fast (g ~ -20 per
token). So P is computed in log space, by sub-blocks of `sub` rows: a block pair (i in a later block
than j) scales both sides to the first row r of i's block, x_i exp(gc_i - gc_r) and k_j exp(gc_r - gc_j),
both factors <= 1, and takes one matmul; the blocks on the diagonal are formed elementwise,
exp(gc_i - gc_j) with i >= j masked on the exponent before the exp. Every exponent is <= 0.
The driver (padding, packed batches, the UT inverse, the state layout) is Gated DeltaNet's chunk.py
(`run_chunked` with this module's `KDA` rule).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule.chunk import ChunkRule, run_chunked, unit_lower_inverse

ABI = abi.KIMI_DELTA_ATTENTION

_HI = jax.lax.Precision.HIGHEST
_NEG = -1e30
# Rows per sub-block of the log-space products: the diagonal blocks cost C * SUB * K exps per chunk.
SUB_BLOCK = 8
# Chunk size on CPU (benchmarks/kda.py).
DEFAULT_CHUNK_SIZE = 32


def decayed_products(x: jax.Array, k: jax.Array, gc: jax.Array, sub: int = SUB_BLOCK) -> jax.Array:
    """P[..., x, i, j] = sum_d x[..., x, i, d] k[..., j, d] exp(gc[..., i, d] - gc[..., j, d]) for j <= i, 0 above.

    x [..., X, C, K] (X operands side by side), k [..., C, K], gc [..., C, K] cumulative log decay, all
    broadcast to gc's leading dims. Returns [..., X, C, C] f32. No exponent is positive (module docstring)."""
    lead, (C, K) = gc.shape[:-2], gc.shape[-2:]
    X = x.shape[-3]
    x = jnp.broadcast_to(x, lead + (X, C, K))
    k = jnp.broadcast_to(k, lead + (C, K))
    c = sub if C % sub == 0 and C > sub else C
    nb = C // c
    gb = gc.reshape(lead + (nb, c, K))
    ref = gb[..., :, :1, :]                                                     # [..., nb, 1, K]
    # later block i against earlier columns j: both factors scaled to block i's first row
    xs = x.reshape(lead + (X, nb, c, K)) * jnp.exp(gb - ref)[..., None, :, :, :]
    before = jnp.arange(C)[None, :] < (jnp.arange(nb) * c)[:, None]              # [nb, C]
    ks = k[..., None, :, :] * jnp.exp(jnp.where(before[:, :, None], ref - gc[..., None, :, :], _NEG))   # [..., nb, C, K]
    off = jnp.einsum("...xbik,...bjk->...xbij", xs, ks, precision=_HI)          # [..., X, nb, c, C]
    # the diagonal blocks, elementwise
    i = jnp.arange(c)
    d = jnp.exp(jnp.where((i[:, None] >= i[None, :])[:, :, None], gb[..., :, None, :] - gb[..., None, :, :], _NEG))
    diag = jnp.einsum("...xbik,...bjk,...bijk->...xbij", x.reshape(lead + (X, nb, c, K)),
                      k.reshape(lead + (nb, c, K)), d, precision=_HI)           # [..., X, nb, c, c]
    blocks = diag[..., :, :, None, :] * jnp.eye(nb, dtype=diag.dtype)[:, None, :, None]
    return (off + blocks.reshape(lead + (X, nb, c, C))).reshape(lead + (X, C, C))


def chunk_prepare(q, k, v, g, beta, C):
    """Intra-chunk work, all chunks at once. q, k [B, T, H, K]; v [B, T, H, r, V]; g [B, T, H, r, K];
    beta [B, T, H, r], fp32, q scaled, T a multiple of C. Returns, chunk axis N leading:
      qw     [N, B, H, r, 2C, K]  [q exp(gc); w], w = A (beta k exp(gc)): both multiply the entering state
      u      [N, B, H, r, C, V]   A (beta v)
      attn   [N, B, H, r, C, C]   tril(P_q)
      kd     [N, B, H, r, C, K]   k exp(gc_last - gc)
      decay  [N, B, H, r, K]      exp(gc_last)
    """
    B, T, H, K = q.shape
    r, V = v.shape[3], v.shape[4]
    N = T // C
    qc = q.reshape(B, N, C, H, K).transpose(1, 0, 3, 2, 4)[:, :, :, None]          # [N, B, H, 1, C, K]
    kc = k.reshape(B, N, C, H, K).transpose(1, 0, 3, 2, 4)[:, :, :, None]
    vc = v.reshape(B, N, C, H, r, V).transpose(1, 0, 3, 4, 2, 5)                    # [N, B, H, r, C, V]
    gc = jnp.cumsum(g.reshape(B, N, C, H, r, K), axis=2).transpose(1, 0, 3, 4, 2, 5)  # [N, B, H, r, C, K]
    bc = beta.reshape(B, N, C, H, r).transpose(1, 0, 3, 4, 2)                        # [N, B, H, r, C]

    prod = decayed_products(jnp.stack([qc, kc], axis=-3), kc, gc)                   # [N, B, H, r, 2, C, C]
    i = jnp.arange(C)
    attn = prod[..., 0, :, :]
    A = unit_lower_inverse(jnp.where(i[:, None] > i[None, :], bc[..., :, None] * prod[..., 1, :, :], 0.0))
    Ab = A * bc[..., None, :]                                                        # column scaling of A
    eg = jnp.exp(gc)
    u = jnp.matmul(Ab, vc, precision=_HI)
    w = jnp.matmul(Ab, kc * eg, precision=_HI)
    g_last = gc[..., -1:, :]
    return (jnp.concatenate([qc * eg, w], axis=-2), u, attn, kc * jnp.exp(g_last - gc), jnp.exp(g_last[..., 0, :]))


def chunk_scan(h0, qw, u, attn, kd, decay):
    """The sequential part: carry the state h [B, H, r, K, V] across chunks.
    Returns (o [N, B, H, r, C, V], final h)."""
    C = u.shape[-2]

    def step(h, xs):
        qw_n, u_n, attn_n, kd_n, decay_n = xs
        p = jnp.matmul(qw_n, h, precision=_HI)                                  # [B, H, r, 2C, V]
        v_new = u_n - p[..., C:, :]
        o = p[..., :C, :] + jnp.matmul(attn_n, v_new, precision=_HI)
        h = decay_n[..., None] * h + jnp.einsum("bhrck,bhrcv->bhrkv", kd_n, v_new, precision=_HI)
        return h, o
    h, o = jax.lax.scan(step, h0, (qw, u, attn, kd, decay))
    return o, h


KDA = ChunkRule(chunk_prepare, chunk_scan, per_channel=True)


def chunk_kda_xla(
    q: jax.Array,            # [B, T, H, K]
    k: jax.Array,            # [B, T, H, K]
    v: jax.Array,            # [B, T, HV, V]
    g: jax.Array,            # [B, T, HV, K]  log decay per key channel
    beta: jax.Array,         # [B, T, HV]
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, HV, K, V] fp32
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,     # [N + 1] int32, packed batch (B == 1)
    chunk_size: int | None = None,
):
    """Chunked form. Returns (o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] fp32 or None). T is
    padded to a multiple of chunk_size with g = 0, beta = 0 (the state stays); with cu_seqlens every
    sequence is padded so (N sequences)."""
    return run_chunked(KDA, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens, chunk_size or DEFAULT_CHUNK_SIZE)
