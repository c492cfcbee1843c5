"""hybrid-jax vs Hugging Face transformers, side by side in one process, on one tiny random
Qwen3-Next checkpoint on CPU: decode tokens/s at batch 1 (64 new tokens) and prefill tokens/s at
2048 prompt tokens, with the ratios. Targets: decode >= 10x HF, prefill >= 2x HF.

    python benchmarks/vs_transformers.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tiny_qwen3_next import CONFIGS, write_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402

# ~1.4M parameters: 3 Gated DeltaNet + 1 gated attention layer, MoE on odd layers.
def timed(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--configs", default="heads32,heads64", help=f"comma-separated, from {sorted(CONFIGS)}")
    args = ap.parse_args()
    for name in args.configs.split(","):
        run(name, CONFIGS[name], args)


def run(name, CONFIG, args):
    torch.set_num_threads(os.cpu_count() or 2)
    tmp = tempfile.mkdtemp()
    write_checkpoint(tmp, config=CONFIG)
    hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    llm = LLM(model=tmp, dtype="float32")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, CONFIG["vocab_size"], 16).tolist()
    long_prompt = rng.integers(0, CONFIG["vocab_size"], args.prefill).tolist()
    N = args.new_tokens
    print(f"\n[{name}] model: {n_params / 1e6:.2f}M parameters, jax {jax.__version__} on {jax.default_backend()}, "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads")

    # --- decode, batch 1, N new tokens (16-token prompt, prefill included on both sides) ----------
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    ours_tokens = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids   # warm-up/compile

    def hf_decode():
        with torch.no_grad():
            return hf.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, do_sample=False)

    hf_tokens = hf_decode()[0, len(prompt):].tolist()
    t_hf = timed(hf_decode, args.repeats)
    t_ours = timed(lambda: llm.generate({"prompt_token_ids": prompt}, sp), args.repeats)
    same = "identical" if hf_tokens == ours_tokens else "DIFFERENT"

    # --- prefill, 2048 tokens -----------------------------------------------------------------------
    gen = llm.generator
    T = len(long_prompt)
    toks = jnp.asarray([long_prompt], jnp.int32)
    n = jnp.asarray([T], jnp.int32)

    def ours_prefill():
        return gen._forward(gen.params, gen.new_cache(1, T), toks, n).logits.block_until_ready()

    ours_prefill()

    def hf_prefill():
        with torch.no_grad():
            return hf(torch.tensor([long_prompt]), logits_to_keep=1, use_cache=True).logits

    hf_prefill()
    tp_hf = timed(hf_prefill, args.repeats)
    tp_ours = timed(ours_prefill, args.repeats)

    print(f"\n{'':28}{'transformers':>14}{'hybrid-jax':>14}{'ratio':>10}{'target':>10}")
    print(f"{'decode tok/s (B=1, %d new)' % N:28}{N / t_hf:>14.1f}{N / t_ours:>14.1f}"
          f"{t_hf / t_ours:>9.1f}x{'>= 10x':>10}")
    print(f"{'prefill tok/s (%d tokens)' % T:28}{T / tp_hf:>14.1f}{T / tp_ours:>14.1f}"
          f"{tp_hf / tp_ours:>9.1f}x{'>= 2x':>10}")
    print(f"greedy tokens vs transformers: {same}")


if __name__ == "__main__":
    main()
