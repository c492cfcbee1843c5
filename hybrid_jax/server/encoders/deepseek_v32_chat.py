"""A chat request rendered with DeepSeek-V3.2's encoding (encoders/deepseek_v32.py): the request's tools go
on its system message, `chat_template_kwargs` choose the mode.

- `thinking` (DeepSeek's switch, as vLLM and SGLang read it) or `enable_thinking` (Qwen's name, accepted
  too): true renders in thinking mode (the reply opens with <think>); false or absent, chat mode
  (as vLLM and SGLang default).
Other kwargs are ignored, as a Jinja template ignores variables it does not read."""
from __future__ import annotations

from hybrid_jax.errors import InputError
from hybrid_jax.server.chat_messages import Conversation
from hybrid_jax.server.encoders.deepseek_v32 import encode_messages

THINKING_SWITCHES = ("thinking", "enable_thinking")


def _switch(kwargs: dict, name: str, default: bool) -> bool:
    value = kwargs.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InputError(f"'chat_template_kwargs'.{name} must be true or false; got {value!r}")
    return value


def thinking_mode(kwargs: dict) -> str:
    """"thinking" or "chat", from the first switch the request sets."""
    for name in THINKING_SWITCHES:
        if kwargs.get(name) is not None:
            return "thinking" if _switch(kwargs, name, False) else "chat"
    return "chat"


def render(conv: Conversation) -> str:
    """The prompt text of a checked chat request."""
    kwargs = conv.template_kwargs
    return encode_messages(conv.messages, conv.tools, thinking_mode=thinking_mode(kwargs),
                           add_generation_prompt=conv.add_generation_prompt,
                           continue_final_message=conv.continue_final_message)
