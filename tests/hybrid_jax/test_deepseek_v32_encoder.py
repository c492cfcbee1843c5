"""DeepSeek-V3.2's chat encoding (hybrid_jax/server/encoders/deepseek_v32.py) against the release's own
examples (tests/data/deepseek_v32_encoding/, README there says where they come from), its output parser
on completions written by hand in the release's format, and the chat path of a tiny deepseek_v32
checkpoint that has no chat template: /v1/chat/completions and /tokenize render through the encoder."""
from __future__ import annotations

import copy
import json
import pathlib

import pytest

from hybrid_jax.errors import InputError
from hybrid_jax.server.encoders import ENCODERS, encoder_for
from hybrid_jax.server.encoders.deepseek_v32 import (ASSISTANT, BOS, EOS, USER, DsmlFormatError, ParsedToolCall,
                                                     encode_messages, parse_completion, tools_block)
from dsml_fixtures import CALL, WEATHER, dsml_call

DATA = pathlib.Path(__file__).parent.parent / "data" / "deepseek_v32_encoding"
EXAMPLES = [("test_input.json", "test_output.txt"), ("variant_en/test_input.json", "variant_en/test_output.txt"),
            ("test_input_search_w_date.json", "test_output_search_w_date.txt"),
            ("test_input_search_wo_date.json", "test_output_search_wo_date.txt")]


def _release_messages(name: str) -> list[dict]:
    """An example's messages as the release's test feeds them: its `tools` on the first message."""
    data = json.loads((DATA / name).read_text(encoding="utf-8"))
    messages = data["messages"]
    if "tools" in data:
        messages[0]["tools"] = data["tools"]
    return messages


def _golden(name: str) -> str:
    text = (DATA / name).read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text        # the file's final newline is not the prompt's


@pytest.mark.parametrize("inp,out", EXAMPLES)
def test_the_release_examples_byte_for_byte(inp, out):
    assert encode_messages(_release_messages(inp), thinking_mode="thinking") == _golden(out)


@pytest.mark.parametrize("inp", ["test_input.json", "variant_en/test_input.json"])
def test_the_release_round_trips_a_tool_call_turn_and_a_thinking_turn(inp):
    messages = _release_messages(inp)           # as the release's own test does, with its indices
    call_turn = messages[4]
    text = encode_messages([call_turn], context=messages[:4], thinking_mode="thinking")
    parsed = parse_completion(text, "thinking").as_message()
    want = copy.deepcopy(call_turn)
    for call in want["tool_calls"]:
        call.pop("id")
    parsed.pop("content")
    assert parsed == want

    thinking_turn = messages[-6]
    text = encode_messages([thinking_turn], context=messages[:-6], thinking_mode="thinking")
    parsed = parse_completion(text, "thinking").as_message()
    parsed.pop("tool_calls")
    assert parsed == thinking_turn


DSML_CALL = dsml_call("function_calls")


def test_generation_prompt_chat_and_thinking():
    msgs = [{"role": "user", "content": "Hello"}]
    assert encode_messages(msgs) == f"{BOS}{USER}Hello{ASSISTANT}</think>"
    assert encode_messages(msgs, thinking_mode="thinking") == f"{BOS}{USER}Hello{ASSISTANT}<think>"
    assert encode_messages(msgs, add_generation_prompt=False) == f"{BOS}{USER}Hello"


def test_request_tools_go_on_the_system_message_or_a_new_empty_one():
    user = {"role": "user", "content": "Weather?"}
    with_system = encode_messages([{"role": "system", "content": "Be brief."}, user], [WEATHER])
    assert with_system == f"{BOS}Be brief.\n\n{tools_block([WEATHER])}{USER}Weather?{ASSISTANT}</think>"
    without = encode_messages([user], [WEATHER])
    assert without == f"{BOS}\n\n{tools_block([WEATHER])}{USER}Weather?{ASSISTANT}</think>"
    assert '{"name": "get_weather", "description": "Weather of a city", "parameters": ' in without


