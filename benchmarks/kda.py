"""Kimi Delta Attention on CPU beside Gated DeltaNet, so the cost of a decay per key channel is visible:
for each rule, the chunked XLA path, the token-by-token XLA path (what a decode step or a verify window
runs) and transformers' torch fallback (`chunk_kimi_delta_attention`, `torch_chunk_gated_delta_rule`:
what the models run without flash-linear-attention), on the same q, k, v, beta (the gates drawn alike:
GDN's per head, KDA's per head and channel).

    python benchmarks/kda.py            # T in {2048, 8192}, H = HV = 16, K = V = 128, B = 1
    python benchmarks/kda.py --quick    # T in {256, 1024}, H = 4, K = V = 64

Times are medians of repeats taken in turn (A, B, C, A, B, C, ...), so the machine's drift hits every
column alike; the ratios are the figures to read. Not a test. The Pallas kernels are not timed: on this
machine they run only interpreted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_xla  # noqa: E402
from pallas_kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_xla  # noqa: E402
from pallas_kernels.kda.chunk import chunk_kda_xla  # noqa: E402
from pallas_kernels.kda.fused_recurrent import fused_recurrent_kda_xla  # noqa: E402


def inputs(T: int, H: int, K: int, seed: int = 0):
    """q, k, v [1, T, H, K]; beta [1, T, H]; the GDN gate [1, T, H] and the KDA gate [1, T, H, K], both
    -exp(A_log) softplus(.) with Kimi's A_log range."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    a = np.exp(np.log(rng.uniform(1.0, 16.0, H))).astype(np.float32)
    sp = lambda x: np.log1p(np.exp(x - 4.0)).astype(np.float32)  # noqa: E731
    beta = (1 / (1 + np.exp(-n(1, T, H)))).astype(np.float32)
    return n(1, T, H, K), n(1, T, H, K), n(1, T, H, K), beta, -a * sp(n(1, T, H)), \
        -a[:, None] * sp(n(1, T, H, K))


def timed_in_turn(fns: dict, repeats: int) -> dict:
    """Median seconds of each fn, the repeats taken in turn; each fn runs once first (compile, warm up)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def run(Ts=(2048, 8192), H=16, K=128, repeats=3, torch_threads=2):
    import torch  # noqa: PLC0415
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention  # noqa: PLC0415
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule  # noqa: PLC0415
    torch.set_num_threads(torch_threads)
    print(f"machine: {os.cpu_count()} CPUs, jax {jax.__version__}, torch {torch.__version__} ({torch_threads} threads)")
    print(f"B=1 H=HV={H} K=V={K}, fp32, q/k l2norm in the kernel; median of {repeats} taken in turn\n")
    head = (f"{'T':>6} {'rule':>5} | {'xla chunk ms':>12} | {'xla recurrent ms':>16} | {'torch ms':>9} | "
            f"{'torch/chunk':>11} | {'recur/chunk':>11} | {'tok/s chunk':>11} | {'rel err rec':>11} | {'rel err torch':>13}")
    print(head)
    print("-" * len(head))
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    err = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))  # noqa: E731
    rows = {}
    for T in Ts:
        q, k, v, beta, g_head, g_chan = inputs(T, H, K)
        jq, jk, jv, jb = (jnp.asarray(x) for x in (q, k, v, beta))
        tq, tk, tv, tb = (torch.from_numpy(x) for x in (q, k, v, beta))
        for rule, g, chunk, rec, ref in (
                ("gdn", g_head, chunk_gated_delta_rule_xla, fused_recurrent_gated_delta_rule_xla,
                 lambda tg: torch_chunk_gated_delta_rule(tq, tk, tv, tg, tb, **kw)),
                ("kda", g_chan, chunk_kda_xla, fused_recurrent_kda_xla,
                 lambda tg: chunk_kimi_delta_attention(tq, tk, tv, tg, tb, **kw))):
            jg, tg = jnp.asarray(g), torch.from_numpy(g)
            fns = {"chunk": lambda: jax.block_until_ready(chunk(jq, jk, jv, jg, jb, **kw)),
                   "recurrent": lambda: jax.block_until_ready(rec(jq, jk, jv, jg, jb, **kw)),
                   "torch": lambda: ref(tg)}
            with torch.no_grad():
                t = timed_in_turn(fns, repeats)
                o_torch = ref(tg)[0].numpy()
            o_chunk, o_rec = chunk(jq, jk, jv, jg, jb, **kw)[0], rec(jq, jk, jv, jg, jb, **kw)[0]
            rows[(T, rule)] = t
            print(f"{T:>6} {rule:>5} | {1e3 * t['chunk']:>12.1f} | {1e3 * t['recurrent']:>16.1f} | "
                  f"{1e3 * t['torch']:>9.1f} | {t['torch'] / t['chunk']:>10.2f}x | {t['recurrent'] / t['chunk']:>10.2f}x | "
                  f"{T / t['chunk']:>11.0f} | {err(o_chunk, o_rec):>11.1e} | {err(o_chunk, o_torch):>13.1e}")
        kda, gdn = rows[(T, "kda")], rows[(T, "gdn")]
        print(f"{T:>6} {'kda/gdn':>5} | {kda['chunk'] / gdn['chunk']:>11.2f}x | {kda['recurrent'] / gdn['recurrent']:>15.2f}x "
              f"| {kda['torch'] / gdn['torch']:>8.2f}x |")
    print("\nkda/gdn: what the decay per channel costs each implementation (the same shapes, the same tokens).")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.quick:
        run(Ts=(256, 1024), H=4, K=64, repeats=args.repeats)
    else:
        run(repeats=args.repeats)


if __name__ == "__main__":
    main()
