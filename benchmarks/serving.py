"""Serving throughput: the continuous-batching engine vs HF transformers' batched `generate`, on the
same tiny random Qwen3-Next checkpoint and the same prompts, at concurrency 1, 8 and 32, in one
run. Prints output tokens/s for both and the ratio (target >= 10x at concurrency 8), and how many
programs were compiled during the measured runs (target: none after the warm-up).

    python benchmarks/serving.py [--requests 64] [--output-len 32]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tiny_qwen3_next import CONFIG, write_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybrid_jax import LLM  # noqa: E402
from hybrid_jax.bench import Workload, run_load, summarize  # noqa: E402
from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: E402
from hybrid_jax.engine.async_engine import AsyncEngine  # noqa: E402


def hf_throughput(hf, prompts, out_len, batch):
    """Batched greedy generate, `batch` prompts at a time, left-padded. Returns (tok/s, outputs)."""
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        L = max(len(p) for p in group)
        ids = torch.tensor([[0] * (L - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                            do_sample=False, pad_token_id=0)
        outs += g[:, L:].tolist()
    return len(prompts) * out_len / (time.perf_counter() - t0), outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8,32")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    tmp = tempfile.mkdtemp()
    write_checkpoint(tmp)
    hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CONFIG["vocab_size"], int(n)).tolist() for n in rng.integers(16, 65, args.requests)]
    wl = Workload(prompts, [args.output_len] * len(prompts))

    llm = LLM(model=tmp)
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=256,
                                         decode_steps=8, warmup="all"))
    t0 = time.perf_counter()
    engine.warmup()
    print(f"warm-up: {engine.runner.num_compiled()} programs in {time.perf_counter() - t0:.1f} s "
          f"(persistent compilation cache: {engine.config.compilation_cache_dir})")
    compiled_after_warmup = engine.runner.num_compiled()
    ae = AsyncEngine(engine)
    ae.start()
    rows = []
    try:
        for c in (int(x) for x in args.concurrency.split(",")):
            results, secs = asyncio.run(run_load(wl, c, engine=ae, progress=False))
            ours = summarize(results, secs)
            hf_tps, hf_out = hf_throughput(hf, prompts, args.output_len, c)
            same = sum(r.tokens == h for r, h in zip(results, hf_out))
            rows.append((c, hf_tps, ours["throughput_tok_s"], ours["ttft_ms"]["p50"], ours["itl_ms"]["p50"], same))
    finally:
        ae.shutdown()
    print(f"\n{'concurrency':>12}{'HF tok/s':>12}{'ours tok/s':>12}{'ratio':>9}{'TTFT p50 ms':>13}"
          f"{'ITL p50 ms':>12}{'same as HF':>12}")
    for c, h, o, ttft, itl, same in rows:
        print(f"{c:>12}{h:>12.1f}{o:>12.1f}{o / h:>8.1f}x{ttft:>13.1f}{itl:>12.2f}{same:>9}/{len(prompts)}")
    print(f"programs compiled during the measured runs: {engine.runner.num_compiled() - compiled_after_warmup}")


if __name__ == "__main__":
    main()
