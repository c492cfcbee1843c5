"""DeepSeek-V3.2's prompt format. The release ships no Jinja chat template: its `encoding/encoding_dsv32.py`
(Hugging Face deepseek-ai/DeepSeek-V3.2) turns OpenAI-style messages into the prompt text. This module
writes the same text, byte for byte (tests/hybrid_jax/test_deepseek_v32_encoder.py checks it against the
release's own examples), and reads the model's completions back (`parse_completion`).

The format:
- the prompt opens with BOS; a system message is its content, then (when it carries tools) two newlines
  and the tools block (`tools_block`), then (with a response_format) the schema block;
- a user message is `<｜User｜>{content}<｜Assistant｜>` followed by `<think>` when it is the last user
  message and the mode is "thinking", else by `</think>` (the generation prompt is part of the turn);
- a developer message is a user turn whose content is its tools / response_format blocks and then
  `# The user's message is: {content}`;
- an assistant message is `{reasoning}</think>` (thinking mode, after the last user message only), its
  content, its tool calls as a DSML block (`<｜DSML｜function_calls>` ... each argument one
  `<｜DSML｜parameter name=.. string="true|false">` line: strings as they are, everything else as JSON),
  and EOS;
- the results of one assistant's tool calls are one `<function_results>` block of `<result>` lines, after
  which the next assistant turn opens with `<think>` (thinking, after the last user message) or `</think>`;
- reasoning is written only for assistant turns after the last user message: earlier turns' reasoning is
  dropped (the release's `drop_thinking`, which it applies in thinking mode; chat mode writes none).

`encode_messages` takes the request's tools as a separate argument: they go on the first message when it
is a system message, else on an empty system message put in front (as SGLang serves V3.2; the release's
example carries them on its system message).

Two things the release does not have, for the server: `add_generation_prompt=False` leaves off the
opening of the next assistant turn after a final user or tool message, and `continue_final_message` ends
the prompt inside a final assistant message (its EOS left off). `parse_completion` also accepts a
completion without its final EOS (the server strips the stop token)."""
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
CALLS_OPEN = f"<{DSML}function_calls>"
CALLS_CLOSE = f"</{DSML}function_calls>"

MODES = ("chat", "thinking")

_TOOLS_PREAMBLE = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{CALLS_OPEN}" block like the following as part of your reply to the user:
{CALLS_OPEN}
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
{CALLS_CLOSE}

String and scalar parameters should be specified as is without any escaping or quotes, while lists and \
objects should use JSON format. The "string" attribute should be set to "true" for string type parameters \
and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a \
thinking block. Here is an example:

{CALLS_OPEN}
...
{CALLS_CLOSE}

<function_results>
...
</function_results>

{THINK}...thinking about results{END_THINK}

Here are the functions available in JSONSchema format:
<functions>
"""
_SCHEMA_PREAMBLE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def to_json(value: Any) -> str:
    """JSON as the release writes it: Python's default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def tools_block(tools: Sequence[dict]) -> str:
    """The tools section of a system (or developer) message: the DSML instructions, then each tool's
    `function` object as one JSON line."""
    lines = [to_json(_function_of(t, f"tools[{i}]")) for i, t in enumerate(tools)]
    return _TOOLS_PREAMBLE + "\n".join(lines) + "\n</functions>\n"


def _function_of(tool, where: str) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict):
        raise InputError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
    return fn


def _blocks(msg: dict) -> str:
    """A system / developer message's tools and response_format sections, each after a blank line."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + tools_block(msg["tools"])
    if msg.get("response_format"):
        out += "\n\n" + _SCHEMA_PREAMBLE + to_json(msg["response_format"])
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


def dsml_calls(tool_calls: Sequence[dict], where: str = "tool_calls") -> str:
    """An assistant's tool calls (OpenAI's {function: {name, arguments}}) as the DSML block it writes."""
    invokes = []
    for j, call in enumerate(tool_calls):
        fn = _function_of(call, f"{where}[{j}]")
        params = [_parameter(k, v) for k, v in _arguments(fn, f"{where}[{j}]").items()]
        invokes.append(f'<{DSML}invoke name="{fn.get("name")}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


@dataclasses.dataclass(frozen=True)
class _Turn:
    """Where a message sits: its index, the last user (or developer) message's index, the mode, and how far
    its index is from the caller's (context messages and a system message made for the tools come first)."""
    index: int
    last_user: int
    thinking: bool
    shift: int = 0

    def name(self, index: int | None = None) -> str:
        """A message (this one by default) as the caller numbers it, for errors."""
        return f"'messages'[{(self.index if index is None else index) - self.shift}]"

    @property
    def opens_thinking(self) -> bool:
        """Whether the assistant turn that follows this message starts inside <think>."""
        return self.thinking and self.index >= self.last_user


