"""Request parsing for the OpenAI-compatible endpoints: JSON in, SamplingParams and prompt out.
Every problem is an InputError whose message the server returns with a 400."""
from __future__ import annotations

import json
from typing import Any

from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "logprobs"}


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InputError("request body must be a JSON object")
    return data


def _typed(data, key, types, default):
    v = data.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types:
        raise InputError(f"'{key}' must be {types[0].__name__}; got {v!r}")
    if not isinstance(v, types):
        raise InputError(f"'{key}' must be {types[0].__name__}; got {v!r}")
    return v


def sampling_params(data: dict[str, Any], *, max_tokens_limit: int, default_max_tokens: int = 16,
                    chat: bool = False) -> SamplingParams:
    n = _typed(data, "n", (int,), 1)
    if n != 1:
        raise InputError("only n = 1 is supported")
    mt_key = "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens"
    max_tokens = _typed(data, mt_key, (int,), default_max_tokens)
    if max_tokens > max_tokens_limit:
        raise InputError(f"'{mt_key}' = {max_tokens} exceeds this server's limit of {max_tokens_limit}")
    stop = data.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise InputError(f"'stop' must be a string or a list of strings; got {stop!r}")
    logprobs = data.get("logprobs")
    if chat:
        logprobs = _typed(data, "top_logprobs", (int,), 0) if data.get("logprobs") else None
    elif logprobs is not None:
        logprobs = _typed(data, "logprobs", (int,), 0)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_typed(data, "temperature", (int, float), 1.0)),
        top_p=float(_typed(data, "top_p", (int, float), 1.0)),
        top_k=_typed(data, "top_k", (int,), -1),
        seed=_typed(data, "seed", (int,), None),
        stop=stop,
        stop_token_ids=list(_typed(data, "stop_token_ids", (list,), [])),
        ignore_eos=bool(_typed(data, "ignore_eos", (bool,), False)),
        logprobs=logprobs,
    )


def completion_prompt(data: dict[str, Any]):
    """`prompt` may be a string or a list of token ids (one prompt per request)."""
    if "prompt" not in data:
        raise InputError("'prompt' is required")
    p = data["prompt"]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt_token_ids": p}
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        return completion_prompt({"prompt": p[0]})
    raise InputError("'prompt' must be a string or a non-empty list of token ids (batches of prompts are "
                     "not supported: send one request per prompt)")


def chat_messages(data: dict[str, Any]) -> list[dict[str, str]]:
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InputError("'messages' must be a non-empty list")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError("each message needs a string 'role' and a string 'content'")
    return msgs
