"""The tool-call parsers (server/tool_parsers/): each family's hand-written outputs parse to the
calls they hold; streaming gives the same final message at every split of the text (1-char deltas,
random chunks, every cut inside a marker: the splits that broke vLLM's parsers, vLLM #40861 and
#39056); and every string xgrammar's structural tag for the family accepts (the grammar that will
enforce tool_choice "required" / named) parses into calls whose arguments validate."""
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


# --- what xgrammar's structural tags allow (the grammars tool_choice "required" / named will apply) --------

def test_each_format_names_its_structural_tag():
    """(The integrator builds the grammar of tool_choice required / named from this name.)"""
    assert {f: TOOL_FORMATS[f].structural_tag for f in TOOL_FORMATS} == {
        "hermes": "qwen_3", "qwen3_coder": "qwen_3_5", "deepseek_v32": "deepseek_v3_2", "deepseek_v4": "deepseek_v4",
        "kimi_k2": "kimi"}


def _dsml(section, calls, lead="\n\n"):
    inner = "".join(f"<{DS}invoke name=\"{n}\">\n" + "".join(
        f"<{DS}parameter name=\"{k}\" string=\"{'true' if isinstance(v, str) else 'false'}\">"
        f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DS}parameter>\n" for k, v in a.items())
        + f"</{DS}invoke>\n" for n, a in calls)
    return f"{lead}<{DS}{section}>\n{inner}</{DS}{section}>"


CALLS = [("get_weather", {"city": "Zürich", "days": 2}), ("search", {"query": "a < b", "filters": {"k": [1]}})]
# per format: strings as the model writes them, and variants the grammar's whitespace rules also allow
GRAMMAR_STRINGS = {
    "hermes": [
        "".join(f"<tool_call>\n{{\"name\": \"{n}\", \"arguments\": {json.dumps(a, ensure_ascii=False)}}}\n</tool_call>"
                for n, a in CALLS),
        "Text first.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Zürich\",\n  \"days\" : 2}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"a < b\",\"filters\":{\"k\":[1]}}}"
        "\n</tool_call>"],
    "qwen3_coder": [
        "".join(f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>" for n, a in CALLS),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter><parameter=days> 2 </parameter>"
        "\n</function>\n</tool_call>\n\n<tool_call>\n<function=search>\n<parameter=query>\na < b\n</parameter>\n"
        "<parameter=filters>\n{\"k\": [1]}\n</parameter>\n</function>\n</tool_call>"],
    "deepseek_v32": [_dsml("function_calls", CALLS), _dsml("function_calls", CALLS, "")],
    "deepseek_v4": [_dsml("tool_calls", CALLS)],
    "kimi_k2": [
        "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a, ensure_ascii=False)}"
            "<|tool_call_end|>" for i, (n, a) in enumerate(CALLS)) + "<|tool_calls_section_end|>",
        "I will call.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:12<|tool_call_argument_begin|>"
        "{\"city\":\"Zürich\",\"days\":2}<|tool_call_end|><|tool_call_begin|>functions.search:13"
        "<|tool_call_argument_begin|>{ \"query\" : \"a < b\" , \"filters\" : {\"k\": [1]} }<|tool_call_end|>"
        "<|tool_calls_section_end|>"],
}
XG_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
        "required": ["query"]}}},
]


def _accepts(fmt: str, text: str, choice: str, reasoning: str) -> bool:
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string  # noqa: PLC0415
    tag = xgrammar.get_model_structural_tag(TOOL_FORMATS[fmt].structural_tag, tools=XG_TOOLS, tool_choice=choice,
                                            reasoning=reasoning)
    return _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(tag), text)


