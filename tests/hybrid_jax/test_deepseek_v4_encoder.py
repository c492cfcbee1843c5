"""DeepSeek-V4's chat encoding (hybrid_jax/server/encoders/deepseek_v4.py) against the release's own four
examples (tests/data/deepseek_v4_encoding/, its README entry says where they come from), against prompts
written here by hand from the release's `encoding_dsv4.py` (a tools request, a tool call answered by a tool
message, thinking on and off, the reasoning effort), the server's DeepSeek-V4 tool-call parser on the calls
the encoder writes back, and the chat path of a tiny deepseek_v4 checkpoint without a chat template:
/tokenize and /v1/chat/completions render through the encoder."""
from __future__ import annotations

import copy
import json
import pathlib

import pytest

from hybrid_jax.errors import InputError
from hybrid_jax.server.encoders import ENCODERS, encoder_for
from hybrid_jax.server.encoders.deepseek_v4 import (ASSISTANT, BOS, EOS, USER, encode_messages, parse_completion,
                                                    tools_block)
from hybrid_jax.server.encoders.dsml import DsmlFormatError, ParsedToolCall
from dsml_fixtures import CALL, WEATHER, dsml_call

DATA = pathlib.Path(__file__).parent.parent / "data" / "deepseek_v4_encoding"
# (example, the mode the release's test renders it in)
EXAMPLES = [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")]


def _release_messages(n: int) -> list[dict]:
    """An example's messages as the release's test feeds them: its `tools` on the first message."""
    data = json.loads((DATA / f"test_input_{n}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data["messages"][0]["tools"] = data["tools"]
        return data["messages"]
    return data


def _golden(n: int) -> str:
    return (DATA / f"test_output_{n}.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("n,mode", EXAMPLES)
def test_the_release_examples_byte_for_byte(n, mode):
    assert encode_messages(_release_messages(n), thinking_mode=mode) == _golden(n)


def test_the_release_parses_its_tool_call_turn_and_final_turn_back():
    prompt = _golden(1)                          # as the release's own test reads it
    opening = f"{ASSISTANT}<think>"
    first = prompt.find(opening) + len(opening)
    turn = prompt[first:prompt.find(USER, first)]
    parsed = parse_completion(turn, "thinking")
    assert parsed.reasoning_content == ("The user wants to know the weather in Beijing. "
                                        "I should use the get_weather tool.")
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"location": "Beijing", "unit": "celsius"})]
    final = parse_completion(prompt[prompt.rfind(opening) + len(opening):], "thinking")
    assert final.reasoning_content == "Got the weather data. Let me format a nice response."
    assert "22°C" in final.content and final.tool_calls == ()


def test_without_tools_thinking_drops_the_earlier_reasoning():
    prompt = _golden(2)
    assert "The user said hello" not in prompt     # the release's example 2: the first reply's reasoning
    assert encode_messages(_release_messages(2), thinking_mode="thinking") == prompt


DSML_CALL = dsml_call("tool_calls")


def test_the_tools_section_is_the_releases():
    """tools_block of example 1's tools is the text the release puts between its system prompt and the
    first user turn; the tests below build their expected prompts with it."""
    data = json.loads((DATA / "test_input_1.json").read_text(encoding="utf-8"))
    golden = _golden(1)
    section = golden[len(BOS + "You are a helpful assistant.\n\n"):golden.index(USER)]
    assert tools_block(data["tools"]) == section
    assert section.startswith("## Tools\n") and "### Available Tool Schemas\n\n" in section


def test_request_tools_go_on_the_system_message_or_a_new_empty_one():
    user = {"role": "user", "content": "Weather?"}
    with_system = encode_messages([{"role": "system", "content": "Be brief."}, user], [WEATHER])
    assert with_system == f"{BOS}Be brief.\n\n{tools_block([WEATHER])}{USER}Weather?{ASSISTANT}</think>"
    without = encode_messages([user], [WEATHER], thinking_mode="thinking")
    assert without == f"{BOS}\n\n{tools_block([WEATHER])}{USER}Weather?{ASSISTANT}<think>"
    assert '{"name": "get_weather", "description": "Weather of a city", "parameters": ' in without


TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "reasoning_content": "need data", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_a_tool_call_and_its_result_with_tools_thinking_and_chat():
    head = f"{BOS}\n\n{tools_block([WEATHER])}{USER}Weather in Paris?{ASSISTANT}"
    # tools present: the reasoning is kept, the results are a user turn, the reply after them opens <think>
    assert encode_messages(TOOL_TURNS, [WEATHER], thinking_mode="thinking") == (
        f"{head}<think>need data</think>{DSML_CALL}{EOS}{USER}<tool_result>sunny</tool_result>{ASSISTANT}<think>")
    assert encode_messages(TOOL_TURNS, [WEATHER]) == (           # chat mode: no reasoning anywhere
        f"{head}</think>{DSML_CALL}{EOS}{USER}<tool_result>sunny</tool_result>{ASSISTANT}</think>")
    assert encode_messages(TOOL_TURNS, [WEATHER], add_generation_prompt=False).endswith(
        "<tool_result>sunny</tool_result>")


def test_without_tools_the_results_turn_is_the_last_user_turn():
    """The tool results being a user turn, thinking mode drops the reasoning of the call before them."""
    text = encode_messages(TOOL_TURNS, thinking_mode="thinking")
    assert text == (f"{BOS}{USER}Weather in Paris?{ASSISTANT}</think>{DSML_CALL}{EOS}"
                    f"{USER}<tool_result>sunny</tool_result>{ASSISTANT}<think>")


def test_results_in_call_order_and_a_user_message_after_them_in_the_same_turn():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"x": [1, True]}}}]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "user", "content": "and then?"}]
    text = encode_messages(msgs)
    assert text.endswith(f"{EOS}{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand then?"
                         f"{ASSISTANT}</think>")
    assert '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>' in text          # no arguments: an empty line
    assert '<｜DSML｜parameter name="x" string="false">[1, true]</｜DSML｜parameter>' in text


