"""What DeepSeek-V3.2's and DeepSeek-V4's prompt formats share (encoders/deepseek_v32.py,
encoders/deepseek_v4.py): the special tokens, JSON as the releases write it, an assistant's tool calls as a
DSML block (`<｜DSML｜{block}>`, one `<｜DSML｜invoke>` per call, one `<｜DSML｜parameter>` line per argument),
the response-format section, where a request's tools go, and the reading of a completion back into
reasoning, content and tool calls. The two formats differ in the DSML block's name (V3.2 `function_calls`,
V4 `tool_calls`), which every function here that writes or reads a block takes as `block`."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from hybrid_jax.errors import InputError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"

MODES = ("chat", "thinking")

_SCHEMA_PREAMBLE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def to_json(value: Any) -> str:
    """JSON as the releases write it: Python's default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def opening(block: str) -> str:
    """The tag that opens a DSML block (`<｜DSML｜function_calls>`, `<｜DSML｜tool_calls>`)."""
    return f"<{DSML}{block}>"


def closing(block: str) -> str:
    return f"</{DSML}{block}>"


def function_of(tool, where: str) -> dict:
    """The `function` object of a tool (or of a tool call), checked."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict):
        raise InputError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
    return fn


def function_lines(tools: Sequence[dict]) -> str:
    """Each tool's `function` object as one JSON line (both releases list their tools so)."""
    return "\n".join(to_json(function_of(t, f"tools[{i}]")) for i, t in enumerate(tools))


def response_format_block(response_format: dict) -> str:
    return _SCHEMA_PREAMBLE + to_json(response_format)


def sections(msg: dict, tools_block) -> str:
    """A system / developer message's tools section (written by the format's `tools_block`) and its
    response_format section, each after a blank line."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + tools_block(msg["tools"])
    if msg.get("response_format"):
        out += "\n\n" + response_format_block(msg["response_format"])
    return out


def _arguments(call: dict, where: str) -> dict:
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise InputError(f"{where}.function.arguments must be a JSON object")
    return args


def _parameter(name: str, value: Any) -> str:
    is_str = isinstance(value, str)
    text = value if is_str else to_json(value)
    return f'<{DSML}parameter name="{name}" string="{"true" if is_str else "false"}">{text}</{DSML}parameter>'


def calls_block(tool_calls: Sequence[dict], block: str, where: str = "tool_calls") -> str:
    """An assistant's tool calls (OpenAI's {function: {name, arguments}}) as the DSML block it writes: string
    arguments as they are (string="true"), every other value as JSON (string="false")."""
    invokes = []
    for j, call in enumerate(tool_calls):
        fn = function_of(call, f"{where}[{j}]")
        params = [_parameter(k, v) for k, v in _arguments(fn, f"{where}[{j}]").items()]
        invokes.append(f'<{DSML}invoke name="{fn.get("name")}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"{opening(block)}\n" + "\n".join(invokes) + f"\n{closing(block)}"


def message_text(msg: dict, where: str) -> str:
    """A message's content: a string, or "" for none."""
    content = msg.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InputError(f"{where}.content must be a string (text parts joined) or null; "
                         f"got {type(content).__name__}")
    return content


