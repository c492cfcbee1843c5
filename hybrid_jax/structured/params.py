"""`StructuredOutputsParams`: what a request's output must match, in vLLM's shape (exactly one of
json, regex, choice, grammar, json_object), checked when it is made and turned into the one grammar
text the grammar library takes (`grammar_text`): a Lark grammar, llguidance's dialect, whose JSON
parts are `%json` schemas.

The API's spellings all land here (server/structured_fields.py): OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` and its older `guided_*` fields."""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from hybrid_jax.errors import InputError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# JSON as Python's json.dumps and the chat templates' tojson write it: ", " and ": ", no other whitespace
# (no run of blanks a model could loop in); a request's whitespace_pattern replaces it
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1 << 20     # a grammar's text (a schema, a regex, the choices, a Lark grammar)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema: a dict, or its text), regex (a regular expression the whole
    output matches), choice (a list of strings: the output is one of them), grammar (a Lark grammar in
    llguidance's dialect, or a GBNF / EBNF one as llama.cpp and vLLM's xgrammar write them:
    `root ::= ...`), json_object (True: any JSON object). whitespace_pattern: a regex for the whitespace
    JSON may hold between its tokens (default: JSON_LAYOUT, one space after `,` and `:`). after: text
    (its tokens) the output must hold before the grammar applies: the end of a reasoning model's
    thinking, which the grammar does not hold (the server sets it where the prompt opened thinking)."""
    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    after: str | None = None     # the grammar applies once the output holds this text (a reasoning model's
                                 # end of thinking, e.g. "</think>"); before it the output is free

    def __post_init__(self):
        if self.choice is not None and isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InputError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_) if set_ else 'none'}")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise InputError(f"after must be a non-empty string; got {self.after!r}")
        self.grammar_text          # the check: a bad schema, regex or grammar is refused here

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def grammar_text(self) -> str:
        """The grammar (llguidance's Lark) the output is held to; InputError naming the problem when the
        request's schema, regex or grammar is malformed or uses what the grammar library refuses."""
        text = _grammar(self)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise InputError(f"the structured output's grammar is {len(text)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS}")
        problem = _problem(text)
        if problem:
            raise InputError(f"structured output ({self.kind}): {problem}")
        return text

    @property
    def key(self) -> str:
        """The grammar cache's key: the grammar text (equal requests share one compiled grammar)."""
        return self.grammar_text


@functools.lru_cache(maxsize=256)
def _problem(text: str) -> str | None:
    """Why the grammar library refuses the grammar text (None: it compiles), remembered by text."""
    import llguidance  # noqa: PLC0415
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return ("; ".join(messages) or "invalid grammar") if failed else None


def _schema(schema: Any, what: str) -> dict:
    """The request's JSON schema as a dict (its text parsed; true / false as the schemas they mean)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InputError(f"{what} is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InputError(f"{what} must be a JSON schema (an object); got {type(schema).__name__}")
    return schema


def _json_options(p: StructuredOutputsParams) -> dict:
    if p.whitespace_pattern is None:
        return dict(JSON_LAYOUT)
    if not isinstance(p.whitespace_pattern, str):
        raise InputError("whitespace_pattern must be a string (a regular expression)")
    return {"whitespace_pattern": p.whitespace_pattern}


def json_rule(schema: dict, options: dict) -> str:
    """A Lark expression matching JSON valid for `schema` (llguidance's `%json`, keys in the schema's
    order: the output follows it); its layout options (JSON_LAYOUT, or whitespace_pattern) ride in the
    schema's `x-guidance` entry, over any it has."""
    if options and isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def lark_string(s: str) -> str:
    """A Lark literal matching s exactly (JSON string escapes are Lark's)."""
    return json.dumps(s, ensure_ascii=False)


def _grammar(p: StructuredOutputsParams) -> str:
    kind = p.kind
    if kind == "json":
        return "start: " + json_rule(_schema(p.json, "the JSON schema"), _json_options(p))
    if kind == "json_object":
        if p.json_object is not True:
            raise InputError(f"json_object must be true; got {p.json_object!r}")
        return "start: " + json_rule({"type": "object"}, _json_options(p))
    if kind == "regex":
        if not isinstance(p.regex, str) or not p.regex:
            raise InputError("regex must be a non-empty string")
        return "start: /" + p.regex.replace("/", "\\/") + "/"
    if kind == "choice":
        if not p.choice or not all(isinstance(c, str) and c for c in p.choice):
            raise InputError(f"choice must be a non-empty list of non-empty strings; got {p.choice!r}")
        return "start: " + " | ".join(lark_string(c) for c in p.choice)
    if not isinstance(p.grammar, str) or not p.grammar.strip():
        raise InputError("grammar must be a non-empty string")
    if "::=" in p.grammar:               # GBNF / EBNF, as vLLM's xgrammar and llama.cpp write them
        from llguidance.gbnf_to_lark import gbnf_to_lark  # noqa: PLC0415
        try:
            return gbnf_to_lark(p.grammar)
        except Exception as e:  # noqa: BLE001  (the converter raises plain exceptions on bad input)
            raise InputError(f"grammar: cannot read it as GBNF: {e}") from None
    return p.grammar
