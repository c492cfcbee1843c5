"""DeepSeek-V3.2's prompt format. The release ships no Jinja chat template: its `encoding/encoding_dsv32.py`
(Hugging Face deepseek-ai/DeepSeek-V3.2) turns OpenAI-style messages into the prompt text. This module
writes the same text, byte for byte (tests/hybrid_jax/test_deepseek_v32_encoder.py checks it against the
release's own examples), and reads the model's completions back (`parse_completion`). What it shares
with DeepSeek-V4's format (encoders/deepseek_v4.py) is in encoders/dsml.py: the tokens, the DSML calls
block, the response-format section, where a request's tools go and the completion parser.

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
from typing import Sequence

from hybrid_jax.errors import InputError
from hybrid_jax.server.encoders import dsml
from hybrid_jax.server.encoders.dsml import (ASSISTANT, BOS, DSML, END_THINK, EOS, MODES, THINK, USER,
                                             DsmlFormatError, ParsedCompletion, ParsedToolCall, last_user_index,
                                             message_text, to_json, with_request_blocks)

__all__ = ["ASSISTANT", "BOS", "CALLS_CLOSE", "CALLS_OPEN", "DSML", "END_THINK", "EOS", "MODES", "THINK", "USER",
           "DsmlFormatError", "ParsedCompletion", "ParsedToolCall", "dsml_calls", "encode_messages",
           "last_user_index", "parse_completion", "to_json", "tools_block"]

BLOCK = "function_calls"
CALLS_OPEN = dsml.opening(BLOCK)
CALLS_CLOSE = dsml.closing(BLOCK)

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
def tools_block(tools: Sequence[dict]) -> str:
    """The tools section of a system (or developer) message: the DSML instructions, then each tool's
    `function` object as one JSON line."""
    return _TOOLS_PREAMBLE + dsml.function_lines(tools) + "\n</functions>\n"


def _blocks(msg: dict) -> str:
    return dsml.sections(msg, tools_block)


def dsml_calls(tool_calls: Sequence[dict], where: str = "tool_calls") -> str:
    """An assistant's tool calls as the `<｜DSML｜function_calls>` block it writes."""
    return dsml.calls_block(tool_calls, BLOCK, where)


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
    return message_text(msg, turn.name())


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
    thinking = dsml.is_thinking(thinking_mode)
    context = list(context or [])
    if not messages:
        raise InputError("'messages' must not be empty")
    msgs = with_request_blocks(list(messages), tools, response_format)
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


def parse_completion(text: str, thinking_mode: str | bool = "chat") -> ParsedCompletion:
    """A completion of DeepSeek-V3.2 (the text after the prompt) as reasoning, content and tool calls, as the
    release's parser reads it (encoders/dsml.py's `parse_completion` with the `function_calls` block)."""
    return dsml.parse_completion(text, thinking_mode, BLOCK)
