"""Grammars for the engine: the model's tokenizer in the grammar library's form, grammars compiled
off the engine thread and cached by their text, and each request's matcher.

`GrammarCompiler.request(params)` returns at once: the compile (the tokenizer's first, ~1 s at a
150k vocabulary, then the grammar's lexer and parser) runs on a worker thread, and a grammar already
compiled is shared (each request deep-copies the compiled matcher, which is cheap). The scheduler
admits a request only once its grammar is ready (`RequestGrammar.ready`), so no step waits on a
compile; one whose compile failed is failed with the compiler's message.

A `RequestGrammar` follows the request's emitted tokens: `fill` writes the next token's allowed set
as a bitmask row (bit t of word t // 32: token t allowed; the model's vocabulary may be larger than
the tokenizer's, and those ids are never allowed), `accept` consumes the tokens the request emitted,
`rollback` takes the last k back (speculative drafts), `valid_prefix` says how many of a draft the
grammar allows. A token outside the mask is a failure of the request (fail-closed), never emitted
silently."""
from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any

import numpy as np

from hybrid_jax.errors import InputError
from hybrid_jax.structured.params import StructuredOutputsParams

CACHE_ENTRIES = 256          # compiled grammars kept (least recently used first out)
MAX_ROLLBACK = 64            # tokens a matcher can take back (speculative drafts)


def words(vocab_size: int) -> int:
    """int32 words of a bitmask row over vocab_size tokens."""
    return (vocab_size + 31) // 32


def lltokenizer(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]):
    """The model's tokenizer as llguidance's LLTokenizer: a checkpoint's tokenizer.json as it is, the
    byte tokenizer through a wrapper; n_vocab is the model's (its logits' width)."""
    import llguidance  # noqa: PLC0415
    eos = list(eos_ids) or None
    tok = getattr(tokenizer, "_tok", None)
    if tok is not None:               # hybrid_jax.tokenizer.HFTokenizer
        return llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)),
                                  n_vocab=vocab_size, eos_token=eos)


class _ByteVocab:
    """The byte tokenizer's vocabulary as llguidance's TokenizerWrapper reads it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, getattr(tokenizer, "bos_token_id", None)
        self.tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(256, vocab_size)]

    def __call__(self, text):
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return list(data)


class RequestGrammar:
    """One request's grammar: its compile (a future, shared) and, once ready, its own matcher. gate: token
    ids after which the grammar applies (a reasoning model's end of thinking, `StructuredOutputsParams.after`);
    until the output holds them the request is free (`active` false) and the matcher waits."""

    def __init__(self, key: str, future: concurrent.futures.Future, gate: tuple[int, ...] = ()):
        self.key, self._future = key, future
        self._matcher = None
        self.gate = tuple(gate)
        self.active = not self.gate
        self._tail: list[int] = []

    @property
    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Why the grammar cannot be used (its compile failed), or None."""
        if not self._future.done():
            return None
        e = self._future.exception()
        return None if e is None else str(e)

    @property
    def matcher(self):
        if self._matcher is None:
            self._matcher = self._future.result().deep_copy()
        return self._matcher

    def fill(self, row: np.ndarray):
        """Writes the allowed set of the next token into row [W] int32 (contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, tokens: list[int]):
        """Consumes the tokens the request emitted (past the gate: before it nothing is held); raises (the
        request fails) for one the grammar does not allow, naming it."""
        if not self.active:
            for i, t in enumerate(tokens):
                self._tail = (self._tail + [int(t)])[-len(self.gate):]
                if tuple(self._tail) == self.gate:
                    self.active = True
                    tokens = tokens[i + 1:]
                    break
            else:
                return
        m = self.matcher
        for t in tokens:
            if not m.consume_token(int(t)):
                raise RuntimeError(f"token {int(t)} is outside the structured output's grammar: {m.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only the end of the sequence)."""
        return self.active and self.matcher.is_stopped()

    def rollback(self, k: int):
        if k > 0 and not self.matcher.rollback(k):
            raise RuntimeError(f"the grammar could not take back {k} tokens: {self.matcher.get_error()}")

    def fill_along(self, draft, rows: np.ndarray):
        """The masks of a verify's positions: rows [k + 1 or more, W] int32, row j the allowed set after
        the first j tokens of the draft (which the grammar must allow: `valid_prefix`). The matcher
        walks the draft and comes back (rollback), so it stays at the tokens the request emitted; on
        landing it consumes what the verify kept, the accepted count + 1, as the recurrent state does."""
        m = self.matcher
        for j, t in enumerate(draft):
            self.fill(rows[j])
            if not m.consume_token(int(t)):
                raise RuntimeError(f"draft token {int(t)} is outside the grammar: {m.get_error()}")
        self.fill(rows[len(draft)])
        self.rollback(len(draft))

    def valid_prefix(self, draft) -> int:
        """How many of the draft's tokens, in order, the grammar allows from here."""
        return self.matcher.validate_tokens([int(t) for t in draft])


_EXECUTOR = None


def fill_rows(grammars: list[RequestGrammar], buf: np.ndarray):
    """Each grammar's next-token mask into buf's rows ([>= len(grammars), W] int32, C-contiguous), the
    rows filled in parallel by llguidance's executor (its threads, off the GIL)."""
    global _EXECUTOR
    import llguidance  # noqa: PLC0415
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    _EXECUTOR.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)], buf.ctypes.data,
                                      buf.shape[1] * 4, buf.shape[0])


class GrammarCompiler:
    """Compiles requests' grammars on a worker thread, keeping the last CACHE_ENTRIES by their text.
    The tokenizer is converted on first use (on the worker too)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...], workers: int = 1):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._ll = None
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self.compiles = 0            # grammars compiled (cache misses)
        self.hits = 0

    def _tokenizer(self):
        with self._lock:
            if self._ll is None:
                self._ll = lltokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._ll

    def _compile(self, text: str):
        import llguidance  # noqa: PLC0415
        m = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if m.is_error():
            raise InputError(f"structured output: {m.get_error()}")
        return m

    def prepare(self):
        """Converts the tokenizer on the worker now (1-3 s at a 150k vocabulary), so the first request
        does not wait for it: the engine's warm-up calls this."""
        self._pool.submit(self._tokenizer)

    def request(self, params: StructuredOutputsParams, gate: tuple[int, ...] = ()) -> RequestGrammar:
        """The request's grammar, its compile submitted (or shared with an earlier request's); gate: the
        token ids after which it applies (none: from the first token)."""
        key = params.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                fut = self._pool.submit(self._compile, key)
                self._cache[key] = fut
                self.compiles += 1
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return RequestGrammar(key, fut, gate)

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
