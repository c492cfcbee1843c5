"""How a chat request's output is read back: the served family's tool-call and reasoning formats
(server/tool_parsers/, chosen by the checkpoint's model_type or `--tool-call-parser` /
`--reasoning-parser`), applied as the request's tools and tool_choice say; and the OpenAI shapes of
the result: `message` (content, tool_calls, reasoning_content / reasoning) and the stream's deltas.

The parser's markers reach it because the request's SamplingParams name them in
`keep_special_tokens`: the detokenizer drops special tokens except those (Kimi's
`<|tool_calls_section_begin|>` and the like are special tokens)."""
from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.sampling import SamplingParams
from hybrid_jax.server.chat_messages import tool_choice_of
from hybrid_jax.server.protocol import typed
from hybrid_jax.server.tool_parsers import Delta, Family, MessageParser, ParsedMessage, needs_tool_format, schemas_of


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    """One chat request's output reading: its parser, and whether reasoning is shown."""
    parser: MessageParser
    include_reasoning: bool = True


def chat_output(fam: Family, data: dict[str, Any]) -> ChatOutput | None:
    """The request's reading of its output (None: plain text, nothing to parse)."""
    choice = tool_choice_of(data)
    if choice.parses_calls and choice.explicit:
        needs_tool_format(fam)
    # TODO(integrator): for ToolMode.REQUIRED / NAMED, attach the family's structural tag
    # (xgrammar.get_model_structural_tag) here; the parser below reads what that grammar allows.
    tool = fam.tool_format if choice.parses_calls else None
    if tool is None and fam.reasoning is None:
        return None
    include = bool(typed(data, "include_reasoning", (bool,), True))
    return ChatOutput(MessageParser(tool, fam.reasoning, schemas_of(data.get("tools")), choice.parallel), include)


def keep_markers(params: SamplingParams, out: ChatOutput | None) -> SamplingParams:
    """The params with the parser's markers kept in the output text."""
    if out is None:
        return params
    return dataclasses.replace(params, keep_special_tokens=tuple(out.parser.markers))


def message(parsed: ParsedMessage, out: ChatOutput) -> dict:
    """A chat choice's `message`: content null when there are only calls (or only reasoning)."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.content is None and not parsed.tool_calls and parsed.reasoning is None:
        msg["content"] = ""
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in parsed.tool_calls]
    if out.include_reasoning and out.parser.reasoning is not None:
        msg["reasoning_content"] = msg["reasoning"] = parsed.reasoning
    return msg


def delta(d: Delta, out: ChatOutput) -> dict | None:
    """A stream delta's OpenAI `delta` object (None: nothing to send, e.g. reasoning not shown)."""
    if d.content is not None:
        return {"content": d.content}
    if d.reasoning is not None:
        return {"reasoning_content": d.reasoning, "reasoning": d.reasoning} if out.include_reasoning else None
    if d.call_id is not None:
        return {"tool_calls": [{"index": d.call_index, "id": d.call_id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": d.call_index, "function": {"arguments": d.arguments}}]}
