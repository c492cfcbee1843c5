"""Incremental detokenization: the text of a growing token list without decoding all of it at
every step (which costs O(n^2) over a long generation).

Each step decodes a short window of already-emitted tokens plus the new ones and emits what the
new ones add. Tokens that end inside an unfinished UTF-8 sequence (the decode ends in U+FFFD) are
held back until the next token completes them. `finish()` decodes the whole list once, so the final
text is exactly `tokenizer.decode(all ids)`. Special tokens are skipped, except those a request
names in `keep_special_tokens` (the chat endpoint's tool-call markers): their text stays. `detokenize_with_stops` applies a request's stop strings
on the way, token by token (with include_stop_str_in_output, vLLM's: the text keeps the stop string
and ends with it).
"""
from __future__ import annotations

CONTEXT = 6          # tokens of left context: enough for merges and multi-byte characters


class IncrementalDetokenizer:
    def __init__(self, tokenizer, keep_special: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.keep = frozenset(keep_special)
        self.ids: list[int] = []
        self.text = ""
        self._done = 0                 # tokens whose text is already in self.text

    def add(self, new_ids: list[int]) -> str:
        """Appends tokens; returns the text they add (possibly "" while a character is unfinished)."""
        self.ids += new_ids
        start = max(0, self._done - CONTEXT)
        prefix = self._decode(self.ids[start:self._done])
        full = self._decode(self.ids[start:])
        if full.endswith("\ufffd") or not full.startswith(prefix):
            return ""                  # wait: an unfinished character, or a merge across the window
        delta = full[len(prefix):]
        self.text += delta
        self._done = len(self.ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode_keeping(ids, self.keep) if self.keep else self.tok.decode(ids)

    def finish(self) -> str:
        """Decodes everything once; returns what it adds to the text emitted so far."""
        final = self._decode(self.ids)
        delta = final[len(self.text):] if final.startswith(self.text) else final
        self.text = final
        self._done = len(self.ids)
        return delta


def detokenize_with_stops(q, detok: IncrementalDetokenizer, accepted: list[int], old_text: str,
                          skip: int = 0) -> list[int]:
    """Sets q.text from the new tokens; with stop strings, token by token, cutting the tokens after
    the one that completes a stop string (and the text before it, or after it with
    include_stop_str_in_output). The first `skip` tokens end nothing (min_tokens): a stop string must
    end in the text of a later one. Returns the tokens kept."""
    if not q.params.stop:
        detok.add(accepted)
        if q.finish_reason is not None:
            detok.finish()
        q.text = detok.text
        return accepted
    floor = len(old_text)            # a stop string found must end past the skipped tokens' text
    for j, t in enumerate(accepted):
        detok.add([t])
        if j == len(accepted) - 1 and q.finish_reason is not None:
            detok.finish()
        if j < skip:
            floor = len(detok.text) + 1
            continue
        for s in q.params.stop:
            at = detok.text.find(s, max(0, floor - len(s)))
            if at >= 0:
                end = at + len(s) if q.params.include_stop_str_in_output else at
                q.text, q.finish_reason = detok.text[:end], "stop"
                return accepted[:j + 1]
    q.text = detok.text
    return accepted
