"""xgrammar and llguidance behind one small interface, configured as vLLM configures them.

An adapter is built once per (library, vocabulary) — the tokenizer conversion is the expensive part —
then compiles grammars into `Compiled` handles and makes matchers from them. Both libraries write the
same mask layout (int32 words, bit i of word j = token 32*j + i allowed), so masks compare directly.

Configuration: JSON schemas with flexible whitespace (vLLM's default); xgrammar in its default strict
mode (objects without `additionalProperties` take no extra keys); llguidance's matcher is built per
request from the grammar string (it has no compiled-grammar cache; vLLM does the same), so its
"cached" compile is a second construction.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np
import xgrammar as xgr


class GrammarRejected(Exception):
    """The library refused the grammar; the message is the library's."""


@dataclass
class Compiled:
    """A compiled grammar: xgrammar's CompiledGrammar, or llguidance's grammar string."""
    handle: object


class XgrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar):
        self.m = xgr.GrammarMatcher(compiled)

    def fill(self, mask: np.ndarray, row: int = 0) -> None:
        self.m.fill_next_token_bitmask(mask, row)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, k: int) -> bool:
        self.m.rollback(k)
        return True

    def finished(self) -> bool:
        return self.m.is_terminated()


class LlguidanceMatcher:
    def __init__(self, m: llguidance.LLMatcher):
        self.m = m

    def fill(self, mask: np.ndarray, row: int = 0) -> None:
        llnp.fill_next_token_bitmask(self.m, mask, row)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def rollback(self, k: int) -> bool:
        return self.m.rollback(k)

    def finished(self) -> bool:
        return self.m.is_stopped()


class XgrammarLib:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, logits_size: int):
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=logits_size)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=True)
        self.eos = hf_tokenizer.eos_token_id
        self.batcher = xgr.BatchGrammarMatcher()

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def compile(self, kind: str, source: str) -> Compiled:
        try:
            if kind == "json_schema":
                return Compiled(self.compiler.compile_json_schema(source, any_whitespace=True))
            if kind == "regex":
                return Compiled(self.compiler.compile_regex(source))
            if kind == "choice":
                alts = " | ".join(json.dumps(c) for c in json.loads(source))
                return Compiled(self.compiler.compile_grammar(f"root ::= {alts}"))
            return Compiled(self.compiler.compile_grammar(source))
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError / ValueError
            raise GrammarRejected(str(e).splitlines()[0][:120]) from e

    def matcher(self, c: Compiled) -> XgrammarMatcher:
        return XgrammarMatcher(c.handle)

    def batch_fill(self, matchers: list[XgrammarMatcher], mask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask([m.m for m in matchers], mask)

    def batch_accept(self, matchers: list[XgrammarMatcher], tokens: list[int]) -> list[bool]:
        return xgr.BatchGrammarMatcher.batch_accept_token([m.m for m in matchers], tokens)


class LlguidanceLib:
    name = "llguidance"

    def __init__(self, hf_tokenizer, logits_size: int):
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=logits_size)
        self.eos = hf_tokenizer.eos_token_id
        self.executor = llguidance.LLExecutor()

    def clear_cache(self) -> None:
        """Nothing to clear: llguidance keeps no compiled-grammar cache."""

    @staticmethod
    def grammar(kind: str, source: str) -> str:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                source, defaults={"whitespace_flexible": True})
        if kind == "regex":
            return llguidance.grammar_from("regex", source)
        if kind == "choice":
            return llguidance.grammar_from("choice", source)
        return llguidance.grammar_from("grammar", source)

    def compile(self, kind: str, source: str) -> Compiled:
        """Builds a matcher (llguidance compiles in LLMatcher's constructor) and keeps its grammar."""
        try:
            grammar = self.grammar(kind, source)
        except ValueError as e:
            raise GrammarRejected(str(e).splitlines()[0][:120]) from e
        m = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise GrammarRejected(m.get_error().splitlines()[0][:120])
        return Compiled(grammar)

    def matcher(self, c: Compiled) -> LlguidanceMatcher:
        return LlguidanceMatcher(llguidance.LLMatcher(self.tok, c.handle, log_level=0))

    def batch_fill(self, matchers: list[LlguidanceMatcher], mask: np.ndarray) -> None:
        llnp.fill_next_token_bitmask_par(self.executor, [(m.m, i) for i, m in enumerate(matchers)], mask)

    def batch_accept(self, matchers: list[LlguidanceMatcher], tokens: list[int]) -> list[bool]:
        return llnp.consume_token_par(self.executor, [(m.m, t) for m, t in zip(matchers, tokens)])


LIBRARIES = (XgrammarLib, LlguidanceLib)


def new_mask(rows: int, logits_size: int) -> np.ndarray:
    return np.full((rows, (logits_size + 31) // 32), -1, dtype=np.int32)


def allowed(mask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)
