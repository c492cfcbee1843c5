"""Request parsing for the OpenAI-compatible endpoints: JSON in, SamplingParams and prompt out.

Parsing is total: every body is either a request or an InputError whose message the server returns
with a 400 — nesting deeper than MAX_DEPTH, integers past Python's digit limit, numbers that
overflow a float (1e400, the integer 10**400 as a temperature), NaN / Infinity literals and strings
with lone surrogates included. OpenAI fields this server does not implement (`echo`, `best_of` > 1,
`logit_bias`, penalties, `suffix`) are refused by name rather than ignored."""
from __future__ import annotations

import json
import math
from typing import Any

from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "logprobs"}


MAX_DEPTH = 32


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise InputError(f"the number {text[:40]} is out of range (it overflows a float)")
    return v


def _no_constant(name: str):
    raise InputError(f"{name} is not valid JSON")


def _check_tree(data):
    """Depth and strings of a parsed body, walked iteratively (no recursion to exhaust)."""
    todo = [(data, 1)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise InputError(f"request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            for k, x in v.items():
                todo.append((k, depth))
                todo.append((x, depth + 1))
        elif isinstance(v, list):
            todo.extend((x, depth + 1) for x in v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"a string holds a lone surrogate ({v[e.start:e.end]!a}): not valid Unicode") from None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body, parse_float=_finite, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"request body is not valid JSON: {e}") from None
    except InputError:
        raise
    except RecursionError:
        raise InputError(f"request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:          # an integer past the digit limit of int('...')
        raise InputError(f"request body has a number out of range: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise InputError("request body must be a JSON object")
    _check_tree(data)
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


def _float(data, key, default) -> float:
    v = _typed(data, key, (int, float), default)
    try:
        f = float(v)
    except OverflowError:
        raise InputError(f"'{key}' = {str(v)[:40]}... is out of range") from None
    if not math.isfinite(f):
        raise InputError(f"'{key}' must be a finite number; got {v!r}")
    return f


def _refuse_unsupported(data: dict[str, Any]):
    """OpenAI fields with no implementation here: a clear 400 instead of silently ignoring them."""
    if data.get("echo"):
        raise InputError("'echo' is not supported: the prompt is not returned with the completion")
    best_of = data.get("best_of")
    if best_of is not None and best_of != 1:
        raise InputError(f"'best_of' = {best_of!r} is not supported (only 1)")
    if data.get("logit_bias"):
        raise InputError("'logit_bias' is not supported")
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = data.get(key)
        if v is not None and v != (1 if key == "repetition_penalty" else 0):
            raise InputError(f"'{key}' is not supported (send it unset)")
    if data.get("suffix") is not None:
        raise InputError("'suffix' is not supported")


def sampling_params(data: dict[str, Any], *, max_tokens_limit: int, default_max_tokens: int = 16,
                    chat: bool = False) -> SamplingParams:
    n = _typed(data, "n", (int,), 1)
    if n != 1:
        raise InputError("only n = 1 is supported")
    _refuse_unsupported(data)
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
        if not isinstance(logprobs, (bool, type(None))):
            raise InputError(f"'logprobs' must be true or false in a chat request; got {logprobs!r}")
        logprobs = _typed(data, "top_logprobs", (int,), 0) if logprobs else None
    elif logprobs is not None:
        logprobs = _typed(data, "logprobs", (int,), 0)
    if logprobs is not None and isinstance(logprobs, int) and not 0 <= logprobs <= 20:
        # (the offline API's -1, the whole vocabulary, is no answer to send over HTTP)
        name = "top_logprobs" if chat else "logprobs"
        raise InputError(f"'{name}' must be an integer in [0, 20]; got {logprobs!r}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(data, "temperature", 1.0),
        top_p=_float(data, "top_p", 1.0),
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
