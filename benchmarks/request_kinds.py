"""Every kind of request the OpenAI-compatible server takes, one of each, for checking that none of
them waits on a compile once the start-up is complete (benchmarks/cold_start.py) or fails.

Each `Case` is a path, a body and a check of the answer (a short note of what came back, or an
AssertionError saying what is wrong). `run_cases(post, budget)` sends them through `post(path, body)
-> (status, json)`, so the same cases run against a live server (httpx) and an in-process app
(FastAPI's TestClient). `budget`: the server's --max-model-len, to size the long prompt near it.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable

BOOK = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                         "chapters": {"type": "integer", "minimum": 1}},
        "required": ["title", "chapters"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}


@dataclasses.dataclass
class Case:
    name: str
    path: str
    body: dict
    check: Callable[[dict], str]


@dataclasses.dataclass
class Outcome:
    name: str
    status: int
    seconds: float
    note: str
    ok: bool


def _text(r: dict) -> str:
    c = r["choices"][0]
    return c["text"] if "text" in c else (c["message"].get("content") or "")


def _tokens(r: dict, n: int) -> str:
    got = r["usage"]["completion_tokens"]
    assert got == n, f"{got} tokens, not {n}"
    return f"{got} tokens"


def _logprobs(r: dict, k: int) -> str:
    lp = r["choices"][0]["logprobs"]
    tops = lp["top_logprobs"]
    assert tops and all(len(t) >= 1 for t in tops) and max(len(t) for t in tops) <= k + 1, "top_logprobs widths"
    return f"{len(lp['tokens'])} tokens with top-{k}"


def _chat_logprobs(r: dict, k: int) -> str:
    content = r["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == k for t in content), "top_logprobs widths"
    return f"{len(content)} tokens with top-{k}"


def _n(r: dict, n: int) -> str:
    assert len(r["choices"]) == n, f"{len(r['choices'])} choices"
    return f"{n} choices"


def _echo(r: dict, prompt_len: int) -> str:
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) >= prompt_len and lp["token_logprobs"][0] is None, "the prompt's logprobs"
    return f"{len(lp['tokens'])} prompt tokens scored"


def _prompt_logprobs(r: dict, prompt_len: int) -> str:
    pl = r["choices"][0].get("prompt_logprobs") or r.get("prompt_logprobs")
    assert pl is not None and len(pl) == prompt_len and pl[0] is None, "prompt_logprobs per prompt token"
    return f"{len(pl)} prompt positions"


def _json_schema(r: dict) -> str:
    text = _text(r)
    doc = json.loads(text)
    assert set(doc) == {"title", "chapters"} and isinstance(doc["chapters"], int) and doc["chapters"] >= 1, text
    return f"valid JSON {text[:40]}"


def _tool_call(r: dict) -> str:
    calls = r["choices"][0]["message"].get("tool_calls") or []
    assert calls and calls[0]["function"]["name"] == "get_weather", \
        f"no get_weather call: {r['usage']} {r['choices'][0]}"
    args = json.loads(calls[0]["function"]["arguments"])
    assert isinstance(args.get("city"), str), calls
    return f"tool call get_weather({args})"


def _stop(r: dict) -> str:
    assert r["choices"][0]["finish_reason"] in ("stop", "length") and " the" not in _text(r), _text(r)
    return f"finish {r['choices'][0]['finish_reason']}"


# the logits processors, which a speculating server refuses by name (engine/limits.py): asked only without
PROCESSORS = {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
              "logit_bias": {"50": -100}, "min_tokens": 4}


def cases(budget: int, speculative: bool = False) -> list[Case]:
    """One request of each kind; the long prompt is `budget` - 24 tokens (ids, so its length is exact).
    speculative: the server speculates, so the sampling case leaves out the logits processors."""
    long_ids = [(i * 37) % 200 + 10 for i in range(budget - 24)]
    short = [5, 6, 7, 8]
    return [
        Case("short", "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
             lambda r: _tokens(r, 8)),
        Case("long prompt", "/v1/completions", {"prompt": long_ids, "max_tokens": 16, "ignore_eos": True},
             lambda r: _tokens(r, 16)),
        Case("long output", "/v1/completions", {"prompt": "Once", "max_tokens": min(512, budget - 8),
                                                "ignore_eos": True}, lambda r: _tokens(r, min(512, budget - 8))),
        Case("logprobs", "/v1/completions", {"prompt": "And God said", "max_tokens": 8, "logprobs": 5},
             lambda r: _logprobs(r, 5)),
        Case("chat top_logprobs", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
             "max_tokens": 8, "logprobs": True, "top_logprobs": 20, "ignore_eos": True},
             lambda r: _chat_logprobs(r, 20)),
        Case("sampling", "/v1/completions", {"prompt": "In the beginning", "max_tokens": 16, "temperature": 0.8,
             "top_p": 0.9, "top_k": 20, "seed": 7, "ignore_eos": True, **({} if speculative else PROCESSORS)},
             lambda r: _tokens(r, 16)),
        Case("stop", "/v1/completions", {"prompt": "And God said", "max_tokens": 32, "stop": [" the"]}, _stop),
        Case("n>1", "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 1},
             lambda r: _n(r, 3)),
        Case("echo logprobs", "/v1/completions", {"prompt": short, "max_tokens": 0, "echo": True, "logprobs": 1},
             lambda r: _echo(r, len(short))),
        Case("prompt_logprobs", "/v1/completions", {"prompt": short, "max_tokens": 2, "prompt_logprobs": 3},
             lambda r: _prompt_logprobs(r, len(short))),
        Case("json_schema", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a book"}],
             "max_tokens": 60, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "book", "schema": BOOK}}},
             _json_schema),
        Case("chat tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
             "max_tokens": 100, "tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
             _tool_call),
    ]


def run_cases(post: Callable[[str, dict], tuple[int, dict]], budget: int, speculative: bool = False) -> list[Outcome]:
    """Sends every case in turn; an answer that is not 200 or fails its check is not ok."""
    out = []
    for c in cases(budget, speculative):
        t0 = time.perf_counter()
        status, body = post(c.path, c.body)
        secs = time.perf_counter() - t0
        try:
            assert status == 200, f"HTTP {status}: {str(body)[:200]}"
            out.append(Outcome(c.name, status, secs, c.check(body), True))
        except (AssertionError, KeyError, IndexError, TypeError, ValueError) as e:
            out.append(Outcome(c.name, status, secs, f"FAILED {type(e).__name__}: {e}"[:160], False))
    return out


def format_outcomes(outs: list[Outcome]) -> str:
    lines = [f"  {'request':<20}{'HTTP':>5}{'s':>7}  what came back"]
    lines += [f"  {o.name:<20}{o.status:>5}{o.seconds:>7.2f}  {o.note}" for o in outs]
    return "\n".join(lines)
