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
  logprobs          0 .. 20
"""
from __future__ import annotations

import numpy as np

from hybrid_jax.errors import InputError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MIN_TEMPERATURE = 1e-5
_F32_MAX = float(np.finfo(np.float32).max)


def check_request(params, vocab_size: int):
    """Raises InputError naming the first field the model or the engine cannot serve."""
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


def row_top_k(top_k: int, vocab_size: int) -> int:
    """The step's int32 top-k: -1 (off) for off and for values that keep the whole vocabulary."""
    return int(top_k) if 0 < top_k < vocab_size else -1


def row_temperature(t: float) -> float:
    """The step's float32 temperature: 0 (greedy) below MIN_TEMPERATURE, where logits / t overflow."""
    return float(t) if t >= MIN_TEMPERATURE else 0.0
