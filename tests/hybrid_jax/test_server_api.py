"""The API surface real clients use (issue 51), on an in-process app over a real engine on the tiny
checkpoint with a word-level tokenizer and a chat template: one table of request fields (unknown
ones refused as OpenAI does, refused ones named), n > 1 and lists of prompts fanned out into engine
requests, seeds per choice, echo, chat log-probabilities, the rest of the context as the default
max_tokens, stream_options' usage chunk, /v1/models/{id}, /tokenize and /detokenize."""
from __future__ import annotations

import asyncio
import json
import pathlib
import shutil

import httpx
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig
from hybrid_jax.server import fields
from hybrid_jax.server.app import ServerConfig
from in_process import serving

KEY = "k"
H = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_MODEL_LEN = 64
WORDS = ["<eos>", "[UNK]", "<", ">", "user", "assistant", "system", "hi", "there"] + [f"w{i}" for i in range(202)]


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("api") / "ckpt"
    shutil.copytree(tiny_checkpoint, d)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    llm = LLM(model=str(d))
    with serving(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN,
                                   compilation_cache_dir=None, warmup="none"),
                 ServerConfig(model_name="tiny", api_key=KEY, max_tokens_limit=40), H) as (c, app, _):
        yield c, llm, app


def _greedy(llm, prompt, n):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0]


def _events(c, path, body):
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# --- the table of fields -------------------------------------------------------------------------

def test_unknown_fields_get_openais_answer_and_refused_ones_are_named(served):
    c, _, _ = served
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = c.post(path, json={**base, "max_tokens": 2, "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["message"] == \
            "Unrecognized request argument supplied: frobnicate"
        assert r.json()["error"]["param"] == "frobnicate"
        for name, value in (("use_beam_search", True), ("allowed_token_ids", [1]), ("priority", 3),
                            ("skip_special_tokens", False), ("cache_salt", "x")):
            r = c.post(path, json={**base, "max_tokens": 2, name: value})
            assert r.status_code == 400, (name, r.text)
            assert f"'{name}'" in r.json()["error"]["message"] and "not supported" in r.json()["error"]["message"]
        # inert values of refused fields, as clients that send every default do
        r = c.post(path, json={**base, "max_tokens": 2, "use_beam_search": False, "skip_special_tokens": True,
                               "priority": 0, "guided_json": None, "response_format": {"type": "text"}})
        assert r.status_code == 200, r.text
    # a field of one endpoint is unknown on the other
    r = c.post("/v1/completions", json={"prompt": "hi", "max_completion_tokens": 2})
    assert r.status_code == 400 and "Unrecognized" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "suffix": "x"})
    assert r.status_code == 400 and "Unrecognized" in r.json()["error"]["message"]


def test_every_sampling_field_reaches_the_engine(served):
    c, _, _ = served
    values = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1,
              "min_tokens": 1, "logit_bias": {"7": 5}, "include_stop_str_in_output": True, "prompt_logprobs": 1}
    for name, v in values.items():          # (min_p, min_tokens, ... were silently ignored before)
        r = c.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 3, name: v})
        assert r.status_code == 200, (name, r.text)
    base = {"prompt": "hi there", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    free = c.post("/v1/completions", json=base).json()["choices"][0]["token_ids"]
    forced = c.post("/v1/completions", json={**base, "logit_bias": {"7": 100}}).json()["choices"][0]["token_ids"]
    assert forced == [7, 7, 7] != free       # the bias took effect: it is applied, not only accepted
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "presence_penalty": 7})
    assert r.status_code == 400 and "presence_penalty" in r.json()["error"]["message"]     # SamplingParams' range


def test_the_readme_lists_the_table():
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    assert fields.markdown("  ") in readme, "README.md's table of request fields is stale: paste fields.markdown('  ')"


# --- small endpoints ---------------------------------------------------------------------------

