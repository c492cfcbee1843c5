"""Ragged paged attention (XLA path, the CPU default) vs the padded dense attention the engine runs today.

One attention layer of one step on CPU, Qwen3-Next-80B's heads (Hq 16, Hkv 2, D 256), pages of 16 tokens:
  decode  R = 32 sequences of one query each, contexts 300-2,000 tokens, capacity 2,048
  mixed   one prefill chunk of 256 queries (a 768-token cached prefix) + 15 decodes of 300-2,000 tokens
The baseline is today's layout: a contiguous cache row per sequence at full capacity, queries padded to the
longest row ([B, T] = [32, 1] / [16, 256]), every query row scoring every slot of its row (masked by
position). The paged side gets the same K/V scattered over shuffled pages of a shared pool and the queries
token-major ([N] = 32 / 271). Both outputs are compared (relative RMS) before timing.

The two are timed alternately (A, B, A, B, ...) in one process and the ratio is the median of the per-pair
ratios (the machine is shared and noisy); medians of each side are printed too.

    python benchmarks/ragged_paged_attention.py [--pairs 9] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import ragged_paged_attention

HQ, HKV, D, PS, CAP = 16, 2, 256, 16, 2048
SCALE = D ** -0.5


@functools.partial(jax.jit, static_argnames=("rows_per_step",))
def dense_padded(q, k, v, q_pos, rows_per_step: int):
    """Today's attention (hybrid_jax/layers/attention.py's `_attend_cache`, the same matmuls): q [B, T, Hq, D],
    k / v [B, C, Hkv, D] (a full-capacity row each), q_pos [B, T] (-1: a padding query) -> [B, T, Hq, D].
    Every query scores all C slots; rows_per_step batch rows at a time keep the [b, Hkv, Hq / Hkv * T, C]
    scores within memory (the engine itself holds them for the whole batch)."""
    B, T, Hq, Dh = q.shape
    C, Hkv = k.shape[1], k.shape[2]
    R = Hq // Hkv

    def rows(args):
        qb, kb, vb, pb = args                                   # [b, T, Hq, D], [b, C, Hkv, D], [b, T]
        b = qb.shape[0]
        qg = qb.reshape(b, T, Hkv, R, Dh).transpose(0, 2, 3, 1, 4) * jnp.asarray(SCALE, qb.dtype)
        s = jnp.matmul(qg.reshape(b, Hkv, R * T, Dh), kb.transpose(0, 2, 3, 1), preferred_element_type=jnp.float32)
        s = s.reshape(b, Hkv, R, T, C)
        s = jnp.where(jnp.arange(C)[None, None, None, None, :] <= pb[:, None, None, :, None], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        l = jnp.sum(e, axis=-1, keepdims=True)
        o = jnp.matmul(e.reshape(b, Hkv, R * T, C).astype(vb.dtype), vb.transpose(0, 2, 1, 3),
                       preferred_element_type=jnp.float32).reshape(b, Hkv, R, T, Dh)
        o = o / jnp.where(l > 0, l, 1.0)
        return o.transpose(0, 3, 1, 2, 4).reshape(b, T, Hq, Dh).astype(qb.dtype)

    split = lambda x: x.reshape((B // rows_per_step, rows_per_step) + x.shape[1:])  # noqa: E731
    out = jax.lax.map(rows, (split(q), split(k), split(v), split(q_pos)))
    return out.reshape(B, T, Hq, Dh)


def build(rng, q_lens, kv_lens, dtype):
    """Both layouts of one batch: (dense args, paged args, gather map from dense [B, T] rows to token rows)."""
    B = len(q_lens)
    T = max(q_lens)
    NP = CAP // PS
    k_rows = rng.standard_normal((B, CAP, HKV, D), np.float32)
    v_rows = rng.standard_normal((B, CAP, HKV, D), np.float32)
    q_pad = np.zeros((B, T, HQ, D), np.float32)
    q_pos = np.full((B, T), -1, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q_tok = rng.standard_normal((cu[-1], HQ, D)).astype(np.float32)
    for b in range(B):
        q_pad[b, :q_lens[b]] = q_tok[cu[b]:cu[b + 1]]
        q_pos[b, :q_lens[b]] = kv_lens[b] - q_lens[b] + np.arange(q_lens[b])
    perm = rng.permutation(B * NP)                              # shuffled pages of a shared pool
    pt = perm.reshape(B, NP).astype(np.int32)
    k_pool = np.zeros((B * NP, PS, HKV, D), np.float32)
    v_pool = np.zeros((B * NP, PS, HKV, D), np.float32)
    k_pool[pt.reshape(-1)] = k_rows.reshape(B * NP, PS, HKV, D)
    v_pool[pt.reshape(-1)] = v_rows.reshape(B * NP, PS, HKV, D)
    dense = tuple(jnp.asarray(x, dtype) for x in (q_pad, k_rows, v_rows)) + (jnp.asarray(q_pos),)
    paged = (jnp.asarray(q_tok, dtype), jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype),
             jnp.asarray(kv_lens, jnp.int32), jnp.asarray(pt), jnp.asarray(cu), jnp.asarray([B], jnp.int32))
    tok_of = np.concatenate([b * T + np.arange(q_lens[b]) for b in range(B)])
    return dense, paged, tok_of


def _time_once(fn, args):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def run(name, q_lens, kv_lens, dtype, pairs):
    rng = np.random.default_rng(0)
    dense_args, paged_args, tok_of = build(rng, q_lens, kv_lens, dtype)
    T = max(q_lens)
    rows = max(1, min(len(q_lens), (256 << 20) // (HQ * T * CAP * 4)))
    while len(q_lens) % rows:
        rows -= 1
    dense = jax.jit(functools.partial(dense_padded, rows_per_step=rows))
    paged = jax.jit(functools.partial(ragged_paged_attention, sm_scale=SCALE, impl="xla",
                                      max_q_len=1))
    o_dense = np.asarray(dense(*dense_args), np.float32).reshape(-1, HQ, D)[tok_of]
    o_paged = np.asarray(paged(*paged_args), np.float32)
    err = float(np.sqrt(np.mean((o_paged - o_dense) ** 2)) / np.sqrt(np.mean(o_dense ** 2)))
    td, tp = [], []
    for _ in range(pairs):
        td.append(_time_once(dense, dense_args))
        tp.append(_time_once(paged, paged_args))
    ratio = float(np.median(np.asarray(td) / np.asarray(tp)))
    real = int(sum(q * k for q, k in zip(q_lens, kv_lens)))
    padded = len(q_lens) * T * CAP
    print(f"{name:>7} {jnp.dtype(dtype).name:>9} {len(q_lens):>3} {sum(q_lens):>5} {np.median(td) * 1e3:>10.1f} "
          f"{np.median(tp) * 1e3:>10.1f} {ratio:>8.2f}x {padded / real:>10.1f}x {err:>9.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    decode_ctx = rng.integers(300, 2001, 32).tolist()
    mixed_ctx = [768] + rng.integers(300, 2001, 15).tolist()
    print(f"one attention layer, CPU ({jax.devices()[0].device_kind}), Hq={HQ} Hkv={HKV} D={D}, pages of {PS}, "
          f"capacity {CAP}; medians of {args.pairs} alternating pairs")
    print(f"{'batch':>7} {'dtype':>9} {'R':>3} {'N':>5} {'dense ms':>10} {'paged ms':>10} {'speedup':>9} "
          f"{'pad waste':>11} {'rel rms':>9}")
    for dtype in (jnp.dtype(d) for d in args.dtypes.split(",")):
        run("decode", [1] * 32, decode_ctx, dtype, args.pairs)
        run("mixed", [256] + [1] * 15, mixed_ctx, dtype, args.pairs)
    print("speedup: median over pairs of dense time / paged time (paged = impl='xla', the CPU default)")
    print("pad waste: query-key pairs the padded layout scores / pairs the queries can see")


if __name__ == "__main__":
    main()
