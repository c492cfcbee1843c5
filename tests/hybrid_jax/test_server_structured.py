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

from hybrid_jax import LLM
from hybrid_jax.engine import EngineConfig
from hybrid_jax.server.app import ServerConfig
from in_process import serving

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
    with serving(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                                   compilation_cache_dir=None, warmup="none"),
                 ServerConfig(model_name="default", api_key=KEY, max_tokens_limit=300, model_type="qwen3_next"), H) as s:
        yield s


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
    _, app, _ = served

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
    c, _, _ = served
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
    c, _, _ = served
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5, **fields})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5, "guided_choice": ["amen"]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "amen"


TOOLS = [{"type": "function", "function": {"name": "find_verse", "parameters": {
    "type": "object", "properties": {"book": {"enum": ["Genesis", "Exodus"]},
                                     "chapter": {"type": "integer", "minimum": 1, "maximum": 50},
                                     "words": {"type": "string", "maxLength": 20}},
    "required": ["book", "chapter", "words"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}]


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "deepseek_v32", "deepseek_v4"])
def test_tool_choice_required_and_named_give_calls_that_validate(served, fmt):
    """The default model (which never saw a tool call) at temperature 0.8, in each family's format (the
    served family's tool-call format overridden as `--tool-call-parser` does): tool_choice "required"
    and a named function give parsed calls whose arguments validate, every choice; streamed and whole
    give the same calls."""
    from hybrid_jax.server.tool_parsers import family  # noqa: PLC0415
    c, _, state = served
    state.family = family("qwen3_next", fmt)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "count"}}):
        body = {"messages": MSGS, "tools": TOOLS, "tool_choice": choice, "max_tokens": 250, "temperature": 0.8,
                "seed": 3, "n": 3, "parallel_tool_calls": False}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        for ch in r.json()["choices"]:
            calls = ch["message"].get("tool_calls")
            assert ch["finish_reason"] == "tool_calls" and len(calls) == 1, ch
            fn = calls[0]["function"]
            assert isinstance(choice, str) or fn["name"] == "count"
            jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
        whole = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        streamed = {"name": None, "arguments": ""}
        with c.stream("POST", "/v1/chat/completions", json={**body, "n": 1, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        for tc in ch["delta"].get("tool_calls") or []:
                            streamed["name"] = tc["function"].get("name") or streamed["name"]
                            streamed["arguments"] += tc["function"].get("arguments") or ""
        assert streamed == whole


def test_tool_choice_required_beside_a_response_format_is_a_400(served):
    c, _, state = served
    from hybrid_jax.server.tool_parsers import family  # noqa: PLC0415
    state.family = family("qwen3_next")
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "required",
                                             "response_format": {"type": "json_object"}, "max_tokens": 5})
    assert r.status_code == 400 and "both constrain" in r.json()["error"]["message"]


def test_a_structured_output_applies_after_the_thinking_the_prompt_opened():
    """Where the rendered prompt opened the reasoning (a thinking template's `<think>\\n`), the grammar
    waits for its end: the thinking is free, the answer is held (StructuredOutputsParams.after)."""
    from hybrid_jax import SamplingParams, StructuredOutputsParams  # noqa: PLC0415
    from hybrid_jax.server.chat_output import chat_output, read_with  # noqa: PLC0415
    from hybrid_jax.server.tool_parsers import family  # noqa: PLC0415
    fam = family("qwen3_5")
    so = StructuredOutputsParams(json=SCHEMA)
    reading = chat_output(fam, {"messages": MSGS})
    opened = read_with(SamplingParams(structured_outputs=so), reading, "<|im_start|>assistant\n<think>\n")
    closed = read_with(SamplingParams(structured_outputs=so), reading, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert opened.structured_outputs.after == "</think>" and closed.structured_outputs.after is None
    calls = read_with(SamplingParams(), chat_output(fam, {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"}),
                      "<think>\n")
    assert calls.structured_outputs.after == "</think>" and "<tool_call>" in calls.structured_outputs.grammar_text