def test_model_by_id_tokenize_and_detokenize(served):
    c, llm, app = served
    r = c.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["max_model_len"] == MAX_MODEL_LEN
    r = c.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = c.post("/tokenize", json={"prompt": "hi there w5", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": llm.tokenizer.encode("hi there w5"),
                        "token_strs": ["hi", "there", "w5"]}
    r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == llm.tokenizer.encode("<user> hi <assistant>")     # the chat path's rendering
    r = c.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": llm.tokenizer.decode(llm.tokenizer.encode(
        "<user> hi <assistant>"))}
    assert c.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert c.post("/tokenize", json={"prompt": "hi", "bogus": 1}).status_code == 400
    with TestClient(app) as bare:                       # behind the API key like /v1/*
        assert bare.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        assert bare.post("/detokenize", json={"tokens": [1]}).status_code == 401
        assert bare.get("/v1/models/tiny").status_code == 401


# --- max_tokens, logprobs, usage ---------------------------------------------------------------------

def test_without_max_tokens_the_rest_of_the_context_is_used(served):
    c, _, _ = served
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                                             "temperature": 0})
    u = r.json()["usage"]
    assert u["completion_tokens"] == min(40, MAX_MODEL_LEN - u["prompt_tokens"])   # 40: the server's limit
    prompt = list(range(9, 9 + 30))
    r = c.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 30
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                                             "max_completion_tokens": 3, "max_tokens": 9})
    assert r.json()["usage"]["completion_tokens"] == 3                              # the newer name wins
    r = c.post("/v1/completions", json={"prompt": list(range(9, 9 + MAX_MODEL_LEN))})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]


