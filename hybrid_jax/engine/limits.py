"""Admission checks of a request against the model and the engine: what a step may receive.

`check_request` runs before a request is queued (the server calls it before it answers 200, the
engine again in `add_request`), so every row a compiled step sees is valid: token ids inside the
vocabulary, numbers that fit the step's int32 / float32 inputs, and bounded host work per token
(stop strings are searched in the new text of every step, so their count and length are capped).

Documented limits (README, Serve section):

  stop strings      at most MAX_STOP_STRINGS, each at most MAX_STOP_STRING_CHARS characters
  stop_token_ids    at most MAX_STOP_TOKEN_IDS, each in [0, vocab_size)
  top_k             -1 / 0 (off) or >= 1; a value >= vocab_size keeps every token (the same as off)
  top_p             in (0, 1] and > 0 once rounded to float32
  temperature       finite in float32 (values below MIN_TEMPERATURE sample greedily, as in vLLM)
  logprobs          0 .. 20, or -1: the whole vocabulary, sorted (offline API only; the server takes 0 .. 20)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hybrid_jax.errors import InputError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MIN_TEMPERATURE = 1e-5
_F32_MAX = float(np.finfo(np.float32).max)


def check_request(params, vocab_size: int, speculative: bool = False):
    """Raises InputError naming the first field the model or the engine cannot serve (speculative: the
    engine speculates, and refuses the logits processors)."""
    params.validate()
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InputError(f"'stop' has {len(params.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    long = [s for s in params.stop if len(s) > MAX_STOP_STRING_CHARS]
    if long:
        raise InputError(f"a 'stop' string has {len(long[0])} characters; at most {MAX_STOP_STRING_CHARS} "
                         "are allowed")
    ids = list(params.stop_token_ids)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InputError(f"'stop_token_ids' has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"'stop_token_ids' outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if float(params.temperature) > _F32_MAX:
        raise InputError(f"'temperature' = {params.temperature!r} overflows float32")
    if not np.float32(params.top_p) > 0:
        raise InputError(f"'top_p' = {params.top_p!r} rounds to 0 in float32: it would keep no token")
    bad = sorted(t for t in (params.logit_bias or {}) if t >= vocab_size)
    if bad:
        raise InputError(f"'logit_bias' names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if speculative:
        refuse_with_speculation(params)


# The logits processors (hybrid_jax/logits_processors.py), which the speculative verify does not apply:
# refused by name when the engine speculates.
PROCESSORS = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_p", 0.0),
              ("min_tokens", 0), ("logit_bias", None))


def refuse_with_speculation(params):
    for name, off in PROCESSORS:
        if getattr(params, name) != off:
            raise InputError(f"'{name}' is not supported with speculative decoding")


def row_top_k(top_k: int, vocab_size: int) -> int:
    """The step's int32 top-k: -1 (off) for off and for values that keep the whole vocabulary."""
    return int(top_k) if 0 < top_k < vocab_size else -1


def row_temperature(t: float) -> float:
    """The step's float32 temperature: 0 (greedy) below MIN_TEMPERATURE, where logits / t overflow."""
    return float(t) if t >= MIN_TEMPERATURE else 0.0


def encode_prompt(prompt: Any, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """A prompt (a string, {"prompt_token_ids": [...]} with an optional "prompt" text, or {"prompt": str})
    as (its text or None, its token ids), every id checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InputError("this checkpoint has no tokenizer.json: pass {'prompt_token_ids': [...]} "
                             "instead of a string, or LLM(..., tokenizer=PATH)")
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
    elif isinstance(prompt, dict) and "prompt" in prompt:
        return encode_prompt(prompt["prompt"], tokenizer, vocab_size)
    else:
        raise InputError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}")
    ids = list(ids) if not isinstance(ids, np.ndarray) else ids.tolist()
    if not ids:
        raise InputError("empty prompt: it has no tokens")
    try:
        arr = np.asarray(ids)
    except (OverflowError, ValueError, TypeError):     # e.g. an int past int64: named below
        arr = None
    if (arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu"
            and 0 <= arr.min() and arr.max() < vocab_size):
        return text, arr.tolist()        # the common case, checked in one pass over an int array
    bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return text, [int(t) for t in ids]


def _text_to_encode(prompt: Any) -> str | None:
    """The string `encode_prompt` would tokenize, if any."""
    while isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
        prompt = prompt["prompt"]
    return prompt if isinstance(prompt, str) else None


def refuse_unfittable(text: str | None, tokenizer, max_tokens: int, max_model_len: int):
    """Refuses a text that cannot fit before tokenizing it (tokenizing hundreds of KB takes a
    second). Only on a sound bound: the tokenizer's `max_token_bytes` (hybrid_jax/tokenizer.py; None
    or absent: no bound, nothing is refused here) says how many bytes one token stands for at most,
    so B bytes are at least ceil(B / max_token_bytes) tokens, and only a text whose least possible
    token count leaves no room for max_tokens is refused. Anything that could fit is tokenized."""
    per_token = getattr(tokenizer, "max_token_bytes", None) if text is not None else None
    if not per_token:
        return
    room = (max_model_len - max_tokens) * per_token       # the most bytes a prompt that fits can have
    if len(text) <= room // 4:                            # (4 bytes a character at most: fits, no count needed)
        return
    nbytes = len(text.encode("utf-8", "surrogatepass"))  # (a copy, but ~1000x cheaper than tokenizing it)
    least = -(-nbytes // per_token)
    if least + max_tokens > max_model_len:
        raise InputError(f"prompt (at least {least} tokens: {nbytes} bytes of text, at most {per_token} bytes a "
                         f"token) + max_tokens ({max_tokens}) exceeds max_model_len {max_model_len}")


def admit(prompt: Any, params, tokenizer, vocab_size: int, max_model_len: int,
          speculative: bool = False) -> tuple[str | None, list[int]]:
    """Admission of one request (`check_request`, the prompt encoded and checked, prompt + max_tokens
    within max_model_len): its text and token ids, or InputError naming the problem. The engine runs
    it in `add_request`; an API server in front of an engine process runs it before answering.
    speculative: the engine speculates (the logits processors are refused)."""
    check_request(params, vocab_size, speculative)
    refuse_unfittable(_text_to_encode(prompt), tokenizer, params.max_tokens, max_model_len)
    text, ids = encode_prompt(prompt, tokenizer, vocab_size)
    if len(ids) + params.max_tokens > max_model_len:
        raise InputError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                         f"max_model_len {max_model_len}")
    return text, ids
