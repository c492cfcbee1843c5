"""Chat templates without an engine: every served family's released template (tests/data/chat_templates)
renders a request as transformers' apply_chat_template renders the conversation vLLM hands it; where
templates come from (chat_template.jinja, tokenizer_config.json, --chat-template); requests refused
with a message that says why."""
from __future__ import annotations

import copy
import json
import pathlib

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from hybrid_jax.errors import ConfigError, InputError
from hybrid_jax.server.chat_messages import parse_conversation
from hybrid_jax.server.chat_template import render, render_request
from hybrid_jax.template_sources import (ChatOptions, ChatTemplates, apply_chat_options, load_chat_templates,
                                         read_template_arg)
from hybrid_jax.tokenizer import HFTokenizer

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "chat_templates"
FAMILIES = sorted(p.stem for p in DATA.glob("*.jinja"))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


def _hf(template: str) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL.values())}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   chat_template=template, **SPECIAL)


def _as_vllm_passes_it(messages: list[dict]) -> list[dict]:
    """What vLLM gives apply_chat_template: text parts joined with "\\n", null content "", arguments parsed."""
    out = copy.deepcopy(messages)
    for m in out:
        c = m.get("content")
        m["content"] = "" if c is None else c if isinstance(c, str) else "\n".join(p["text"] for p in c)
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