def _text(msg: dict, turn: _Turn) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InputError(f"{turn.name()}.content must be a string (text parts joined) or null; "
                         f"got {type(content).__name__}")
    return content


def _system(msg: dict, turn: _Turn, messages: list[dict]) -> str:
    return _text(msg, turn) + _blocks(msg)


def _user(msg: dict, turn: _Turn, messages: list[dict]) -> str:
    marker = THINK if turn.thinking and turn.index == turn.last_user else END_THINK
    return f"{USER}{_text(msg, turn)}{ASSISTANT}{marker}"


def _developer(msg: dict, turn: _Turn, messages: list[dict]) -> str:
    if not msg.get("content"):
        raise InputError(f"{turn.name()}: a developer message needs content")
    return _user({"content": _blocks(msg) + f"\n\n# The user's message is: {msg['content']}"}, turn, messages)


def _assistant(msg: dict, turn: _Turn, messages: list[dict]) -> str:
    calls = msg.get("tool_calls")
    reasoning = msg.get("reasoning_content")
    thinking_part = ""
    if turn.thinking and turn.index > turn.last_user:
        if not (reasoning or calls):
            raise InputError(f"{turn.name()}: in thinking mode an assistant message after the last user "
                             "message needs reasoning_content or tool_calls (DeepSeek-V3.2's encoding)")
        thinking_part = (reasoning or "") + END_THINK
    calls_part = "\n\n" + dsml_calls(calls, f"{turn.name()}.tool_calls") if calls else ""
    return thinking_part + _text(msg, turn) + calls_part + EOS


def _answered_call(messages: list[dict], turn: _Turn) -> tuple[int, int]:
    """For the tool message `turn`: which of the previous assistant's calls it answers (1-based), and how
    many calls that assistant made."""
    at = turn.index - 1
    while at >= 0 and messages[at].get("role") == "tool":
        at -= 1
    if at < 0 or messages[at].get("role") != "assistant":
        raise InputError(f"{turn.name()}: a tool message must follow an assistant message with tool_calls")
    calls = messages[at].get("tool_calls") or []
    if len(calls) < turn.index - at:
        raise InputError(f"{turn.name()}: more tool results than the assistant message {turn.name(at)} made "
                         f"tool calls ({len(calls)})")
    return turn.index - at, len(calls)


def _tool(msg: dict, turn: _Turn, messages: list[dict]) -> str:
    order, count = _answered_call(messages, turn)
    out = "\n\n<function_results>" if order == 1 else ""
    out += f"\n<result>{_text(msg, turn)}</result>"
    if order == count:
        out += "\n</function_results>\n\n" + (THINK if turn.opens_thinking else END_THINK)
    return out


_RENDERERS = {"system": _system, "user": _user, "developer": _developer, "assistant": _assistant, "tool": _tool}


def last_user_index(messages: Sequence[dict]) -> int:
    """The index of the last user or developer message (-1: none)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def _mode(thinking_mode: str | bool) -> bool:
    if isinstance(thinking_mode, bool):
        return thinking_mode
    if thinking_mode not in MODES:
        raise InputError(f"thinking_mode must be 'chat' or 'thinking'; got {thinking_mode!r}")
    return thinking_mode == "thinking"


def _with_request_blocks(messages: list[dict], tools, response_format) -> list[dict]:
    """The request's tools / response_format put on the first message (a system one, made when missing)."""
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


