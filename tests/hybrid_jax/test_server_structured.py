"""Structured outputs through the OpenAI API (server/structured_fields.py), on an in-process app over the
shipped default model: OpenAI's response_format (json_schema, json_object) read by the official client,
vLLM's structured_outputs and guided_* spellings, streaming giving the same final text as not, and
malformed or doubled requests answered 400 naming the problem while the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from hybrid_jax import LLM
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.async_engine import AsyncEngine
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.server.supervisor import EngineSupervisor

KEY = "k"
H = {"Authorization": f"Bearer {KEY}"}
SCHEMA = {"type": "object", "properties": {"book": {"enum": ["Genesis", "Exodus", "Psalms"]},
                                           "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
                                           "words": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                     "minItems": 1, "maxItems": 3}},
          "required": ["book", "chapter", "words"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "Name a book of the law."}]


@pytest.fixture(scope="module")
def served():
    llm = LLM()
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                                         compilation_cache_dir=None, warmup="none"))
    state = ServerState(ServerConfig(model_name="default", api_key=KEY, max_tokens_limit=300))
    ae = AsyncEngine(engine)
    ae.start()
    state.engine = EngineSupervisor(ae, state.metrics)
    app = build_app(state)
    with TestClient(app, headers=H) as c:
        yield c, app
    state.engine.shutdown()


def _stream_text(c, path, body, key):
    text = ""
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += (ch["delta"].get("content") or "") if key == "chat" else ch["text"]
    return text


def test_the_official_client_gets_json_that_validates(served):
    import openai  # noqa: PLC0415
    _, app = served

    async def main():
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=KEY, max_retries=0, http_client=httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"))
        res = await client.chat.completions.create(
            model="default", messages=MSGS, n=3, temperature=0.8, max_tokens=200, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "verse", "schema": SCHEMA, "strict": True}})
        for ch in res.choices:
            assert ch.finish_reason == "stop"
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
        res = await client.completions.create(model="default", prompt="In the beginning", max_tokens=20, temperature=0.8,
                                              extra_body={"structured_outputs": {"choice": ["light", "darkness"]}})
        assert res.choices[0].text in ("light", "darkness")
        await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("fields, check", [
    ({"guided_regex": "[0-9]{3}-[a-z]{2,5}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,5}", t)),
    ({"guided_choice": ["yea", "nay"]}, lambda t: t in ("yea", "nay")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'root ::= "amen" | "selah"'}}, lambda t: t in ("amen", "selah")),
])
def test_every_spelling_streamed_and_not_gives_the_same_output(served, fields, check):
    c, _ = served
    for path, body, key in (("/v1/chat/completions", {"messages": MSGS}, "chat"),
                            ("/v1/completions", {"prompt": "And Moses said,"}, "text")):
        body = {**body, **fields, "max_tokens": 200, "temperature": 0}
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        text = ch["message"]["content"] if key == "chat" else ch["text"]
        assert check(text), text
        assert _stream_text(c, path, body, key) == text


@pytest.mark.parametrize("fields, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "nonsense"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "asked for twice"),
    ({"structured_outputs": {"regex": "(", "frob": 1}}, "frob"),
    ({"structured_outputs": {"regex": "("}}, "regex"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_malformed_structured_requests_are_400_and_the_server_keeps_serving(served, fields, needle):
    c, _ = served
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5, **fields})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5, "guided_choice": ["amen"]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "amen"
