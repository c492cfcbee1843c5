"""Chat encoders: the prompt format of a family that ships Python code for it instead of a Jinja chat
template (DeepSeek-V3.2's `encoding_dsv32.py`, DeepSeek-V4's `encoding_dsv4.py`), registered by the
checkpoint's `model_type`.

server/chat_template.py renders a chat request with its encoder when the model has no chat template
of its own (a request's `chat_template`, `--chat-template` and the checkpoint's templates come first).
An encoder reads the same checked Conversation a template does (server/chat_messages.py)."""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Callable, Mapping

from hybrid_jax.server.chat_messages import Conversation
from hybrid_jax.server.encoders import deepseek_v4_chat, deepseek_v32_chat


@dataclasses.dataclass(frozen=True)
class ChatEncoder:
    """A family's prompt format as code: its name and the function that renders a conversation."""
    name: str
    render: Callable[[Conversation], str]


ENCODERS: Mapping[str, ChatEncoder] = MappingProxyType({
    "deepseek_v32": ChatEncoder("deepseek_v32 (DeepSeek-V3.2's encoding_dsv32)", deepseek_v32_chat.render),
    "deepseek_v4": ChatEncoder("deepseek_v4 (DeepSeek-V4's encoding_dsv4)", deepseek_v4_chat.render),
})


def encoder_for(model_type: str | None) -> ChatEncoder | None:
    """The registered encoder of a model_type (None: the family uses a chat template)."""
    return ENCODERS.get(model_type) if model_type is not None else None
