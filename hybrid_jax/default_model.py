"""The embedded default model: a small trained hybrid Qwen3-Next checkpoint shipped inside the package
(hybrid_jax/assets/default_model), so `LLM()` and `hybrid-jax generate` work with nothing downloaded.

It is an ordinary Hugging Face checkpoint directory (config.json, model.safetensors in bf16,
tokenizer.json) and loads through the same loader as any other: `LLM()` is `LLM(DEFAULT_MODEL_DIR)`.
Three Gated DeltaNet layers and one gated full-attention layer, MoE in layers 1 and 3, a 4096-token
byte-level BPE; 6.3M parameters trained by scripts/train_default.py on the King James Version
(training.json in the directory holds the run's figures). It writes archaic English, and nothing else.
Its chat_template.jinja writes a chat as role-prefixed paragraphs ending in "Assistant:", which the model
continues as text: it was never trained on dialogue (README, "Chat").
"""
from __future__ import annotations

import json
import os

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default_model")
DEFAULT_MODEL_NAME = "hybrid-jax/default-qwen3-next-kjv-6m"


def checkpoint_dir(model: str | None) -> str:
    """model, or the shipped checkpoint's directory when model is None."""
    return DEFAULT_MODEL_DIR if model is None else model


def training_figures() -> dict:
    """The training run's figures (corpus, tokens, steps, losses, wall time), as the script wrote them."""
    with open(os.path.join(DEFAULT_MODEL_DIR, "training.json"), encoding="utf-8") as f:
        return json.load(f)
