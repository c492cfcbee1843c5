"""The grammars and documents `benchmarks/structured.py` measures, and its JSON-schema coverage cases.

Each timed grammar comes with a document valid for it (written here by hand, checked against the
schema with `jsonschema` by tests/hybrid_jax/test_structured_bench.py), which drives the matchers
token by token as a model's output would. Each coverage case is one schema feature with an instance
that keeps it and one that breaks only it: a library that compiles the schema but lets the breaking
instance through ignores the feature.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarCase:
    """A grammar to compile and a text the grammar accepts. kind: json_schema|regex|choice|ebnf."""
    name: str
    kind: str
    source: str
    text: str


@dataclass(frozen=True)
class CoverageCase:
    """A JSON-schema feature: the schema, an instance keeping it, an instance breaking only it."""
    feature: str
    schema: dict
    valid: object
    invalid: object


ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            "address": {"type": "object", "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
            "required": ["name", "email", "address"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"]}},
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "status", "customer", "items", "gift"],
}
ORDER_DOC = {
    "order_id": 48213, "status": "shipped",
    "customer": {"name": "Ada Lovelace", "email": "ada.lovelace@example.com",
                 "address": {"city": "London", "zip": "10115"}},
    "items": [{"sku": "KB-204", "quantity": 2, "price": 49.5},
              {"sku": "MS-11", "quantity": 1, "price": 19.99},
              {"sku": "USB-C-2M", "quantity": 3, "price": 7.25}],
    "gift": False,
}

PERSON_SCHEMA = {
    "$defs": {
        "phone": {"type": "object", "properties": {
            "kind": {"enum": ["home", "work", "mobile"]},
            "number": {"type": "string", "pattern": "^\\+[0-9]{6,14}$"}},
            "required": ["kind", "number"]},
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "phones": {"type": "array", "items": {"$ref": "#/$defs/phone"}, "maxItems": 3},
            "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["name", "age", "phones", "nickname"]},
    },
    "type": "object",
    "properties": {"owner": {"$ref": "#/$defs/person"},
                   "contacts": {"type": "array", "items": {"$ref": "#/$defs/person"},
                                "minItems": 1, "maxItems": 4}},
    "required": ["owner", "contacts"],
}
PERSON_DOC = {
    "owner": {"name": "Grace Hopper", "age": 85,
              "phones": [{"kind": "work", "number": "+12025550143"}], "nickname": "Amazing Grace"},
    "contacts": [
        {"name": "Alan Turing", "age": 41, "phones": [], "nickname": None},
        {"name": "Edsger Dijkstra", "age": 72,
         "phones": [{"kind": "home", "number": "+31205550199"}, {"kind": "mobile", "number": "+31615550123"}],
         "nickname": "EWD"},
    ],
}

TOOL_CALL_SCHEMA = {
    "anyOf": [
        {"type": "object", "properties": {
            "name": {"const": "get_weather"},
            "arguments": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["city", "unit", "days"], "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False},
        {"type": "object", "properties": {
            "name": {"const": "search_flights"},
            "arguments": {"type": "object", "properties": {
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"enum": ["economy", "premium", "business", "first"]}},
                "required": ["from", "to", "date", "passengers", "cabin"], "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False},
    ],
}
TOOL_CALL_DOC = {"name": "search_flights",
                 "arguments": {"from": "SFO", "to": "NRT", "date": "2026-12-24", "passengers": 2,
                               "cabin": "business"}}

LOG_REGEX = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z (INFO|WARN|ERROR) [a-z_.]+: [A-Za-z0-9 ,.'=-]{1,120}"
LOG_TEXT = ("2026-12-06T14:15:09Z WARN engine.scheduler: queue depth 48 exceeds the soft limit, "
            "deferring 3 prefills of length=2048")

CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable"]

SQL_EBNF = r'''root ::= "SELECT " cols " FROM " ident where? ";"
cols ::= "*" | ident (", " ident)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= ident " " op " " value
op ::= "=" | "<" | ">" | "<=" | ">=" | "!="
value ::= [0-9]+ | "'" [a-zA-Z0-9 ]* "'"
ident ::= [a-z_] [a-z0-9_]*
'''
SQL_TEXT = ("SELECT order_id, status, total FROM orders WHERE status = 'shipped' AND total >= 100 "
            "AND customer_id != 42;")


def _doc(value: object) -> str:
    return json.dumps(value, indent=2)


def grammar_cases() -> list[GrammarCase]:
    """Every timed grammar: any JSON object, four schemas, a regex, a choice and an EBNF grammar."""
    return [
        GrammarCase("json_object", "json_schema", json.dumps({"type": "object"}), _doc(ORDER_DOC)),
        GrammarCase("schema:order", "json_schema", json.dumps(ORDER_SCHEMA), _doc(ORDER_DOC)),
        GrammarCase("schema:person", "json_schema", json.dumps(PERSON_SCHEMA), _doc(PERSON_DOC)),
        GrammarCase("schema:tool_call", "json_schema", json.dumps(TOOL_CALL_SCHEMA), _doc(TOOL_CALL_DOC)),
        GrammarCase("regex:log_line", "regex", LOG_REGEX, LOG_TEXT),
        GrammarCase("choice:5", "choice", json.dumps(CHOICES), "not applicable"),
        GrammarCase("ebnf:sql", "ebnf", SQL_EBNF, SQL_TEXT),
    ]


QUICK_CASES = ("json_object", "schema:order", "regex:log_line")


def _obj(props: dict, required: list[str] | None = None, **more) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), **more}


def coverage_cases() -> list[CoverageCase]:
    """One case per schema feature (25); each invalid instance breaks only that feature."""
    tree = {"$defs": {"node": _obj({"v": {"type": "integer"},
                                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}})},
            "$ref": "#/$defs/node"}
    return [
        CoverageCase("required", _obj({"a": {"type": "integer"}, "b": {"type": "string"}}),
                     {"a": 1, "b": "x"}, {"a": 1}),
        CoverageCase("enum", _obj({"c": {"enum": ["red", "green"]}}), {"c": "red"}, {"c": "blue"}),
        CoverageCase("const", _obj({"c": {"const": "v1"}}), {"c": "v1"}, {"c": "v2"}),
        CoverageCase("integer min/max", _obj({"n": {"type": "integer", "minimum": 10, "maximum": 20}}),
                     {"n": 15}, {"n": 25}),
        CoverageCase("exclusiveMinimum", _obj({"n": {"type": "integer", "exclusiveMinimum": 0}}),
                     {"n": 1}, {"n": 0}),
        CoverageCase("number min/max", _obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
                     {"x": 0.5}, {"x": 1.5}),
        CoverageCase("multipleOf", _obj({"n": {"type": "integer", "multipleOf": 5}}), {"n": 15}, {"n": 7}),
        CoverageCase("minLength/maxLength", _obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
                     {"s": "abc"}, {"s": "abcdef"}),
        CoverageCase("pattern", _obj({"s": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
                     {"s": "ABC"}, {"s": "ABc"}),
        CoverageCase("format: date", _obj({"d": {"type": "string", "format": "date"}}),
                     {"d": "2026-12-06"}, {"d": "06/12/2026"}),
        CoverageCase("format: email", _obj({"e": {"type": "string", "format": "email"}}),
                     {"e": "a@b.io"}, {"e": "not an email"}),
        CoverageCase("minItems/maxItems", _obj({"l": {"type": "array", "items": {"type": "integer"},
                                                      "minItems": 1, "maxItems": 2}}),
                     {"l": [1, 2]}, {"l": [1, 2, 3]}),
        CoverageCase("uniqueItems", _obj({"l": {"type": "array", "items": {"type": "integer"},
                                                "uniqueItems": True}}),
                     {"l": [1, 2]}, {"l": [1, 1]}),
        CoverageCase("prefixItems", _obj({"t": {"type": "array", "prefixItems": [{"type": "string"},
                                                                             {"type": "integer"}],
                                                "items": False}}),
                     {"t": ["a", 1]}, {"t": [1, "a"]}),
        CoverageCase("additionalProperties:false", _obj({"a": {"type": "integer"}},
                                                        additionalProperties=False),
                     {"a": 1}, {"a": 1, "z": 2}),
        CoverageCase("additionalProperties:schema", {"type": "object",
                                                     "additionalProperties": {"type": "integer"}},
                     {"k": 1}, {"k": "one"}),
        CoverageCase("$ref/$defs", {"$defs": {"pos": {"type": "integer", "minimum": 1}},
                                    **_obj({"p": {"$ref": "#/$defs/pos"}})}, {"p": 3}, {"p": -3}),
        CoverageCase("recursive $ref", tree, {"v": 1, "kids": [{"v": 2, "kids": []}]},
                     {"v": 1, "kids": [{"v": "two", "kids": []}]}),
        CoverageCase("anyOf", _obj({"u": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}),
                     {"u": True}, {"u": "s"}),
        CoverageCase("oneOf", _obj({"u": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}),
                     {"u": "s"}, {"u": None}),
        CoverageCase("allOf", _obj({"u": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}),
                     {"u": 4}, {"u": 2}),
        CoverageCase("type list (nullable)", _obj({"u": {"type": ["string", "null"]}}),
                     {"u": None}, {"u": 5}),
        CoverageCase("minProperties", {"type": "object", "additionalProperties": {"type": "integer"},
                                       "minProperties": 2}, {"a": 1, "b": 2}, {"a": 1}),
        CoverageCase("patternProperties", {"type": "object", "patternProperties": {
            "^x_": {"type": "integer"}}, "additionalProperties": False}, {"x_a": 1}, {"x_a": "s"}),
        CoverageCase("if/then/else", {**_obj({"k": {"enum": ["a", "b"]}, "n": {"type": "integer"}}),
                                      "if": {"properties": {"k": {"const": "a"}}},
                                      "then": {"properties": {"n": {"minimum": 10}}}},
                     {"k": "a", "n": 10}, {"k": "a", "n": 1}),
    ]
