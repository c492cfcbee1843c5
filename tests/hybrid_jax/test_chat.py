"""Chat completions when the checkpoint ships a chat template (in-process app, real engine)."""
from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.async_engine import AsyncEngine
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.server.supervisor import EngineSupervisor

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
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                                         compilation_cache_dir=None, warmup="none"))
    state = ServerState(ServerConfig(model_name="tiny-chat"))
    ae = AsyncEngine(engine)
    ae.start()
    state.engine = EngineSupervisor(ae, state.metrics)
    with TestClient(build_app(state)) as c:
        yield c, llm
    state.engine.shutdown()


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
