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

CONFIGS = {"heads32": CONFIG, "heads64": CONFIG_WIDE_HEADS}


def write_checkpoint(path: str, seed: int = 0, config: dict | None = None) -> str:
    import torch  # noqa: PLC0415
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: PLC0415
    torch.manual_seed(seed)
    Qwen3NextForCausalLM(Qwen3NextConfig(**(config or CONFIG))).save_pretrained(path)
    return path
