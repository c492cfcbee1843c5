"""The tool-call parsers (server/tool_parsers/): each family's hand-written outputs parse to the
calls they hold; streaming gives the same final message at every split of the text (1-char deltas,
random chunks, every cut inside a marker: the splits that broke vLLM's parsers, vLLM #40861 and
#39056); and what the family's tool-call grammar allows (structured/tool_grammars.py, which enforces
tool_choice "required" / named) parses back into the calls, arguments valid for their tools: the
family's own layout, random awkward arguments, a blank inserted anywhere it allows one."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from hybrid_jax.server.tool_parsers import (REASONING_FORMATS, TOOL_FORMATS, Delta, MessageParser, collect, family,
                                            for_model_type, schemas_of)
from tool_call_fixtures import CASES, DS, TOOLS, Case


def parser(fmt: str, parallel: bool = True, tools=TOOLS) -> MessageParser:
    return MessageParser(TOOL_FORMATS[fmt], REASONING_FORMATS["qwen3"], schemas_of(tools), parallel)


def streamed(p: MessageParser, pieces: list[str], prompt: str = "") -> tuple[list[Delta], object]:
    st = p.stream(prompt)
    deltas = [d for piece in pieces for d in st.feed(piece)] + st.finish()
    return deltas, collect(deltas)


def check(case: Case, msg):
    assert msg.content == case.content
    assert msg.reasoning == case.reasoning
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == case.calls
    if case.ids:
        assert tuple(c.id for c in msg.tool_calls) == case.ids
    else:
        ids = [c.id for c in msg.tool_calls]
        assert all(i.startswith("call_") and len(i) > 12 for i in ids) and len(set(ids)) == len(ids)


def same(a, b):
    """Equal but for the random call ids."""
    return (a.content, a.reasoning, [(c.name, c.arguments) for c in a.tool_calls]) == \
           (b.content, b.reasoning, [(c.name, c.arguments) for c in b.tool_calls])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fixture_parses(case):
    check(case, parser(case.format).parse(case.text, case.prompt))


def _marker_cuts(case: Case) -> list[int]:
    """Every position inside or at the edge of a marker of the format (and of the reasoning markers)."""
    markers = TOOL_FORMATS[case.format].markers + ("<think>", "</think>", f"<{DS}invoke", f"<{DS}parameter",
                                                   "<function=", "<parameter=", "</parameter>")
    cuts = set()
    for m in markers:
        at = case.text.find(m)
        while at >= 0:
            cuts.update(range(at, at + len(m) + 1))
            at = case.text.find(m, at + 1)
    return sorted(cuts)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_streaming_equals_parse_at_every_split(case):
    p = parser(case.format)
    whole = p.parse(case.text, case.prompt)
    text = case.text
    _, one_char = streamed(p, list(text), case.prompt)
    check(case, one_char)
    for cut in range(len(text) + 1):                  # every single split point
        _, msg = streamed(p, [text[:cut], text[cut:]], case.prompt)
        assert same(msg, whole), cut
    for a in _marker_cuts(case):                       # two cuts, each inside a marker
        for b in _marker_cuts(case)[::7]:
            lo, hi = sorted((a, b))
            _, msg = streamed(p, [text[:lo], text[lo:hi], text[hi:]], case.prompt)
            assert same(msg, whole), (lo, hi)
    rng = random.Random(len(text))
    for _ in range(30):                                # random chunks
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 12))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        _, msg = streamed(p, pieces, case.prompt)
        assert same(msg, whole), cuts


@pytest.mark.parametrize("case", [c for c in CASES if c.calls], ids=[c.name for c in CASES if c.calls])
def test_stream_deltas_are_openais_shape_and_never_leak_markers(case):
    p = parser(case.format)
    deltas, _ = streamed(p, list(case.text), case.prompt)
    starts = [d for d in deltas if d.call_id is not None]
    assert [d.call_index for d in starts] == list(range(len(case.calls)))
    assert all(d.arguments == "" and d.name for d in starts)    # the first delta of a call: name, arguments ""
    seen = set()
    for d in deltas:
        if d.call_index is not None and d.call_id is None:
            assert d.call_index in seen                          # fragments follow their call's start
        if d.call_id is not None:
            seen.add(d.call_index)
    text = "".join(d.content for d in deltas if d.content is not None)
    begin = TOOL_FORMATS[case.format].begin
    assert not any(begin[:k] in text for k in range(2, len(begin) + 1) if begin[:k] not in (case.content or ""))


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "deepseek_v32", "kimi_k2"])
def test_parallel_tool_calls_false_keeps_the_first(fmt):
    case = next(c for c in CASES if c.format == fmt and len(c.calls) >= 2)
    p = parser(fmt, parallel=False)
    msg = p.parse(case.text, case.prompt)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == case.calls[:1]
    _, one_char = streamed(p, list(case.text), case.prompt)
    assert same(one_char, msg)


def test_no_tool_format_leaves_calls_as_content():
    case = CASES[1]
    msg = MessageParser(None, None).parse(case.text)
    assert msg.content == case.text and msg.tool_calls == []


def test_qwen3_coder_values_are_typed_by_the_schema():
    p = parser("qwen3_coder")
    text = ("<tool_call>\n<function=search>\n<parameter=query>\n[1, 2]\n</parameter>\n<parameter=strict>\nTrue\n"
            "</parameter>\n<parameter=limit>\n7\n</parameter>\n<parameter=extra>\n{\"a\": 1}\n</parameter>\n"
            "</function>\n</tool_call>")
    (call,) = p.parse(text).tool_calls
    # query is a string in the schema: kept as written; strict a boolean as Jinja's `string` writes it;
    # a parameter the schema does not name stays text
    assert json.loads(call.arguments) == {"query": "[1, 2]", "strict": True, "limit": 7, "extra": "{\"a\": 1}"}


def test_families_defaults_and_overrides():
    assert for_model_type("qwen3_next").tool_format.name == "hermes"
    assert for_model_type("qwen3_5").tool_format.name == "qwen3_coder"
    assert for_model_type("deepseek_v32").tool_format.name == "deepseek_v32"
    assert for_model_type("deepseek_v4").tool_format.name == "deepseek_v4"
    assert for_model_type("kimi_linear").tool_format.name == "kimi_k2"
    assert for_model_type("llama").tool_format is None and for_model_type(None).reasoning is None
    assert family("qwen3_next", "qwen3_coder", "none") == family("qwen3_5", None, "none")
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        family("qwen3_next", "nope")


# --- what the tool-call grammars allow (tool_choice "required" / named: structured/tool_grammars.py) -------

FORMATS = sorted(TOOL_FORMATS)
CALLS = [("get_weather", {"city": "Zürich", "days": 2}), ("search", {"query": "a < b", "filters": {"k": [1]}})]
GRAMMAR_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
        "required": ["query"]}}},
]
KIMI_SPECIALS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


def _dsml(section, calls):
    inner = "".join(f"<{DS}invoke name=\"{n}\">\n" + "".join(
        f"<{DS}parameter name=\"{k}\" string=\"{'true' if isinstance(v, str) else 'false'}\">"
        f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DS}parameter>\n" for k, v in a.items())
        + f"</{DS}invoke>\n" for n, a in calls)
    return f"<{DS}{section}>\n{inner}</{DS}{section}>"


def _written(fmt, calls):
    """The calls as each family's template / encoder writes them (JSON as tojson: ", " and ": ")."""
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{{\"name\": \"{n}\", \"arguments\": {json.dumps(a, ensure_ascii=False)}}}\n"
                         "</tool_call>" for n, a in calls)
    if fmt == "qwen3_coder":
        return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in a.items())
            + "</function>\n</tool_call>" for n, a in calls)
    if fmt.startswith("deepseek"):
        return _dsml("function_calls" if fmt == "deepseek_v32" else "tool_calls", calls)
    return "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a, ensure_ascii=False)}"
        "<|tool_call_end|>" for i, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>"


