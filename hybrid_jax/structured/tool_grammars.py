"""Grammars that make a model call tools in its own format: `tool_choice` "required" (at least one call
of any of the request's tools) and a named function (a call of that one), enforced by the mask rather
than hoped for. One builder per call syntax, picked by the family's format name (the server's
tool-call parsers, hybrid_jax/server/tool_parsers, name the same formats and parse what these allow):

  hermes        Qwen3-Next   <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>
  qwen3_coder   Qwen3.5      <tool_call>\\n<function=N>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
  deepseek_v32  DeepSeek-V3.2  <｜DSML｜function_calls>\\n<｜DSML｜invoke name="N">\\n<｜DSML｜parameter name="P"
                             string="true|false">VALUE</｜DSML｜parameter>\\n...</｜DSML｜invoke>\\n</｜DSML｜function_calls>
  deepseek_v4   DeepSeek-V4  the same inside <｜DSML｜tool_calls>
  kimi_k2       Kimi-Linear  <|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>
                             {...}<|tool_call_end|>...<|tool_calls_section_end|> (special tokens, named as such)

Arguments follow each tool's `parameters` schema (JSON where the format writes JSON; in the XML
formats each parameter by its schema: JSON for non-strings, raw text for strings,
required parameters in the schema's order, optional ones optional; a raw value is any text up to its
closing tag, a lazy rule, held to the schema's length, pattern or enum; any other string keyword is
refused there). With parallel_tool_calls false
the output is one call. The grammar is a Lark grammar in llguidance's dialect."""
from __future__ import annotations

import dataclasses

from hybrid_jax.errors import InputError
from hybrid_jax.structured.params import JSON_LAYOUT, StructuredOutputsParams, json_rule, lark_string

DSML = "｜DSML｜"
FORMATS = ("hermes", "qwen3_coder", "deepseek_v32", "deepseek_v4", "kimi_k2")


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the request offers: its name and its parameters' JSON schema."""
    name: str
    parameters: dict

    @staticmethod
    def of(tools: list[dict]) -> list["Tool"]:
        out = []
        for t in tools or []:
            fn = t.get("function") or {}
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {"type": "object"}
            out.append(Tool(fn["name"], params))
        return out


def _args(schema) -> str:
    """Arguments valid for a parameter schema, laid out as the templates write them (JSON_LAYOUT)."""
    return json_rule(schema, JSON_LAYOUT)


def _blocks(call: str, parallel: bool) -> str:
    """Formats whose every call is its own block: one, or blocks joined by a newline."""
    return f"start: {call}" + (f' ("\\n" {call})*' if parallel else "")


def _hermes(tools: list[Tool], parallel: bool) -> tuple[str, list[str]]:
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                      "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    return _blocks("call", parallel), ['call: "<tool_call>\\n" ' + _args(one) + ' "\\n</tool_call>"']


# what a raw string value can be held to (the XML formats write strings unquoted): its length, a pattern,
# an enum or const; any other constraint on a string parameter is refused, never left unenforced
RAW_STRING_KEYS = {"type", "description", "title", "default", "examples", "minLength", "maxLength", "pattern",
                   "enum", "const"}


def _is_string(schema) -> bool:
    """A parameter the XML formats write raw: a string, or an enum / const of strings."""
    if not isinstance(schema, dict):
        return False
    vals = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if vals is not None:
        return schema.get("type", "string") == "string" and all(isinstance(v, str) for v in vals)
    return schema.get("type") == "string"


def _raw(schema: dict, name: str, rule: str, close: str, newline: bool) -> tuple[str, list[str]]:
    """A raw string value with its closing tag `close`: (the Lark expression, its rules). Free text is one
    lexeme that ends at the tag's first occurrence (a regex and the negation of any text past the tag:
    llguidance's `&` and `~`), so the value may hold anything but the tag; the value ends with a newline
    where the format writes one before the tag (qwen3_coder)."""
    bad = sorted(set(schema) - RAW_STRING_KEYS)
    if bad:
        raise InputError(f"tool parameter {name!r}: {', '.join(bad)} cannot be enforced on a string this model's "
                         "tool-call format writes unquoted")
    nl = "\n" if newline else ""
    vals = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if vals is not None:
        return "(" + " | ".join(lark_string(v + nl) for v in vals) + ") " + lark_string(close), []
    if "pattern" in schema:
        body = "(?:" + schema["pattern"].replace("/", "\\/") + ")"
    elif "minLength" in schema or "maxLength" in schema:
        body = "(.|\\n){" + f"{int(schema.get('minLength', 0))},{schema.get('maxLength', '')}" + "}"
    else:
        body = "(.|\\n)*"
    tag = ("\\n" if newline else "") + _regex_literal(close)
    token, anything = rule.upper(), "(.|\\n)"
    return token, [f"{token}: /{body}{tag}/ & ~/{anything}*{_regex_literal(close)}{anything}+/"]


