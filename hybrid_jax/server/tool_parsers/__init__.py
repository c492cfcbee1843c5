"""Tool-call and reasoning parsers of the chat endpoint: a registry of formats by name (vLLM's
`--tool-call-parser` / `--reasoning-parser` names where they exist), each served family's default
(`for_model_type`), and the parser one request gets (`MessageParser`: parse a whole output, or
stream one). The formats are data (formats.py, reasoning.py); one scanner (stream.py) serves all."""
from __future__ import annotations

import dataclasses

from hybrid_jax.errors import InputError
from hybrid_jax.server.tool_parsers.arguments import schemas_of
from hybrid_jax.server.tool_parsers.formats import TOOL_FORMATS, ToolFormat
from hybrid_jax.server.tool_parsers.reasoning import REASONING_FORMATS, ReasoningFormat
from hybrid_jax.server.tool_parsers.stream import MessageParser, MessageStream
from hybrid_jax.server.tool_parsers.types import Delta, ParsedMessage, ToolCall, collect

__all__ = ["TOOL_FORMATS", "REASONING_FORMATS", "Family", "for_model_type", "family", "MessageParser",
           "MessageStream", "Delta", "ParsedMessage", "ToolCall", "collect", "schemas_of", "ToolFormat",
           "ReasoningFormat"]


@dataclasses.dataclass(frozen=True)
class Family:
    """The parsers a served model's output is read with (None: not parsed)."""
    tool_format: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None


# model_type (config.json) -> (tool-call format, reasoning format)
_DEFAULTS = {
    "qwen3_next": ("hermes", "qwen3"),
    "qwen3_5": ("qwen3_coder", "qwen3"),
    "qwen3_5_moe": ("qwen3_coder", "qwen3"),
    "deepseek_v32": ("deepseek_v32", "deepseek_v3"),
    "deepseek_v4": ("deepseek_v4", "deepseek_v4"),
    "kimi_linear": ("kimi_k2", "kimi_k2"),
}


def for_model_type(model_type: str | None) -> Family:
    """A model family's own formats (none for a model type this table does not know)."""
    tool, think = _DEFAULTS.get(model_type or "", (None, None))
    return Family(TOOL_FORMATS.get(tool or ""), REASONING_FORMATS.get(think or ""))


def _named(table: dict, name: str, what: str):
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))} (or 'none')")
    return table[name]


def family(model_type: str | None, tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> Family:
    """The family's defaults, with `hybrid-jax serve`'s --tool-call-parser / --reasoning-parser
    overrides ("none": not parsed). A name not in the registry is a ValueError (the command's error)."""
    base = for_model_type(model_type)
    tool, think = base.tool_format, base.reasoning
    if tool_call_parser is not None:
        tool = None if tool_call_parser == "none" else _named(TOOL_FORMATS, tool_call_parser, "tool-call parser")
    if reasoning_parser is not None:
        think = None if reasoning_parser == "none" else _named(REASONING_FORMATS, reasoning_parser, "reasoning parser")
    return Family(tool, think)


def needs_tool_format(fam: Family):
    """InputError for tool_choice asking for calls when the served model has no tool-call format."""
    if fam.tool_format is None:
        raise InputError("tool calls are not parsed for this model (its family has no known tool-call format); "
                         "start the server with --tool-call-parser NAME, NAME one of "
                         f"{', '.join(sorted(TOOL_FORMATS))}, or send tool_choice \"none\"")
