"""What the tool-call and reasoning parsers give back: a parsed message (non-streaming) and the
deltas a stream of text becomes (streaming), both independent of OpenAI's JSON shapes, which
server/responses.py writes."""
from __future__ import annotations

import dataclasses
import secrets


def new_call_id() -> str:
    """An OpenAI-style tool-call id, `call_` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: its id, the function's name, and its arguments as a JSON object's text."""
    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class RawCall:
    """A call as a format's block parser reads it, before it has an id (`id`: one the format itself
    writes, as Kimi's `functions.NAME:IDX`)."""
    name: str
    arguments: str
    id: str | None = None


@dataclasses.dataclass(frozen=True)
class ParsedMessage:
    """A whole answer split: content (None when there is none), tool calls, reasoning (None when none)."""
    content: str | None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    reasoning: str | None = None


@dataclasses.dataclass(frozen=True)
class Delta:
    """One piece of a streamed answer; exactly one kind is set:
    content / reasoning text, a call's start (index, id, name), or a fragment of a call's arguments."""
    content: str | None = None
    reasoning: str | None = None
    call_index: int | None = None       # set for a call's start and for its argument fragments
    call_id: str | None = None          # set only on a call's start (with name)
    name: str | None = None
    arguments: str | None = None        # a fragment of the call's arguments ("" on its start)


def collect(deltas: list[Delta]) -> ParsedMessage:
    """The message a list of deltas adds up to (as an OpenAI client accumulates a stream)."""
    content, reasoning = [], []
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.content is not None:
            content.append(d.content)
        if d.reasoning is not None:
            reasoning.append(d.reasoning)
        if d.call_index is not None:
            c = calls.setdefault(d.call_index, {"id": None, "name": None, "arguments": ""})
            if d.call_id is not None:
                c["id"], c["name"] = d.call_id, d.name
            c["arguments"] += d.arguments or ""
    text, thought = "".join(content), "".join(reasoning)
    return ParsedMessage(text or None, [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())],
                         thought or None)