def _regex_literal(text: str) -> str:
    """text as a Lark regex matching it exactly."""
    return "".join("\\" + c if c in "\\/.^$|?*+()[]{}" else c for c in text)


def _params(tool: Tool, i: int, write, close: str, newline: bool) -> tuple[str, list[str]]:
    """The XML formats' parameters of tool i: a rule per parameter (required in order, optional ones
    optional), write(name, value, is_string) -> the parameter's Lark sequence; a string's value is raw
    (`_raw`: it ends with its closing tag `close`), any other's its schema's JSON."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    rules, seq = [], []
    for j, (name, schema) in enumerate(props.items()):
        is_str = _is_string(schema)
        if is_str:
            value, more = _raw(schema, name, f"s{i}_{j}", close, newline)
            rules += more
        else:
            value = _args(schema if isinstance(schema, dict) else {})
        rules.append(f"p{i}_{j}: {write(name, value, is_str)}")
        seq.append(f"p{i}_{j}" + ("" if name in required else "?"))
    return " ".join(seq), rules


def _qwen3_coder(tools: list[Tool], parallel: bool) -> tuple[str, list[str]]:
    fns, rules = [], []
    for i, t in enumerate(tools):
        params, prules = _params(t, i, lambda n, v, s: f'"<parameter={n}>\\n" {v} ' +
                                 ('"\\n"' if s else '"\\n</parameter>\\n"'), "</parameter>", True)
        rules += prules + [f"f{i}: " + lark_string(f"<function={t.name}>\n") + f" {params} " + '"</function>\\n"']
        fns.append(f"f{i}")
    return _blocks("call", parallel), rules + ['call: "<tool_call>\\n" (' + " | ".join(fns) + ') "</tool_call>"']


def _dsml(tools: list[Tool], parallel: bool, section: str) -> tuple[str, list[str]]:
    fns, rules = [], []
    for i, t in enumerate(tools):
        params, prules = _params(t, i, lambda n, v, s: lark_string(
            f'<{DSML}parameter name="{n}" string="{"true" if s else "false"}">') + f" {v} " +
            ('"\\n"' if s else lark_string(f"</{DSML}parameter>\n")), f"</{DSML}parameter>", False)
        rules += prules + [f"f{i}: " + lark_string(f'<{DSML}invoke name="{t.name}">\n') + f" {params} " +
                           lark_string(f"</{DSML}invoke>\n")]
        fns.append(f"f{i}")
    many = "+" if parallel else ""          # (the invokes of one block)
    return ("start: " + lark_string(f"<{DSML}{section}>\n") + " (" + " | ".join(fns) + f"){many} " +
            lark_string(f"</{DSML}{section}>")), rules


def _kimi(tools: list[Tool], parallel: bool) -> tuple[str, list[str]]:
    calls = [f'<|tool_call_begin|> "functions.{t.name}:" IDX <|tool_call_argument_begin|> {_args(t.parameters)} '
             f'<|tool_call_end|>' for t in tools]
    many = "+" if parallel else ""          # (the calls of one section)
    return (f"start: <|tool_calls_section_begin|> ({' | '.join(calls)}){many} <|tool_calls_section_end|>",
            ["IDX: /[0-9]+/"])


def tool_call_grammar(fmt: str, tools: list[dict], name: str | None = None, parallel: bool = True) -> StructuredOutputsParams:
    """The structured output that makes the model call tools in format `fmt`: any of `tools` (OpenAI's
    [{type: function, function: {name, parameters}}]), or only the function `name`; one call, or with
    `parallel` one or more (Qwen's formats: a block each, a newline between; DSML and Kimi: the calls
    of one block)."""
    ts = Tool.of(tools)
    if name is not None:
        ts = [t for t in ts if t.name == name]
        if not ts:
            raise InputError(f"'tool_choice' names the function {name!r}, which is not among the request's tools")
    if not ts:
        raise InputError("'tool_choice' \"required\" needs at least one tool in 'tools'")
    build = {"hermes": _hermes, "qwen3_coder": _qwen3_coder, "kimi_k2": _kimi,
             "deepseek_v32": lambda t, p: _dsml(t, p, "function_calls"),
             "deepseek_v4": lambda t, p: _dsml(t, p, "tool_calls")}
    if fmt not in build:
        raise InputError(f"no tool-call grammar for the format {fmt!r} (known: {', '.join(FORMATS)})")
    start, rules = build[fmt](ts, parallel)
    return StructuredOutputsParams(grammar="\n".join([start, *rules]))
