"""Gated delta rule, token by token (decode steps and speculative verify windows): the XLA token
scan (`fused_recurrent.py`: state carried K-major, read twice per token) against the reference
scan (`naive.py`: the textbook update, five passes over the state), on identical inputs, at the
shapes of one layer of the benchmark models.

    python benchmarks/gdn_recurrent.py

Prints the median time per call of each, the ratio, and the largest difference between their
outputs. Not a test: timings depend on the machine and its load; the two alternate per repeat.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_xla  # noqa: E402
from pallas_kernels.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402

# (name, H key heads, HV value heads, K = V head dim): one linear-attention layer of each model
LAYERS = [("tiny", 2, 4, 32), ("medium", 4, 8, 64)]


def inputs(B, T, H, HV, D, seed=0):
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    return (n(B, T, H, D), n(B, T, H, D), n(B, T, HV, D), -np.logaddexp(0.0, n(B, T, HV) - 2.0).astype(np.float32),
            (1.0 / (1.0 + np.exp(-n(B, T, HV)))).astype(np.float32)), 0.1 * n(B, HV, D, D)


def main(repeats: int = 40):
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; one layer, use_qk_l2norm_in_kernel, per-token "
          f"deltas out (as a verify step asks); median of {repeats} calls each, alternating")
    print(f"   {'layer':<7} {'B':>2} {'T':>3} {'reference us':>12} {'xla scan us':>11} {'ref/xla':>7} {'max |diff|':>10}")
    for name, H, HV, D in LAYERS:
        for B in (1, 8):
            for T in (1, 33):
                args, h0 = inputs(B, T, H, HV, D)
                kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, output_deltas=True)
                fns = {"ref": lambda: naive_recurrent_gated_delta_rule(*args, **kw),
                       "xla": lambda: fused_recurrent_gated_delta_rule_xla(*args, **kw)}
                outs = {k: jax.block_until_ready(f()) for k, f in fns.items()}
                ts = {k: [] for k in fns}
                for _ in range(repeats):
                    for k, f in fns.items():
                        t0 = time.perf_counter()
                        jax.block_until_ready(f())
                        ts[k].append(time.perf_counter() - t0)
                ref, xla = (np.median(ts[k]) * 1e6 for k in ("ref", "xla"))
                diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                           for a, b in zip(outs["ref"], outs["xla"]))
                print(f"   {name:<7} {B:>2} {T:>3} {ref:>12.1f} {xla:>11.1f} {ref / xla:>6.2f}x {diff:>10.1e}")


if __name__ == "__main__":
    main()
