"""DeepSeek-V4's prompt format. Like V3.2 (encoders/deepseek_v32.py) the release ships no Jinja chat
template but Python code, `encoding/encoding_dsv4.py` (Hugging Face deepseek-ai/DeepSeek-V4-Flash); this
module writes the same text, byte for byte (tests/hybrid_jax/test_deepseek_v4_encoder.py checks it against
the release's own examples), and reads completions back (`parse_completion`). The tokens, the DSML calls
block, the response-format section and the completion parser are V3.2's (encoders/dsml.py).

Where V4 differs from V3.2:
- the calls block is `<｜DSML｜tool_calls>` (V3.2: `function_calls`), and the tools section of a system or
  developer message is V4's own text, its functions listed under `### Available Tool Schemas`;
- a developer message is `<｜User｜>{content}` followed by its tools / response-format sections (V3.2 puts
  the sections first and the content after `# The user's message is:`);
- there is no tool turn: tool results are a user turn, `<｜User｜><tool_result>{content}</tool_result>`,
  the results of consecutive tool messages (sorted into the order of the assistant's calls by their ids)
  and a user message right after them joined by blank lines in one turn (so are consecutive user
  messages);
- a user (or developer) turn is followed by `<｜Assistant｜>` and `<think>` / `</think>` only when an
  assistant turn (or nothing) comes next; the tool results being a user turn, the turn after them opens
  like any reply;
- thinking mode keeps every turn's reasoning, and opens every reply with `<think>`, when the conversation
  carries tools; without tools it drops the reasoning before the last user turn (as V3.2 does, where tool
  results are not a user turn), and developer messages before it too;
- an assistant turn in thinking mode always writes `{reasoning}</think>`, its reasoning possibly empty (V3.2
  requires reasoning or tool calls after the last user message);
- `reasoning_effort="max"` in thinking mode puts the release's maximum-effort instructions at the start of
  the first message ("high" and None write nothing);
- two roles of DeepSeek's own, `latest_reminder` (`<｜latest_reminder｜>{content}`) and a user message's
  `task` (its special token ends the turn: `<｜action｜>` after the reply's opening, the others instead of
  it), which the release's examples use; the server's chat requests cannot send them.

`encode_messages` takes the request's tools separately: they go on the first message when it is a system
message, else on an empty system message put in front (as SGLang serves V4). As for V3.2,
`add_generation_prompt=False` leaves off the opening of the next reply and `continue_final_message` ends the
prompt inside a final assistant message; the release has neither. With `context` (earlier messages, seen but
not written) the turns written are exactly those of `messages`; the release counts them after its thinking
mode has left out developer messages and can be off by those it left out of the context."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from hybrid_jax.errors import InputError
from hybrid_jax.server.encoders import dsml
from hybrid_jax.server.encoders.dsml import (ASSISTANT, BOS, DSML, END_THINK, EOS, THINK, USER,  # noqa: F401
                                             ParsedCompletion, message_text, with_request_blocks)

BLOCK = "tool_calls"
CALLS_OPEN = dsml.opening(BLOCK)
CALLS_CLOSE = dsml.closing(BLOCK)
LATEST_REMINDER = "<｜latest_reminder｜>"
TASK_TOKENS = {task: f"<｜{task}｜>" for task in ("action", "query", "authority", "domain", "title", "read_url")}
REASONING_EFFORTS = ("max", "high", None)
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

_TOOLS_HEAD = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside \
{THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def tools_block(tools: Sequence[dict]) -> str:
    """The tools section of a system (or developer) message: the DSML instructions, then each tool's
    `function` object as one JSON line."""
    return _TOOLS_HEAD + dsml.function_lines(tools) + _TOOLS_TAIL


def dsml_calls(tool_calls: Sequence[dict], where: str = "tool_calls") -> str:
    """An assistant's tool calls as the `<｜DSML｜tool_calls>` block it writes."""
    return dsml.calls_block(tool_calls, BLOCK, where)


# --- the conversation as V4's turns -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Part:
    """One piece of a user turn: a user message's text, or a tool result (`call_id`: the call it answers)."""
    text: str
    call_id: str | None = None

    @property
    def is_result(self) -> bool:
        return self.call_id is not None


