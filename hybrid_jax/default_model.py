"""The embedded default model: a small hybrid Qwen3-Next-shaped config with deterministic random
weights, so `hybrid-jax generate` runs with nothing downloaded. It is UNTRAINED: its text is noise.

Layers: three Gated DeltaNet + one gated full attention, repeated twice; MoE on odd layers, dense
MLP on even ones; HV = 2 H value heads; byte-level vocabulary.
"""
from __future__ import annotations

from hybrid_jax.config import ModelConfig
from hybrid_jax.layers.rope import RopeSpec
from hybrid_jax.tokenizer import ByteTokenizer

DEFAULT_MODEL_NAME = "hybrid-jax/embedded-qwen3-next-tiny (untrained)"
DEFAULT_SEED = 1234


def default_config() -> ModelConfig:
    tok = ByteTokenizer()
    return ModelConfig(
        model_type="qwen3_next", vocab_size=tok.vocab_size, hidden_size=128, num_hidden_layers=8,
        layer_types=tuple(("linear_attention",) * 3 + ("full_attention",)) * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope=RopeSpec(theta=10000.0, partial_rotary_factor=0.25),
        max_position_embeddings=32768,
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
        intermediate_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=2,
        bos_token_id=tok.bos_token_id, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
        dtype="float32")
