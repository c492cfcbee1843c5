"""Writing the KV cache in place vs slicing each layer out and stacking the layers back, side by side
in one run: time per decode step of the on-device decode loop (Generator), for several cache
capacities and batch sizes, on the shared tiny Qwen3-Next (benchmarks/tiny_qwen3_next.py).

A decode step writes one entry per row and layer. The model writes it into the KV group's stacked
[L, B, S, Hkv, D] arrays in place (`layers.attention.write_kv(..., layer=)`). The other column is
the write the model used to do, reproduced here by wrapping the attention layer: take the layer's
[B, S, Hkv, D] slice, scatter into it, put it back into the stack; XLA then copies whole cache
arrays at every step, so that column grows with the capacity, not with what is written.

    python benchmarks/cache_writes.py [--capacities 512,4096,16384] [--batch 1,8] [--steps 64]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tiny_qwen3_next import write_checkpoint  # noqa: E402

from hybrid_jax import LLM  # noqa: E402
from hybrid_jax.generate import Generator  # noqa: E402
from hybrid_jax.layers import attention  # noqa: E402
from hybrid_jax.models import qwen3_next  # noqa: E402
from hybrid_jax.sampling import SamplerFlags  # noqa: E402


def stacking_attention(p, x, cos, sin, positions, valid, k_all, v_all, *, layer, **kw):
    """The attention layer with the old cache write: the layer's slice out, written, stacked back."""
    out, kc, vc = attention.gated_attention(p, x, cos, sin, positions, valid, k_all[layer], v_all[layer], **kw)
    return out, k_all.at[layer].set(kc), v_all.at[layer].set(vc)


def decode_fn(gen: Generator, B: int, cap: int, steps: int, stacking: bool):
    """A function running one decode loop of `steps` steps after a 16-token prompt; returns its time."""
    prompt = np.ones((B, 16), np.int32)
    n = np.full((B,), 16, np.int32)
    z = np.zeros((B,), np.int32)
    flags = SamplerFlags(False, False, False)

    def run():
        cache = gen.new_cache(B, cap)
        logits, cache = gen._prefill(gen.params, cache, prompt, n)
        jax.block_until_ready(logits)
        t0 = time.perf_counter()
        out, _, cache = gen._decode(gen.params, cache, logits, z.astype(np.uint32), z.astype(np.float32), z - 1,
                                    z.astype(np.float32) + 1, z + steps, np.full((B, 1), -1, np.int32),
                                    steps=steps, flags=flags)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    def traced_run():
        if not stacking:
            return run()
        keep = qwen3_next.gated_attention
        qwen3_next.gated_attention = stacking_attention     # read when the programs are first traced
        try:
            return run()
        finally:
            qwen3_next.gated_attention = keep
    return traced_run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacities", default="512,4096,16384")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    llm = LLM(model=write_checkpoint(tempfile.mkdtemp()), dtype="float32")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; tiny Qwen3-Next (3 GDN + 1 attention layer, "
          f"KV [L, B, S, 2, 32] fp32); decode loop of {args.steps} steps after a 16-token prompt; best of "
          f"{args.repeats}, the two run alternately")
    print(f"   {'batch':>5} {'capacity':>8} {'KV MiB':>7} {'in place ms/step':>16} {'stacking ms/step':>16} "
          f"{'stacking/in place':>17} {'identical':>9}")
    for B in (int(b) for b in args.batch.split(",")):
        for cap in (int(c) for c in args.capacities.split(",")):
            kv = llm.new_cache(B, cap).groups["full_attention"]
            mib = (kv.k.nbytes + kv.v.nbytes) / 2**20
            fns = {s: decode_fn(Generator(llm.config, llm.params, llm.dtype), B, cap, args.steps, s)
                   for s in (False, True)}
            for f in fns.values():
                f()                                        # compiles
            times = {False: [], True: []}
            for _ in range(args.repeats):
                for s, f in fns.items():
                    times[s].append(f())
            t_in, t_st = min(times[False]) / args.steps, min(times[True]) / args.steps
            same = np.array_equal(*(greedy(Generator(llm.config, llm.params, llm.dtype), B, cap, s)
                                    for s in (False, True)))
            print(f"   {B:>5} {cap:>8} {mib:>7.2f} {t_in * 1e3:>16.3f} {t_st * 1e3:>16.3f} {t_st / t_in:>16.2f}x "
                  f"{str(same):>9}")


def greedy(gen: Generator, B: int, cap: int, stacking: bool) -> np.ndarray:
    """16 greedy tokens per row from a random prompt, with either write."""
    keep = qwen3_next.gated_attention
    if stacking:
        qwen3_next.gated_attention = stacking_attention
    try:
        prompt = np.random.default_rng(0).integers(1, gen.cfg.vocab_size, (B, 16)).astype(np.int32)
        z = np.zeros((B,), np.int32)
        cache = gen.new_cache(B, cap)
        logits, cache = gen._prefill(gen.params, cache, prompt, np.full((B,), 16, np.int32))
        out, _, _ = gen._decode(gen.params, cache, logits, z.astype(np.uint32), z.astype(np.float32), z - 1,
                                z.astype(np.float32) + 1, z + 16, np.full((B, 1), -1, np.int32), steps=16,
                                flags=SamplerFlags(False, False, False))
        return np.asarray(out)
    finally:
        qwen3_next.gated_attention = keep


if __name__ == "__main__":
    main()
