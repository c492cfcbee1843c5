"""Qwen4-Exp's PLE (per-layer embedding): hashed n-gram embeddings of the token ids, injected into every
hyper-connection stream through a gate and a dilated depthwise conv over positions.

For token t (n = ngram_size, context c = n - 1 tokens):
  shifted_s[t] = token[t - s] (s = 0 .. n-1), or EOS when that crosses an EOS or the sequence start
  hash_g[t]    = xor_{s < g} shifted_s[t] * m_s   (64-bit; m_s odd multipliers from a SplitMix64 stream)
  id_{g,h}[t]  = hash_g[t] mod p_{g,h} + offset_{g,h}   (heads_per_ngram heads per order g = 2 .. n, p a
                                                        distinct prime >= ngram_vocab_size_base per head)
  e[t]         = concat_h table[id_{g,h}[t]]                                     [E]
  key = norm_k(e K) [N, Hd], value = e V [Hd], query = norm_q(x) [N, Hd]     (streams normed one by one)
  gate_n = signed_sqrt(key_n . query_n / sqrt(Hd)),  g = sigmoid(gate)[:, None] * value     [N, Hd]
  out = g + silu(dilated_conv(norm_c(g)))     (kernel ple_conv_kernel_size, dilation n, causal)
The per-request state is the last c token ids and the conv's last (kernel - 1) * n inputs
(cache.ple.PLEGroup); with them a chunk or a decode step continues exactly where the last one ended.

JAX runs without 64-bit integers here, so the 64-bit products and the modulus are computed on pairs of
uint32 words (exact: every product of a token id and a multiplier is < 2^63).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from cache.state import conv_state_after
from hybrid_jax.layers.gated_deltanet import causal_conv
from hybrid_jax.layers.hyper_connections import normed_streams
from hybrid_jax.layers.linear import linear

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15           # SplitMix64's increment
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
RANK_STRIDE = 10007                   # the seed offset between consecutive PLE layers


@dataclasses.dataclass(frozen=True)
class NGramHash:
    """The static hash of one PLE layer: multipliers m_s (s < n), and per head its prime and table offset."""
    multipliers: tuple[int, ...]
    primes: tuple[int, ...]
    offsets: tuple[int, ...]
    heads_per_ngram: int
    eos: int


def splitmix64(v: int) -> int:
    """SplitMix64's output for state v (advanced by the golden increment first)."""
    z = (v + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def _is_prime(v: int) -> bool:
    if v < 2 or v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


@functools.lru_cache(maxsize=16)
def primes_from(base: int, count: int) -> tuple[int, ...]:
    """The first `count` primes >= base."""
    out, v = [], base
    while len(out) < count:
        if _is_prime(v):
            out.append(v)
        v += 1
    return tuple(out)


def ngram_hash(cfg, rank: int) -> NGramHash:
    """The hash of the PLE layer of rank `rank` (its place among the model's PLE layers)."""
    half = max(1, ((1 << 63) - 1) // max(cfg.vocab_size, 1) // 2)
    seed = cfg.ngram_seed + RANK_STRIDE * rank
    mults = tuple(2 * (splitmix64((seed + GOLDEN * (s + 1)) & MASK64) % half) + 1 for s in range(cfg.ngram_size))
    H = cfg.ngram_heads
    primes = primes_from(cfg.ngram_vocab_size_base, (rank + 1) * H)[rank * H:]
    offsets = tuple(sum(primes[:h]) for h in range(H))
    return NGramHash(mults, primes, offsets, cfg.heads_per_ngram, cfg.ple_eos_id)


def table_rows(h: NGramHash, multiple: int) -> int:
    """Rows of the layer's embedding table: every head's ids, padded to a multiple of `multiple`."""
    return -(-sum(h.primes) // multiple) * multiple


def rows_per_lane_row(width: int) -> int:
    """Table rows stored side by side in one stored row: k rows of `width` make a multiple of 128 lanes. A
    narrow table ([rows, 160] at the release's sizes) is otherwise laid out rows-minor by the TPU compiler
    (its compact layout), and every gather of a few rows first copied the whole table (12 GiB a step per chip
    at tp 8)."""
    return 128 // math.gcd(width, 128)


# Stored rows come in multiples of this, so that they split evenly over up to as many devices (vocabulary-
# parallel, `qwen4_exp_params.PARAM_AXES`).
SPLIT_ROWS = 64


def packed_rows(rows: int, width: int) -> int:
    """Stored rows of a table of `rows` x `width` (`pack_table`)."""
    return -(-rows // (rows_per_lane_row(width) * SPLIT_ROWS)) * SPLIT_ROWS


def pack_table(table, width: int):
    """A table [rows, width] (numpy or lazy) as stored: [packed_rows, k * width], k = rows_per_lane_row, zero
    rows appended (no id reaches them)."""
    k = rows_per_lane_row(width)
    pad = packed_rows(table.shape[0], width) * k - table.shape[0]
    if pad:
        import numpy as np  # noqa: PLC0415
        table = np.concatenate([np.asarray(table), np.zeros((pad, width), table.dtype)])
    return table.reshape(table.shape[0] // k, k * width)


def gather_rows(packed: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """Rows `ids` [...] of the table `pack_table` stored: [..., width]."""
    k = packed.shape[1] // width
    rows = packed[ids // k].reshape(ids.shape + (k, width))
    return jnp.take_along_axis(rows, (ids % k)[..., None, None], axis=-2)[..., 0, :]


# ---- 64-bit arithmetic on (hi, lo) uint32 words -------------------------------------------------------

def _mul64(t: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """t [...] uint32 (< 2^31) times the constant m, modulo 2^64, as (hi, lo) uint32 words: 16-bit limbs,
    each partial product < 2^32, carries propagated limb by limb."""
    tl = (t & 0xFFFF, t >> 16)
    ml = [(m >> (16 * j)) & 0xFFFF for j in range(4)]
    acc = [jnp.zeros_like(t) for _ in range(5)]
    for i, ti in enumerate(tl):
        for j, mj in enumerate(ml):
            if i + j > 3:
                continue
            prod = ti * jnp.uint32(mj)
            acc[i + j] = acc[i + j] + (prod & 0xFFFF)
            acc[i + j + 1] = acc[i + j + 1] + (prod >> 16)
    limbs, carry = [], jnp.zeros_like(t)
    for k in range(4):
        v = acc[k] + carry
        limbs.append(v & 0xFFFF)
        carry = v >> 16
    return limbs[3] << 16 | limbs[2], limbs[1] << 16 | limbs[0]


def _mod64(hi: jax.Array, lo: jax.Array, p: int) -> jax.Array:
    """(hi * 2^32 + lo) mod p for hi < 2^31 and p < 2^31, in uint32: Horner over chunks of lo small enough
    that the running remainder times 2^chunk stays below 2^32."""
    step = 32 - p.bit_length()
    if step < 1:
        raise ValueError(f"n-gram table size {p} is too large for the 32-bit modulus")
    r, done = hi % jnp.uint32(p), 0
    while done < 32:
        bits = min(step, 32 - done)
        chunk = (lo >> (32 - done - bits)) & ((1 << bits) - 1)
        r = ((r << bits) | chunk) % jnp.uint32(p)
        done += bits
    return r


# ---- the layer -------------------------------------------------------------------------------------------

def shifted_tokens(history: jax.Array, first_pos: jax.Array, n: int, eos: int) -> list[jax.Array]:
    """history [B, c + T] (the last c = n - 1 ids before the step, then its T tokens); first_pos [B] the
    absolute position of history[:, 0]. Returns shifted_s [B, T] for s = 0 .. n-1: the token s before each
    new one, EOS where that lies before the sequence or an EOS sits between (the context restarts)."""
    c, T = n - 1, history.shape[1] - (n - 1)
    is_eos = history == eos
    pos = first_pos[:, None] + jnp.arange(c + T)[None, :]
    out, blocked = [history[:, c:]], jnp.zeros((history.shape[0], T), bool)
    for s in range(1, n):
        blocked = blocked | is_eos[:, c - s:c - s + T]
        ok = ~blocked & (pos[:, c - s:c - s + T] >= 0)
        out.append(jnp.where(ok, history[:, c - s:c - s + T], eos))
    return out


def ngram_ids(h: NGramHash, shifted: list[jax.Array]) -> jax.Array:
    """The table rows of every head for each token: [B, T, (n - 1) * heads_per_ngram] int32."""
    words = [_mul64(s.astype(jnp.uint32), m) for s, m in zip(shifted, h.multipliers)]
    ids, hi, lo = [], words[0][0], words[0][1]
    for g in range(2, len(shifted) + 1):
        hi, lo = hi ^ words[g - 1][0], lo ^ words[g - 1][1]
        first = (g - 2) * h.heads_per_ngram
        for k in range(first, first + h.heads_per_ngram):
            ids.append(_mod64(hi, lo, h.primes[k]).astype(jnp.int32) + h.offsets[k])
    return jnp.stack(ids, axis=-1)


def ple(p: dict, h: NGramHash, x: jax.Array, tokens: jax.Array, n_new: jax.Array, positions: jax.Array,
        ctx: jax.Array, conv_state: jax.Array, *, eps: float):
    """One PLE layer over the streams x [B, T, N, Hd] for tokens [B, T] (row b's first n_new[b] real) at
    positions [B, T]; ctx [B, c] int32 the ids before them, conv_state [B, (K-1) * n, N * Hd].
    p: table [rows, E / heads] as `pack_table` stores it, key [E, N * Hd], value [E, Hd], norm_key, norm_query, norm_conv [N * Hd],
    conv [K, N * Hd]. Returns (what is added to x [B, T, N, Hd], ctx, conv_state after each row's last token)."""
    B, T, N, Hd = x.shape
    n = len(h.multipliers)
    history = jnp.concatenate([ctx, tokens.astype(ctx.dtype)], axis=1)
    ids = ngram_ids(h, shifted_tokens(history, positions[:, 0] - (n - 1), n, h.eos))
    e = gather_rows(p["table"], ids, p["key"].shape[0] // ids.shape[-1]).reshape(B, T, -1)
    key = normed_streams(linear(e, p["key"]).reshape(B, T, N, Hd), p["norm_key"], eps)
    query = normed_streams(x, p["norm_query"], eps)
    gate = jnp.sum(key.astype(jnp.float32) * query.astype(jnp.float32), axis=-1) / math.sqrt(Hd)
    gate = jnp.sign(gate) * jnp.sqrt(jnp.maximum(jnp.abs(gate), 1e-6))
    g = (jax.nn.sigmoid(gate)[..., None] * linear(e, p["value"])[:, :, None, :].astype(jnp.float32)).astype(x.dtype)
    normed = normed_streams(g, p["norm_conv"], eps).reshape(B, T, N * Hd)
    y, conv_state = causal_conv(normed, conv_state, p["conv"], n_new, dilation=n)
    new_ctx = conv_state_after(history[..., None], n_new - 1, n)[..., 0]
    return g + y.reshape(B, T, N, Hd), new_ctx, conv_state
