"""Chat completions when the checkpoint ships a chat template (in-process app, real engine)."""
from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig
from hybrid_jax.server.app import ServerConfig, ServerState
from hybrid_jax.template_sources import ChatOptions, apply_chat_options
from in_process import serving

TEMPLATE = "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def client(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny_checkpoint, d)
    words = ["<eos>", "[UNK]", "<", ">", "user", "assistant", "system", "hi", "there"] + [f"w{i}" for i in range(202)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    llm = LLM(model=str(d))
    apply_chat_options(llm.tokenizer, ChatOptions(trust_request_templates=True))   # requests bring templates below
    with serving(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                                   compilation_cache_dir=None, warmup="none"), ServerConfig(model_name="tiny-chat")) as s:
        yield s[0], llm


def test_chat_completion_uses_the_template(client):
    c, llm = client
    msgs = [{"role": "user", "content": "hi there"}]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant"
    rendered = "<user> hi there <assistant>"
    ref = llm.generate(rendered, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert msg["content"] == ref.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_chat_streaming_deltas_add_up(client):
    c, _ = client
    msgs = [{"role": "system", "content": "hi"}, {"role": "user", "content": "there"}]
    full = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                "ignore_eos": True}).json()["choices"][0]["message"]["content"]
    with c.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                        "ignore_eos": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and "[DONE]" not in line]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert "".join(ch["choices"][0]["delta"]["content"] for ch in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_messages(client):
    c, _ = client
    assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert c.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}).status_code == 400


def test_the_prompt_is_tokenized_once_per_request(client, monkeypatch):
    c, llm = client
    tok = llm.tokenizer                  # the engine's: it was built from this LLM
    calls = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: calls.append(text) or encode(text, *a, **k))
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    assert calls == ["<user> hi there <assistant>"]


def _rendered(c, llm, monkeypatch, body: dict):
    """The response to a chat request, and the prompt text its template rendered (what was tokenized)."""
    tok = llm.tokenizer
    seen = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: seen.append(text) or encode(text, *a, **k))
    r = c.post("/v1/chat/completions", json={"max_tokens": 2, "temperature": 0, **body})
    monkeypatch.setattr(tok, "encode", encode)
    return r, (seen[0] if seen else None)


def test_content_parts_are_joined_as_vllm_joins_them(client, monkeypatch):
    c, llm = client                        # guidellm's chat mode sends content as a list of text parts
    r, text = _rendered(c, llm, monkeypatch, {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]})
    assert r.status_code == 200, r.text
    assert text == "<system> hi <user> hi\nthere <assistant>"
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_tool_calls_and_tool_results_are_history(client, monkeypatch):
    c, llm = client
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "x"}'}}
    template = ("{% for m in messages %}<{{ m.role }}> {{ m.content }}{% for t in m.tool_calls or [] %} "
                "{{ t.function.name }} {{ t.function.arguments.city }}{% endfor %}{% if m.tool_call_id %} "
                "{{ m.tool_call_id }}{% endif %} {% endfor %}{{ tools | length }}")
    r, text = _rendered(c, llm, monkeypatch, {"chat_template": template, "tools": [
        {"type": "function", "function": {"name": "w", "parameters": {}}}], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "there"}]}]})
    assert r.status_code == 200, r.text
    assert text == "<user> hi <assistant>  w x <tool> there call_1 1"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                  {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
                                  {"type": "video_url", "video_url": {"url": "x"}}, {"type": "file", "file": {}}])
def test_media_parts_are_refused_by_name(client, part):
    c, _ = client
    r = c.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert repr(part["type"]) in msg and "'messages'[0].content[1]" in msg and "text only" in msg
    assert r.json()["error"]["param"] == "messages"


def test_a_template_that_raises_or_fails_is_a_400_saying_why(client):
    c, _ = client
    msgs = [{"role": "user", "content": "hi"}]
    r = c.post("/v1/chat/completions", json={"messages": msgs,
                                             "chat_template": "{{ raise_exception('System role not supported') }}"})
    assert r.status_code == 400 and "System role not supported" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "chat_template": "{{ messages[0].content + 1 }}"})
    assert r.status_code == 400 and "chat template failed" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "chat_template": "{% if %}"})
    assert r.status_code == 400 and "not valid Jinja" in r.json()["error"]["message"]


