"""Structured outputs, measured: which grammar library (issue 52), and what masking costs the engine.

Part `libraries` (this file's first half) compares xgrammar and llguidance on stand-in tokenizers of
the served vocabularies (hybrid_jax/structured/bench_tokenizers.py: Qwen3 151,936, DeepSeek 129,280,
Kimi 163,840 logits; byte-level BPEs trained here, the hub being out of reach):

  compile    per grammar (any JSON object, four JSON schemas, a regex, a choice, an EBNF grammar):
             cold compile (cache cleared), cached compile, and the first request's time to its first
             mask (cold compile + matcher + one fill);
  mask       each library's matcher driven along a document valid for the grammar, tokenised by the
             stand-in: per token, fill the next-token bitmask and accept the token (median, p99);
             every document token must be allowed by the mask, and EOS must end the match;
  batch      32 matchers stepped together with the library's batch call (xgrammar's
             BatchGrammarMatcher, llguidance's LLExecutor): time per step for all 32 rows;
  rollback   advance k tokens, roll back k, and check the mask equals the one before;
  coverage   25 schema features: rejected at compile, enforced, ignored (compiles but lets an
             instance breaking the feature through) or over-strict (blocks an instance keeping it);
  ratios     llguidance / xgrammar, and a recommendation by a stated rule (`recommendation`):
             eligible if rollback is exact, masks allow every valid token and a batch-32 mask fits
             --step-budget-ms; then fewest schema features that compile but give wrong output;
             then the lower mask p99.

Part `engine` (benchmarks/structured_engine.py) measures what masking costs the engine: generated
tokens/s with 0, 50% and 100% of a wave's rows under a JSON schema at concurrency 1, 8 and 32 (A/B
alternating rounds, medians), and a grammar's compile from add_request to ready. One function per
part; `main` picks them. Timings are wall-clock on whatever CPU runs this; the libraries use several
threads.

    python benchmarks/structured.py [--part libraries|engine|all] [--quick] [--vocab qwen3-151k ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_engine  # noqa: E402
from structured_adapters import LIBRARIES, GrammarRejected, allowed, new_mask  # noqa: E402
from structured_cases import QUICK_CASES, CoverageCase, GrammarCase, coverage_cases, grammar_cases  # noqa: E402

from hybrid_jax.structured import bench_tokenizers  # noqa: E402

BATCH = 32
ROLLBACK_KS = (1, 4, 16)


@dataclass(frozen=True)
class Settings:
    vocabs: tuple[str, ...]
    cases: tuple[GrammarCase, ...]
    max_steps: int
    repeats: int
    step_budget_ms: float
    concurrency: tuple[int, ...] = (1, 8, 32)     # the engine part's waves


@dataclass
class CompileTiming:
    cold_ms: float
    cached_ms: float
    first_mask_ms: float


@dataclass
class DriveTiming:
    steps_s: list[float]
    fills_s: list[float]
    valid: bool


@dataclass
class SetupRow:
    vocab: str
    library: str
    seconds: float


@dataclass
class GrammarRow:
    vocab: str
    grammar: str
    library: str
    cold_ms: float
    cached_ms: float
    first_mask_ms: float
    tokens: int
    mask_p50_us: float
    mask_p99_us: float
    fill_p50_us: float
    valid: bool


@dataclass
class BatchRow:
    vocab: str
    library: str
    steps: int
    p50_ms: float
    p99_ms: float


@dataclass
class RollbackRow:
    vocab: str
    library: str
    k: int
    supported: bool
    rollback_us: float
    same_mask: bool


@dataclass
class LibraryResults:
    vocabs: list[bench_tokenizers.VocabStats] = field(default_factory=list)
    setup: list[SetupRow] = field(default_factory=list)
    grammars: list[GrammarRow] = field(default_factory=list)
    batches: list[BatchRow] = field(default_factory=list)
    rollbacks: list[RollbackRow] = field(default_factory=list)
    coverage: dict[str, dict[str, str]] = field(default_factory=dict)


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else float("nan")


def now() -> float:
    return time.perf_counter()


# ---- compile -------------------------------------------------------------------------------------

def time_compile(lib, case: GrammarCase, mask: np.ndarray, repeats: int) -> CompileTiming:
    """Medians over `repeats` cold compiles (cache cleared), then one cached compile."""
    cold, first = [], []
    for _ in range(repeats):
        lib.clear_cache()
        t0 = now()
        compiled = lib.compile(case.kind, case.source)
        t1 = now()
        lib.matcher(compiled).fill(mask, 0)
        t2 = now()
        cold.append(t1 - t0)
        first.append(t2 - t0)
    t0 = now()
    lib.compile(case.kind, case.source)
    cached = now() - t0
    return CompileTiming(statistics.median(cold) * 1e3, cached * 1e3, statistics.median(first) * 1e3)


# ---- mask along a document -----------------------------------------------------------------------

def drive(lib, compiled, tokens: list[int], mask: np.ndarray, ends: bool) -> DriveTiming:
    """Fill + accept per token of `tokens` (then EOS if `ends`); valid: every token allowed and
    accepted, and EOS ends the match."""
    m = lib.matcher(compiled)
    steps, fills, ok = [], [], True
    for tok in tokens + ([lib.eos] if ends else []):
        t0 = now()
        m.fill(mask, 0)
        t1 = now()
        accepted = m.accept(tok)
        t2 = now()
        ok = ok and allowed(mask, 0, tok) and accepted
        steps.append(t2 - t0)
        fills.append(t1 - t0)
    return DriveTiming(steps, fills, ok and (m.finished() or not ends))


def grammar_row(lib, vocab: str, case: GrammarCase, tokens: list[int], mask: np.ndarray,
                s: Settings) -> GrammarRow:
    nan = float("nan")
    try:
        ct = time_compile(lib, case, mask, s.repeats)
        compiled = lib.compile(case.kind, case.source)
    except GrammarRejected as e:
        print(f"  {lib.name} rejected {case.name}: {e}", file=sys.stderr)
        return GrammarRow(vocab, case.name, lib.name, nan, nan, nan, 0, nan, nan, nan, False)
    cut = bool(s.max_steps) and len(tokens) > s.max_steps  # a cut document is not followed by EOS
    runs = [drive(lib, compiled, tokens[:s.max_steps] if cut else tokens, mask, ends=not cut)
            for _ in range(s.repeats)]
    steps = [x for r in runs for x in r.steps_s]
    fills = [x for r in runs for x in r.fills_s]
    return GrammarRow(vocab, case.name, lib.name, ct.cold_ms, ct.cached_ms, ct.first_mask_ms, len(tokens),
                      statistics.median(steps) * 1e6, p99(steps) * 1e6, statistics.median(fills) * 1e6,
                      all(r.valid for r in runs))


# ---- batch ---------------------------------------------------------------------------------------

def batch_row(lib, vocab: str, compiled: list[object], docs: list[list[int]], logits: int,
              s: Settings) -> BatchRow:
    """BATCH matchers over the JSON grammars in turn, stepped together for the shortest document."""
    rows = [(compiled[i % len(compiled)], docs[i % len(docs)]) for i in range(BATCH)]
    matchers = [lib.matcher(c) for c, _ in rows]
    n = min(len(d) for _, d in rows)
    n = min(n, s.max_steps) if s.max_steps else n
    mask = new_mask(BATCH, logits)
    times = []
    for step in range(n):
        tokens = [d[step] for _, d in rows]
        t0 = now()
        lib.batch_fill(matchers, mask)
        oks = lib.batch_accept(matchers, tokens)
        times.append(now() - t0)
        if not all(oks) or not all(allowed(mask, i, t) for i, t in enumerate(tokens)):
            raise RuntimeError(f"{lib.name}: batch step {step} refused a valid token")
    return BatchRow(vocab, lib.name, n, statistics.median(times) * 1e3, p99(times) * 1e3)


# ---- rollback ------------------------------------------------------------------------------------

def rollback_rows(lib, vocab: str, compiled, tokens: list[int], logits: int) -> list[RollbackRow]:
    """From the middle of a document: advance k tokens, roll back k, compare the mask with before."""
    rows = []
    half = len(tokens) // 2
    for k in ROLLBACK_KS:
        m = lib.matcher(compiled)
        before, after = new_mask(1, logits), new_mask(1, logits)
        for tok in tokens[:half]:
            m.accept(tok)
        m.fill(before, 0)
        times, same, supported = [], True, True
        for _ in range(5):
            for tok in tokens[half:half + k]:
                m.accept(tok)
            t0 = now()
            supported = supported and m.rollback(k)
            times.append(now() - t0)
            m.fill(after, 0)
            same = same and bool(np.array_equal(before, after))
        rows.append(RollbackRow(vocab, lib.name, k, supported, statistics.median(times) * 1e6, same))
    return rows


# ---- coverage ------------------------------------------------------------------------------------

def accepts(lib, compiled, text: str, encode) -> bool:
    m = lib.matcher(compiled)
    return all(m.accept(t) for t in encode(text)) and m.accept(lib.eos) and m.finished()


def verdict(lib, case: CoverageCase, encode) -> str:
    try:
        compiled = lib.compile("json_schema", json.dumps(case.schema))
    except GrammarRejected:
        return "rejected"
    keeps = accepts(lib, compiled, json.dumps(case.valid), encode)
    breaks = accepts(lib, compiled, json.dumps(case.invalid), encode)
    if not keeps:
        return "over-strict"
    return "ignored" if breaks else "enforced"


# ---- the libraries part --------------------------------------------------------------------------

def encoder(hf):
    return lambda text: hf.encode(text, add_special_tokens=False)


def run_vocab(vocab: str, s: Settings, res: LibraryResults, with_coverage: bool) -> None:
    spec = bench_tokenizers.VOCABS[vocab]
    hf = bench_tokenizers.hf_tokenizer(vocab)
    res.vocabs.append(bench_tokenizers.describe(vocab))
    encode = encoder(hf)
    docs = {c.name: encode(c.text) for c in s.cases}
    for lib_cls in LIBRARIES:
        t0 = now()
        lib = lib_cls(hf, spec.logits_size)
        res.setup.append(SetupRow(vocab, lib.name, now() - t0))
        lib.compile("regex", "warm[0-9]")  # one-off per-process set-up, kept out of the first case
        mask = new_mask(1, spec.logits_size)
        compiled = {}
        for case in s.cases:
            res.grammars.append(grammar_row(lib, vocab, case, docs[case.name], mask, s))
            if case.kind == "json_schema":
                compiled[case.name] = lib.compile(case.kind, case.source)
        names = list(compiled)
        res.batches.append(batch_row(lib, vocab, [compiled[n] for n in names], [docs[n] for n in names],
                                     spec.logits_size, s))
        order = next(c for c in s.cases if c.name == "schema:order")
        res.rollbacks += rollback_rows(lib, vocab, compiled[order.name], docs[order.name], spec.logits_size)
        if with_coverage:
            res.coverage[lib.name] = {c.feature: verdict(lib, c, encode) for c in coverage_cases()}
        print(f"  done {vocab} {lib.name}", file=sys.stderr, flush=True)


def run_libraries(s: Settings) -> LibraryResults:
    res = LibraryResults()
    for i, vocab in enumerate(s.vocabs):
        run_vocab(vocab, s, res, with_coverage=i == 0)
    print_library_tables(res, s)
    return res


# ---- printing ------------------------------------------------------------------------------------

def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print(f"\n## {title}")
    for r in [header] + rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def f(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def ratio(a: float, b: float) -> str:
    return "n/a" if a != a or b != b or b == 0 else f"{a / b:.2f}"


def print_library_tables(res: LibraryResults, s: Settings) -> None:
    table("stand-in vocabularies (hybrid_jax/structured/bench_tokenizers.py)",
          ["vocab", "BPE ids", "added", "logits", "whitespace runs", "digit tokens", "JSON punct tokens",
           "non-ASCII tokens", "mean bytes"],
          [[v.name, v.bpe_tokens, v.added, v.logits_size, v.whitespace_runs, v.digit_tokens,
            v.json_punct_tokens, v.non_ascii_tokens, f(v.mean_bytes, 2)] for v in res.vocabs])
    table("tokenizer setup (once per engine start)", ["vocab", "library", "seconds"],
          [[r.vocab, r.library, f(r.seconds, 2)] for r in res.setup])
    table("compile and mask time per token (single request; llguidance keeps no grammar cache: its "
          "cached compile is a second matcher built from the grammar)",
          ["vocab", "grammar", "library", "compile cold ms", "compile cached ms", "first mask ms",
           "doc tokens", "mask p50 us", "mask p99 us", "fill p50 us", "valid"],
          [[g.vocab, g.grammar, g.library, f(g.cold_ms, 2), f(g.cached_ms, 3), f(g.first_mask_ms, 2),
            g.tokens, f(g.mask_p50_us), f(g.mask_p99_us), f(g.fill_p50_us), "yes" if g.valid else "NO"]
           for g in res.grammars])
    table(f"batch of {BATCH} (fill + accept for all rows, per step)",
          ["vocab", "library", "steps", "step p50 ms", "step p99 ms", "per row p50 us"],
          [[b.vocab, b.library, b.steps, f(b.p50_ms, 3), f(b.p99_ms, 3), f(b.p50_ms * 1e3 / BATCH)]
           for b in res.batches])
    table("rollback (schema:order, from mid-document)",
          ["vocab", "library", "k", "supported", "rollback us", "same mask"],
          [[r.vocab, r.library, r.k, "yes" if r.supported else "no", f(r.rollback_us),
            "yes" if r.same_mask else "NO"] for r in res.rollbacks])
    libs = list(res.coverage)
    table("JSON-schema coverage", ["feature"] + libs,
          [[c.feature] + [res.coverage[lib][c.feature] for lib in libs] for c in coverage_cases()])
    print_ratios(res, s.step_budget_ms)


def print_ratios(res: LibraryResults, budget_ms: float) -> None:
    by = {(g.vocab, g.grammar, g.library): g for g in res.grammars}
    rows = []
    for (vocab, grammar, lib), x in by.items():
        if lib != "xgrammar" or (vocab, grammar, "llguidance") not in by:
            continue
        y = by[(vocab, grammar, "llguidance")]
        rows.append([vocab, grammar, ratio(y.cold_ms, x.cold_ms), ratio(y.first_mask_ms, x.first_mask_ms),
                     ratio(y.mask_p50_us, x.mask_p50_us), ratio(y.mask_p99_us, x.mask_p99_us)])
    bb = {(b.vocab, b.library): b for b in res.batches}
    for (vocab, lib), x in bb.items():
        if lib == "xgrammar" and (vocab, "llguidance") in bb:
            y = bb[(vocab, "llguidance")]
            rows.append([vocab, f"batch {BATCH}", "", "", ratio(y.p50_ms, x.p50_ms), ratio(y.p99_ms, x.p99_ms)])
    table("ratios llguidance / xgrammar (< 1: llguidance faster)",
          ["vocab", "grammar", "compile cold", "first mask", "mask p50", "mask p99"], rows)
    print("\n" + recommendation(res, budget_ms))


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x and x > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def recommendation(res: LibraryResults, budget_ms: float) -> str:
    """The rule, in order: (1) eligible = exact rollback, every document's tokens allowed, and the
    batch's mask ready within `budget_ms` (p50 step of 32 rows: it is hidden behind the device step
    only if it is shorter); (2) fewest schema features that compile but give wrong output (ignored
    or over-strict: a 200 with invalid JSON, what issue 52 exists to end); (3) lower mask p99."""
    libs = ("xgrammar", "llguidance")
    by = {(g.vocab, g.grammar, g.library): g for g in res.grammars}
    pairs = [(by[k], by[(k[0], k[1], "llguidance")]) for k in by
             if k[2] == "xgrammar" and (k[0], k[1], "llguidance") in by]
    p99r = geomean([y.mask_p99_us / x.mask_p99_us for x, y in pairs])
    firstr = geomean([y.first_mask_ms / x.first_mask_ms for x, y in pairs])
    wrong = {lib: sum(v in ("ignored", "over-strict") for v in res.coverage.get(lib, {}).values()) for lib in libs}
    eligible = [lib for lib in libs
                if all(r.supported and r.same_mask for r in res.rollbacks if r.library == lib)
                and all(g.valid for g in res.grammars if g.library == lib)
                and all(b.p50_ms <= budget_ms for b in res.batches if b.library == lib)]
    faster = "llguidance" if p99r < 1 else "xgrammar"
    ranked = sorted(eligible, key=lambda lib: (wrong[lib], lib != faster))
    pick = ranked[0] if ranked else "neither"
    return (f"RECOMMENDATION: {pick} (eligible: {', '.join(eligible) or 'none'} [exact rollback, valid masks, "
            f"batch-{BATCH} step p50 <= {budget_ms:g} ms]; schema features compiled but wrong "
            f"(ignored/over-strict): {wrong}; llguidance/xgrammar geomean mask p99 {p99r:.2f}, "
            f"first-request mask {firstr:.2f})")


# ---- main ----------------------------------------------------------------------------------------

def settings(a: argparse.Namespace) -> Settings:
    cases = grammar_cases()
    if a.quick:
        return Settings(tuple(a.vocab or ["qwen3-151k"]),
                        tuple(c for c in cases if c.name in QUICK_CASES), max_steps=48, repeats=1,
                        step_budget_ms=a.step_budget_ms, concurrency=(1, 8))
    return Settings(tuple(a.vocab or bench_tokenizers.VOCABS), tuple(cases), max_steps=0, repeats=3,
                    step_budget_ms=a.step_budget_ms)


def run_engine(s: Settings) -> None:
    """The engine half (structured_engine.py): tokens/s with 0, 50% and 100% of rows masked at each
    concurrency, and the grammar compile from add_request to ready."""
    print("\n## the engine: tokens/s constrained vs free (shipped default model)")
    structured_engine.run(rounds=s.repeats, concurrency=list(s.concurrency))


PARTS = {"libraries": run_libraries, "engine": run_engine}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["all", *PARTS], default="all")
    ap.add_argument("--quick", action="store_true", help="one vocabulary, three grammars, 48 steps")
    ap.add_argument("--vocab", action="append", choices=list(bench_tokenizers.VOCABS))
    ap.add_argument("--step-budget-ms", type=float, default=10.0,
                    help="most a batch-32 mask may take: it must hide behind one device decode step")
    a = ap.parse_args(argv)
    s = settings(a)
    for name, part in PARTS.items():
        if a.part in ("all", name):
            part(s)


if __name__ == "__main__":
    main()
