"""benchmarks/structured.py, part `libraries`: its inputs are right and its quick run prints every table.

The documents that drive the matchers and the coverage cases are checked with `jsonschema` (an
implementation independent of both grammar libraries); the stand-in vocabularies against the
published configs' sizes and the families' digit splitting; then one `--quick` run in a subprocess.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from structured_cases import QUICK_CASES, coverage_cases, grammar_cases  # noqa: E402

from hybrid_jax.structured import bench_tokenizers  # noqa: E402

VERDICTS = {"enforced", "ignored", "rejected", "over-strict"}


def validator(schema: dict) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_driving_documents_are_valid_for_their_grammars():
    for case in grammar_cases():
        if case.kind == "json_schema":
            validator(json.loads(case.source)).validate(json.loads(case.text))
        elif case.kind == "regex":
            assert re.fullmatch(case.source, case.text), case.name
        elif case.kind == "choice":
            assert case.text in json.loads(case.source)


@pytest.mark.parametrize("case", coverage_cases(), ids=lambda c: c.feature)
def test_coverage_case_breaks_only_its_feature(case):
    v = validator(case.schema)
    assert v.is_valid(case.valid)
    assert not v.is_valid(case.invalid)


def test_stand_in_sizes_are_the_published_configs():
    configs = ROOT / "hybrid_jax" / "published_configs"
    sizes = {"qwen3-151k": "qwen3_next_80b_a3b_instruct.json", "deepseek-129k": "deepseek_v32.json",
             "kimi-163k": "kimi_linear_48b_a3b_instruct.json"}
    for name, file in sizes.items():
        published = json.loads((configs / file).read_text())["vocab_size"]
        published = int(str(published).split(":")[0].replace(",", ""))
        spec = bench_tokenizers.VOCABS[name]
        assert spec.logits_size == published
        assert spec.tokenizer_size <= spec.logits_size


def test_stand_ins_split_digits_as_their_families():
    """Qwen's released pre-tokenizer takes one digit at a time; DeepSeek's and Kimi's up to three."""
    def pieces(name: str) -> list[str]:
        tok = bench_tokenizers._empty_tokenizer(bench_tokenizers.VOCABS[name])
        return [p for p, _ in tok.pre_tokenizer.pre_tokenize_str('{"n": 12345}')]
    assert [p for p in pieces("qwen3-151k") if p.isdigit()] == list("12345")
    assert [p for p in pieces("deepseek-129k") if p.isdigit()] == ["123", "45"]
    assert [p for p in pieces("kimi-163k") if p.isdigit()] == ["123", "45"]


def tables(out: str) -> dict[str, list[list[str]]]:
    """Each '## title' section of the output: its rows split on ' | ' (the header first)."""
    found, current = {}, None
    for line in out.splitlines():
        if line.startswith("## "):
            current = found.setdefault(line[3:].split(" (")[0], [])
        elif not line.strip():
            current = None
        elif current is not None:
            current.append([c.strip() for c in line.split(" | ")])
    return found


def test_quick_libraries_run_prints_every_table(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "structured.py"), "--part", "libraries",
                          "--quick"], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    t = tables(run.stdout)
    libs = {"xgrammar", "llguidance"}
    (vocab_header, vocab_row), spec = t["stand-in vocabularies"], bench_tokenizers.VOCABS["qwen3-151k"]
    assert vocab_row[:4] == ["qwen3-151k", str(spec.bpe_tokens), str(len(spec.added)), str(spec.logits_size)]
    # Qwen splits digits one at a time, so its only digit tokens are the ten digits
    assert vocab_row[vocab_header.index("digit tokens")] == "10"
    header, *rows = t["compile and mask time per token"]
    col = {h: i for i, h in enumerate(header)}
    got = {(r[col["vocab"]], r[col["grammar"]], r[col["library"]]) for r in rows}
    assert got == {("qwen3-151k", g, lib) for g in QUICK_CASES for lib in libs}
    # every token of every driving document was allowed by the library's mask
    assert all(r[col["valid"]] == "yes" for r in rows)
    assert all(float(r[col["mask p50 us"]]) > 0 for r in rows)
    batch = t["batch of 32"][1:]
    assert {(r[0], r[1]) for r in batch} == {("qwen3-151k", lib) for lib in libs}
    rollback = t["rollback"][1:]
    assert {r[1] for r in rollback} == libs and all(r[3] == "yes" and r[5] == "yes" for r in rollback)
    cov_header, *cov = t["JSON-schema coverage"]
    assert set(cov_header[1:]) == libs
    assert [r[0] for r in cov] == [c.feature for c in coverage_cases()]
    assert all(cell in VERDICTS for r in cov for cell in r[1:])
    # the goal features (nested objects, enums, bounded arrays, integer ranges) must be enforced
    must = {"required", "enum", "integer min/max", "minItems/maxItems", "$ref/$defs"}
    assert all(set(r[1:]) == {"enforced"} for r in cov if r[0] in must)
    ratios = t["ratios llguidance / xgrammar"][1:]
    assert {r[1] for r in ratios} == set(QUICK_CASES) | {"batch 32"}
    assert re.search(r"^RECOMMENDATION: (xgrammar|llguidance|neither) \(eligible: ", run.stdout, re.M)