def test_a_tool_turn_and_earlier_reasoning():
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "reasoning_content": "old thoughts", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "reasoning_content": "need data", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = encode_messages(msgs, thinking_mode="thinking")
    assert text == (f"{BOS}{USER}Q1{ASSISTANT}</think>A1{EOS}{USER}Q2{ASSISTANT}<think>need data</think>"
                    f"{DSML_CALL}{EOS}\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>")
    chat = encode_messages(msgs)            # chat mode: no reasoning anywhere, the next turn opens with </think>
    assert "thoughts" not in chat and "need data" not in chat and chat.endswith("</function_results>\n\n</think>")
    assert encode_messages(msgs, add_generation_prompt=False).endswith("</function_results>")


def test_continue_final_message_leaves_the_turn_open():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}]
    assert encode_messages(msgs, continue_final_message=True) == f"{BOS}{USER}Q{ASSISTANT}</think>The answer is"


@pytest.mark.parametrize("msgs,match", [
    ([{"role": "tool", "tool_call_id": "x", "content": "r"}, {"role": "user", "content": "q"}], r"'messages'\[0\]"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}], r"'messages'\[3\].*more tool results"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "must be a JSON object"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "just text"}],
     "reasoning_content or tool_calls"),
    ([{"role": "narrator", "content": "q"}], "role must be one of"),
    ([{"role": "user", "content": [{"type": "text", "text": "q"}]}], r"'messages'\[0\].content must be a string"),
])
def test_malformed_conversations_are_input_errors(msgs, match):
    with pytest.raises(InputError, match=match):
        encode_messages(msgs, thinking_mode="thinking")
    with pytest.raises(InputError, match=match):      # named as the caller numbers them, tools or not
        encode_messages(msgs, [WEATHER], thinking_mode="thinking")


def test_parse_completion_of_hand_written_outputs():
    out = parse_completion(f"Let me look it up.</think>{DSML_CALL}{EOS}", "thinking")
    assert out.reasoning_content == "Let me look it up." and out.content == ""
    assert out.tool_calls == (ParsedToolCall("get_weather", '{"city": "Paris", "days": 2}'),)
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Paris", "days": 2}
    out = parse_completion("Bonjour!" + EOS)                        # chat mode: no reasoning
    assert (out.content, out.reasoning_content, out.tool_calls) == ("Bonjour!", "", ())
    assert parse_completion("Bonjour!").content == "Bonjour!"        # the server strips the stop token


@pytest.mark.parametrize("text,match", [
    ("no end of thinking", "no </think>"),
    (f"t</think>{DSML_CALL}trailing", "unexpected text after"),
    ('t</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
     '<｜DSML｜parameter name="a" string="true">1</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
     "twice"),
    ("t</think>a <think> b" + EOS, "special token"),
])
def test_parse_completion_refuses_malformed_text(text, match):
    with pytest.raises(DsmlFormatError, match=match):
        parse_completion(text, "thinking")


def test_the_registry_names_the_family():
    assert encoder_for("deepseek_v32") is ENCODERS["deepseek_v32"]
    assert encoder_for("qwen3_next") is None and encoder_for(None) is None


# --- the chat path of a deepseek_v32 checkpoint without a chat template -------------------------------

SPECIALS = [BOS, EOS, USER, ASSISTANT, "<think>", "</think>", "｜DSML｜"]