def _generation_tail(messages: list[dict], thinking: bool) -> str:
    """What the last message's rendering ends with that opens the next assistant turn."""
    role = messages[-1].get("role")
    if role in ("user", "developer"):
        return ASSISTANT + (THINK if thinking else END_THINK)
    if role == "tool":
        return "\n\n" + (THINK if thinking else END_THINK)
    return ""


def encode_messages(messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
                    thinking_mode: str | bool = "chat", add_generation_prompt: bool = True,
                    continue_final_message: bool = False, context: Sequence[dict] | None = None,
                    add_bos: bool = True, response_format: dict | None = None) -> str:
    """The prompt text of OpenAI-style `messages` (see the module's docstring). `context`: earlier messages,
    not rendered but seen (the release's way of rendering one more turn; no BOS then). `thinking_mode`:
    "chat" / "thinking" (or a bool). Malformed messages are InputErrors naming the message."""
    thinking = _mode(thinking_mode)
    context = list(context or [])
    if not messages:
        raise InputError("'messages' must not be empty")
    msgs = _with_request_blocks(list(messages), tools, response_format)
    full = context + msgs
    last_user = last_user_index(full)
    shift = len(full) - len(messages)
    parts = [BOS] if add_bos and not context else []
    for i in range(len(context), len(full)):
        turn = _Turn(i, last_user, thinking, shift)
        role = full[i].get("role")
        if role not in _RENDERERS:
            raise InputError(f"{turn.name()}.role must be one of {', '.join(_RENDERERS)}; got {role!r}")
        parts.append(_RENDERERS[role](full[i], turn, full))
    text = "".join(parts)
    if continue_final_message:
        if full[-1].get("role") != "assistant":
            raise InputError("'continue_final_message' needs the last message to be the assistant's")
        return text[:-len(EOS)]
    if not add_generation_prompt:
        tail = _generation_tail(full, thinking)
        if tail and text.endswith(tail):
            text = text[:-len(tail)]
    return text


# --- completions ------------------------------------------------------------------------------------


class DsmlFormatError(ValueError):
    """A completion that is not in DeepSeek-V3.2's output format (the message says where)."""


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


_CALLS_START = "\n\n" + CALLS_OPEN
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


def _read_calls(text: str, at: int) -> tuple[tuple[ParsedToolCall, ...], int]:
    """The invokes of a function_calls block whose opening tag ends at `at`; the offset after its close."""
    if not text.startswith("\n", at):
        raise DsmlFormatError(f"expected a newline after {CALLS_OPEN}")
    at += 1
    calls = []
    while not text.startswith(CALLS_CLOSE, at):
        call, at = _read_invoke(text, at)
        calls.append(call)
    return tuple(calls), at + len(CALLS_CLOSE)


def parse_completion(text: str, thinking_mode: str | bool = "chat") -> ParsedCompletion:
    """A completion of DeepSeek-V3.2 (the text after the prompt) as reasoning, content and tool calls, as the
    release's parser reads it: in thinking mode the reasoning runs to </think>; the content runs to EOS or to
    a DSML function_calls block, which must end the message. Malformed text is a DsmlFormatError."""
    thinking = _mode(thinking_mode)
    reasoning, at = "", 0
    if thinking:
        end = text.find(END_THINK)
        calls_at = text.find(_CALLS_START)
        if end < 0 or 0 <= calls_at < end:
            raise DsmlFormatError("thinking mode: the completion has no </think> before its content")
        reasoning, at = text[:end], end + len(END_THINK)
    calls_at = text.find(_CALLS_START, at)
    eos_at = text.find(EOS, at)
    calls: tuple[ParsedToolCall, ...] = ()
    if calls_at >= 0 and (eos_at < 0 or calls_at < eos_at):
        content = text[at:calls_at]
        calls, at = _read_calls(text, calls_at + len(_CALLS_START))
    else:
        content = text[at:] if eos_at < 0 else text[at:eos_at]
        at = len(text) if eos_at < 0 else eos_at
    if text[at:] not in ("", EOS):
        raise DsmlFormatError(f"unexpected text after the message: {text[at:at + 40]!r}")
    for token in _SPECIAL:
        if token in content or token in reasoning:
            raise DsmlFormatError(f"special token {token!r} inside the reasoning or content")
    return ParsedCompletion(content, reasoning, calls)
