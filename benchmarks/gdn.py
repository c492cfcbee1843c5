"""Gated delta rule on CPU: the chunked XLA path against the token-level recurrence and
transformers' torch fallback (`torch_chunk_gated_delta_rule`, what Qwen3-Next runs without
flash-linear-attention), on identical inputs.

    python benchmarks/gdn.py            # T in {2048, 8192}, H = HV = 16, K = V = 128, B = 1
    python benchmarks/gdn.py --quick    # small sizes, seconds

Prints the time per implementation, the ratios, and the achieved GFLOP/s of the chunked path
(the matmul FLOPs of the chunked algorithm as chunk.py runs it) against this machine's measured
fp32 matmul GFLOP/s. Targets: chunked XLA >= 4x faster than the torch fallback at T = 8192, and
faster than the recurrence. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta_rule import chunk as gdn_chunk  # noqa: E402
from pallas_kernels.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402


def inverse_flops(C: int, base: int = 16) -> int:
    """Matmul FLOPs of chunk.unit_lower_inverse on one [C, C] block."""
    if C <= base or C % 2:
        return 2 * 2 * C ** 3 * max(0, math.ceil(math.log2(C)) - 1)
    h = C // 2
    return 2 * inverse_flops(h, base) + 2 * 2 * h ** 3


def chunk_flops(T: int, H: int, HV: int, K: int, V: int, C: int) -> int:
    """Matmul FLOPs of chunk_gated_delta_rule_xla (chunk.py) as it runs: per chunk and key head
    [q; k] k^T; per chunk and value head the inverse, A [beta v, beta k e^g], and in the scan
    [q e^g; w] h, attn v', kd^T v'. Elementwise work (exp, masks, l2norm) is not counted."""
    n = -(-T // C)
    per_key_head = 2 * (2 * C) * C * K
    per_value_head = (inverse_flops(C) + 2 * C * C * (V + K)
                      + 2 * (2 * C) * K * V + 2 * C * C * V + 2 * K * C * V)
    return n * (H * per_key_head + HV * per_value_head)


def bench(fn, repeats: int) -> float:
    fn()                                              # compile / warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_gflops(n: int = 2048, repeats: int = 3) -> tuple[float, float]:
    """Measured fp32 n^3 matmul GFLOP/s: (XLA at HIGHEST precision, torch)."""
    import torch  # noqa: PLC0415
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    mm = jax.jit(lambda a: jnp.matmul(a, a, precision=jax.lax.Precision.HIGHEST))
    t_jax = bench(lambda: mm(x).block_until_ready(), repeats)
    xt = torch.randn(n, n)
    t_torch = bench(lambda: xt @ xt, repeats)
    return 2 * n ** 3 / t_jax / 1e9, 2 * n ** 3 / t_torch / 1e9


def batched_matmul_gflops(batch: int, m: int, k: int, n: int) -> tuple[float, float]:
    """GFLOP/s of one batched matmul [batch, m, k] @ [batch, k, n] (the chunked path's shapes):
    (XLA, torch.bmm). Explains where the time goes: the chunked form is many small matmuls."""
    import torch  # noqa: PLC0415
    rng = np.random.default_rng(0)
    a = rng.standard_normal((batch, m, k), np.float32)
    b = rng.standard_normal((batch, k, n), np.float32)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
    aj, bj = jnp.asarray(a), jnp.asarray(b)
    t_jax = bench(lambda: f(aj, bj).block_until_ready(), 3)
    at, bt = torch.from_numpy(a), torch.from_numpy(b)
    t_torch = bench(lambda: torch.bmm(at, bt), 3)
    flops = 2 * batch * m * k * n
    return flops / t_jax / 1e9, flops / t_torch / 1e9


def make_inputs(T, H, HV, K, V, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, T, H, K), np.float32)
    k = rng.standard_normal((1, T, H, K), np.float32)
    v = rng.standard_normal((1, T, HV, V), np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((1, T, HV)) - 2.0)).astype(np.float32)   # -softplus
    beta = (1 / (1 + np.exp(-rng.standard_normal((1, T, HV))))).astype(np.float32)
    return q, k, v, g, beta


def run(Ts=(2048, 8192), H=16, HV=16, K=128, V=128, repeats=3, chunk_size=None, torch_threads=2,
        verbose=True):
    """Times the three implementations at each T. Returns a list of dicts (one per T)."""
    import torch  # noqa: PLC0415
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule  # noqa: PLC0415
    torch.set_num_threads(torch_threads)
    C = chunk_size or gdn_chunk.DEFAULT_CHUNK_SIZE
    peak_jax, peak_torch = matmul_gflops()
    if verbose:
        print(f"machine: {os.cpu_count()} CPUs, jax {jax.__version__} ({jax.default_backend()}), "
              f"torch {torch.__version__} with {torch_threads} threads")
        print(f"measured fp32 2048^3 matmul: XLA {peak_jax:.1f} GFLOP/s, torch {peak_torch:.1f} GFLOP/s")
    rows = []
    for T in Ts:
        arrays = make_inputs(T, H, HV, K, V)
        jx = [jnp.asarray(a) for a in arrays]
        tt = [torch.from_numpy(a) for a in arrays]
        kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
        t_chunk = bench(lambda: jax.block_until_ready(
            gdn_chunk.chunk_gated_delta_rule_xla(*jx, chunk_size=C, **kw)), repeats)
        t_ref = bench(lambda: jax.block_until_ready(naive_recurrent_gated_delta_rule(*jx, **kw)), max(1, repeats - 1))
        with torch.no_grad():
            t0 = time.perf_counter()
            torch_chunk_gated_delta_rule(*tt, **kw)
            t_torch_cold = time.perf_counter() - t0
            t_torch = bench(lambda: torch_chunk_gated_delta_rule(*tt, **kw), max(1, repeats - 1))
            o_torch, s_torch = torch_chunk_gated_delta_rule(*tt, **kw)
        o_chunk, s_chunk = gdn_chunk.chunk_gated_delta_rule_xla(*jx, chunk_size=C, **kw)
        o_ref, _ = naive_recurrent_gated_delta_rule(*jx, **kw)
        err = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))  # noqa: E731
        flops = chunk_flops(T, H, HV, K, V, C)
        rows.append(dict(T=T, chunk_s=t_chunk, reference_s=t_ref, torch_s=t_torch, torch_cold_s=t_torch_cold, gflop=flops / 1e9,
                         chunk_gflops=flops / t_chunk / 1e9, peak_gflops=peak_jax,
                         err_vs_reference=err(o_chunk, o_ref), err_vs_torch=err(o_chunk, o_torch.numpy())))
    if verbose:
        report(rows, H, HV, K, V, C)
        n = HV * (-(-Ts[-1] // C))
        bj, bt = batched_matmul_gflops(n, 2 * C, K, V)
        print(f"batched matmul of the chunked shapes, [{n}, {2 * C}, {K}] @ [{n}, {K}, {V}]: "
              f"XLA {bj:.1f} GFLOP/s, torch.bmm {bt:.1f} GFLOP/s")
    return rows


def report(rows, H, HV, K, V, C):
    print(f"\nB=1 H={H} HV={HV} K={K} V={V}, chunk {C}, fp32, q/k l2norm in kernel; best of repeats")
    head = (f"{'T':>6} | {'xla chunk ms':>12} | {'recurrence ms':>13} | {'torch fallback ms':>17} | "
            f"{'torch/chunk':>11} | {'recur/chunk':>11} | {'chunk GFLOP':>11} | {'GFLOP/s':>7} | "
            f"{'of peak':>7} | {'tok/s chunk':>11} | {'rel err ref':>11} | {'rel err torch':>13}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['T']:>6} | {1e3 * r['chunk_s']:>12.1f} | {1e3 * r['reference_s']:>13.1f} | "
              f"{1e3 * r['torch_s']:>17.1f} | {r['torch_s'] / r['chunk_s']:>10.2f}x | "
              f"{r['reference_s'] / r['chunk_s']:>10.2f}x | {r['gflop']:>11.2f} | {r['chunk_gflops']:>7.1f} | "
              f"{r['chunk_gflops'] / r['peak_gflops']:>6.0%} | {r['T'] / r['chunk_s']:>11.0f} | "
              f"{r['err_vs_reference']:>11.1e} | {r['err_vs_torch']:>13.1e}")
    print("torch fallback, first call at each T (cold: allocator and page faults, excluded above): "
          + ", ".join(f"T={r['T']}: {1e3 * r['torch_cold_s']:.0f} ms" for r in rows))
    last = rows[-1]
    if last["T"] < 8192:
        print("\n(targets are stated for the full sizes, T = 8192; run without --quick)")
    ok_torch = last["torch_s"] / last["chunk_s"] >= 4
    ok_ref = all(r["reference_s"] > r["chunk_s"] for r in rows)
    print(f"\ntarget chunked >= 4x torch fallback at T={last['T']}: {'met' if ok_torch else 'MISSED'} "
          f"({last['torch_s'] / last['chunk_s']:.2f}x); faster than the recurrence at every T: "
          f"{'met' if ok_ref else 'MISSED'}")
    print("Pallas kernels (tokens/s, fraction of HBM bandwidth): not measured, no GPU/TPU on this machine "
          "(they run here only in interpret mode, which measures nothing).")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: T in {256, 1024}, H = HV = 4, K = V = 64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=None)
    args = p.parse_args(argv)
    if args.quick:
        run(Ts=(256, 1024), H=4, HV=4, K=64, V=64, repeats=args.repeats, chunk_size=args.chunk_size)
    else:
        run(repeats=args.repeats, chunk_size=args.chunk_size)


if __name__ == "__main__":
    main()