def _byte_level_tokenizer(path: pathlib.Path):
    """A byte-level BPE without merges (one token a byte) with DeepSeek-V3.2's special tokens added whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return tok


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from in_process import serving  # noqa: PLC0415
    from test_deepseek_v32 import make_checkpoint  # noqa: PLC0415

    from hybrid_jax import LLM  # noqa: PLC0415
    from hybrid_jax.engine import EngineConfig  # noqa: PLC0415
    from hybrid_jax.server.app import ServerConfig  # noqa: PLC0415
    from hybrid_jax.template_sources import ChatOptions, apply_chat_options  # noqa: PLC0415

    path = pathlib.Path(make_checkpoint(tmp_path_factory.mktemp("dsv32_chat") / "ckpt", vocab_size=272,
                                        max_position_embeddings=4096))
    _byte_level_tokenizer(path)
    llm = LLM(model=str(path), dtype="float32")
    apply_chat_options(llm.tokenizer, ChatOptions(trust_request_templates=True))
    with serving(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=4096,
                                   compilation_cache_dir=None, warmup="none"), ServerConfig(model_name="tiny-dsv32")) as s:
        yield s[0], llm


TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "need data", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_the_checkpoint_has_no_template_and_its_family_an_encoder(server):
    _, llm = server
    templates = llm.tokenizer.chat_templates
    assert templates.templates == {} and templates.model_type == "deepseek_v32"


def test_tools_and_a_tool_turn_render_through_the_encoder(server):
    c, llm = server
    r = c.post("/tokenize", json={"messages": TOOL_CONVERSATION, "tools": [WEATHER],
                                  "chat_template_kwargs": {"thinking": True}})
    assert r.status_code == 200, r.text
    want = (f"{BOS}You are terse.\n\n{tools_block([WEATHER])}{USER}Weather in Paris?{ASSISTANT}<think>"
            f"need data</think>{DSML_CALL}{EOS}\n\n<function_results>\n<result>sunny</result>\n</function_results>"
            "\n\n<think>")
    tokens = r.json()["tokens"]
    assert tokens == llm.tokenizer.encode(want)
    ids = {s: llm.tokenizer._tok.token_to_id(s) for s in SPECIALS}
    assert tokens[0] == ids[BOS] and tokens.count(ids[USER]) == 1 and tokens.count(ids[EOS]) == 1
    turn = tokens[tokens.index(ids[USER]):]        # the assistant's call: function_calls, invoke, 2 parameters,
    assert turn.count(ids["｜DSML｜"]) == 8           # each opened and closed


def test_enable_thinking_is_accepted_and_chat_mode_is_the_default(server):
    c, llm = server
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    default = c.post("/tokenize", json=body).json()["tokens"]
    assert default == llm.tokenizer.encode(f"{BOS}{USER}Hi{ASSISTANT}</think>")
    on = c.post("/tokenize", json={**body, "chat_template_kwargs": {"enable_thinking": True}}).json()["tokens"]
    assert on == llm.tokenizer.encode(f"{BOS}{USER}Hi{ASSISTANT}<think>")
    bad = c.post("/tokenize", json={**body, "chat_template_kwargs": {"thinking": "yes"}})
    assert bad.status_code == 400 and "thinking" in bad.json()["error"]["message"]


def test_chat_completions_renders_with_the_encoder_and_a_request_template_still_wins(server, monkeypatch):
    c, llm = server
    tok, seen = llm.tokenizer, []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: seen.append(text) or encode(text, *a, **k))
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert seen[0] == f"{BOS}{USER}Hi{ASSISTANT}</think>"
    assert r.json()["usage"]["completion_tokens"] == 2
    seen.clear()
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                             "chat_template": "OWN {{ messages[0].content }}"})
    assert r.status_code == 200, r.text
    assert seen[0] == "OWN Hi"


def test_a_malformed_conversation_is_a_400_naming_the_message(server):
    c, _ = server
    r = c.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "a"},
        {"role": "tool", "tool_call_id": "c2", "content": "b"}]})
    assert r.status_code == 400
    assert "'messages'[3]" in r.json()["error"]["message"]


def test_a_template_of_any_source_comes_before_the_encoder():
    from types import MappingProxyType, SimpleNamespace  # noqa: PLC0415

    from hybrid_jax.server.chat_template import render_request  # noqa: PLC0415
    from hybrid_jax.template_sources import ChatTemplates  # noqa: PLC0415
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    bare = ChatTemplates(model_type="deepseek_v32")
    assert render_request(SimpleNamespace(chat_templates=bare), body) == f"{BOS}{USER}Hi{ASSISTANT}</think>"
    shipped = ChatTemplates(MappingProxyType({"default": "T {{ messages[0].content }}"}), "chat_template.jinja",
                            model_type="deepseek_v32")
    assert render_request(SimpleNamespace(chat_templates=shipped), body) == "T Hi"
    option = bare.overridden("O {{ messages[0].content }}", "--chat-template")
    assert render_request(SimpleNamespace(chat_templates=option), body) == "O Hi"
    other = ChatTemplates(model_type="qwen3_next")          # no template, no encoder: the 400 that says so
    with pytest.raises(InputError, match="no chat template"):
        render_request(SimpleNamespace(chat_templates=other), body)