@pytest.mark.parametrize("fmt", sorted(GRAMMAR_STRINGS))
def test_what_the_structural_tag_accepts_parses(fmt):
    p = parser(fmt, tools=XG_TOOLS)
    for text in GRAMMAR_STRINGS[fmt]:
        # "required" writes the block first (DSML after "\n\n"); text before it needs "auto"
        choice = "required" if text.startswith("\n\n<" if fmt.startswith("deepseek") else "<") else "auto"
        assert _accepts(fmt, text, choice, "disabled"), text
        msg = p.parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == CALLS, text
        for c in msg.tool_calls:
            schema = next(t["function"]["parameters"] for t in XG_TOOLS if t["function"]["name"] == c.name)
            jsonschema.validate(json.loads(c.arguments), schema)
        # with reasoning on, the grammar starts inside the block the prompt opened
        thinking = "Reason < first.\n</think>" + ("\n\n" if fmt in ("hermes", "qwen3_coder") else "") + text
        assert _accepts(fmt, thinking, choice, "enabled"), thinking
        think_msg = p.parse(thinking, prompt="<think>\n")
        assert think_msg.reasoning == "Reason < first." and same(p.parse(text), think_msg.__class__(
            think_msg.content, think_msg.tool_calls, None))


@pytest.mark.parametrize("fmt", sorted(GRAMMAR_STRINGS))
def test_fixtures_are_what_the_structural_tag_accepts(fmt):
    """The hand-written fixtures are in the shape the family's grammar allows: the first with calls
    (and no reasoning) is accepted by its tag, with the fixtures' own tools."""
    case = next(c for c in CASES if c.format == fmt and c.calls and not c.reasoning)
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string  # noqa: PLC0415
    tag = xgrammar.get_model_structural_tag(TOOL_FORMATS[fmt].structural_tag, tools=TOOLS, tool_choice="auto",
                                            reasoning="disabled")
    assert _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(tag), case.text)


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


# the text that starts a block for the grammar (xgrammar's trigger): a blank inside it makes the block free
# text for the grammar, which is not what this test is about
TRIGGERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>\n<function=", "deepseek_v32": f"<{DS}function_calls>",
            "deepseek_v4": f"<{DS}tool_calls>", "kimi_k2": "<|tool_calls_section_begin|>"}


@pytest.mark.parametrize("fmt", sorted(GRAMMAR_STRINGS))
def test_every_blank_the_grammar_allows_still_parses(fmt):
    """A blank (" " or "\n") inserted at every position of a call string (outside the block's trigger):
    each variant the family's "required" grammar accepts (a matcher over a byte vocabulary) parses into
    both calls, with arguments valid for their tools."""
    xgrammar = pytest.importorskip("xgrammar")
    info = xgrammar.TokenizerInfo([bytes([i]) for i in range(256)], vocab_type=xgrammar.VocabType.RAW,
                                  stop_token_ids=[])
    tag = xgrammar.get_model_structural_tag(TOOL_FORMATS[fmt].structural_tag, tools=XG_TOOLS,
                                            tool_choice="required", reasoning="disabled")
    grammar = xgrammar.GrammarCompiler(info).compile_structural_tag(tag)
    p = parser(fmt, tools=XG_TOOLS)
    text, accepted = GRAMMAR_STRINGS[fmt][0], 0
    inside = set()
    at = text.find(TRIGGERS[fmt])
    while at >= 0:
        inside.update(range(at + 1, at + len(TRIGGERS[fmt])))
        at = text.find(TRIGGERS[fmt], at + 1)
    for i in sorted(set(range(len(text) + 1)) - inside):
        for blank in (" ", "\n"):
            variant = text[:i] + blank + text[i:]
            m = xgrammar.GrammarMatcher(grammar, terminate_without_stop_token=True)
            if not (m.accept_string(variant) and m.is_terminated()):
                continue
            accepted += 1
            msg = p.parse(variant)
            assert [c.name for c in msg.tool_calls] == [n for n, _ in CALLS], variant
            for c in msg.tool_calls:
                schema = next(t["function"]["parameters"] for t in XG_TOOLS if t["function"]["name"] == c.name)
                jsonschema.validate(json.loads(c.arguments), schema)
    assert accepted > 20          # (the matcher did accept variants: the check above ran)