def test_the_request_fields_reach_the_template(client, monkeypatch):
    c, llm = client
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there w1 "}]
    r, text = _rendered(c, llm, monkeypatch, {"messages": msgs, "add_generation_prompt": False})
    assert r.status_code == 200 and text == "<user> hi <assistant> there w1  "
    r, text = _rendered(c, llm, monkeypatch, {"messages": msgs, "add_generation_prompt": False,
                                              "continue_final_message": True})
    assert r.status_code == 200 and text == "<user> hi <assistant> there w1 "      # (transformers' text too)
    r, text = _rendered(c, llm, monkeypatch, {"messages": msgs[:1], "chat_template_kwargs": {"w": "w7"},
                                              "documents": [{"title": "w9", "text": "w3"}],
                                              "chat_template": "{{ w }} {{ documents[0].title }} {{ eos_token }}"})
    assert r.status_code == 200 and text == "w7 w9 <eos>"
    r = c.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]


def test_tool_choice_none_is_honoured_and_calls_refused_without_a_tool_format(client):
    """This checkpoint's family has no tool-call format (and no --tool-call-parser was given): asking for
    calls is a 400 that says how to get them (test_server_tools.py: the families that have one)."""
    c, _ = client
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "w"}}]}
    assert c.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    for choice in ("auto", "required", {"type": "function", "function": {"name": "w"}}):
        r = c.post("/v1/chat/completions", json={**body, "tool_choice": choice})
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"], choice


def test_chat_template_option_reaches_the_api_server(client, tmp_path, monkeypatch):
    """`serve --chat-template`: parsed, read before the model loads, and set on the tokenizer the API server
    process loads for itself when the engine core runs in another process."""
    from hybrid_jax.cli_args import build_parser  # noqa: PLC0415
    from hybrid_jax.engine import core_client  # noqa: PLC0415
    from hybrid_jax.errors import ConfigError, InputError  # noqa: PLC0415
    from hybrid_jax.server import main  # noqa: PLC0415
    from hybrid_jax.server.chat_template import render_request  # noqa: PLC0415
    f = tmp_path / "t.jinja"
    f.write_text("FILE {{ messages | length }}")
    assert build_parser().parse_args(["serve", "--chat-template", str(f)]).chat_template == str(f)
    with pytest.raises(ConfigError, match="cannot be opened"):
        main.serve(model=None, host="127.0.0.1", port=0, dtype="auto", engine_config=None,
                   server_config=ServerConfig(), chat_template=str(tmp_path / "missing.jinja"))
    args = build_parser().parse_args(["serve", "--trust-request-chat-template"])
    assert args.trust_request_chat_template and not build_parser().parse_args(["serve"]).trust_request_chat_template
    monkeypatch.setattr(core_client, "EngineCoreClient", lambda address, authkey, info, tok, process=None: tok)
    info = {"tokenizer": "checkpoint", "warmup": "none", "num_compiled": 0}
    msgs = [{"role": "user", "content": "hi"}]
    for trust in (False, True):
        tok = main._core_client(ServerState(ServerConfig()), client[1].checkpoint_dir, "addr", b"key", info,
                                chat=ChatOptions(main.read_template_arg(str(f)), trust))
        assert tok.chat_templates.source == "--chat-template"
        assert render_request(tok, {"messages": msgs}) == "FILE 1"
        if trust:
            assert render_request(tok, {"messages": msgs, "chat_template": "OWN"}) == "OWN"
        else:                   # a template's text in a request: only with --trust-request-chat-template
            with pytest.raises(InputError, match="--trust-request-chat-template"):
                render_request(tok, {"messages": msgs, "chat_template": "OWN"})


@pytest.fixture(scope="module")
def default_client():
    llm = LLM()                                  # the shipped default model, as `hybrid-jax serve` loads it
    with serving(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256,
                                   compilation_cache_dir=None, warmup="none"), ServerConfig(model_name="default")) as s:
        yield s[0], llm


def test_the_default_model_chats_out_of_the_box(default_client, monkeypatch):
    c, llm = default_client
    assert llm.tokenizer.chat_templates.source == "chat_template.jinja"
    r, text = _rendered(c, llm, monkeypatch, {"messages": [
        {"role": "system", "content": "Speak plainly."},
        {"role": "user", "content": [{"type": "text", "text": "Who made the heaven and the earth?"}]}],
        "max_tokens": 12})
    assert r.status_code == 200, r.text
    assert text == "Speak plainly.\n\nUser: Who made the heaven and the earth?\n\nAssistant:"
    answer = r.json()["choices"][0]["message"]["content"]
    assert answer.strip() and r.json()["usage"]["completion_tokens"] > 0


def test_a_request_template_needs_the_trust_option(default_client):
    c, _ = default_client                  # served as `hybrid-jax serve` serves it: no --trust-request-chat-template
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                             "chat_template": "{{ messages[0].content }}"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "--trust-request-chat-template" in err["message"] and err["param"] == "chat_template"
