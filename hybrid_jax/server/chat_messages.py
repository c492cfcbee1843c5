"""A chat request's fields, checked and put in the shape a chat template reads, as vLLM's
/v1/chat/completions hands them to transformers' `apply_chat_template`: content parts of text joined
with "\\n" (vLLM's "string" content format), a null content made "", tool-call arguments parsed from
their JSON string to a dict, keys whose value is null dropped and a message's reasoning given under
each name templates read it by (`reasoning_content`, `thinking`, `reasoning`).

Every malformed message is an InputError (a 400) naming its index and what is wrong; a part that is
not text (an image, audio, video, file) is refused by its type: the models served here take text only.
The fields read here, and their accepted values, are listed in `CHAT_FIELDS`."""
from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from hybrid_jax.errors import InputError

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")
# message keys a client may send back from an earlier response with a null value (the OpenAI SDK's
# message objects carry them); a non-null value of one is read below or refused by name
_NULLABLE = {"refusal", "annotations", "audio", "function_call", "tool_calls", "name", "tool_call_id",
             "reasoning", "reasoning_content", "thinking"}
_RESERVED_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}

# the request fields this module reads, with the values it accepts (the table of known fields points here)
CHAT_FIELDS = {
    "messages": "a non-empty list of messages (roles system, developer, user, assistant, tool)",
    "chat_template": "the name of one of the model's templates, or (with --trust-request-chat-template) "
                     "a Jinja template's text, for this request",
    "chat_template_kwargs": "an object whose entries the template sees as variables",
    "add_generation_prompt": "true (default) or false",
    "continue_final_message": "false (default) or true (then add_generation_prompt must be false)",
    "tools": "a list of {type: function, function: {name, ...}}, passed to the template",
    "tool_choice": '"auto" (the default with tools; calls are parsed out of the output), "none" (no parsing: '
                   'text stays content), "required" or {type: function, function: {name}} (accepted; the '
                   'grammar that enforces them is issue 52\'s)',
    "parallel_tool_calls": "true (default) or false (only the first parsed call is kept)",
    "documents": "a list of objects, passed to the template",
}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """What a chat template is rendered with: the messages as the template sees them, and the
    request's other template inputs."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    chat_template: str | None = None      # the request's own template (text, or a name of the model's)


def _flag(data: dict, key: str, default: bool) -> bool:
    v = data.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InputError(f"'{key}' must be true or false; got {v!r}")
    return v


def parse_conversation(data: dict[str, Any]) -> Conversation:
    """The chat fields of a request body (see CHAT_FIELDS), checked."""
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InputError("'messages' must be a non-empty list of messages")
    messages = [message(m, i) for i, m in enumerate(msgs)]
    add_gen = _flag(data, "add_generation_prompt", True)
    cont = _flag(data, "continue_final_message", False)
    if add_gen and cont:
        raise InputError("'continue_final_message' continues the last message; it cannot be combined with "
                         "'add_generation_prompt' (send add_generation_prompt: false)")
    if cont and messages[-1]["role"] != "assistant":
        raise InputError("'continue_final_message' needs the last message to be the assistant's "
                         f"(it is a {messages[-1]['role']!r} message)")
    kwargs = data.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise InputError(f"'chat_template_kwargs' must be an object; got {type(kwargs).__name__}")
    clash = sorted(_RESERVED_KWARGS & kwargs.keys())
    if clash:
        raise InputError(f"'chat_template_kwargs' may not set {', '.join(clash)}: send them as request fields")
    template = data.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template):
        raise InputError("'chat_template' must be a non-empty string (a Jinja template)")
    tool_choice_of(data)
    return Conversation(messages, _tools(data.get("tools")), _documents(data.get("documents")), add_gen, cont,
                        dict(kwargs), template)


class ToolMode(enum.Enum):
    AUTO = "auto"            # the model may call tools: calls are parsed out of its output
    NONE = "none"            # no calls: the output is text
    REQUIRED = "required"    # at least one call (enforced by a grammar)
    NAMED = "named"          # a call of the function `name` (enforced by a grammar)


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """A chat request's tool_choice and parallel_tool_calls, checked against its tools."""
    mode: ToolMode
    name: str | None = None          # NAMED: the function
    parallel: bool = True            # parallel_tool_calls: false keeps the first call only
    explicit: bool = False           # tool_choice was sent (not defaulted)

    @property
    def parses_calls(self) -> bool:
        return self.mode is not ToolMode.NONE