@dataclasses.dataclass(frozen=True)
class _Turn:
    """A message as V4 renders it: user and tool messages merged into user turns of parts. `name`: the
    caller's name of its (first) message, for errors; `message`: the message itself (not for user turns)."""
    role: str
    name: str
    message: dict
    parts: tuple[_Part, ...] = ()
    task: str | None = None
    context: bool = False

    def calls(self) -> list:
        return self.message.get("tool_calls") or []


def _task(msg: dict, name: str) -> str | None:
    task = msg.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise InputError(f"{name}.task must be one of {', '.join(TASK_TOKENS)}; got {task!r}")
    return task


def _merged(messages: Sequence[dict], names: Sequence[str], context: bool) -> list[_Turn]:
    """The messages as turns: each tool message a result part, joined to the user turn before it (or
    starting one); a user message joined to the user turn before it unless that turn has a task."""
    turns: list[_Turn] = []
    for msg, name in zip(messages, names):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise InputError(f"{name}.role must be one of {', '.join(ROLES)}; got {role!r}")
        text = message_text(msg, name)
        last = turns[-1] if turns and turns[-1].role == "user" else None
        if role == "tool":
            part = _Part(f"<tool_result>{text}</tool_result>", str(msg.get("tool_call_id") or ""))
        elif role == "user":
            part = _Part(text)
            if last is not None and last.task is not None:
                last = None
        else:
            turns.append(_Turn(role, name, msg, context=context))
            continue
        if last is not None:
            turns[-1] = dataclasses.replace(last, parts=last.parts + (part,))
        else:
            turns.append(_Turn("user", name, {}, (part,), _task(msg, name) if role == "user" else None, context))
    return turns


def _in_call_order(turn: _Turn, order: dict[str, int]) -> _Turn:
    """A user turn with its tool results sorted into the order of the calls they answer (a stable sort; a
    result whose id is not one of the calls' sorts as the first call), other parts left where they are."""
    results = [p for p in turn.parts if p.is_result]
    if len(results) < 2 or not order:
        return turn
    ranked = iter(sorted(results, key=lambda p: order.get(p.call_id or "", 0)))
    return dataclasses.replace(turn, parts=tuple(next(ranked) if p.is_result else p for p in turn.parts))


def _call_id(call) -> str | None:
    """A call's id (the release also looks for one inside its `function`)."""
    if not isinstance(call, dict):
        return None
    fn = call.get("function")
    return call.get("id") or (fn.get("id") if isinstance(fn, dict) else None)


def _sorted_results(turns: list[_Turn]) -> list[_Turn]:
    """Each user turn's results in the order of the calls of the last assistant turn that made calls."""
    out, order = [], {}
    for turn in turns:
        if turn.role == "assistant" and turn.calls():
            order = {cid: j for j, cid in enumerate(map(_call_id, turn.calls())) if cid}
        out.append(_in_call_order(turn, order) if turn.role == "user" else turn)
    return out


