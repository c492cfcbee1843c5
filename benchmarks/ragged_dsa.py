"""DeepSeek-V3.2 and -V4, one mixed step padded vs ragged: a prefill chunk beside decodes.

The engine's mixed step is ragged for both families (`forward_ragged`): V3.2 runs its per-token work on the
flat batch and the indexer's Top-K and the sparse MLA on the batch's tiles; V4 runs mHC, the MoE and the
projections flat and each attention layer on the tiles as rows (window ring and compressor tails carried
tile to tile). This compares each with the padded `[S, T]` forward the family stepped before, on small
random models (V3.2: 2 layers, MLA 8 heads, latent 64, indexer 8 x 32, Top-K 128; V4: sliding, CSA and HCA
layers, 8 heads of 64, window 128, rates 4 / 128, Top-K 128), S sequences that each hold `context` tokens:
one feeds a chunk of `chunk` tokens, the others one decode token each. Same cache, same tokens; medians
of alternating runs (XLA:CPU, f32). Also printed: the query rows each form computes (padded: S x the chunk).

    python benchmarks/ragged_dsa.py [--models v32,v4] [--seqs 16] [--chunk 256] [--context 512] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import config_from_hf_dict
from hybrid_jax.models.ragged import pack

V32 = dict(model_type="deepseek_v32", vocab_size=512, hidden_size=256, intermediate_size=512,
              moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
              n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
              kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
              index_topk=128, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
              max_position_embeddings=8192)
V4 = dict(model_type="deepseek_v4", vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=3,
          num_attention_heads=8, head_dim=64, q_lora_rank=96, num_experts_per_tok=2, n_routed_experts=8,
          sliding_window=128, o_groups=2, o_lora_rank=64, index_n_heads=8, index_head_dim=32, index_topk=128,
          hc_mult=2, hc_sinkhorn_iters=5, compress_rates={"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 128},
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          mlp_layer_types=["moe", "moe", "moe"], partial_rotary_factor=0.5, max_position_embeddings=8192)
CONFIGS = {"v32": V32, "v4": V4}


def run(name: str, S: int, T: int, ctx: int, rounds: int):
    cfg = config_from_hf_dict(CONFIGS[name])
    fam = get_model(cfg.model_type)
    params = fam.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    cache = fam.new_cache(cfg, S, ctx + T + 64, jnp.float32)
    held = [ctx] * S
    prompt = rng.integers(0, cfg.vocab_size, (S, ctx)).astype(np.int32)
    cache = jax.jit(lambda c, t, n: fam.forward(cfg, params, c, t, n).cache)(cache, jnp.asarray(prompt),
                                                                            jnp.asarray(held, jnp.int32))
    new = [rng.integers(0, cfg.vocab_size, T).tolist()] + [[int(rng.integers(0, cfg.vocab_size))]
                                                           for _ in range(S - 1)]
    tp = np.zeros((S, T), np.int32)
    for i, a in enumerate(new):
        tp[i, :len(a)] = a
    n_new = jnp.asarray([len(a) for a in new], jnp.int32)
    N = 1 << (sum(map(len, new)) - 1).bit_length()          # the runner's power-of-two token bucket
    batch = pack(new, held, N, S)
    padded = jax.jit(lambda c, t, n: fam.forward(cfg, params, c, t, n).logits)
    ragged = jax.jit(lambda c, b: fam.forward_ragged(cfg, params, c, b).logits)
    want = np.asarray(padded(cache, jnp.asarray(tp), n_new))
    got = np.asarray(ragged(cache, batch))
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    times = {"padded": [], "ragged": []}
    for _ in range(rounds):
        for form, fn in (("padded", lambda: padded(cache, jnp.asarray(tp), n_new)),
                         ("ragged", lambda: ragged(cache, batch))):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[form].append(time.perf_counter() - t0)
    p, r = statistics.median(times["padded"]), statistics.median(times["ragged"])
    print(f"{cfg.model_type} mixed step: {S} sequences at {ctx} tokens, one {T}-token chunk + {S - 1} decodes "
          f"(median of {rounds}, alternating; logits max rel. difference {err:.1e})")
    print(f"   {'form':<8}{'query rows':>12}{'ms':>10}")
    print(f"   {'padded':<8}{S * T:>12}{p * 1e3:>10.1f}")
    print(f"   {'ragged':<8}{N:>12}{r * 1e3:>10.1f}")
    print(f"   ragged / padded time: {r / p:.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="v32,v4")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for name in args.models.split(","):
        run(name, args.seqs, args.chunk, args.context, args.rounds)


if __name__ == "__main__":
    main()
