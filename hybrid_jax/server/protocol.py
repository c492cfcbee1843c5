"""Request parsing for the OpenAI-compatible endpoints: JSON in, SamplingParams and prompt out.

Parsing is total: every body is either a request or an InputError whose message the server returns
with a 400 — nesting deeper than MAX_DEPTH, integers past Python's digit limit, numbers that
overflow a float (1e400, the integer 10**400 as a temperature), NaN / Infinity literals and strings
with lone surrogates included. Which fields a request may carry is decided by
server/fields.py alone (`check_fields` runs first); this module reads the honoured ones into a
`RequestOptions` (what the server does with the request) and SamplingParams (what the engine does)."""
from __future__ import annotations

import json
import math
import dataclasses
from typing import Any

from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.server.fields import Endpoint, check_fields
from hybrid_jax.server.structured_fields import structured_outputs_of

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


def typed(data, key, types, default):
    v = data.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types:
        raise InputError(f"'{key}' must be {types[0].__name__}; got {v!r}")
    if not isinstance(v, types):
        raise InputError(f"'{key}' must be {types[0].__name__}; got {v!r}")
    return v


def _float(data, key, default) -> float:
    v = typed(data, key, (int, float), default)
    try:
        f = float(v)
    except OverflowError:
        raise InputError(f"'{key}' = {str(v)[:40]}... is out of range") from None
    if not math.isfinite(f):
        raise InputError(f"'{key}' must be a finite number; got {v!r}")
    return f


MAX_SEQUENCES = 64        # engine requests one HTTP request may fan out into (prompts x n)
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False             # a last chunk with `choices: []` and the request's usage
    continuous_usage_stats: bool = False    # (with include_usage) the usage so far on every chunk


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """What the server does with a request beyond its sampling: how many choices, streamed how,
    echoed, and the response's log-probabilities."""
    chat: bool
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    echo: bool = False
    logprobs: int | None = None             # top-n per token (chat: top_logprobs when logprobs is true)
    max_tokens: int | None = None           # as sent (None: the rest of the context); 0 only with echo
    tokens_as_ids: bool = False             # return_tokens_as_token_ids
    request_id: str | None = None
    add_special_tokens: bool = True         # completions: the tokenizer's BOS before a text prompt
    user: str | None = None
    prompt_logprobs: bool = False           # vLLM's prompt_logprobs asked for by name (its own response field)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint.CHAT if self.chat else Endpoint.COMPLETIONS


def _bool(data, key, default: bool) -> bool:
    return bool(typed(data, key, (bool,), default))


def _stream_options(data, stream: bool) -> StreamOptions:
    so = data.get("stream_options")
    if so is None:
        return StreamOptions()
    if not stream:
        raise InputError("'stream_options' is only allowed with \"stream\": true")
    if not isinstance(so, dict):
        raise InputError(f"'stream_options' must be an object; got {so!r}")
    unknown = sorted(set(so) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise InputError(f"Unrecognized request argument supplied: stream_options.{unknown[0]}")
    return StreamOptions(include_usage=_bool(so, "include_usage", False),
                         continuous_usage_stats=_bool(so, "continuous_usage_stats", False))


def _logprobs(data, chat: bool) -> int | None:
    lp = data.get("logprobs")
    if chat:
        if not isinstance(lp, (bool, type(None))):
            raise InputError(f"'logprobs' must be true or false in a chat request; got {lp!r}")
        top = typed(data, "top_logprobs", (int,), None)
        if top is not None and not lp:
            raise InputError("'top_logprobs' needs \"logprobs\": true")
        lp, name = ((top or 0) if lp else None), "top_logprobs"
    else:
        lp, name = typed(data, "logprobs", (int,), None), "logprobs"
    if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
        # (the offline API's -1, the whole vocabulary, is no answer to send over HTTP)
        raise InputError(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}]; got {lp!r}")
    return lp


def _max_tokens(data, chat: bool, echo: bool, limit: int) -> int | None:
    key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    v = typed(data, key, (int,), None)
    if v is None:
        return None
    if v < 0 or (v == 0 and not echo):
        raise InputError(f"'{key}' must be a positive integer{' (0 only with echo)' if not chat else ''}; got {v}")
    if v > limit:
        raise InputError(f"'{key}' = {v} exceeds this server's limit of {limit}")
    return v


