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
formats each parameter by its schema: JSON for non-strings, raw text without `<` for strings,
required parameters in the schema's order, optional ones optional). With parallel_tool_calls false
the output is one call. The grammar is a Lark grammar in llguidance's dialect."""
from __future__ import annotations

import dataclasses
import json

from hybrid_jax.errors import InputError
from hybrid_jax.structured.params import StructuredOutputsParams, lark_string

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


def _js(schema: dict) -> str:
    return "%json " + json.dumps(schema, sort_keys=True, ensure_ascii=False)


def _hermes(tools: list[Tool]) -> tuple[str, list[str]]:
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                      "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    return '"<tool_call>\\n" ' + _js(one) + ' "\\n</tool_call>"', []


def _params(tool: Tool, i: int, write) -> tuple[str, list[str]]:
    """The XML formats' parameters of tool i: a rule per parameter (required in order, optional ones
    optional), write(name, value_rule, is_string) -> the parameter's Lark sequence."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    rules, seq = [], []
    for j, (name, schema) in enumerate(props.items()):
        is_str = isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema
        value = "TEXT" if is_str else _js(schema if isinstance(schema, dict) else {})
        rules.append(f"p{i}_{j}: {write(name, value, is_str)}")
        seq.append(f"p{i}_{j}" + ("" if name in required else "?"))
    return " ".join(seq), rules


def _qwen3_coder(tools: list[Tool]) -> tuple[str, list[str]]:
    fns, rules = [], []
    for i, t in enumerate(tools):
        params, prules = _params(t, i, lambda n, v, s: f'"<parameter={n}>\\n" {v} "\\n</parameter>\\n"')
        rules += prules + [f"f{i}: " + lark_string(f"<function={t.name}>\n") + f" {params} " + '"</function>\\n"']
        fns.append(f"f{i}")
    return '"<tool_call>\\n" (' + " | ".join(fns) + ') "</tool_call>"', rules + ["TEXT: /[^<]*/"]


def _dsml(tools: list[Tool], section: str) -> tuple[str, list[str]]:
    fns, rules = [], []
    for i, t in enumerate(tools):
        params, prules = _params(t, i, lambda n, v, s: lark_string(
            f'<{DSML}parameter name="{n}" string="{"true" if s else "false"}">') + f" {v} " +
            lark_string(f"</{DSML}parameter>\n"))
        rules += prules + [f"f{i}: " + lark_string(f'<{DSML}invoke name="{t.name}">\n') + f" {params} " +
                           lark_string(f"</{DSML}invoke>\n")]
        fns.append(f"f{i}")
    return lark_string(f"<{DSML}{section}>\n") + " (" + " | ".join(fns) + ") " + lark_string(f"</{DSML}{section}>"), \
        rules + ["TEXT: /[^<]*/"]


def _kimi(tools: list[Tool]) -> tuple[str, list[str]]:
    calls = [f'<|tool_call_begin|> "functions.{t.name}:" IDX <|tool_call_argument_begin|> {_js(t.parameters)} '
             f'<|tool_call_end|>' for t in tools]
    return "<|tool_calls_section_begin|> (" + " | ".join(calls) + ") <|tool_calls_section_end|>", ["IDX: /[0-9]+/"]


def tool_call_grammar(fmt: str, tools: list[dict], name: str | None = None, parallel: bool = True) -> StructuredOutputsParams:
    """The structured output that makes the model call tools in format `fmt`: any of `tools` (OpenAI's
    [{type: function, function: {name, parameters}}]), or only the function `name`; one call, or with
    `parallel` one or more (each a block of the format; Kimi and DSML blocks hold one call each here)."""
    ts = Tool.of(tools)
    if name is not None:
        ts = [t for t in ts if t.name == name]
        if not ts:
            raise InputError(f"'tool_choice' names the function {name!r}, which is not among the request's tools")
    if not ts:
        raise InputError("'tool_choice' \"required\" needs at least one tool in 'tools'")
    build = {"hermes": _hermes, "qwen3_coder": _qwen3_coder, "kimi_k2": _kimi,
             "deepseek_v32": lambda t: _dsml(t, "function_calls"), "deepseek_v4": lambda t: _dsml(t, "tool_calls")}
    if fmt not in build:
        raise InputError(f"no tool-call grammar for the format {fmt!r} (known: {', '.join(FORMATS)})")
    call, rules = build[fmt](ts)
    start = "start: call" + (' ("\\n" call)*' if parallel else "")
    return StructuredOutputsParams(grammar="\n".join([start, "call: " + call, *rules]))