def test_generation_prompt_reasoning_in_thinking_mode_and_continue_final_message():
    msgs = [{"role": "user", "content": "Hello"}]
    assert encode_messages(msgs) == f"{BOS}{USER}Hello{ASSISTANT}</think>"
    assert encode_messages(msgs, thinking_mode="thinking") == f"{BOS}{USER}Hello{ASSISTANT}<think>"
    assert encode_messages(msgs, add_generation_prompt=False) == f"{BOS}{USER}Hello"
    answered = msgs + [{"role": "assistant", "content": "Hi"}]
    # V4 writes an empty reasoning where V3.2 refuses the message
    assert encode_messages(answered, thinking_mode="thinking") == f"{BOS}{USER}Hello{ASSISTANT}<think></think>Hi{EOS}"
    assert encode_messages(answered, continue_final_message=True) == f"{BOS}{USER}Hello{ASSISTANT}</think>Hi"


def test_a_developer_message_is_a_user_turn_with_its_content_first():
    msgs = [{"role": "developer", "content": "Find it.", "tools": [WEATHER]}]
    assert encode_messages(msgs, thinking_mode="thinking") == (
        f"{BOS}{USER}Find it.\n\n{tools_block([WEATHER])}{ASSISTANT}<think>")
    earlier = [{"role": "developer", "content": "D"}, {"role": "assistant", "content": "A"},
               {"role": "user", "content": "Q"}]
    # thinking mode without tools leaves out a developer message before the last user turn; chat mode keeps it
    assert encode_messages(earlier, thinking_mode="thinking") == f"{BOS}A{EOS}{USER}Q{ASSISTANT}<think>"
    assert encode_messages(earlier) == f"{BOS}{USER}D{ASSISTANT}</think>A{EOS}{USER}Q{ASSISTANT}</think>"


MAX_EFFORT_FIRST_LINE = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"