def _last_user(turns: Sequence[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _dropped(turns: list[_Turn]) -> list[_Turn]:
    """The turns less the developer messages before the last user turn, which thinking mode without tools
    leaves out (as it writes no reasoning for the assistant turns there)."""
    last = _last_user(turns)
    return [t for i, t in enumerate(turns) if t.role != "developer" or i >= last]


# --- rendering -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mode:
    """How a conversation renders: thinking or chat; whether earlier reasoning is dropped (thinking mode
    without tools); the reasoning effort; the index of the last user (or developer) turn."""
    thinking: bool
    drop: bool
    effort: str | None
    last_user: int = -1

    def writes_reasoning(self, i: int) -> bool:
        """Whether assistant turn `i` writes its reasoning and </think>: thinking mode, and nothing dropped or
        the turn after the last user turn."""
        return self.thinking and (not self.drop or i > self.last_user)

    def opens_thinking(self, i: int) -> bool:
        """Whether the reply after user turn `i` opens with <think> (else </think>)."""
        return self.thinking and (not self.drop or i >= self.last_user)


def _system(turn: _Turn) -> str:
    return message_text(turn.message, turn.name) + dsml.sections(turn.message, tools_block)


def _developer(turn: _Turn) -> str:
    if not turn.message.get("content"):
        raise InputError(f"{turn.name}: a developer message needs content")
    return USER + message_text(turn.message, turn.name) + dsml.sections(turn.message, tools_block)


def _user(turn: _Turn) -> str:
    return USER + "\n\n".join(p.text for p in turn.parts)


def _reminder(turn: _Turn) -> str:
    return LATEST_REMINDER + message_text(turn.message, turn.name)


def _assistant(turns: list[_Turn], i: int, mode: _Mode) -> str:
    turn = turns[i]
    follows_task = i > 0 and turns[i - 1].task is not None
    thinking_part = ""
    if not follows_task and mode.writes_reasoning(i):
        thinking_part = (turn.message.get("reasoning_content") or "") + END_THINK
    calls = turn.calls()
    calls_part = "\n\n" + dsml_calls(calls, f"{turn.name}.tool_calls") if calls else ""
    return thinking_part + message_text(turn.message, turn.name) + calls_part + EOS


def _reply_opening(turns: list[_Turn], i: int, mode: _Mode) -> str:
    """What ends turn `i` when an assistant turn (or a reminder, or nothing) comes next: a task's token, or,
    after a user or developer turn, the opening of the reply."""
    turn = turns[i]
    if i + 1 < len(turns) and turns[i + 1].role not in ("assistant", "latest_reminder"):
        return ""
    if turn.task == "action":
        return ASSISTANT + (THINK if mode.thinking else END_THINK) + TASK_TOKENS["action"]
    if turn.task is not None:
        return TASK_TOKENS[turn.task]
    if turn.role not in ("user", "developer"):
        return ""
    return ASSISTANT + (THINK if mode.opens_thinking(i) else END_THINK)


_WRITERS = {"system": _system, "developer": _developer, "user": _user, "latest_reminder": _reminder}


def _render(turns: list[_Turn], i: int, mode: _Mode) -> str:
    turn = turns[i]
    effort = REASONING_EFFORT_MAX if i == 0 and mode.thinking and mode.effort == "max" else ""
    body = _assistant(turns, i, mode) if turn.role == "assistant" else _WRITERS[turn.role](turn)
    return effort + body + _reply_opening(turns, i, mode)


def _turns(messages: list[dict], context: list[dict], shift: int) -> list[_Turn]:
    """Context and messages as turns (each merged on its own, as the release does), results in call order."""
    names = [f"'messages'[{i - shift}]" for i in range(len(context) + len(messages))]
    turns = _merged(context, names[:len(context)], True) + _merged(messages, names[len(context):], False)
    return _sorted_results(turns)


def encode_messages(messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
                    thinking_mode: str | bool = "chat", reasoning_effort: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    context: Sequence[dict] | None = None, add_bos: bool = True,
                    response_format: dict | None = None) -> str:
    """The prompt text of OpenAI-style `messages` (see the module's docstring). `context`: earlier messages,
    not rendered but seen (no BOS then). `thinking_mode`: "chat" / "thinking" (or a bool);
    `reasoning_effort`: "max", "high" or None. Malformed messages are InputErrors naming the message."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise InputError(f"reasoning_effort must be 'max', 'high' or None for DeepSeek-V4; got {reasoning_effort!r}")
    if not messages:
        raise InputError("'messages' must not be empty")
    context = list(context or [])
    msgs = with_request_blocks(list(messages), tools, response_format)
    turns = _turns(msgs, context, len(context) + len(msgs) - len(messages))
    has_tools = any(t.message.get("tools") for t in turns)
    thinking = dsml.is_thinking(thinking_mode)
    if thinking and not has_tools:
        turns = _dropped(turns)
    mode = _Mode(thinking, not has_tools, reasoning_effort, _last_user(turns))
    parts = [BOS] if add_bos and not context else []
    parts += [_render(turns, i, mode) for i, t in enumerate(turns) if not t.context]
    text = "".join(parts)
    if continue_final_message:
        if turns[-1].role != "assistant":
            raise InputError("'continue_final_message' needs the last message to be the assistant's")
        return text[:-len(EOS)]
    last = turns[-1]
    if not add_generation_prompt and last.role in ("user", "developer") and last.task is None:
        text = text.removesuffix(_reply_opening(turns, len(turns) - 1, mode))
    return text


def parse_completion(text: str, thinking_mode: str | bool = "chat") -> ParsedCompletion:
    """A completion of DeepSeek-V4 (the text after the prompt) as reasoning, content and tool calls, as the
    release's parser reads it (encoders/dsml.py's `parse_completion` with the `tool_calls` block)."""
    return dsml.parse_completion(text, thinking_mode, BLOCK)
