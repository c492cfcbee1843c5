"""/v1/chat/completions with tools and reasoning, end to end through the app: the request's prompt is
rendered with the family's released template, the output is parsed by the family's format, and the
response carries `message.tool_calls` / `reasoning_content` (streamed: OpenAI's tool_calls deltas),
the same streamed or not. The engine is scripted (it answers each prompt with a fixture of the family's
real output, cut into the pieces a detokenizer hands on), since a model's own output cannot be
chosen; everything from the HTTP body to the response is the server's own."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import MappingProxyType

import pytest
from fastapi.testclient import TestClient

from hybrid_jax.engine.request import EngineOutput
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.template_sources import ChatTemplates
from tool_call_fixtures import CASES, TOOLS

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


class ScriptedTokenizer:
    """One id per character; the chat templates of a family."""

    def __init__(self, template: str):
        self.chat_templates = ChatTemplates(MappingProxyType({"default": template}), "test",
                                            MappingProxyType({"eos_token": "<|im_end|>"}))
        self.eos_token_id = None

    def encode(self, text, add_bos=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class ScriptedEngine:
    """The engine surface the server uses, answering with `self.output` in pieces of `self.chunk`
    characters; records the prompts and params it was given."""

    def __init__(self, template: str):
        self.tokenizer = ScriptedTokenizer(template)
        self.output, self.chunk, self.finish = "", 3, "stop"
        self.prompts: list[str] = []
        self.params = []

    def model_card(self):
        return {"max_model_len": 1 << 16, "vocab_size": 1 << 21, "max_num_seqs": 8}

    def unavailable(self):
        return None

    def validate(self, prompt, params):
        if isinstance(prompt, dict):
            return prompt["prompt_token_ids"]
        return self.tokenizer.encode(prompt)

    async def generate(self, request_id, prompt, params, arrival=None):
        self.prompts.append(self.tokenizer.decode(prompt["prompt_token_ids"]))
        self.params.append(params)
        text, ids = self.output, []
        pieces = [text[i:i + self.chunk] for i in range(0, len(text), self.chunk)] or [""]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            new = [ord(c) for c in piece]
            ids += new
            await asyncio.sleep(0)
            yield EngineOutput(request_id, new, piece, list(ids), text[:len(ids)], last,
                               self.finish if last else None, prompt["prompt_token_ids"], [])


def _client(template: str, model_type: str, **cfg):
    state = ServerState(ServerConfig(model_name="m", model_type=model_type, **cfg))
    eng = ScriptedEngine(template)
    state.engine = eng
    return TestClient(build_app(state)), eng


@pytest.fixture(scope="module")
def qwen35():
    with_client, eng = _client((TEMPLATES / "qwen3_5.jinja").read_text(), "qwen3_5")
    with with_client as c:
        yield c, eng


def _post(c, body):
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "weather?"}], **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(c, body):
    with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "weather?"}],
                                                         "stream": True, **body}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and "[DONE]" not in line]


def _accumulate(chunks) -> tuple[dict, str | None]:
    """What an OpenAI client makes of the chunks: the message, and the finish_reason."""
    msg = {"content": None, "reasoning_content": None, "tool_calls": {}}
    finish = None
    for ch in chunks:
        (choice,) = ch["choices"]
        d = choice["delta"]
        for key in ("content", "reasoning_content"):
            if d.get(key) is not None:
                msg[key] = (msg[key] or "") + d[key]
        for tc in d.get("tool_calls", []):
            slot = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert slot["id"] is None and tc["type"] == "function" and tc["function"]["arguments"] == ""
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
            slot["arguments"] += tc["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return msg, finish


THINK_CODER = next(c for c in CASES if c.name == "coder_thinking_text_two")


@pytest.mark.parametrize("chunk", [1, 3, 17])
def test_qwen35_tool_calls_and_reasoning_streamed_and_whole_agree(qwen35, chunk):
    c, eng = qwen35
    eng.output, eng.chunk = THINK_CODER.text, chunk
    body = _post(c, {"tools": TOOLS})
    assert eng.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")     # the template opened the block
    (choice,) = body["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["content"] == THINK_CODER.content
    assert msg["reasoning_content"] == msg["reasoning"] == THINK_CODER.reasoning
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] == \
        THINK_CODER.calls
    assert all(t["type"] == "function" and t["id"].startswith("call_") for t in msg["tool_calls"])
    chunks = _stream(c, {"tools": TOOLS})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed, finish = _accumulate(chunks)
    assert finish == "tool_calls"
    assert streamed["content"] == msg["content"] and streamed["reasoning_content"] == msg["reasoning_content"]
    assert [(t["name"], t["arguments"]) for t in streamed["tool_calls"].values()] == \
        [(t["function"]["name"], t["function"]["arguments"]) for t in msg["tool_calls"]]
    assert "<tool_call>" not in (streamed["content"] or "") and "<" not in streamed["content"]


def test_tool_choice_none_leaves_the_text(qwen35):
    c, eng = qwen35
    eng.output = THINK_CODER.text
    msg = _post(c, {"tools": TOOLS, "tool_choice": "none"})["choices"][0]["message"]
    assert "tool_calls" not in msg and "<tool_call>\n<function=search>" in msg["content"]
    assert msg["reasoning_content"] == THINK_CODER.reasoning        # reasoning is still split


def test_parallel_tool_calls_false_and_include_reasoning_false(qwen35):
    c, eng = qwen35
    eng.output = THINK_CODER.text
    body = {"tools": TOOLS, "parallel_tool_calls": False, "include_reasoning": False}
    msg = _post(c, body)["choices"][0]["message"]
    assert [t["function"]["name"] for t in msg["tool_calls"]] == ["search"]
    assert "reasoning_content" not in msg and "reasoning" not in msg
    streamed, _ = _accumulate(_stream(c, body))
    assert list(streamed["tool_calls"]) == [0] and streamed["reasoning_content"] is None


def test_no_calls_is_plain_content_and_stop(qwen35):
    c, eng = qwen35
    eng.output = "Short thought.\n</think>\n\nIt is sunny."
    choice = _post(c, {"tools": TOOLS})["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "It is sunny." and choice["message"]["reasoning_content"] == "Short thought."


def test_enable_thinking_false_starts_outside_reasoning(qwen35):
    c, eng = qwen35
    eng.output = "Plain answer."
    msg = _post(c, {"chat_template_kwargs": {"enable_thinking": False}})["choices"][0]["message"]
    assert eng.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert msg["content"] == "Plain answer." and msg["reasoning_content"] is None


def test_the_markers_are_kept_in_the_output_text(qwen35):
    c, eng = qwen35
    eng.output = "x"
    _post(c, {"tools": TOOLS})
    assert {"<tool_call>", "</tool_call>", "<think>", "</think>"} <= set(eng.params[-1].keep_special_tokens)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_required_and_named_are_accepted(qwen35, choice):
    c, eng = qwen35
    eng.output = THINK_CODER.text
    assert _post(c, {"tools": TOOLS, "tool_choice": choice})["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("body, says", [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be true or false"),
    ({"include_reasoning": 1}, "'include_reasoning' must be"),
])
def test_bad_tool_fields_are_400s(qwen35, body, says):
    c, _ = qwen35
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_a_model_without_a_tool_format_refuses_auto_by_name():
    client, eng = _client("{% for m in messages %}{{ m.content }}{% endfor %}", "llama")
    with client as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                 "tool_choice": "auto"})
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        eng.output = "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>"
        msg = _post(c, {"tools": TOOLS})["choices"][0]["message"]       # tool_choice absent: text
        assert msg["content"] == eng.output and "tool_calls" not in msg


def test_kimi_calls_keep_their_own_ids_and_parser_override():
    kimi = next(x for x in CASES if x.name == "kimi_two")
    client, eng = _client((TEMPLATES / "kimi_k2_instruct.jinja").read_text(), "kimi_linear")
    with client as c:
        eng.output = kimi.text
        msg = _post(c, {"tools": TOOLS})["choices"][0]["message"]
        assert [t["id"] for t in msg["tool_calls"]] == list(kimi.ids) and msg["content"] == kimi.content
    client, eng = _client((TEMPLATES / "qwen3_next_instruct.jinja").read_text(), "kimi_linear",
                          tool_call_parser="hermes")
    with client as c:
        hermes = next(x for x in CASES if x.name == "hermes_text_then_two")
        eng.output = hermes.text
        msg = _post(c, {"tools": TOOLS})["choices"][0]["message"]
        assert [t["function"]["name"] for t in msg["tool_calls"]] == ["get_weather", "search"]


def test_unknown_parser_name_fails_at_startup():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ServerState(ServerConfig(model_type="qwen3_5", tool_call_parser="nope"))


def test_each_of_n_choices_is_parsed_on_its_own(qwen35):
    c, eng = qwen35
    eng.output, eng.chunk = THINK_CODER.text, 5
    choices = _post(c, {"tools": TOOLS, "n": 2})["choices"]
    assert [ch["index"] for ch in choices] == [0, 1]
    ids = [t["id"] for ch in choices for t in ch["message"]["tool_calls"]]
    assert len(ids) == 4 and len(set(ids)) == 4                     # unique across choices too
    chunks = _stream(c, {"tools": TOOLS, "n": 2})
    for i in (0, 1):
        mine = [ch for ch in chunks if ch["choices"][0]["index"] == i]
        msg, finish = _accumulate(mine)
        assert finish == "tool_calls" and [t["name"] for t in msg["tool_calls"].values()] == ["search", "get_weather"]


def test_streamed_logprobs_ride_on_the_chunks_that_are_sent(qwen35):
    c, eng = qwen35
    eng.output, eng.chunk = THINK_CODER.text, 2
    chunks = _stream(c, {"tools": TOOLS, "logprobs": True})
    msg, finish = _accumulate(chunks)
    assert finish == "tool_calls" and msg["content"] == THINK_CODER.content
    assert all(ch["choices"][0]["logprobs"] is not None for ch in chunks if ch["choices"][0]["delta"].get("role"))


def test_serve_reads_the_family_from_the_checkpoint_and_takes_overrides(tmp_path):
    from hybrid_jax.cli_args import build_parser  # noqa: PLC0415
    from hybrid_jax.cli_config import _model_type  # noqa: PLC0415
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "hidden_size": 8}))
    assert _model_type(str(tmp_path)) == "qwen3_5" and _model_type(None) is None
    args = build_parser().parse_args(["serve", "--tool-call-parser", "kimi_k2", "--reasoning-parser", "none"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("kimi_k2", "none")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