def test_reasoning_effort_max_opens_a_thinking_prompt_only():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    plain = encode_messages(msgs, thinking_mode="thinking")
    maxed = encode_messages(msgs, thinking_mode="thinking", reasoning_effort="max")
    assert maxed.startswith(BOS + MAX_EFFORT_FIRST_LINE) and maxed.endswith("\n\nS" + plain[len(BOS + "S"):])
    assert encode_messages(msgs, thinking_mode="thinking", reasoning_effort="high") == plain
    assert encode_messages(msgs, reasoning_effort="max") == encode_messages(msgs)
    with pytest.raises(InputError, match="reasoning_effort"):
        encode_messages(msgs, reasoning_effort="medium")


@pytest.mark.parametrize("msgs,match", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], r"'messages'\[1\].*must be a JSON object"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], "not valid JSON"),
    ([{"role": "narrator", "content": "q"}], r"'messages'\[0\].role must be one of"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": 3}], r"'messages'\[1\].content must be a string"),
    ([{"role": "developer", "content": ""}], r"'messages'\[0\]: a developer message needs content"),
    ([{"role": "user", "content": "q", "task": "dance"}], r"'messages'\[0\].task must be one of"),
])
def test_malformed_conversations_are_input_errors(msgs, match):
    with pytest.raises(InputError, match=match):
        encode_messages(msgs, thinking_mode="thinking")
    with pytest.raises(InputError, match=match):      # named as the caller numbers them, tools or not
        encode_messages(msgs, [WEATHER], thinking_mode="thinking")


@pytest.mark.parametrize("text,match", [
    ("no end of thinking", "no </think>"),
    (f"t</think>{DSML_CALL}trailing", "unexpected text after"),
    (f"t</think>{DSML_CALL.replace('tool_calls', 'function_calls')}{EOS}", "special token"),   # V3.2's block
])
def test_parse_completion_refuses_malformed_text(text, match):
    with pytest.raises(DsmlFormatError, match=match):
        parse_completion(text, "thinking")


# the calls of an assistant turn, each kind of argument: a string with a newline and non-ASCII, numbers,
# booleans, null, a list, an object
CALLS = [("get_weather", {"city": "Zürich", "days": 2}),
         ("search", {"query": "a\nb <c>", "strict": True, "limit": 1.5, "tags": ["x", 1], "opts": {"k": None}})]
PARSER_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in CALLS]


