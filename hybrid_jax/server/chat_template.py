"""Chat prompts for /v1/chat/completions, rendered as transformers' `apply_chat_template` renders them,
with the template the request names, else the model's (hybrid_jax/template_sources.py says where
those come from).

Rendering: a sandboxed Jinja environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loop controls, the `{% generation %}` block) with transformers' `tojson` filter and its globals
`raise_exception`, `strftime_now`, `dict` and `namespace`; the template sees `messages`, `tools`,
`documents`, `add_generation_prompt`, the tokenizer's special tokens (bos_token, eos_token, ...) and
the request's `chat_template_kwargs`. `continue_final_message` cuts the text after the last
message's content. A template that raises, or fails on the request, is an InputError (a 400) that
says why, never a 500.

A model without a template whose model_type has a chat encoder (server/encoders/, e.g. DeepSeek-V3.2's)
is rendered by that encoder from the same checked conversation; a request's own `chat_template` and
`--chat-template` still come first."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from hybrid_jax.errors import InputError
from hybrid_jax.server.chat_messages import Conversation, parse_conversation
from hybrid_jax.server.encoders import encoder_for
from hybrid_jax.template_sources import NO_TEMPLATES, ChatTemplates, HasChatTemplates

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "      # marks the end of the message continue_final_message cuts at


class TemplateRaised(Exception):
    """A template's raise_exception(message)."""


def _environment():
    import jinja2  # noqa: PLC0415
    from jinja2 import nodes  # noqa: PLC0415
    from jinja2.ext import Extension, loopcontrols  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace(), refusing names that start with an underscore."""

        def __init__(*args, **kwargs):           # (jinja's own signature trick: `self` may be a keyword)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    class DictMaker:
        """The template's dict(): building dicts, nothing more."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise TemplateRaised(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # json.dumps as transformers' filter does it: no HTML escaping, indent / separators / sort_keys
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=DictMaker(), namespace=Namespace)
    return env


_ENV = None


@lru_cache(maxsize=32)
def _compiled(template: str):
    global _ENV
    import jinja2  # noqa: PLC0415
    if _ENV is None:
        _ENV = _environment()
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from None


def _with_continue_tag(conv: Conversation, template: str) -> tuple[list[dict], str]:
    """The messages with the last one's content marked where continue_final_message cuts; its content."""
    if "content" not in template:
        raise InputError("'continue_final_message': this chat template does not read a message's content")
    messages = list(conv.messages)
    last = dict(messages[-1])
    final = last["content"]
    last["content"] = final + _CONTINUE_TAG
    messages[-1] = last
    return messages, final


def _cut_at_continue_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise InputError("'continue_final_message': the chat template does not keep the last message's content "
                         "as it is, so there is no end of it to continue from")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()      # the template trimmed the message: so is the text it continues


def render(templates: ChatTemplates, conv: Conversation) -> str:
    """The prompt text of a conversation (see the module's docstring)."""
    import jinja2  # noqa: PLC0415
    encoder = encoder_for(templates.model_type) if templates.uses_encoder(conv.chat_template) else None
    if encoder is not None:
        return encoder.render(conv)
    template = templates.select(conv.chat_template, bool(conv.tools))
    compiled = _compiled(template)
    messages, final = conv.messages, None
    if conv.continue_final_message:
        messages, final = _with_continue_tag(conv, template)
    variables = {**templates.special_tokens, **conv.template_kwargs}
    try:
        text = compiled.render(messages=messages, tools=conv.tools, documents=conv.documents,
                               add_generation_prompt=conv.add_generation_prompt, **variables)
    except TemplateRaised as e:
        raise InputError(f"the chat template refused the request: {e}") from None
    except jinja2.TemplateError as e:
        raise InputError(f"the chat template failed on this request: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise InputError(f"the chat template failed on this request: {type(e).__name__}: {e}") from None
    if final is not None:
        text = _cut_at_continue_tag(text, final)
    return text


def render_request(tokenizer, data: dict[str, Any]) -> str:
    """The prompt of a /v1/chat/completions body: its conversation checked (chat_messages.py) and rendered
    with the request's template or the tokenizer's."""
    conv = parse_conversation(data)
    templates = tokenizer.chat_templates if isinstance(tokenizer, HasChatTemplates) else NO_TEMPLATES
    return render(templates, conv)