def request_options(data: dict[str, Any], *, chat: bool, max_tokens_limit: int) -> RequestOptions:
    """Checks the body's fields against the table (server/fields.py) and reads the server's part."""
    endpoint = Endpoint.CHAT if chat else Endpoint.COMPLETIONS
    check_fields(data, endpoint)
    n = typed(data, "n", (int,), 1)
    if n < 1:
        raise InputError(f"'n' must be a positive integer; got {n}")
    best_of = typed(data, "best_of", (int,), None)
    if best_of is not None and best_of != n:
        raise InputError(f"'best_of' = {best_of} is not supported: only best_of equal to n ({n}), or absent "
                         "(ranking more candidates than are returned is not implemented)")
    stream = _bool(data, "stream", False)
    echo = _bool(data, "echo", False)
    rid = typed(data, "request_id", (str,), None)
    user = typed(data, "user", (str,), None) or typed(data, "safety_identifier", (str,), None)
    return RequestOptions(chat=chat, n=n, stream=stream, stream_options=_stream_options(data, stream), echo=echo,
                          logprobs=_logprobs(data, chat), max_tokens=_max_tokens(data, chat, echo, max_tokens_limit),
                          tokens_as_ids=_bool(data, "return_tokens_as_token_ids", False), request_id=rid,
                          add_special_tokens=chat or _bool(data, "add_special_tokens", True), user=user,
                          prompt_logprobs=data.get("prompt_logprobs") is not None)


def sampling_params(data: dict[str, Any], opts: RequestOptions, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for one choice (seeds per choice: server/fanout.py). `max_tokens` is
    what the engine generates (echo with max_tokens 0 generates 1 and drops it, as vLLM)."""
    stop = data.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise InputError(f"'stop' must be a string or a list of strings; got {stop!r}")
    prompt_logprobs = typed(data, "prompt_logprobs", (int,), None)
    if prompt_logprobs is None and opts.echo and opts.logprobs is not None:
        prompt_logprobs = opts.logprobs or 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(data, "temperature", 1.0),
        top_p=_float(data, "top_p", 1.0),
        top_k=typed(data, "top_k", (int,), -1),
        min_p=_float(data, "min_p", 0.0),
        seed=typed(data, "seed", (int,), None),
        stop=stop,
        stop_token_ids=list(typed(data, "stop_token_ids", (list,), [])),
        ignore_eos=_bool(data, "ignore_eos", False),
        logprobs=opts.logprobs,
        presence_penalty=_float(data, "presence_penalty", 0.0),
        frequency_penalty=_float(data, "frequency_penalty", 0.0),
        repetition_penalty=_float(data, "repetition_penalty", 1.0),
        min_tokens=typed(data, "min_tokens", (int,), 0),
        logit_bias=typed(data, "logit_bias", (dict,), None),
        include_stop_str_in_output=_bool(data, "include_stop_str_in_output", False),
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs_of(data),
    )


def _one_prompt(p):
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt_token_ids": p}
    return None


def completion_prompts(data: dict[str, Any]) -> list:
    """`prompt`: a string, a list of token ids, or a non-empty list of strings or of token-id lists
    (one or more choices for each, in order)."""
    if "prompt" not in data or data["prompt"] is None:
        raise InputError("'prompt' is required")
    p = data["prompt"]
    one = _one_prompt(p)
    if one is not None:
        return [one]
    many = [_one_prompt(x) for x in p] if isinstance(p, list) and p else [None]
    if None in many:
        raise InputError("'prompt' must be a string, a non-empty list of token ids, or a non-empty list of "
                         "strings or of non-empty token-id lists")
    return many


def completion_prompt(data: dict[str, Any]):
    """The one prompt of a completions request (a list of several is `completion_prompts`)."""
    prompts = completion_prompts(data)
    if len(prompts) != 1:
        raise InputError(f"'prompt' holds {len(prompts)} prompts where one is expected")
    return prompts[0]
