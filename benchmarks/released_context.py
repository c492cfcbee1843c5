"""A short request at a release's max_model_len against the same request at 4k: the step must cost the context
the rows hold, not the capacity of their page tables.

The DeepSeek-V3.2 / GLM-5 indexer and DeepSeek-V4's HCA read used to walk every page of a row's table (the
release's 163,840 / 202,752 / 1,048,576 positions) on every step, however short the context. Each model here is
a tiny random transformers checkpoint with its family's released max_position_embeddings (transformers'
defaults); `LLM.generate` of 3 prompts x 20 greedy tokens runs at `max_model_len=4096` and at the release's,
alternating, and the medians are printed side by side with the ratio (1.0: the capacity costs nothing) and
whether both gave the same tokens. XLA:CPU, f32.

    python benchmarks/released_context.py [--models v4,v32,glm5] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
DSA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
           num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
           qk_nope_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=32, first_k_dense_replace=1,
           eos_token_id=None, bos_token_id=None, pad_token_id=None)
MODELS = {   # name: (transformers config, model class, config overrides)
    "v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8, sliding_window=6, o_groups=2,
        o_lora_rank=12, index_n_heads=32, index_head_dim=16, index_topk=3, hc_mult=3, hc_sinkhorn_iters=5,
        layer_types=[SWA, CSA, HCA], compress_rates={CSA: 4, HCA: 8}, mlp_layer_types=["moe", "moe", "moe"],
        partial_rotary_factor=0.5, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    "v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(DSA, n_group=4, topk_group=2)),
    "glm5": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(DSA, n_group=1, topk_group=1)),
}


def write_checkpoint(name: str, path: str) -> int:
    """A random checkpoint of `name` (its release's max_position_embeddings kept); returns that length."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    cfg_cls, model_cls, kw = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**kw)
    getattr(transformers, model_cls)(config).eval().save_pretrained(path)
    return config.max_position_embeddings


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="v4,v32,glm5")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from hybrid_jax import LLM, SamplingParams  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    sp = SamplingParams(max_tokens=20, temperature=0)
    print(f"{'model':6} {'release len':>11} {'4k (s)':>8} {'release (s)':>11} {'ratio':>6}  same tokens")
    for name in a.models.split(","):
        with tempfile.TemporaryDirectory() as d:
            released = write_checkpoint(name, d)
            llms = {L: LLM(model=d, dtype="float32", max_model_len=L) for L in (4096, released)}
            rng = np.random.default_rng(0)
            prompts = [{"prompt_token_ids": rng.integers(0, 97, 20).tolist()} for _ in range(3)]
            times = {L: [] for L in llms}
            out = {L: [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] for L, llm in llms.items()}
            for _ in range(a.rounds):
                for L, llm in llms.items():
                    t = time.perf_counter()
                    llm.generate(prompts, sp)
                    times[L].append(time.perf_counter() - t)
            short, full = (statistics.median(times[L]) for L in (4096, released))
            print(f"{name:6} {released:>11,} {short:8.3f} {full:11.3f} {full / short:6.2f}  "
                  f"{out[4096] == out[released]}", flush=True)


if __name__ == "__main__":
    main()
