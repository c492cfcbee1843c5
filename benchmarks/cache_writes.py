"""Writing the KV cache in place vs slicing each layer out and stacking the layers back, side by side
in one run: time per decode step of the engine's on-device decode loop, for several cache
capacities and batch sizes, on the shared tiny Qwen3-Next (benchmarks/tiny_qwen3_next.py).

A decode step writes one entry per row and layer. The model writes it into the KV group's stacked
page pools [L, P, ps, Hkv, D] in place (`layers.attention.write_kv(..., layer=)`). The other column
is the write the model used to do, reproduced here by wrapping the attention layer: take the
layer's [P, ps, Hkv, D] pool out, scatter into it, put it back into the stack; XLA then copies
whole cache arrays at every step, so that column grows with the capacity, not with what is written.

    python benchmarks/cache_writes.py [--capacities 512,4096,16384] [--batch 1,8] [--steps 64]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tiny_qwen3_next import write_checkpoint  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: E402
from hybrid_jax.layers import attention  # noqa: E402
from hybrid_jax.models import qwen3_next  # noqa: E402


def stacking_attention(p, x, cos, sin, positions, valid, k_all, v_all, page_table, *, layer, **kw):
    """The attention layer with the old cache write: the layer's pool out, written, stacked back."""
    out, kc, vc = attention.gated_attention(p, x, cos, sin, positions, valid, k_all[layer], v_all[layer], page_table,
                                            **kw)
    return out, k_all.at[layer].set(kc), v_all.at[layer].set(vc)


@contextlib.contextmanager
def write_mode(stacking: bool):
    """Programs first traced inside run with the old write (`stacking_attention`) when stacking."""
    keep = qwen3_next.gated_attention
    if stacking:
        qwen3_next.gated_attention = stacking_attention
    try:
        yield
    finally:
        qwen3_next.gated_attention = keep


def decode_engine(llm, batch: int, cap: int, steps: int) -> LLMEngine:
    """An engine whose decode call runs `steps` iterations, with `batch` rows of `cap` tokens."""
    return LLMEngine(llm, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(64, 32 * batch),
                                       max_model_len=cap, decode_steps=steps, compilation_cache_dir=None,
                                       warmup="none"))


def decode(engine: LLMEngine, prompt: np.ndarray, steps: int):
    """Prefills `prompt` [B, 16] (one engine step), then times the engine's next step: one greedy
    decode call of `steps` iterations (on-device loop). Returns (tokens [B, steps], its wall time)."""
    sp = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    rids = [f"r{time.monotonic_ns()}-{i}" for i in range(prompt.shape[0])]
    for rid, p in zip(rids, prompt):
        engine.add_request(rid, {"prompt_token_ids": p.tolist()}, sp)
    engine.step()                                       # the prompts and each row's first token
    t0 = time.perf_counter()
    outs = {o.request_id: o.new_token_ids for o in engine.step()}
    dt = time.perf_counter() - t0
    assert not engine.has_unfinished()
    return np.asarray([outs[r] for r in rids]), dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacities", default="512,4096,16384")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    llm = LLM(model=write_checkpoint(tempfile.mkdtemp()), dtype="float32")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; tiny Qwen3-Next (3 GDN + 1 attention layer, "
          f"KV pages [L, P, 64, 2, 32] fp32, pools for B rows of the capacity); decode loop of {args.steps} steps after a 16-token prompt; best of "
          f"{args.repeats}, the two run alternately")
    print(f"   {'batch':>5} {'capacity':>8} {'KV MiB':>7} {'in place ms/step':>16} {'stacking ms/step':>16} "
          f"{'stacking/in place':>17} {'identical':>9}")
    for B in (int(b) for b in args.batch.split(",")):
        for cap in (int(c) for c in args.capacities.split(",")):
            engines = {s: decode_engine(llm, B, cap, args.steps) for s in (False, True)}
            kv = engines[False].runner.cache.groups["full_attention"]
            mib = (kv.k.nbytes + kv.v.nbytes) / 2**20
            prompt = np.random.default_rng(0).integers(1, llm.config.vocab_size, (B, 16)).astype(np.int32)
            outs, times = {}, {False: [], True: []}
            for s, eng in engines.items():
                with write_mode(s):                        # compiles; its greedy tokens are compared
                    outs[s] = decode(eng, prompt, args.steps)[0]
            for _ in range(args.repeats):
                for s, eng in engines.items():
                    times[s].append(decode(eng, prompt, args.steps)[1])
            t_in, t_st = min(times[False]) / args.steps, min(times[True]) / args.steps
            same = np.array_equal(outs[False], outs[True])
            print(f"   {B:>5} {cap:>8} {mib:>7.2f} {t_in * 1e3:>16.3f} {t_st * 1e3:>16.3f} {t_st / t_in:>16.2f}x "
                  f"{str(same):>9}")


if __name__ == "__main__":
    main()
