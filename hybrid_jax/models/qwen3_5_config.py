"""Qwen3.5 (`model_type: qwen3_5` dense, `qwen3_5_moe` MoE) configuration: the text model of the
multimodal checkpoint, as the Qwen3-Next `ModelConfig` it is.

The released config.json is multimodal: the language model's fields sit under `text_config` (the
vision tower's under `vision_config`, which this project does not run); text-only checkpoints
(`qwen3_5_text`, `qwen3_5_moe_text`) carry them at the top level. Qwen3.5 is Qwen3-Next's layer stack
(Gated DeltaNet + gated full attention) with split input projections (a weight-map matter), every
MoE layer sparse with renormalised Top-K, and interleaved mRoPE, which for text positions is 1-D RoPE.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.errors import ConfigError
from hybrid_jax.models.qwen3_next_config import qwen3_next_config

MROPE_SECTION = (11, 11, 10)         # transformers' default for Qwen3.5 (always interleaved)


def qwen3_5_config(d: dict[str, Any]):
    """config.json -> models.qwen3_next_config.ModelConfig (KeyError / ValueError / ConfigError on bad fields)."""
    model_type = d["model_type"]
    text = d.get("text_config")
    if text is None:
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            raise ConfigError(f"{model_type} config.json lacks its text_config")
        text = d
    if not isinstance(text, dict):
        raise ConfigError("text_config must be a JSON object")
    if text.get("attn_output_gate", True) is not True:
        raise ConfigError("attn_output_gate=false is not supported for Qwen3.5 (its attention is gated)")
    ssm = text.get("mamba_ssm_dtype", "float32")
    if ssm not in ("float32", None):
        raise ConfigError(f"mamba_ssm_dtype {ssm!r} is not supported: the recurrent state is kept in float32")
    t = dict(text, model_type=model_type)
    for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "dtype", "torch_dtype"):
        if k in d and d is not text:       # the multimodal model's own (transformers ties by the top level)
            t[k] = d[k]
    moe = int(t.get("num_experts") or 0) > 0
    if moe:                                # every layer sparse; Top-K weights always renormalised
        if t.get("mlp_only_layers") or int(t.get("decoder_sparse_step") or 1) != 1:
            raise ConfigError("Qwen3.5 MoE has no dense layers: mlp_only_layers / decoder_sparse_step are not read")
        t.update(mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)
    elif model_type.startswith("qwen3_5_moe"):
        raise ConfigError(f"{model_type} needs num_experts > 0")
    cfg = qwen3_next_config(t)
    rope = cfg.rope
    if not rope.mrope_section:
        rope = dataclasses.replace(rope, mrope_section=MROPE_SECTION)
    return dataclasses.replace(cfg, rope=dataclasses.replace(rope, mrope_interleaved=True))
