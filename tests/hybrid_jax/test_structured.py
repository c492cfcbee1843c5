"""Structured outputs (hybrid_jax/structured): the request's grammar compiled off the engine thread and
cached, its bitmask applied on the device inside the compiled sampler (one program for masked and free
rows), outputs that validate against their schema with the shipped default model (which has never seen
JSON) at temperature 0.8, free rows untouched by masked ones, a token outside the grammar failing its
request (fail-closed), and a compile that fails or takes long harming no other request."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from hybrid_jax import LLM, SamplingParams, StructuredOutputsParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.errors import InputError
from hybrid_jax.structured import grammars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["king", "prophet", "scribe"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                  "year": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                 "required": ["city", "year"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "home"],
    "additionalProperties": False,
}
PROMPT = "And the LORD said unto Moses,"


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def engine(llm):
    """The overlapped engine loop (async scheduling, several decode iterations a call), as `serve` runs it."""
    e = LLMEngine(llm, EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, decode_steps=4,
                                    compilation_cache_dir=None, warmup="none"))
    yield e
    e.close()


def _run(engine, reqs):
    """reqs: [(prompt, SamplingParams)] -> final outputs in order."""
    ids = [f"s{i}-{id(p)}" for i, (_, p) in enumerate(reqs)]
    for rid, (prompt, p) in zip(ids, reqs):
        engine.add_request(rid, prompt, p)
    final = {}
    while len(final) < len(ids):
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return [final[r] for r in ids]


def json_params(seed, schema=SCHEMA, **kw):
    return SamplingParams(max_tokens=300, temperature=0.8, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=schema), **kw)


# --- the parameters -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, needle", [
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),      # not enforceable: refused, not ignored
    (dict(json={"type": "frobnicate"}), "frobnicate"),
    (dict(regex="(ab"), "regex"),
    (dict(choice=[]), "non-empty list"),
    (dict(grammar="root ::= ("), "GBNF"),
    (dict(json={}, regex="a"), "exactly one"),
    (dict(), "exactly one"),
])
def test_malformed_structured_outputs_are_refused_naming_the_problem(kw, needle):
    with pytest.raises(InputError) as e:
        StructuredOutputsParams(**kw)
    assert needle in str(e.value)


def test_every_kind_makes_one_grammar_text():
    texts = {StructuredOutputsParams(**kw).grammar_text for kw in (
        dict(json=SCHEMA), dict(json=json.dumps(SCHEMA)), dict(json_object=True), dict(regex=r"[a-z]+"),
        dict(choice=["yes", "no"]), dict(grammar='root ::= "a" | "b"'), dict(grammar='start: "a" | "b"'))}
    # the schema as a dict and as text are one grammar (one cache entry); the rest differ
    assert len(texts) == 6


# --- on the engine ----------------------------------------------------------------------------------------

def test_json_schema_outputs_validate_at_temperature_08(engine):
    outs = _run(engine, [(PROMPT, json_params(seed)) for seed in range(8)])
    for o in outs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1          # sampled, not one forced string


def test_regex_choice_grammar_and_json_object(engine):
    kinds = [dict(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"), dict(choice=["yea", "nay", "selah"]),
             dict(grammar='root ::= item ("," item)?\nitem ::= "(" [a-z] [a-z]? [a-z]? ")"'), dict(json_object=True)]
    outs = _run(engine, [(PROMPT, SamplingParams(max_tokens=200, temperature=0.8, seed=i,
                                                 structured_outputs=StructuredOutputsParams(**k)))
                         for i, k in enumerate(kinds)])
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", outs[0].text)
    assert outs[1].text in ("yea", "nay", "selah")
    assert re.fullmatch(r"\([a-z]{1,3}\)(,\([a-z]{1,3}\))?", outs[2].text)
    assert [o.finish_reason for o in outs[:3]] == ["stop"] * 3       # each bounded grammar ends the output itself
    # any JSON object: unbounded, so it may run out of tokens inside a string; complete, it is an object
    assert outs[3].text.startswith("{") and (outs[3].finish_reason == "length" or isinstance(json.loads(outs[3].text), dict))


def test_after_warm_up_no_grammar_compiles_a_program(llm):
    """The programs the default warm-up compiles (every decode bucket, the mixed steps at the smallest
    token bucket: what these short prompts need): requests under new grammars, beside free ones, compile
    nothing more (the bitmask is a runtime input; its writer was warmed up too)."""
    e = LLMEngine(llm, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=512, decode_steps=4,
                                    compilation_cache_dir=None, warmup="minimal"))
    e.warmup()
    n = e.num_compiled()
    schemas = [SCHEMA, {"type": "array", "items": {"type": "integer"}, "maxItems": 4}]
    outs = _run(e, [(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))] +
                [(PROMPT, json_params(i, schemas[i % 2])) for i in range(3)])
    assert all(o.finish_reason == "stop" for o in outs[1:])
    assert e.num_compiled() == n
    e.close()


def test_free_rows_beside_masked_ones_are_untouched(engine):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = _run(engine, [(PROMPT, free)])[0]
    schemas = [SCHEMA, {"type": "array", "items": {"type": "integer"}, "maxItems": 4}]
    mixed = _run(engine, [(PROMPT, free)] + [(PROMPT, json_params(i, schemas[i % 2])) for i in range(4)])
    assert mixed[0].token_ids == alone.token_ids
    # masked rows at temperature 0: the argmax of the allowed tokens, the same in a batch as alone
    greedy = dict(max_tokens=200, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    one = _run(engine, [(PROMPT, SamplingParams(**greedy))])[0]
    many = _run(engine, [(PROMPT, SamplingParams(**greedy)), (PROMPT, free), ("Free text:", SamplingParams(**greedy))])
    assert many[0].token_ids == one.token_ids


def test_a_grammar_is_compiled_once_and_shared(engine):
    g = engine.grammars
    schema = {"type": "object", "properties": {"verse": {"type": "integer", "minimum": 1, "maximum": 176}},
              "required": ["verse"], "additionalProperties": False}
    before = (g.compiles, g.hits)
    _run(engine, [(PROMPT, json_params(i, schema)) for i in range(3)])
    assert (g.compiles - before[0], g.hits - before[1]) == (1, 2)


def test_a_slow_compile_stalls_no_other_request(engine, monkeypatch):
    release = threading.Event()
    real = grammars.GrammarCompiler._compile

    def slow(self, text):
        assert release.wait(60)
        return real(self, text)
    monkeypatch.setattr(grammars.GrammarCompiler, "_compile", slow)
    schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"],
              "additionalProperties": False}
    engine.add_request("slow", PROMPT, json_params(0, schema))
    free = _run(engine, [(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))])[0]
    assert len(free.token_ids) == 8                    # served while the grammar compiled
    assert engine.scheduler.requests["slow"].num_output == 0
    release.set()
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.request_id == "slow" and o.finished), None)
    assert json.loads(final.text)["slow"] in (True, False)


def test_a_failed_compile_fails_its_request_alone(engine, monkeypatch):
    def broken(self, text):
        raise InputError("structured output: the compiler gave up")
    monkeypatch.setattr(grammars.GrammarCompiler, "_compile", broken)
    schema = {"type": "object", "properties": {"broken": {"type": "null"}}}
    outs = _run(engine, [(PROMPT, json_params(0, schema)),
                         (PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
    assert outs[0].finish_reason == "error" and "gave up" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4


def test_a_token_outside_the_grammar_fails_the_request_never_emitted(engine, monkeypatch):
    from hybrid_jax.engine import runner  # noqa: PLC0415
    monkeypatch.setattr(runner, "fill_rows", lambda gs, buf: buf.fill(-1))       # masks that let everything through
    outs = _run(engine, [(PROMPT, SamplingParams(max_tokens=40, temperature=0,
                                                 structured_outputs=StructuredOutputsParams(regex="[0-9]+"))),
                         (PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
    assert outs[0].finish_reason == "error" and "outside the structured output's grammar" in outs[0].error
    assert not re.search(r"[^0-9]", outs[0].text)     # nothing outside the grammar reached the output
    assert outs[1].finish_reason == "length"


def test_offline_generate_holds_to_the_schema(llm):
    outs = llm.generate([PROMPT] * 2, [json_params(s) for s in range(2)])
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_greedy_structured_output_with_ngram_speculation_equals_it_without(llm):
    """n-gram drafts are cut to what the grammar allows, each verify position is held to its mask, and
    the matcher keeps what the verify kept: greedy output equals plain decoding's, token for token;
    sampled (temperature 0.8) outputs still validate."""
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512, compilation_cache_dir=None,
               warmup="none")
    # a schema whose output repeats itself, so prompt lookup has drafts to propose
    schema = {"type": "array", "items": {"enum": ["the LORD", "the LORD God", "Moses"]}, "minItems": 6, "maxItems": 6}
    greedy = SamplingParams(max_tokens=300, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    plain = LLMEngine(llm, EngineConfig(**cfg))
    spec = LLMEngine(llm, EngineConfig(**cfg, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                  "prompt_lookup_min": 1}))
    prompts = [PROMPT, "And the LORD God said,"]
    want = _run(plain, [(p, greedy) for p in prompts])
    got = _run(spec, [(p, greedy) for p in prompts])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.spec_stats()["accepted_tokens"] > 0          # drafts were verified and kept
    sampled = _run(spec, [(PROMPT, json_params(i)) for i in range(2)])
    for o in sampled:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    plain.close()
    spec.close()


def test_the_grammar_applies_after_its_gate_as_to_a_reasoning_models_answer(llm, engine):
    """`after` (the server sets it to the end of thinking where the prompt opened thinking): the output
    is free until it holds the gate's tokens, then held to the grammar."""
    free = _run(engine, [(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])[0].token_ids
    tok = llm.tokenizer
    k = next(k for k in range(4, 12) if tok.encode(tok.decode(free[:k]), add_bos=False) == free[:k])
    gate = tok.decode(free[:k])
    p = SamplingParams(max_tokens=100, temperature=0,
                       structured_outputs=StructuredOutputsParams(regex="[0-9]{2,4}", after=gate))
    out = _run(engine, [(PROMPT, p)])[0]
    assert out.token_ids[:k] == free[:k]                   # free (the same greedy tokens) up to the gate
    assert re.fullmatch("[0-9]{2,4}", tok.decode(out.token_ids[k:])) and out.finish_reason == "stop"


def test_a_gated_grammar_waits_for_its_whole_gate():
    g = grammars.RequestGrammar("k", _done(None), gate=(5, 6))
    g.accept([1, 5, 2, 6])            # 5 and 6, not in a row: still free
    assert not g.active
    g.accept([5])
    assert not g.active
    g._matcher = _Recorder()
    g.accept([6, 9, 10])               # the gate completes: what follows it goes to the matcher
    assert g.active and g._matcher.seen == [9, 10]


class _Recorder:
    def __init__(self):
        self.seen = []

    def consume_token(self, t):
        self.seen.append(t)
        return True


def _done(value):
    import concurrent.futures  # noqa: PLC0415
    f = concurrent.futures.Future()
    f.set_result(value)
    return f


def test_draft_model_drafts_are_cut_by_the_grammar_and_greedy_output_is_unchanged(llm):
    """A drafter on the device (the default model as its own draft model: its drafts are what the target
    would say unmasked) drafts alone first; the host cuts a masked row's draft to what its grammar allows
    and fills each position's mask; the verify takes those drafts with their distributions. Greedy output
    equals plain decoding's token for token, drafts are accepted, and sampled outputs validate."""
    from hybrid_jax.default_model import DEFAULT_MODEL_DIR  # noqa: PLC0415
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512, compilation_cache_dir=None,
               warmup="none")
    greedy = SamplingParams(max_tokens=300, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = [PROMPT]
    plain = LLMEngine(llm, EngineConfig(**cfg))
    want = _run(plain, [(p, greedy) for p in prompts] + [(PROMPT, SamplingParams(max_tokens=20, temperature=0))])
    spec = LLMEngine(llm, EngineConfig(**cfg, speculative_config={
        "method": "draft_model", "model": DEFAULT_MODEL_DIR, "num_speculative_tokens": 3, "dynamic_k": False}))
    drawn, real = [], spec.runner.draft

    def counted(reqs, lengths, K):                  # the drafts drawn alone, before their verify
        out = real(reqs, lengths, K)
        drawn.append(sum(lengths))
        return out
    spec.runner.draft = counted
    got = _run(spec, [(p, greedy) for p in prompts] + [(PROMPT, SamplingParams(max_tokens=20, temperature=0))])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    st = spec.spec_stats()
    assert sum(drawn) > 0 and st["verify_steps"] > 0 and st["accepted_tokens"] > 0
    assert st["draft_tokens"] < sum(drawn)             # the grammar cut drafts the target's mask would refuse
    jsonschema.validate(json.loads(_run(spec, [(PROMPT, json_params(1))])[0].text), SCHEMA)
    plain.close()
    spec.close()
