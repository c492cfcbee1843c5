"""Vectorised XLA paths of the DeepSeek-V4 compressed-attention ops (the CPU default).

compress_xla lays the step's stream (tail + valid new tokens) out as [B, NW, m, C] windows and pools every
window at once (CSA: each window's b-half with the previous window's a-half, window 0 with the stored
overlap). attention_xla scores each block of queries against the shared window keys ([B, t, H, S]) and
against only its own gathered entries ([B, t, H, K], CSA), one softmax over both plus the sink. HCA's entries
are walked in blocks of pages folded into an online softmax, only as far as the furthest entry a query of
the step can read (a loop with a run-time trip count): the work follows the context the rows hold, never
the page table's capacity (a release's max_model_len of 1M tokens is 131,072 HCA entries a row).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.compressed_attention.common import finish, hca_reach, stream, window_mask
from pallas_kernels.ragged_paged_attention.common import cdiv, softmax_fold


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    block_q: int = 128        # queries per step of the attention
    block_entries: int = 512  # HCA entries (whole pages) folded per step of its online softmax


def pool_windows(s_kv, s_gate, overlap_kv, overlap_gate, entry_count, bias, *, rate: int, overlap: bool):
    """s_kv, s_gate [B, (NW + 1) m, C] (the stream, raw gates); overlap_* [B, m, C/2] | None; entry_count [B];
    bias [m, C] -> pooled [B, NW, D] f32 (before the norm)."""
    B, Ls, C = s_kv.shape
    m = rate
    NW = Ls // m - 1
    w_kv = s_kv[:, :NW * m].reshape(B, NW, m, C).astype(jnp.float32)
    w_gate = s_gate[:, :NW * m].reshape(B, NW, m, C).astype(jnp.float32) + bias.astype(jnp.float32)
    if overlap:
        D = C // 2
        k = jnp.arange(NW, dtype=jnp.int32)[None, :]
        prev_kv = jnp.concatenate([overlap_kv[:, None].astype(jnp.float32), w_kv[:, :-1, :, :D]], axis=1)
        prev_g = jnp.concatenate([overlap_gate[:, None].astype(jnp.float32), w_gate[:, :-1, :, :D]], axis=1)
        has_prev = (entry_count[:, None] + k > 0)[..., None, None]
        w_kv = jnp.concatenate([prev_kv, w_kv[..., D:]], axis=2)                      # [B, NW, 2m, D]
        w_gate = jnp.concatenate([jnp.where(has_prev, prev_g, -jnp.inf), w_gate[..., D:]], axis=2)
    return jnp.sum(w_kv * jax.nn.softmax(w_gate, axis=2), axis=2)


@functools.partial(jax.jit, static_argnames=("rate", "overlap", "eps", "rope_scale"))
def compress_xla(kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate,
                 bias, norm_w, freqs, *, rate: int, overlap: bool, eps: float, rope_scale: float = 1.0):
    """Shapes as ops.compress_windows."""
    s_kv = stream(tail_kv, kv_new, tail_count, n_new, rate)
    s_gate = stream(tail_gate, gate_new, tail_count, n_new, rate)
    pooled = pool_windows(s_kv, s_gate, overlap_kv, overlap_gate, entry_count, bias, rate=rate, overlap=overlap)
    return finish(pooled, s_kv, s_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate, bias, norm_w,
                  freqs, rate=rate, overlap=overlap, eps=eps, rope_scale=rope_scale, out_dtype=kv_new.dtype)


def _attend(q, kv, ok_w, ext, ok_e, sinks, scale):
    """q [B, t, H, D]; kv [B, S, D] f32; ok_w [B, t, S]; ext [B, t, K, D] f32 | None; ok_e [B, t, K] -> [B, t, H, D]."""
    hp = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32)
    logits = [jnp.where(ok_w[:, :, None], jnp.einsum("bthd,bsd->bths", qf, kv, precision=hp) * scale, -jnp.inf)]
    if ext is not None:
        logits.append(jnp.where(ok_e[:, :, None], jnp.einsum("bthd,btkd->bthk", qf, ext, precision=hp) * scale,
                                -jnp.inf))
    B, t, H, _ = q.shape
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None], (B, t, H, 1))
    p = jax.nn.softmax(jnp.concatenate(logits + [sink], axis=-1), axis=-1)
    S = kv.shape[1]
    out = jnp.einsum("bths,bsd->bthd", p[..., :S], kv, precision=hp)
    if ext is not None:
        out = out + jnp.einsum("bthk,btkd->bthd", p[..., S:-1], ext, precision=hp)
    return out


def _attend_dense(q, kv, ok_w, sinks, scale, entries, table, counts, q_positions, rate, n, bp):
    """HCA: the window keys, then the row's entry pages bp at a time for n blocks (online softmax).
    q [B, t, H, D]; kv [B, S, D] f32; ok_w [B, t, S]; entries [P, ps, D]; table [B, nb * bp] (padded with -1);
    counts [B]; q_positions [B, t]; n: blocks to walk (a traced scalar) -> [B, t, H, D] f32."""
    hp = jax.lax.Precision.HIGHEST
    P, ps, D = entries.shape
    B, t, H, _ = q.shape
    qf = q.astype(jnp.float32)
    s = jnp.where(ok_w[:, :, None], jnp.einsum("bthd,bsd->bths", qf, kv, precision=hp) * scale, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None], (B, t, H, 1))
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)                  # finite: the sink is a logit
    e = jnp.exp(s - m)
    l, acc = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m), jnp.einsum("bths,bsd->bthd", e, kv, precision=hp)

    def body(j, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * bp, bp, axis=1)                       # [B, bp]
        pos = j * bp * ps + jnp.arange(bp * ps, dtype=jnp.int32)
        readable = jnp.repeat((pages >= 0) & (pages < P), ps, axis=1) & (pos[None, :] < counts[:, None])
        ents = entries[jnp.clip(pages, 0, P - 1)].reshape(B, bp * ps, D).astype(jnp.float32)
        ents = jnp.where(readable[..., None], ents, 0.0)            # a slot past a row's count may hold NaN
        ok = readable[:, None, :] & ((pos[None, None, :] + 1) * rate <= q_positions[:, :, None] + 1)
        sb = jnp.where(ok[:, :, None], jnp.einsum("bthd,bsd->bths", qf, ents, precision=hp) * scale, -jnp.inf)
        m, l, alpha, e = softmax_fold(m, l, sb)
        return m, l, alpha * acc + jnp.einsum("bths,bsd->bthd", e, ents, precision=hp)

    _, l, acc = jax.lax.fori_loop(0, n, body, (m, l, acc))
    return acc / l


@functools.partial(jax.jit, static_argnames=("window", "scale", "rate", "config"))
def attention_xla(q, kv, kv_positions, q_positions, entries, page_table, indices, entry_counts, sinks, *,
                  window: int, scale: float, rate: int | None = None, config: XlaConfig = XlaConfig()):
    """Shapes as ops.compressed_sparse_read -> [B, T, H, D] f32. HCA (rate, no indices): the row's entries are
    read through the page table a block of pages at a time, as far as the step's furthest readable entry."""
    from pallas_kernels.sparse_attention.common import physical_rows  # noqa: PLC0415
    B, T = q.shape[:2]
    kvf = kv.astype(jnp.float32)
    ok_w = window_mask(kv_positions, q_positions, window)                             # [B, T, S]
    rows = ok_e = None
    dense = entries is not None and indices is None                                   # HCA
    if dense:
        P, ps, D = entries.shape
        NP = page_table.shape[1]
        bp = max(1, min(NP, config.block_entries // ps))                              # pages per block
        nb = cdiv(NP, bp)
        table = jnp.pad(page_table, ((0, 0), (0, nb * bp - NP)), constant_values=-1)
        reach = hca_reach(entry_counts[:, None], q_positions, rate)                  # the furthest entry read
        n_blocks = jnp.clip(cdiv(jnp.max(reach), bp * ps), 0, nb)
    elif entries is not None:
        P, ps, D = entries.shape
        rows, ok_e = physical_rows(indices, page_table, ps, P, entry_counts)          # [B, T, K]

    def block(qb, okb, rb, oeb, qpb):
        if dense:
            return _attend_dense(qb, kvf, okb, sinks, scale, entries, table, entry_counts, qpb, rate, n_blocks, bp)
        ext = None if rb is None else entries.reshape(P * ps, D)[rb].astype(jnp.float32)   # selected rows only
        return _attend(qb, kvf, okb, ext, oeb, sinks, scale)

    tq = config.block_q
    if T <= tq:
        return block(q, ok_w, rows, ok_e, q_positions)
    n = -(-T // tq)

    def split(x):   # [B, T, ...] -> [n, B, tq, ...]
        if x is None:
            return None
        x = jnp.pad(x, ((0, 0), (0, n * tq - T)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n, tq) + x.shape[2:]), 1, 0)

    o = jax.lax.map(lambda a: block(*a), (split(q), split(ok_w), split(rows), split(ok_e), split(q_positions)))
    return jnp.moveaxis(o, 0, 1).reshape((B, n * tq) + o.shape[3:])[:, :T]
