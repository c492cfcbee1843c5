"""The tiny random Qwen3-Next checkpoint the side-by-side benchmarks share (about 1.2M parameters:
3 Gated DeltaNet + 1 gated attention layer, MoE on odd layers), written with transformers."""
from __future__ import annotations

CONFIG = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
              decoder_sparse_step=2, max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
              pad_token_id=0)


# The same layer pattern with head sizes closer to the real model's proportions (Qwen3-Next-80B
# uses 256-dim attention heads and 128-dim linear heads; 32-dim heads are far below that).
CONFIG_WIDE_HEADS = dict(CONFIG, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
                         linear_value_head_dim=64)

# The 64-dim heads with Qwen3-Next-80B-A3B's balance of per-token work to attention work: there,
# attention over a 4,096-token context is about 11% of a token's matmul FLOPs (12 of 48 layers
# attend with 16 x 256-dim heads; about 2.4B active non-embedding parameters); in the two configs
# above, whose layers are 128 wide, attention is most of it, so no cache can make a long prompt's
# last chunk cost what an average chunk costs. `attention_share` computes the figure for each.
CONFIG_PROPORTIONAL = dict(CONFIG_WIDE_HEADS, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           shared_expert_intermediate_size=512)

CONFIGS = {"heads32": CONFIG, "heads64": CONFIG_WIDE_HEADS, "proportional": CONFIG_PROPORTIONAL}


def attention_share(config: dict, context: int = 4096) -> float:
    """Share of attention (QK and PV over `context` keys) in one token's matmul FLOPs, the other
    part being 2 x the active non-embedding parameters (projections, MLP or routed + shared experts)."""
    h = config["hidden_size"]
    layers = config["layer_types"]
    attn = lin = 0
    for i, kind in enumerate(layers):
        if kind == "full_attention":
            q = config["num_attention_heads"] * config["head_dim"]
            kv = config["num_key_value_heads"] * config["head_dim"]
            lin += h * (2 * q + 2 * kv) + q * h             # q and its gate, k, v; o
            attn += 4 * q * context
        else:
            k = config["linear_num_key_heads"] * config["linear_key_head_dim"]
            v = config["linear_num_value_heads"] * config["linear_value_head_dim"]
            lin += h * (2 * k + 2 * v) + v * h              # q, k, v, z; out
        moe = config.get("num_experts", 0) and (i + 1) % config.get("decoder_sparse_step", 1) == 0
        if moe:
            lin += 3 * h * (config["num_experts_per_tok"] * config["moe_intermediate_size"]
                            + config["shared_expert_intermediate_size"])
        else:
            lin += 3 * h * config["intermediate_size"]
    return attn / (attn + 2 * lin)


def write_checkpoint(path: str, seed: int = 0, config: dict | None = None) -> str:
    import torch  # noqa: PLC0415
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: PLC0415
    torch.manual_seed(seed)
    Qwen3NextForCausalLM(Qwen3NextConfig(**(config or CONFIG))).save_pretrained(path)
    return path