@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_the_servers_parser_reads_the_calls_the_encoder_writes_back(mode):
    from hybrid_jax.server.tool_parsers import (REASONING_FORMATS, TOOL_FORMATS,  # noqa: PLC0415
                                                MessageParser, schemas_of)
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, (n, a) in enumerate(CALLS)]
    msgs = [{"role": "user", "content": "weather and news?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "two tools", "tool_calls": calls}]
    prompt = encode_messages(msgs[:1], PARSER_TOOLS, thinking_mode=mode)
    whole = encode_messages(msgs, PARSER_TOOLS, thinking_mode=mode)
    assert whole.startswith(prompt) and whole.endswith(EOS)
    completion = whole[len(prompt):-len(EOS)]           # what the model writes after the prompt
    fmt = TOOL_FORMATS["deepseek_v4"]
    assert fmt.begin in completion
    msg = MessageParser(fmt, REASONING_FORMATS["deepseek_v4"], schemas_of(PARSER_TOOLS)).parse(completion, prompt)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == CALLS
    assert msg.content == "Checking."
    assert msg.reasoning == ("two tools" if mode == "thinking" else None)
    own = parse_completion(completion, mode)           # and the release's own reading of it
    assert [ParsedToolCall(c.name, c.arguments) for c in own.tool_calls] == list(own.tool_calls)
    assert [(c.name, json.loads(c.arguments)) for c in own.tool_calls] == CALLS


def test_the_registry_names_the_family():
    assert encoder_for("deepseek_v4") is ENCODERS["deepseek_v4"]
    assert encoder_for("deepseek_v32") is not encoder_for("deepseek_v4")


# --- the chat path of a deepseek_v4 checkpoint without a chat template --------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from in_process import serving  # noqa: PLC0415
    from test_deepseek_v4 import make_checkpoint  # noqa: PLC0415
    from test_deepseek_v32_encoder import _byte_level_tokenizer  # noqa: PLC0415

    from hybrid_jax import LLM  # noqa: PLC0415
    from hybrid_jax.engine import EngineConfig  # noqa: PLC0415
    from hybrid_jax.server.app import ServerConfig  # noqa: PLC0415

    path = pathlib.Path(make_checkpoint(tmp_path_factory.mktemp("dsv4_chat") / "ckpt", vocab_size=272,
                                        max_position_embeddings=4096))
    _byte_level_tokenizer(path)                   # V3.2's specials are V4's (the DSML token included)
    llm = LLM(model=str(path), dtype="float32")
    with serving(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=4096,
                                   compilation_cache_dir=None, warmup="none"), ServerConfig(model_name="tiny-dsv4")) as s:
        yield s[0], llm


def test_the_checkpoint_has_no_template_and_tools_render_through_the_encoder(server):
    c, llm = server
    templates = llm.tokenizer.chat_templates
    assert templates.templates == {} and templates.model_type == "deepseek_v4"
    r = c.post("/tokenize", json={"messages": [{"role": "system", "content": "You are terse."}, *TOOL_TURNS],
                                  "tools": [WEATHER], "chat_template_kwargs": {"thinking": True}})
    assert r.status_code == 200, r.text
    want = (f"{BOS}You are terse.\n\n{tools_block([WEATHER])}{USER}Weather in Paris?{ASSISTANT}<think>need data"
            f"</think>{DSML_CALL}{EOS}{USER}<tool_result>sunny</tool_result>{ASSISTANT}<think>")
    tokens = r.json()["tokens"]
    assert tokens == llm.tokenizer.encode(want)
    ids = {s: llm.tokenizer._tok.token_to_id(s) for s in (BOS, EOS, USER, "｜DSML｜")}
    assert tokens[0] == ids[BOS] and tokens.count(ids[USER]) == 2 and tokens.count(ids[EOS]) == 1
    turn = tokens[tokens.index(ids[USER]):]        # the assistant's call: tool_calls, invoke, 2 parameters,
    assert turn.count(ids["｜DSML｜"]) == 8           # each opened and closed


def test_thinking_switches_and_reasoning_effort_of_a_request(server):
    c, llm = server
    body = {"messages": [{"role": "user", "content": "Hi"}]}

    def tokens(**kwargs):
        r = c.post("/tokenize", json={**body, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    assert tokens() == llm.tokenizer.encode(f"{BOS}{USER}Hi{ASSISTANT}</think>")
    assert tokens(enable_thinking=True) == llm.tokenizer.encode(f"{BOS}{USER}Hi{ASSISTANT}<think>")
    maxed = llm.tokenizer._tok.decode(tokens(thinking=True, reasoning_effort="max"), skip_special_tokens=False)
    assert maxed.startswith(BOS + MAX_EFFORT_FIRST_LINE) and maxed.endswith(f"{USER}Hi{ASSISTANT}<think>")
    assert tokens(thinking=True, reasoning_effort="low") == tokens(thinking=True)
    bad = c.post("/tokenize", json={**body, "chat_template_kwargs": {"reasoning_effort": "extreme"}})
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]


def test_chat_completions_renders_with_the_encoder(server, monkeypatch):
    c, llm = server
    tok, seen = llm.tokenizer, []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: seen.append(text) or encode(text, *a, **k))
    msgs = copy.deepcopy(TOOL_TURNS)
    r = c.post("/v1/chat/completions", json={"messages": msgs, "tools": [WEATHER], "max_tokens": 2,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert seen[0] == (f"{BOS}\n\n{tools_block([WEATHER])}{USER}Weather in Paris?{ASSISTANT}</think>{DSML_CALL}"
                       f"{EOS}{USER}<tool_result>sunny</tool_result>{ASSISTANT}</think>")
    assert r.json()["usage"]["completion_tokens"] == 2
