"""The request fields that ask for a structured output, read into one `StructuredOutputsParams`
(hybrid_jax/structured/params.py): OpenAI's `response_format` ({"type": "text"}, "json_object", or
"json_schema" with its `json_schema.schema`), vLLM's `structured_outputs` ({json | regex | choice |
grammar | json_object, whitespace_pattern}) and its older spellings (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, `guided_whitespace_pattern`, `guided_decoding_backend`). Two ways
of asking at once are refused (a 400 naming both), as is a backend other than this server's."""
from __future__ import annotations

from typing import Any

from hybrid_jax.errors import InputError
from hybrid_jax.structured.params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
BACKENDS = ("auto", "llguidance", "guidance")     # guided_decoding_backend values this server answers
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "disable_any_whitespace",
                   "disable_additional_properties", "backend")


def _response_format(fmt: Any) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise InputError("'response_format' json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return {"json": spec.get("schema", spec.get("json_schema"))}
    raise InputError(f"'response_format' type must be \"text\", \"json_object\" or \"json_schema\"; got {kind!r}")


def _structured(spec: Any) -> dict | None:
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise InputError(f"'structured_outputs' must be an object; got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(STRUCTURED_KEYS))
    if unknown:
        raise InputError(f"'structured_outputs' has unknown keys {unknown}; it takes {', '.join(STRUCTURED_KEYS)}")
    out = {k: v for k, v in spec.items() if k in ("json", "regex", "choice", "grammar", "json_object",
                                                  "whitespace_pattern") and v is not None}
    _backend(spec.get("backend"), "structured_outputs.backend")
    return out or None


def _guided(data: dict) -> dict | None:
    out = {kind: data[name] for name, kind in GUIDED.items() if data.get(name) is not None}
    if not out:
        return None
    if data.get("guided_whitespace_pattern") is not None:
        out["whitespace_pattern"] = data["guided_whitespace_pattern"]
    return out


def _backend(name: Any, field: str):
    if name is not None and name not in BACKENDS:
        raise InputError(f"'{field}' = {name!r}: this server's grammars are llguidance's ({', '.join(BACKENDS)})")


def structured_outputs_of(data: dict) -> StructuredOutputsParams | None:
    """The request's structured output (None: free text); InputError when it is malformed, when two
    fields ask for one, or when its schema / regex / grammar cannot be compiled."""
    _backend(data.get("guided_decoding_backend"), "guided_decoding_backend")
    asked = {name: spec for name, spec in (("response_format", _response_format(data.get("response_format"))),
                                           ("structured_outputs", _structured(data.get("structured_outputs"))),
                                           ("guided_*", _guided(data))) if spec}
    if len(asked) > 1:
        raise InputError(f"a structured output is asked for twice ({' and '.join(asked)}): send one")
    if not asked:
        if data.get("guided_whitespace_pattern") is not None:
            raise InputError("'guided_whitespace_pattern' needs guided_json")
        return None
    return StructuredOutputsParams(**next(iter(asked.values())))
