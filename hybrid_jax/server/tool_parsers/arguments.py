"""Turning a call's written arguments into the JSON object text OpenAI's `function.arguments` holds:
a JSON object as written (hermes, Kimi), or XML-style parameters whose values are raw text for
strings and JSON otherwise — typed by the tool's parameter schema (Qwen3.5's `qwen3_coder`) or by
the parameter's own `string="true|false"` attribute (DeepSeek's DSML)."""
from __future__ import annotations

import json
from typing import Any

Schemas = dict[str, dict]          # tool name -> its `parameters` JSON schema


def schemas_of(tools: list[dict] | None) -> Schemas:
    """The request's tools by name (as chat_messages.py checked them)."""
    out: Schemas = {}
    for t in tools or []:
        fn = t.get("function") or {}
        params = fn.get("parameters")
        out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def dumps(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def json_object(text: str) -> dict | None:
    """`text` as a JSON object, or None."""
    try:
        v = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return v if isinstance(v, dict) else None


def _types(schema: dict) -> set[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    kinds: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            if isinstance(sub, dict):
                kinds |= _types(sub)
    if "enum" in schema and not kinds:
        kinds = {type_name(v) for v in schema["enum"]}
    return kinds


def type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array",
            type(None): "null"}.get(type(v), "string")


def typed_value(raw: str, schema: dict | None) -> Any:
    """A qwen3_coder parameter's text as its schema types it: strings as written, everything else JSON
    (booleans also as Python writes them, since templates render `True`); text that is not valid
    JSON for its type stays a string (what the model wrote is kept, not dropped)."""
    kinds = _types(schema or {}) or {"string"}
    if kinds <= {"string"} or ("string" in kinds and not _json_like(raw)):
        return raw
    text = raw.strip()
    if "boolean" in kinds and text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return raw


def _json_like(raw: str) -> bool:
    t = raw.strip()
    return t[:1] in ("{", "[") or t in ("true", "false", "null")
