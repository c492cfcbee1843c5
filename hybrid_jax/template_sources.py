"""Where a model's chat templates come from, in vLLM's order: `hybrid-jax serve --chat-template` (a
file, or the template text itself), else the checkpoint's `chat_template.jinja` (where current Hugging
Face releases keep it; named extra templates in `additional_chat_templates/*.jinja`), else
`tokenizer_config.json`'s `chat_template` (a string, or a list of {name, template}: "default" is used,
"tool_use" when the request has tools, as transformers picks). A request's own `chat_template` (text,
or the name of one of the model's) comes before all of them. A checkpoint with none of these whose
config.json `model_type` has a chat encoder (server/encoders/: a family that ships Python code for its
prompt format, DeepSeek-V3.2) is rendered with that encoder.

The tokenizer loads them (hybrid_jax/tokenizer.py) with the special tokens a template sees and keeps
them as its `chat_templates`, so they reach the API server wherever the tokenizer does (the server's
process loads its own tokenizer when the engine core runs in another). server/chat_template.py
renders them."""
from __future__ import annotations

import dataclasses
import json
import os
from types import MappingProxyType
from typing import Mapping, Protocol, runtime_checkable

from hybrid_jax.errors import ConfigError, InputError

# the special tokens transformers passes a template (its named special tokens)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplates:
    """A model's chat templates: by name ("default" for a single one), where they were read from, and the
    special tokens a template sees."""
    templates: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    source: str = "none"
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    problem: str | None = None      # why the checkpoint's templates could not be read (chat then says so)
    trust_request_templates: bool = False     # a request may bring a template's text (--trust-request-chat-template)
    model_type: str | None = None    # config.json's: picks a chat encoder (server/encoders/) when there is no template

    def uses_encoder(self, requested: str | None) -> bool:
        """Whether a request is rendered by the model's chat encoder rather than a template: it names no
        template and the model has none (nor one that could not be read)."""
        return requested is None and not self.templates and self.problem is None

    def select(self, requested: str | None, has_tools: bool) -> str:
        """The template a request renders with: its own (`requested`: the name of one of these, or a template's
        text where trusted), else "tool_use" when it has tools and the model names one, else "default"."""
        if requested is not None:
            if requested in self.templates:
                return self.templates[requested]
            if not self.trust_request_templates:
                names = f" (this model's: {', '.join(sorted(self.templates))})" if self.templates else ""
                raise InputError("'chat_template' is not the name of one of this model's templates" + names +
                                 "; a template's text in a request is rendered only when the server runs with "
                                 "--trust-request-chat-template (as in vLLM)")
            return requested
        if self.problem is not None:
            raise InputError(f"this model's chat template cannot be used ({self.problem}): send 'chat_template' "
                             "or start the server with --chat-template FILE")
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if self.templates:
            raise InputError(f"this model has several chat templates and none is named 'default': pick one with "
                             f"'chat_template' ({', '.join(sorted(self.templates))})")
        raise InputError("this model has no chat template: use /v1/completions, or start the server with "
                         "--chat-template FILE")

    def overridden(self, text: str, source: str) -> "ChatTemplates":
        """These templates with `text` (e.g. --chat-template's) as the only one."""
        return dataclasses.replace(self, templates=MappingProxyType({"default": text}), source=source, problem=None)


NO_TEMPLATES = ChatTemplates()


@runtime_checkable
class HasChatTemplates(Protocol):
    """A tokenizer that carries its checkpoint's chat templates (hybrid_jax/tokenizer.py's)."""
    chat_templates: ChatTemplates


def _token_text(v) -> str | None:
    if isinstance(v, dict):          # an AddedToken written out: {"content": ..., "lstrip": ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _config_templates(value, path: str) -> dict[str, str]:
    """tokenizer_config.json's `chat_template`: a string, or a list of {name, template}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ConfigError(f"{path}: 'chat_template' must be a string or a list of {{name, template}}")


def load_chat_templates(path: str) -> ChatTemplates:
    """The chat templates and special tokens of the checkpoint (or tokenizer) directory `path`."""
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.exists(cfg_path) else {}
    special_path = os.path.join(path, "special_tokens_map.json")
    special_map = _read_json(special_path) if os.path.exists(special_path) else {}
    special = {}
    for name in SPECIAL_TOKENS:
        text = _token_text(cfg.get(name)) or _token_text(special_map.get(name))
        if text is not None:
            special[name] = text
    model_type = _model_type(path)
    try:                 # a template that cannot be read fails chat requests, not the model's loading
        templates, source = _templates(path, cfg.get("chat_template"), cfg_path)
    except ConfigError as e:
        return ChatTemplates(special_tokens=MappingProxyType(special), problem=str(e), model_type=model_type)
    return ChatTemplates(MappingProxyType(templates), source, MappingProxyType(special), model_type=model_type)


def _model_type(path: str) -> str | None:
    """config.json's `model_type` beside the tokenizer (None: no config.json, or no model_type in it)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        return None
    try:
        value = _read_json(cfg_path).get("model_type")
    except ConfigError:          # the model's loading reads config.json too, and says what is wrong with it
        return None
    return value if isinstance(value, str) else None


def _templates(path: str, configured, cfg_path: str) -> tuple[dict[str, str], str]:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        templates, source = {"default": _read_text(jinja)}, "chat_template.jinja"
    else:
        templates = _config_templates(configured, cfg_path)
        source = "tokenizer_config.json" if templates else "none"
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                templates[name[:-len(".jinja")]] = _read_text(os.path.join(extra, name))
    return templates, source


def read_template_arg(value: str) -> str:
    """`--chat-template`'s value, as vLLM reads it: a file's contents, or, when no file of that name can be
    opened and the value looks like a template (it has a brace or a newline), the value itself."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ConfigError(f"--chat-template {value!r} looks like a file path, but it cannot be opened: "
                              f"{e.strerror or e}") from None
        return value
    except UnicodeDecodeError as e:
        raise ConfigError(f"--chat-template {value!r}: not UTF-8 text: {e}") from None


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """The server's chat options: --chat-template's text (None: the checkpoint's templates), and whether a
    request may bring a template's text (--trust-request-chat-template; off, as in vLLM: rendering is
    sandboxed, but a template is code a client could make slow)."""
    template: str | None = None
    trust_request_templates: bool = False


def apply_chat_options(tokenizer, options: ChatOptions | None):
    """Set the server's chat options on the tokenizer the API server renders with."""
    if options is None or not isinstance(tokenizer, HasChatTemplates):
        return
    templates = tokenizer.chat_templates
    if options.template is not None:
        templates = templates.overridden(options.template, "--chat-template")
    tokenizer.chat_templates = dataclasses.replace(templates, trust_request_templates=options.trust_request_templates)