class _Bytes:
    """A byte vocabulary with Kimi's markers as special tokens, for llguidance's matcher."""
    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b""] + [m.encode() for m in KIMI_SPECIALS]
    special_token_ids = list(range(256, 257 + len(KIMI_SPECIALS)))

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)

    @staticmethod
    def ids(text):
        out, i = [], 0
        while i < len(text):
            m = next((j for j, k in enumerate(KIMI_SPECIALS) if text.startswith(k, i)), None)
            if m is None:
                out += list(text[i].encode())
                i += 1
            else:
                out.append(257 + m)
                i += len(KIMI_SPECIALS[m])
        return out


def _matcher(fmt, name=None, parallel=True, tools=GRAMMAR_TOOLS):
    import llguidance  # noqa: PLC0415

    from hybrid_jax.structured.tool_grammars import tool_call_grammar  # noqa: PLC0415
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=len(_Bytes.tokens))
    m = llguidance.LLMatcher(tok, tool_call_grammar(fmt, tools, name, parallel).grammar_text, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _accepts(fmt, text, name=None, parallel=True, tools=GRAMMAR_TOOLS) -> bool:
    m, ids = _matcher(fmt, name, parallel, tools), _Bytes.ids(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_required_grammar_allows_the_familys_calls_and_they_parse(fmt):
    p = parser(fmt, tools=GRAMMAR_TOOLS)
    text = _written(fmt, CALLS)
    assert _accepts(fmt, text), text
    msg = p.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == CALLS and not msg.content
    # one call: parallel_tool_calls false allows it, not two; a named choice only its function
    one = _written(fmt, CALLS[:1])
    assert _accepts(fmt, one, parallel=False) and not _accepts(fmt, text, parallel=False)
    assert _accepts(fmt, one, name="get_weather") and not _accepts(fmt, _written(fmt, CALLS[1:]), name="get_weather")
    # text before the calls, a call of a tool the request does not have, arguments against the schema
    assert not _accepts(fmt, "Sure. " + text)
    assert not _accepts(fmt, _written(fmt, [("delete_all", {"city": "x", "days": 1})]))
    assert not _accepts(fmt, _written(fmt, [("get_weather", {"city": "x", "days": "two"})]))


ALPHABET = list("abc xyz019") + ["<", ">", "\"", "\\", "\n", "ü", "{", "}", "[", "]", ":", ",", "</", "</b>", "é€"]


def _random_arguments(rng) -> list[tuple[str, dict]]:
    """One or two calls with random arguments valid for GRAMMAR_TOOLS: strings of awkward characters
    (quotes, backslashes, newlines, `<`, `</`, non-ASCII; never a closing tag of the formats, which
    they cannot hold), integers, nested objects."""
    def text():
        return "".join(rng.choice(ALPHABET) for _ in range(int(rng.integers(0, 12)))).strip()
    calls = []
    for _ in range(int(rng.integers(1, 3))):
        if rng.random() < 0.5:
            calls.append(("get_weather", {"city": text() or "x", "days": int(rng.integers(-5, 400))}))
        else:
            args = {"query": text() or "q"}
            if rng.random() < 0.6:
                args["filters"] = {text() or "k": [int(rng.integers(0, 9)), text()], "n": {"deep": None}}
            calls.append(("search", args))
    return calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_calls_the_grammar_allows_parse_back_to_themselves(fmt):
    """Random calls (awkward strings, nested objects), written as the family writes them: the required
    grammar allows each and the parser gives back the same calls, arguments valid for their tools."""
    import numpy as np  # noqa: PLC0415
    rng = np.random.default_rng(0)
    p = parser(fmt, tools=GRAMMAR_TOOLS)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in GRAMMAR_TOOLS}
    for _ in range(30):
        calls = _random_arguments(rng)
        text = _written(fmt, calls)
        assert _accepts(fmt, text), text
        got = [(c.name, json.loads(c.arguments)) for c in p.parse(text).tool_calls]
        if fmt == "qwen3_coder":         # (a raw value loses one leading and one trailing newline)
            calls = [(n, {k: v.strip("\n") if isinstance(v, str) else v for k, v in a.items()}) for n, a in calls]
        assert got == calls, text
        for name, args in got:
            jsonschema.validate(args, schemas[name])


# --- a follow-up turn: the calls sent back render as the family writes them ----------------------------

# format -> (template, what opens the assistant's turn, how the first tool answer is written)
FOLLOW_UP_TEMPLATES = {
    "hermes": ("qwen3_next_instruct.jinja", "<|im_start|>assistant\n",
               "<tool_response>\n18 C, sunny\n</tool_response>"),
    "qwen3_coder": ("qwen3_5.jinja", "<|im_start|>assistant\n", "<tool_response>\n18 C, sunny\n</tool_response>"),
    "kimi_k2": ("kimi_k2_thinking.jinja", "<|im_assistant|>assistant<|im_middle|>",
                "## Return of functions.get_weather:0\n18 C, sunny"),
}


@pytest.mark.parametrize("fmt", sorted(FOLLOW_UP_TEMPLATES))
def test_a_follow_up_turn_renders_the_calls_in_the_familys_format(fmt):
    """The assistant's `tool_calls` (as a client sends them back: arguments a JSON string) and the `tool`
    message render through the released template; the assistant turn, parsed by the family's parser,
    gives back the same calls, and the tool's answer is in the prompt."""
    from pathlib import Path  # noqa: PLC0415
    from types import MappingProxyType  # noqa: PLC0415

    from hybrid_jax.server.chat_messages import parse_conversation  # noqa: PLC0415
    from hybrid_jax.server.chat_template import render  # noqa: PLC0415
    from hybrid_jax.template_sources import ChatTemplates  # noqa: PLC0415
    calls = [("get_weather", {"city": "Zürich", "days": 2}), ("search", {"query": "a\nb", "strict": True})]
    ids = ["functions.get_weather:0", "functions.search:1"] if fmt == "kimi_k2" else ["call_0", "call_1"]
    data = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "weather and news?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": ids[i], "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)]},
        {"role": "tool", "tool_call_id": ids[0], "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": ids[1], "content": "nothing new"}]}
    name, opens, answer = FOLLOW_UP_TEMPLATES[fmt]
    template = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / name).read_text()
    text = render(ChatTemplates(MappingProxyType({"default": template})), parse_conversation(data))
    turn = text.split(opens)[1].split("<|im_end|>")[0]
    assert TOOL_FORMATS[fmt].begin in turn
    msg = MessageParser(TOOL_FORMATS[fmt], REASONING_FORMATS["qwen3"], schemas_of(TOOLS)).parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == calls
    if fmt == "kimi_k2":                       # the ids are written back as the calls' headers
        assert [c.id for c in msg.tool_calls] == ids
    assert answer in text and "nothing new" in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_blank_the_grammar_allows_still_parses(fmt):
    """A blank (" " or "\n") inserted at every position of the family's calls: each variant the
    "required" grammar accepts parses into both calls, with arguments valid for their tools."""
    p = parser(fmt, tools=GRAMMAR_TOOLS)
    text = _written(fmt, CALLS)
    for i in range(len(text) + 1):
        for blank in (" ", "\n"):
            variant = text[:i] + blank + text[i:]
            if not _accepts(fmt, variant):
                continue
            msg = p.parse(variant)
            assert [c.name for c in msg.tool_calls] == [n for n, _ in CALLS], variant
            for c in msg.tool_calls:
                schema = next(t["function"]["parameters"] for t in GRAMMAR_TOOLS if t["function"]["name"] == c.name)
                jsonschema.validate(json.loads(c.arguments), schema)