def test_chat_logprobs_in_openais_shape(served):
    c, llm, _ = served
    msgs = [{"role": "user", "content": "hi there"}]
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2}
    r = c.post("/v1/chat/completions", json=body)
    ref = llm.generate("<user> hi there <assistant>", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                    logprobs=2))[0].outputs[0]
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [llm.tokenizer.decode([t]) for t in ref.token_ids]
    assert [e["logprob"] for e in content] == pytest.approx([x["logprob"] for x in ref.logprobs], abs=1e-5)
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    chunks = _events(c, "/v1/chat/completions", body)
    streamed = [e for ch in chunks for e in ch["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_stream_usage_only_with_include_usage_in_a_last_chunk(served):
    c, _, _ = served
    base = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    chunks = _events(c, "/v1/completions", base)
    assert all("usage" not in ch for ch in chunks)
    chunks = _events(c, "/v1/completions", {**base, "stream_options": {"include_usage": False}})
    assert all("usage" not in ch for ch in chunks)
    chunks = _events(c, "/v1/completions", {**base, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                                   "total_tokens": 7}
    assert all(ch["usage"] is None and ch["choices"] for ch in chunks[:-1])
    chunks = _events(c, "/v1/completions", {**base, "stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True}})
    counts = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1]["choices"] == []
    r = c.post("/v1/completions", json={**base, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]


# --- n > 1 and lists of prompts ------------------------------------------------------------------------

def test_n_greedy_choices_equal_separate_greedy_requests(served):
    c, llm, _ = served
    body = {"prompt": "hi there w3", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    one = c.post("/v1/completions", json=body).json()["choices"][0]
    r = c.post("/v1/completions", json={**body, "n": 4, "best_of": 4})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1, 2, 3]
    assert all(ch["token_ids"] == one["token_ids"] == _greedy(llm, "hi there w3", 6).token_ids for ch in choices)
    u = r.json()["usage"]
    assert u["prompt_tokens"] == 3 and u["completion_tokens"] == 24          # the prompt counted once
    assert c.post("/v1/completions", json={**body, "n": 2, "best_of": 3}).status_code == 400


def test_seeded_choice_i_equals_a_single_request_with_seed_plus_i(served):
    c, _, _ = served
    body = {"prompt": "hi there", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    got = [ch["token_ids"] for ch in c.post("/v1/completions", json={**body, "n": 3, "seed": 11}).json()["choices"]]
    singles = [c.post("/v1/completions", json={**body, "seed": 11 + i}).json()["choices"][0]["token_ids"]
               for i in range(3)]
    assert got == singles
    assert len({tuple(t) for t in got}) > 1               # (the seeds differ: so do the samples)


def test_a_list_of_prompts_gets_n_choices_each_in_openais_order(served):
    c, llm, _ = served
    prompts = ["hi there", "w1 w2 w3 w4"]
    r = c.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0,
                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1, 2, 3]
    for i, ch in enumerate(choices):
        assert ch["token_ids"] == _greedy(llm, prompts[i // 2], 5).token_ids
    assert r.json()["usage"]["prompt_tokens"] == 2 + 4
    ids = [[9, 10, 11], [12, 13]]
    r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert [ch["token_ids"] for ch in r.json()["choices"]] == [
        _greedy(llm, {"prompt_token_ids": p}, 3).token_ids for p in ids]


def test_streamed_n_interleaves_choices_by_index(served):
    c, _, _ = served
    body = {"prompt": ["hi there", "w7"], "n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    full = c.post("/v1/completions", json=body).json()["choices"]
    chunks = _events(c, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    toks: dict[int, list[int]] = {}
    for ch in chunks[:-1]:
        (choice,) = ch["choices"]
        toks.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert toks == {ch["index"]: ch["token_ids"] for ch in full}
    assert chunks[-1]["usage"]["completion_tokens"] == 20


# --- echo ------------------------------------------------------------------------------------------------

def test_echo_puts_the_prompt_text_first(served):
    c, llm, _ = served
    r = c.post("/v1/completions", json={"prompt": "hi there", "echo": True, "max_tokens": 3, "temperature": 0,
                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    ref = _greedy(llm, "hi there", 3)
    assert r.json()["choices"][0]["text"] == "hi there" + ref.text
    r = c.post("/v1/completions", json={"prompt": "hi there", "echo": True, "max_tokens": 0})
    ch = r.json()["choices"][0]
    assert r.status_code == 200 and ch["text"] == "hi there" and ch["token_ids"] == []
    assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 400


def test_echo_logprobs_equal_the_offline_engines(served):
    c, llm, _ = served
    prompt = "hi there w4 w9"
    r = c.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = llm.tokenizer.encode(prompt)
    assert lp["token_ids"] == ids and lp["token_logprobs"][0] is None
    ref = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    want = [x["logprob"] for x in ref.prompt_logprobs[1:]]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)


# --- the official client -------------------------------------------------------------------------------

def test_the_official_openai_client_reads_n_usage_and_chat_logprobs(served):
    import openai  # noqa: PLC0415
    c, _, app = served

    async def main():
        transport = httpx.ASGITransport(app=app)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=KEY, max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport, base_url="http://test"))
        msgs = [{"role": "user", "content": "hi there"}]
        res = await client.chat.completions.create(model="tiny", messages=msgs, n=2, max_tokens=3, temperature=0,
                                                   logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
        assert [ch.index for ch in res.choices] == [0, 1]
        assert all(len(ch.logprobs.content) == 3 and len(ch.logprobs.content[0].top_logprobs) == 1
                   for ch in res.choices)
        assert res.usage.completion_tokens == 6
        last = None
        seen = set()
        async for chunk in await client.chat.completions.create(
                model="tiny", messages=msgs, n=2, max_tokens=3, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True}):
            seen |= {ch.index for ch in chunk.choices}
            last = chunk
        assert seen == {0, 1} and last.choices == [] and last.usage.completion_tokens == 6
        model = await client.models.retrieve("tiny")
        assert model.id == "tiny"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"nonsense": 1})
        assert "Unrecognized request argument supplied: nonsense" in e.value.body["message"]
        await client.close()

    asyncio.run(main())
