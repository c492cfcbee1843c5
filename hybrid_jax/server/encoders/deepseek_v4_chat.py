"""A chat request rendered with DeepSeek-V4's encoding (encoders/deepseek_v4.py): the request's tools go on
its system message, `chat_template_kwargs` choose the mode and the reasoning effort.

- `thinking` / `enable_thinking`: as for V3.2 (encoders/deepseek_v32_chat.py): true renders in thinking
  mode, false or absent in chat mode (SGLang's default; vLLM's current V4 tokenizer defaults to thinking).
- `reasoning_effort`: "max" puts the release's maximum-effort instructions at the start of a thinking-mode
  prompt; "high" and OpenAI's lower values ("none", "minimal", "low", "medium") write nothing, as the
  release's "high" / None (SGLang passes only "max" and "high" to the encoder). It does not switch
  thinking on or off."""
from __future__ import annotations

from hybrid_jax.errors import InputError
from hybrid_jax.server.chat_messages import Conversation
from hybrid_jax.server.encoders.deepseek_v32_chat import thinking_mode
from hybrid_jax.server.encoders.deepseek_v4 import encode_messages

# OpenAI's reasoning_effort values (and the release's "max") -> what the release's encoder takes
EFFORTS = {"max": "max", "high": "high", "medium": None, "low": None, "minimal": None, "none": None}


def reasoning_effort(kwargs: dict) -> str | None:
    """The release's reasoning_effort ("max", "high" or None) for `chat_template_kwargs`."""
    value = kwargs.get("reasoning_effort")
    if value is None:
        return None
    if value not in EFFORTS:
        raise InputError(f"'chat_template_kwargs'.reasoning_effort must be one of {', '.join(EFFORTS)}; "
                         f"got {value!r}")
    return EFFORTS[value]


def render(conv: Conversation) -> str:
    """The prompt text of a checked chat request."""
    kwargs = conv.template_kwargs
    return encode_messages(conv.messages, conv.tools, thinking_mode=thinking_mode(kwargs),
                           reasoning_effort=reasoning_effort(kwargs),
                           add_generation_prompt=conv.add_generation_prompt,
                           continue_final_message=conv.continue_final_message)