def last_user_index(messages: Sequence[dict]) -> int:
    """The index of the last user or developer message (-1: none)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def is_thinking(thinking_mode: str | bool) -> bool:
    """"thinking" (or True) / "chat" (or False) as a bool; anything else an InputError."""
    if isinstance(thinking_mode, bool):
        return thinking_mode
    if thinking_mode not in MODES:
        raise InputError(f"thinking_mode must be 'chat' or 'thinking'; got {thinking_mode!r}")
    return thinking_mode == "thinking"


def with_request_blocks(messages: list[dict], tools, response_format) -> list[dict]:
    """The request's tools / response_format put on the first message (a system one, made when missing):
    how vLLM and SGLang serve both formats (the releases' examples carry them on their system message)."""
    if not tools and not response_format:
        return messages
    if messages and messages[0].get("role") == "system":
        first, rest = dict(messages[0]), messages[1:]
    else:
        first, rest = {"role": "system", "content": ""}, messages
    if tools:
        first["tools"] = tools
    if response_format:
        first["response_format"] = response_format
    return [first, *rest]


# --- completions ------------------------------------------------------------------------------------


class DsmlFormatError(ValueError):
    """A completion that is not in its format (the message says where)."""


@dataclasses.dataclass(frozen=True)
class ParsedToolCall:
    """One DSML invoke: the function's name and its arguments as a JSON object's text."""
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ParsedCompletion:
    """A completion read back: its reasoning (thinking mode), its content, its tool calls."""
    content: str
    reasoning_content: str
    tool_calls: tuple[ParsedToolCall, ...]

    def as_message(self) -> dict:
        """The OpenAI assistant message (tool calls as {type, function: {name, arguments}})."""
        return {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning_content,
                "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in self.tool_calls]}


_INVOKE = re.compile(rf'<{DSML}invoke\s*name="(.*?)">\n', re.DOTALL)
_PARAM = re.compile(rf'<{DSML}parameter name="(.*?)" string="(true|false)">(.*?)</{DSML}parameter>\n', re.DOTALL)
_INVOKE_END = f"</{DSML}invoke>\n"
_SPECIAL = (BOS, EOS, THINK, END_THINK, DSML)


def _arguments_json(params: list[tuple[str, str, str]]) -> str:
    """DSML parameters back to a JSON object's text: string values quoted, the others as written."""
    items = [f"{to_json(k)}: {to_json(v) if is_str == 'true' else v}" for k, is_str, v in params]
    return "{" + ", ".join(items) + "}"


def _read_invoke(text: str, at: int) -> tuple[ParsedToolCall, int]:
    head = _INVOKE.match(text, at)
    if head is None:
        raise DsmlFormatError(f"expected <{DSML}invoke name=\"...\"> at offset {at}")
    at, params, names = head.end(), [], set()
    while (p := _PARAM.match(text, at)) is not None:
        if p.group(1) in names:
            raise DsmlFormatError(f"parameter {p.group(1)!r} given twice in invoke {head.group(1)!r}")
        names.add(p.group(1))
        params.append((p.group(1), p.group(2), p.group(3)))
        at = p.end()
    if not text.startswith(_INVOKE_END, at):
        raise DsmlFormatError(f"expected a parameter or </{DSML}invoke> at offset {at}")
    return ParsedToolCall(head.group(1), _arguments_json(params)), at + len(_INVOKE_END)


def _read_calls(text: str, at: int, block: str) -> tuple[tuple[ParsedToolCall, ...], int]:
    """The invokes of a block whose opening tag ends at `at`; the offset after its close."""
    if not text.startswith("\n", at):
        raise DsmlFormatError(f"expected a newline after {opening(block)}")
    at += 1
    calls = []
    while not text.startswith(closing(block), at):
        call, at = _read_invoke(text, at)
        calls.append(call)
    return tuple(calls), at + len(closing(block))


def parse_completion(text: str, thinking_mode: str | bool, block: str) -> ParsedCompletion:
    """A completion (the text after the prompt) as reasoning, content and tool calls, as the releases' parsers
    read it: in thinking mode the reasoning runs to </think>; the content runs to EOS or to the DSML block
    (after a blank line), which must end the message. A missing final EOS is accepted (the server strips the
    stop token). Malformed text is a DsmlFormatError."""
    thinking = is_thinking(thinking_mode)
    calls_start = "\n\n" + opening(block)
    reasoning, at = "", 0
    if thinking:
        end = text.find(END_THINK)
        calls_at = text.find(calls_start)
        if end < 0 or 0 <= calls_at < end:
            raise DsmlFormatError("thinking mode: the completion has no </think> before its content")
        reasoning, at = text[:end], end + len(END_THINK)
    calls_at = text.find(calls_start, at)
    eos_at = text.find(EOS, at)
    calls: tuple[ParsedToolCall, ...] = ()
    if calls_at >= 0 and (eos_at < 0 or calls_at < eos_at):
        content = text[at:calls_at]
        calls, at = _read_calls(text, calls_at + len(calls_start), block)
    else:
        content = text[at:] if eos_at < 0 else text[at:eos_at]
        at = len(text) if eos_at < 0 else eos_at
    if text[at:] not in ("", EOS):
        raise DsmlFormatError(f"unexpected text after the message: {text[at:at + 40]!r}")
    for token in _SPECIAL:
        if token in content or token in reasoning:
            raise DsmlFormatError(f"special token {token!r} inside the reasoning or content")
    return ParsedCompletion(content, reasoning, calls)