CASES = {
    "plain turns": dict(messages=[{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                                  {"role": "user", "content": "How are you?"}]),
    "system": dict(messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]),
    "content parts": dict(messages=[{"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
                                    {"role": "user", "content": [{"type": "text", "text": "first"},
                                                                 {"type": "text", "text": "second"}]}]),
    "tools and results": dict(messages=[{"role": "system", "content": "Use tools."},
                                        {"role": "user", "content": "Weather in Rome?"},
                                        {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
                                        {"role": "user", "content": "Thanks. And tomorrow?"}], tools=[WEATHER]),
    "no generation prompt": dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                                 add_generation_prompt=False),
    "continue final message": dict(messages=[{"role": "user", "content": "Count to three"},
                                             {"role": "assistant", "content": "One, two,"}],
                                   add_generation_prompt=False, continue_final_message=True),
    "template kwargs": dict(messages=[{"role": "user", "content": "Quick question"}],
                            chat_template_kwargs={"enable_thinking": False}),
    "two tool calls": dict(messages=[{"role": "user", "content": "Rome and Oslo?"},
                                     {"role": "assistant", "content": "Checking.",
                                      "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {
                                          "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                                     {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                                     {"role": "tool", "tool_call_id": "call_2", "content": "4 C"}], tools=[WEATHER]),
}


def _transformers(template: str, body: dict):
    """apply_chat_template's text for the conversation vLLM would pass it, or the error it raises."""
    kwargs = dict(body.get("chat_template_kwargs", {}))
    try:
        return _hf(template).apply_chat_template(
            _as_vllm_passes_it(body["messages"]), tools=body.get("tools"), tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False), **kwargs)
    except Exception as e:  # noqa: BLE001  (a template's raise_exception is a jinja TemplateError)
        return e


def _ours(template: str, body: dict):
    templates = ChatTemplates({"default": template}, "test", SPECIAL, trust_request_templates=True)
    try:
        return render(templates, parse_conversation(copy.deepcopy(body)))
    except InputError as e:
        return e


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_released_templates_render_like_transformers(family, case):
    template = (DATA / f"{family}.jinja").read_text(encoding="utf-8")
    want, got = _transformers(template, CASES[case]), _ours(template, CASES[case])
    if isinstance(want, Exception):        # the template refuses this conversation: so do we, with its words
        assert isinstance(got, InputError), (family, case, got)
        assert str(want).split("\n")[0][:60] in str(got), (want, got)
    else:
        assert got == want, (family, case)


def test_the_families_are_all_there():
    assert {"qwen3_next_instruct", "qwen3_next_thinking", "qwen3_5", "kimi_k2_instruct",
            "llama3_1_instruct"} <= set(FAMILIES)


def test_thinking_off_on_qwen3_5():
    template = (DATA / "qwen3_5.jinja").read_text(encoding="utf-8")
    body = dict(messages=[{"role": "user", "content": "Hi"}])
    on = _ours(template, body)
    off = _ours(template, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_template_raise_is_an_input_error_naming_its_message():
    template = (DATA / "llama3_1_instruct.jinja").read_text(encoding="utf-8")
    with pytest.raises(InputError, match="only supports single tool-calls at once"):
        render(ChatTemplates({"default": template}, "t", SPECIAL), parse_conversation(CASES["two tool calls"]))
    with pytest.raises(InputError, match="Unexpected message role"):      # Qwen3.5 has no developer role
        render(ChatTemplates({"default": (DATA / "qwen3_5.jinja").read_text()}, "t", SPECIAL),
               parse_conversation({"messages": [{"role": "developer", "content": "x"},
                                                {"role": "user", "content": "y"}]}))


def test_globals_and_filters_as_transformers_gives_them():
    t = ("{{ bos_token }}|{{ strftime_now('%Y') | length }}|{{ {'a': 'é<'} | tojson }}|"
         "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
         "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ dict(x=1) | tojson }}|"
         "{% generation %}{{ messages[0].content }}{% endgeneration %}")
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    assert _ours(t, body) == _transformers(t, body) == '<s>|4|{"a": "é<"}|1|{"x": 1}|a'


def _checkpoint(tmp_path, config: dict, jinja: str | None = None) -> pathlib.Path:
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hi": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_chat_template_jinja_comes_before_tokenizer_config(tmp_path):
    d = _checkpoint(tmp_path, {"chat_template": "CONFIG", "bos_token": {"content": "<s>", "lstrip": False},
                               "eos_token": "</s>"}, jinja="JINJA {{ bos_token }}{{ eos_token }}")
    tok = HFTokenizer(str(d))
    assert tok.chat_templates.source == "chat_template.jinja"
    assert render_request(tok, {"messages": [{"role": "user", "content": "hi"}]}) == "JINJA <s></s>"
    (d / "chat_template.jinja").unlink()
    tok = HFTokenizer(str(d))
    assert tok.chat_templates.source == "tokenizer_config.json"
    assert render_request(tok, {"messages": [{"role": "user", "content": "hi"}]}) == "CONFIG"


def test_named_templates_pick_default_or_tool_use_as_transformers_does(tmp_path):
    named = [{"name": "default", "template": "PLAIN"}, {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
             {"name": "rag", "template": "RAG {{ documents[0].title }}"}]
    tok = HFTokenizer(str(_checkpoint(tmp_path, {"chat_template": named})))
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InputError, match="--trust-request-chat-template"):     # a template's text: not by default
        render_request(tok, {"messages": msgs, "chat_template": "OWN {{ messages[0].content }}"})
    apply_chat_options(tok, ChatOptions(trust_request_templates=True))
    assert render_request(tok, {"messages": msgs}) == "PLAIN"
    assert render_request(tok, {"messages": msgs, "tools": [WEATHER]}) == "TOOLS 1"
    assert render_request(tok, {"messages": msgs, "chat_template": "rag",
                                "documents": [{"title": "T", "text": "x"}]}) == "RAG T"
    assert render_request(tok, {"messages": msgs, "chat_template": "OWN {{ messages[0].content }}"}) == "OWN hi"
    hf = _hf("unused")
    hf.chat_template = {t["name"]: t["template"] for t in named}
    assert hf.apply_chat_template(msgs, tools=[WEATHER], tokenize=False) == "TOOLS 1"


def test_chat_template_option_reads_a_file_or_the_text_itself(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("FILE {{ messages | length }}")
    assert read_template_arg(str(f)) == "FILE {{ messages | length }}"
    assert read_template_arg("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ConfigError, match="looks like a file path"):
        read_template_arg(str(tmp_path / "missing.jinja"))
    tok = HFTokenizer(str(_checkpoint(tmp_path, {"chat_template": "CONFIG"})))
    apply_chat_options(tok, ChatOptions(read_template_arg(str(f))))
    assert tok.chat_templates.source == "--chat-template"
    assert render_request(tok, {"messages": [{"role": "user", "content": "hi"}]}) == "FILE 1"


def test_load_reads_special_tokens_and_no_template(tmp_path):
    t = load_chat_templates(str(_checkpoint(tmp_path, {"unk_token": "<unk>", "pad_token": None})))
    assert dict(t.special_tokens) == {"unk_token": "<unk>"} and t.source == "none"
    with pytest.raises(InputError, match="no chat template"):
        t.select(None, False)


def test_an_unusable_template_fails_chat_not_loading(tmp_path):
    tok = HFTokenizer(str(_checkpoint(tmp_path, {"chat_template": {"odd": 1}})))      # (loads: completions work)
    with pytest.raises(InputError, match="cannot be used.*must be a string or a list"):
        render_request(tok, {"messages": [{"role": "user", "content": "hi"}]})
    apply_chat_options(tok, ChatOptions(trust_request_templates=True))
    assert render_request(tok, {"messages": [{"role": "user", "content": "hi"}], "chat_template": "OWN"}) == "OWN"
    apply_chat_options(tok, ChatOptions("OPTION"))
    assert render_request(tok, {"messages": [{"role": "user", "content": "hi"}]}) == "OPTION"


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["'messages'[0].content[0]", "'image_url'", "text only"]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
     ["content[1]", "'input_audio'"]),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "file"}]}]},
     ["'messages'[1]", "'file'"]),
    ({"messages": [{"role": "robot", "content": "a"}]}, ["'messages'[0].role"]),
    ({"messages": [{"role": "user", "content": None}]}, ["'messages'[0].content is required"]),
    ({"messages": [{"role": "user", "content": 5}]}, ["'messages'[0].content must be"]),
    ({"messages": [{"role": "tool", "content": "x"}]}, ["'messages'[0].tool_call_id"]),
    ({"messages": [{"role": "user", "content": "a", "colour": "red"}]}, ["unknown field", "'colour'"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     ["'messages'[0].tool_calls[0].function.arguments is not valid JSON"]),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, ["'tool_choice'", "needs 'tools'"]),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, ["'tool_choice' names the function 'f'"]),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "maybe"}, ["'tool_choice' must be"]),
    ({"messages": [{"role": "assistant", "content": "a"}], "continue_final_message": True},
     ["'continue_final_message'", "add_generation_prompt"]),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": []}},
     ["'chat_template_kwargs'", "messages"]),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, ["'tools'[0]"]),
])
def test_malformed_requests_say_what_is_wrong(body, words):
    with pytest.raises(InputError) as e:
        parse_conversation(body)
    for w in words:
        assert w in str(e.value)


def test_messages_as_the_template_sees_them():
    conv = parse_conversation({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None, "audio": None,
         "reasoning_content": "think"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]}],
        "tool_choice": "none"})
    user, assistant, tool = conv.messages
    assert user == {"role": "user", "content": "a\nb", "name": "ann"}
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert assistant["reasoning_content"] == assistant["thinking"] == "think" and "refusal" not in assistant
    assert tool == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
