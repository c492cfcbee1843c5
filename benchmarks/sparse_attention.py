"""DeepSeek sparse attention (DSA) vs dense MLA: one decode step of one layer on CPU.

Sizes are DeepSeek-V3.2's: MLA 128 heads, latent R = 512 + RoPE key 64 (bf16), indexer 64 heads x 128,
Top-K 2048. Contexts 8k, 16k, 32k, batch 1. Bytes count everything the step reads from the cache and
its tables: dense = every latent + RoPE row; sparse = every indexer key (+ fp8 scales) + the selected
latent rows + the page table and indices. Times are the XLA paths (impl="xla", the CPU default), best
of 3 after a warm-up. fp8 keys (e4m3, one f32 scale per token: 132 B) are checked by the recall of
their selected set against the bf16 keys' selection.

    python benchmarks/sparse_attention.py [--contexts 8192,16384,32768]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import sparse_attention as sa

H, R, DR, HI, DI, TOPK, PS = 128, 512, 64, 64, 128, 2048, 64


def _time(fn, *args, reps=3):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def run(S: int, rng) -> dict:
    NP = S // PS
    pt = jnp.arange(NP, dtype=jnp.int32)[None]
    lens = jnp.asarray([S], jnp.int32)
    qpos = jnp.asarray([[S - 1]], jnp.int32)
    bf = jnp.bfloat16
    lat = jnp.asarray(rng.standard_normal((NP, PS, R), np.float32), bf)
    rope = jnp.asarray(rng.standard_normal((NP, PS, DR), np.float32), bf)
    keys = jnp.asarray(rng.standard_normal((NP, PS, DI), np.float32), bf)
    k8, sc = sa.quantize_fp8(keys)
    ql = jnp.asarray(rng.standard_normal((1, 1, H, R), np.float32), bf)
    qr = jnp.asarray(rng.standard_normal((1, 1, H, DR), np.float32), bf)
    qi = jnp.asarray(rng.standard_normal((1, 1, HI, DI), np.float32), bf)
    w = sa.indexer_weights(jnp.asarray(rng.standard_normal((1, 1, HI), np.float32)), HI, DI)
    scale = (128 + DR) ** -0.5

    dense = jax.jit(lambda ql, qr, lat, rope: sa.dense_mla_attention(ql, qr, lat, rope, pt, qpos, lens, scale=scale))

    @jax.jit
    def sparse(ql, qr, lat, rope, qi, w, keys):
        idx = sa.indexer_topk(qi, w, keys, pt, qpos, lens, topk=TOPK, impl="xla")
        return sa.sparse_mla_attention(ql, qr, lat, rope, pt, idx, lens, scale=scale, impl="xla")

    t_dense = _time(dense, ql, qr, lat, rope)
    t_sparse = _time(sparse, ql, qr, lat, rope, qi, w, keys)
    sel_bf = np.asarray(sa.indexer_topk(qi, w, keys, pt, qpos, lens, topk=TOPK, impl="xla"))[0, 0]
    sel_8 = np.asarray(sa.indexer_topk(qi, w, k8, pt, qpos, lens, topk=TOPK, k_scale=sc, impl="xla"))[0, 0]
    recall = len(set(sel_bf.tolist()) & set(sel_8.tolist())) / TOPK
    tables = NP * 4 + TOPK * 4
    b_dense = S * (R + DR) * 2 + NP * 4
    b_sparse = S * DI * 2 + TOPK * (R + DR) * 2 + tables
    b_fp8 = S * (DI + 4) + TOPK * (R + DR) * 2 + tables
    return dict(S=S, t_dense=t_dense, t_sparse=t_sparse, b_dense=b_dense, b_sparse=b_sparse, b_fp8=b_fp8, recall=recall)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,16384,32768")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"decode step, one layer, batch 1, CPU ({jax.devices()[0].device_kind}); MLA H={H} R={R}+{DR} bf16, "
          f"indexer {HI}x{DI}, Top-K {TOPK}")
    print(f"{'context':>8} {'dense ms':>9} {'sparse ms':>10} {'speedup':>8} {'dense MB':>9} {'sparse MB':>10} "
          f"{'bytes x':>8} {'fp8 MB':>7} {'fp8 x':>6} {'fp8 recall':>10}")
    for S in (int(s) for s in args.contexts.split(",")):
        r = run(S, rng)
        print(f"{S:>8} {r['t_dense'] * 1e3:>9.2f} {r['t_sparse'] * 1e3:>10.2f} {r['t_dense'] / r['t_sparse']:>7.2f}x "
              f"{r['b_dense'] / 1e6:>9.2f} {r['b_sparse'] / 1e6:>10.2f} {r['b_dense'] / r['b_sparse']:>7.2f}x "
              f"{r['b_fp8'] / 1e6:>7.2f} {r['b_dense'] / r['b_fp8']:>5.2f}x {r['recall']:>10.3f}")
    print("HBM-bandwidth fraction: not measured (no GPU/TPU on this machine; CPU times only).")


if __name__ == "__main__":
    main()
