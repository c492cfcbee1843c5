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

from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.server.chat_messages import ToolMode, tool_choice_of
from hybrid_jax.server.protocol import typed
from hybrid_jax.structured.params import StructuredOutputsParams
from hybrid_jax.structured.tool_grammars import tool_call_grammar
from hybrid_jax.server.tool_parsers import Delta, Family, MessageParser, ParsedMessage, needs_tool_format, schemas_of


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    """One chat request's output reading: its parser, whether reasoning is shown, and for tool_choice
    "required" or a named function the grammar that makes the model call (structured/tool_grammars.py,
    in the family's format: the parser reads what it allows)."""
    parser: MessageParser
    include_reasoning: bool = True
    calls: StructuredOutputsParams | None = None


def chat_output(fam: Family, data: dict[str, Any]) -> ChatOutput | None:
    """The request's reading of its output (None: plain text, nothing to parse)."""
    choice = tool_choice_of(data)
    if choice.parses_calls and choice.explicit:
        needs_tool_format(fam)
    tool = fam.tool_format if choice.parses_calls else None
    if tool is None and fam.reasoning is None:
        return None
    calls = None
    if choice.mode in (ToolMode.REQUIRED, ToolMode.NAMED):      # enforced by the mask, not hoped for
        calls = tool_call_grammar(tool.name, data.get("tools") or [], choice.name, choice.parallel)
    include = bool(typed(data, "include_reasoning", (bool,), True))
    return ChatOutput(MessageParser(tool, fam.reasoning, schemas_of(data.get("tools")), choice.parallel), include,
                      calls)


def read_with(params: SamplingParams, out: ChatOutput | None, prompt: str | None) -> SamplingParams:
    """The params as the reading needs them: the parser's markers kept in the output text; the tool-call
    grammar as the structured output (tool_choice required / named; with response_format too: a 400); a
    structured output applying after the reasoning where the prompt opened it (the answer is held to the
    grammar, the thinking is not)."""
    if out is None:
        return params
    so = params.structured_outputs
    if out.calls is not None:
        if so is not None:
            raise InputError("'tool_choice' required / a named function and a structured output (response_format, "
                             "structured_outputs, guided_*) both constrain the answer: send one")
        so = out.calls
    reasoning = out.parser.reasoning
    if so is not None and reasoning is not None and prompt is not None and reasoning.starts_inside(prompt):
        so = dataclasses.replace(so, after=reasoning.end)
    return dataclasses.replace(params, keep_special_tokens=tuple(out.parser.markers), structured_outputs=so)


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
