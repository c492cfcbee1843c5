"""Prefix reuse on the request patterns of real traffic, against what an attention-only model would reuse.

Three generated workloads (sizes drawn from --seed), each served one request at a time by an engine with
prefix caching and by one without, on the same prompts:

  system prompt   one shared system prompt (300-500 tokens) + a unique question (20-60) per request
  conversations   multi-turn chats: each prompt = the previous prompt + the model's answer + a new message
  tree            a trunk (250-350 tokens), branches (40-80) on it, leaves (20-40) on each branch

Columns:
  ideal      tokens an attention-only model with 16-token blocks would reuse: per request the longest
             common prefix with any earlier request's cached sequence (prompt + output), rounded down
             to 16, at most the prompt minus one token; as a share of all prompt tokens
  reused     tokens the engine actually took from its prefix cache (Request.num_cached_tokens)
  ratio      reused / ideal (target >= 0.9)
  ckpt B/tok bytes of checkpoint objects (recurrent state, SWA ring, tails, overlap state) in the store at
             the end, per token reused
  lookup us  host time of an admission's lookup and validation (median)
  TTFT p50   arrival to first token, with and without prefix caching (ms; this CPU, tiny models)

    python benchmarks/prefix_workloads.py [--models qwen3_next,deepseek_v4,deepseek_v32] [--seed 0] [--requests 24]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from tiny_qwen3_next import CONFIG, write_checkpoint  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: E402

IDEAL_BLOCK = 16
CHECKPOINT_KINDS = ("recurrent_state", "swa_window", "uncompressed_tail", "csa_overlap")

# DeepSeek-V4's layer pattern and compression rates (sliding window, CSA at 4, HCA at 128), shrunk.
V4 = dict(vocab_size=2048, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=3,
          num_attention_heads=4, head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4,
          sliding_window=128, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=64,
          hc_mult=2, hc_sinkhorn_iters=5, compress_rates={"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 128},
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          mlp_layer_types=["hash_moe", "moe", "moe"], partial_rotary_factor=0.5, max_position_embeddings=8192,
          eos_token_id=None, bos_token_id=None, pad_token_id=None)


# DeepSeek-V3.2 (MLA latent + indexer key pages, no checkpoint), shrunk.
V32 = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, n_group=2,
           topk_group=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
           v_head_dim=32, qk_nope_head_dim=32, index_topk=64, index_head_dim=32, index_n_heads=4,
           first_k_dense_replace=1, max_position_embeddings=8192, eos_token_id=None, bos_token_id=None,
           pad_token_id=None)


def write_v32(path: str) -> str:
    import torch  # noqa: PLC0415
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: PLC0415
    torch.manual_seed(0)
    DeepseekV32ForCausalLM(DeepseekV32Config(**V32)).eval().save_pretrained(path)
    return path


def write_v4(path: str) -> str:
    import torch  # noqa: PLC0415
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: PLC0415
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**V4)).eval()
    E, k = V4["n_routed_experts"], V4["num_experts_per_tok"]
    with torch.no_grad():
        for name, p in model.named_buffers():
            if name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(E)[:k] for _ in range(p.shape[0])]))
    model.save_pretrained(path)
    return path


# --- workloads: (name, [(prompt or None, turn-builder), ...]) ----------------------------------------

def system_prompt(rng, vocab, n):
    sys_p = rng.integers(1, vocab, int(rng.integers(300, 501))).tolist()
    return [sys_p + rng.integers(1, vocab, int(rng.integers(20, 61))).tolist() for _ in range(n)]


def tree(rng, vocab, n):
    trunk = rng.integers(1, vocab, int(rng.integers(250, 351))).tolist()
    branches = [trunk + rng.integers(1, vocab, int(rng.integers(40, 81))).tolist() for _ in range(4)]
    leaves = [b + rng.integers(1, vocab, int(rng.integers(20, 41))).tolist() for b in branches
              for _ in range(max(1, n // 4))]
    return [leaves[i] for i in rng.permutation(len(leaves))]


def conversations(rng, vocab, n):
    """Turn builders: a conversation's first prompt, then callables that extend the previous prompt
    with its answer (filled in when it is served) and a new message."""
    convs, turns = max(1, n // 4), 4
    first = [rng.integers(1, vocab, int(rng.integers(60, 121))).tolist() for _ in range(convs)]
    msgs = [[rng.integers(1, vocab, int(rng.integers(20, 61))).tolist() for _ in range(turns - 1)]
            for _ in range(convs)]
    order = []
    for t in range(turns):
        for c in range(convs):
            order.append((c, t))
    return first, msgs, order


def ideal(prompts, seqs) -> list[int]:
    """Per request: tokens an attention-only model with IDEAL_BLOCK-token blocks reuses (see the top)."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for s in seqs[:i]:
            n = min(len(p), len(s))
            a, b = np.asarray(p[:n]), np.asarray(s[:n])
            diff = np.flatnonzero(a != b)
            best = max(best, int(diff[0]) if diff.size else n)
        out.append(min(best, len(p) - 1) // IDEAL_BLOCK * IDEAL_BLOCK)
    return out


def serve(eng: LLMEngine, prompt, max_tokens: int):
    """One request alone: (output ids, tokens reused, TTFT s)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    req = eng.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt}, sp)
    ttft = None
    while not req.finished:
        eng.step()
        if ttft is None and req.output_ids:
            ttft = time.perf_counter() - t0
    eng.flush_publishes()
    return list(req.output_ids), req.num_cached_tokens, ttft


def run_workload(name, eng, plain, rng, vocab, n, out_len):
    """Serves the workload on the caching engine (conversations are built from its answers), then the
    same prompts on the plain engine; returns the table row."""
    eng.reset_prefix_cache()
    prompts, seqs, reused, ttft_c = [], [], [], []
    if name == "conversations":
        first, msgs, order = conversations(rng, vocab, n)
        last = {}
        for c, t in order:
            p = first[c] if t == 0 else last[c] + msgs[c][t - 1]
            out, r, tt = serve(eng, p, out_len)
            last[c] = p + out
            prompts.append(p), seqs.append(p + out[:-1]), reused.append(r), ttft_c.append(tt)
    else:
        for p in (system_prompt if name == "system prompt" else tree)(rng, vocab, n):
            out, r, tt = serve(eng, p, out_len)
            prompts.append(p), seqs.append(p + out[:-1]), reused.append(r), ttft_c.append(tt)
    ttft_p = [serve(plain, p, out_len)[2] for p in prompts]
    st = eng.cache_stats()
    ck = sum(st["bytes_by_kind"].get(k, 0) for k in CHECKPOINT_KINDS)
    want, total = sum(ideal(prompts, seqs)), sum(len(p) for p in prompts)
    got = sum(reused)
    look = eng.prefix.lookup_seconds
    return dict(name=name, requests=len(prompts), ideal=want / total, reused=got / total,
                ratio=got / want if want else float("nan"), ckpt=ck / got if got else float("nan"),
                lookup=statistics.median(look) * 1e6 if look else float("nan"),
                ttft_c=statistics.median(ttft_c) * 1e3, ttft_p=statistics.median(ttft_p) * 1e3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3_next,deepseek_v4,deepseek_v32")
    ap.add_argument("--workloads", default="system prompt,conversations,tree")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=None, help="EngineConfig.prefix_block_size (default: its)")
    ap.add_argument("--grid", type=int, default=0, help="EngineConfig.prefix_checkpoint_grid (0: its default,"
                                                        " -1: None)")
    ap.add_argument("--publish-chunk-ends", action="store_true",
                    help="EngineConfig.prefix_publish_chunk_ends: publish the LCM points a prefill chunk ends at")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    for model in args.models.split(","):
        writers = {"qwen3_next": lambda p: write_checkpoint(p, config=dict(CONFIG)), "deepseek_v4": write_v4,
                   "deepseek_v32": write_v32}
        path = writers[model](os.path.join(tmp, model))
        llm = LLM(model=path, dtype="float32")
        vocab = llm.config.vocab_size
        common = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, warmup="all")
        if args.block_size:
            common["prefix_block_size"] = args.block_size
        if args.grid:
            common["prefix_checkpoint_grid"] = None if args.grid < 0 else args.grid
        eng = LLMEngine(llm, EngineConfig(enable_prefix_caching=True, prefix_publish_chunk_ends=args.publish_chunk_ends,
                                          **common))
        plain = LLMEngine(llm, EngineConfig(**common))
        eng.warmup(), plain.warmup()
        st = eng.cache_stats()
        print(f"\n{model}: resume grid {st.get('resume_grid', st['lcm'])} tokens (block sizes {st['block_sizes']}), "
              f"store cap {st['cap_bytes'] / 2**20:.1f} MiB, checkpoint interval "
              f"{eng.config.prefix_checkpoint_interval}")
        print(f"   {'workload':<15}{'requests':>9}{'ideal':>8}{'reused':>8}{'ratio':>8}{'ckpt B/tok':>12}"
              f"{'lookup us':>11}{'TTFT p50 cached':>17}{'uncached ms':>13}")
        for w in args.workloads.split(","):
            r = run_workload(w, eng, plain, np.random.default_rng(args.seed), vocab, args.requests, args.output_len)
            print(f"   {r['name']:<15}{r['requests']:>9}{r['ideal']:>8.0%}{r['reused']:>8.0%}{r['ratio']:>8.2f}"
                  f"{r['ckpt']:>12.0f}{r['lookup']:>11.0f}{r['ttft_c']:>17.1f}{r['ttft_p']:>13.1f}")
    print(f"\n({time.perf_counter() - t0:.0f} s; ideal: an attention-only model with {IDEAL_BLOCK}-token blocks)")


if __name__ == "__main__":
    main()
