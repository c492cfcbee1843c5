"""Each family's tool-call format as data: the markers around a block of calls and how a block's
text becomes calls. Two syntaxes cover the five families:

- JSON calls: `hermes` (Qwen3-Next: `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one
  call a block) and `kimi_k2` (Kimi-Linear: `<|tool_calls_section_begin|>` then per call
  `<|tool_call_begin|>functions.N:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`, its id the
  `functions.N:IDX` header the chat template writes back).
- XML calls, one engine (`XmlSyntax`) for `qwen3_coder` (Qwen3.5: `<tool_call>\\n<function=N>\\n<parameter=P>\\n
  VALUE\\n</parameter>\\n</function>\\n</tool_call>`, values typed by the tool's schema) and DSML (DeepSeek-V3.2:
  `<｜DSML｜function_calls>`, V4: `<｜DSML｜tool_calls>`, around `<｜DSML｜invoke name="N">` with
  `<｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>`).

The shapes are those the releases' templates / encoders write, and what the tool-call grammars of
tool_choice "required" / named allow (structured/tool_grammars.py, built for the same format names);
a block that does not parse is left as content."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from hybrid_jax.server.tool_parsers.arguments import Schemas, dumps, json_object, typed_value
from hybrid_jax.server.tool_parsers.types import RawCall

BlockParser = Callable[[str, Schemas], "list[RawCall] | None"]


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """A tool-call format: the markers around a block, and the parser of a block's inside."""
    name: str
    begin: str
    end: str
    parse_block: BlockParser
    markers: tuple[str, ...] = ()        # every marker the format writes (kept in the output text)
    variants: tuple[tuple[str, str], ...] = ()   # other (begin, end) spellings the model is seen to write

    @property
    def blocks(self) -> dict[str, str]:
        """Each begin marker with its end marker."""
        return dict(((self.begin, self.end), *self.variants))


def _hermes(body: str, schemas: Schemas) -> list[RawCall] | None:
    obj = json_object(body.strip())
    if obj is None or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):                  # some fine-tunes write the arguments as a JSON string
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return [RawCall(obj["name"], dumps(args))]


_KIMI_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<>]+):\d+)\s*"
                        r"<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>", re.S)


def _kimi(body: str, schemas: Schemas) -> list[RawCall] | None:
    calls, at = [], 0
    while at < len(body.rstrip()):
        m = _KIMI_CALL.match(body, at)
        args = json_object(m["args"].strip()) if m else None
        if args is None:
            return None
        calls.append(RawCall(m["name"], dumps(args), m["id"]))
        at = m.end()
    return calls or None


@dataclasses.dataclass(frozen=True)
class XmlSyntax:
    """An XML-style call: `call` matches one whole call (groups `name`, `params`); `param` one parameter
    (groups `key`, `value`, optionally `string`: "true" when the value is raw text, "false" for JSON;
    absent: typed by the schema). Only blanks may lie between calls and between parameters."""
    call: re.Pattern
    param: re.Pattern
    strip_newline: bool          # a raw value loses one leading and one trailing newline (qwen3_coder)

    def parse(self, body: str, schemas: Schemas) -> list[RawCall] | None:
        calls, at = [], 0
        while at < len(body.rstrip()):
            m = self.call.match(body, at)
            args = self._params(m["params"], schemas.get(m["name"], {})) if m else None
            if args is None:
                return None
            calls.append(RawCall(m["name"], dumps(args)))
            at = m.end()
        return calls or None

    def _params(self, text: str, schema: dict) -> dict | None:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        args, at = {}, 0
        while at < len(text.rstrip()):
            m = self.param.match(text, at)
            if m is None:
                return None
            args[m["key"]] = self._value(m, props.get(m["key"]))
            at = m.end()
        return args

    def _value(self, m: re.Match, schema: dict | None):
        raw = m["value"]
        if self.strip_newline:
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
        flag = m.groupdict().get("string")
        if flag == "true":
            return raw
        if flag == "false":
            return typed_value(raw, {"type": ["object", "array", "number", "integer", "boolean", "null"]})
        return typed_value(raw, schema)


QWEN_XML = XmlSyntax(
    call=re.compile(r"\s*<function=(?P<name>[^>\n]+)>(?P<params>.*?)</function>", re.S),
    param=re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)</parameter>", re.S),
    strip_newline=True)


def _dsml(word: str) -> str:
    return f"<｜DSML｜{word}"


DSML = XmlSyntax(
    call=re.compile(r"\s*" + re.escape(_dsml("invoke")) + r' name="(?P<name>[^"]+)">(?P<params>.*?)'
                    + re.escape("</｜DSML｜invoke>"), re.S),
    param=re.compile(r"\s*" + re.escape(_dsml("parameter")) + r' name="(?P<key>[^"]+)" string="(?P<string>true|false)">'
                     r"(?P<value>.*?)" + re.escape("</｜DSML｜parameter>"), re.S),
    strip_newline=False)


def _dsml_format(name: str, section: str) -> ToolFormat:
    return ToolFormat(name, _dsml(section) + ">", f"</｜DSML｜{section}>", DSML.parse,
                      (_dsml(section) + ">", f"</｜DSML｜{section}>"))


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", "<tool_call>", "</tool_call>", _hermes, ("<tool_call>", "</tool_call>")),
    ToolFormat("qwen3_coder", "<tool_call>", "</tool_call>", QWEN_XML.parse, ("<tool_call>", "</tool_call>")),
    _dsml_format("deepseek_v32", "function_calls"),
    _dsml_format("deepseek_v4", "tool_calls"),
    ToolFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _kimi,
               ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_call_section_begin|>",
                "<|tool_call_section_end|>"),
               # Kimi models also write the section markers in the singular (vLLM and SGLang read both)
               variants=(("<|tool_call_section_begin|>", "<|tool_call_section_end|>"),)),
)}