def tool_choice_of(data: dict[str, Any]) -> ToolChoice:
    """tool_choice as OpenAI defines it: "none" without tools, "auto" with them when absent; "required"
    and a named function need tools (the name one of them). REQUIRED / NAMED are enforced by the family's
    tool-call grammar (server/chat_output.py, structured/tool_grammars.py) and parsed like AUTO."""
    choice, tools = data.get("tool_choice"), _tools(data.get("tools")) or []
    parallel = _flag(data, "parallel_tool_calls", True)
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ToolChoice(ToolMode.AUTO if tools else ToolMode.NONE, parallel=parallel)
    if choice == "none":
        return ToolChoice(ToolMode.NONE, parallel=parallel, explicit=True)
    if choice in ("auto", "required"):
        if choice == "required" and not tools:
            raise InputError("'tool_choice' = \"required\" needs 'tools' (at least one function to call)")
        mode = ToolMode.REQUIRED if choice == "required" else ToolMode.AUTO if tools else ToolMode.NONE
        return ToolChoice(mode, parallel=parallel, explicit=True)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InputError("'tool_choice' as an object must be {\"type\": \"function\", \"function\": {\"name\": "
                             "...}}")
        if name not in names:
            raise InputError(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                             f"({', '.join(map(repr, names)) or 'none sent'})")
        return ToolChoice(ToolMode.NAMED, name, parallel, explicit=True)
    raise InputError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{type: function, ...}}; "
                     f"got {choice!r}")


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InputError(f"'tools' must be a list of tools; got {type(tools).__name__}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise InputError(f"'tools'[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InputError(f"'tools'[{i}].function.name must be a non-empty string")
    return tools


def _documents(docs) -> list[dict] | None:
    if docs is None:
        return None
    if not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs):
        raise InputError("'documents' must be a list of objects (e.g. {\"title\": ..., \"text\": ...})")
    return docs


def content_text(content, where: str) -> str:
    """A message's content as one string: text parts joined with "\\n"; any other part refused by its type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where}.content must be a string, a list of content parts or null; "
                         f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise InputError(f"{where}.content[{j}] must be a content part with a string 'type'")
        key = TEXT_PARTS.get(kind)
        if key is None:
            raise InputError(f"{where}.content[{j}] is a {kind!r} part: this model takes text only "
                             "(send parts of type 'text')")
        text = part.get(key)
        if not isinstance(text, str):
            raise InputError(f"{where}.content[{j}] ({kind!r}) needs a string {key!r}")
        texts.append(text)
    return "\n".join(texts)


def _tool_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InputError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                         "\"arguments\": ...}}}}")
    if call.get("type", "function") != "function":
        raise InputError(f"{where}.type must be \"function\"; got {call.get('type')!r}")
    args = fn.get("arguments")
    if isinstance(args, str):
        if not args.strip():
            args = {}
        else:
            try:                             # templates read the arguments as a mapping (vLLM parses them too)
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}.function.arguments is not valid JSON: {e}") from None
    elif args is None:
        args = {}
    if not isinstance(args, (dict, list)):
        raise InputError(f"{where}.function.arguments must be a JSON object (as a string or an object)")
    out = {k: v for k, v in call.items() if k != "function" and v is not None}
    out["type"] = "function"
    out["function"] = {**{k: v for k, v in fn.items() if v is not None}, "arguments": args}
    return out


def message(m, i: int) -> dict[str, Any]:
    """Message `i` of a request, as the template sees it."""
    where = f"'messages'[{i}]"
    if not isinstance(m, dict):
        raise InputError(f"{where} must be an object with a 'role'")
    role = m.get("role")
    if role not in ROLES:
        raise InputError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    unknown = sorted(k for k in m if k not in ("role", "content") and k not in _NULLABLE)
    if unknown:
        raise InputError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}")
    calls = m.get("tool_calls")
    content = m.get("content")
    if content is None and not (role == "assistant" and (calls or m.get("refusal") is not None)):
        raise InputError(f"{where}.content is required (null only on an assistant message with tool_calls)")
    out: dict[str, Any] = {"role": role, "content": "" if content is None else content_text(content, where)}
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise InputError(f"{where}.name must be a string")
        out["name"] = m["name"]
    for key in ("audio", "function_call"):
        if m.get(key) is not None:
            raise InputError(f"{where}.{key} is not supported ({'text only' if key == 'audio' else 'use tool_calls'})")
    if m.get("refusal") is not None:
        if not isinstance(m["refusal"], str):
            raise InputError(f"{where}.refusal must be a string")
        out["refusal"] = m["refusal"]
    if calls is not None:
        if role != "assistant":
            raise InputError(f"{where}.tool_calls: only an assistant message makes tool calls")
        if not isinstance(calls, list):
            raise InputError(f"{where}.tool_calls must be a list")
        if calls:                          # an empty list keeps the template on the plain assistant path
            out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    call_id = m.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str):
            raise InputError(f"{where}.tool_call_id (a string: the id of the call this answers) is required")
        out["tool_call_id"] = call_id
    elif call_id is not None:
        raise InputError(f"{where}.tool_call_id belongs on a 'tool' message")
    _reasoning(m, role, where, out)
    return out


def _reasoning(m: dict, role: str, where: str, out: dict):
    """An assistant message's reasoning, under every name templates read it by."""
    given = [k for k in REASONING_NAMES if m.get(k) is not None]
    if not given:
        return
    if role != "assistant":
        raise InputError(f"{where}.{given[0]}: only an assistant message has reasoning")
    text = m[given[0]]
    if not isinstance(text, str):
        raise InputError(f"{where}.{given[0]} must be a string")
    for k in REASONING_NAMES:
        out[k] = text
