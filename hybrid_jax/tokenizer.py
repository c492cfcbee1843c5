"""Tokenizers: a byte-level one for the embedded default model, and a checkpoint's own
`tokenizer.json` (Hugging Face tokenizers) when the checkpoint directory has one."""
from __future__ import annotations

import functools
import json
import os

from hybrid_jax.errors import CheckpointError
from hybrid_jax.template_sources import NO_TEMPLATES, ChatTemplates, load_chat_templates


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS = 256, EOS = 257, PAD = 258."""
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259
    max_token_bytes = 1          # each id is one byte of the text (see limits.refuse_unfittable)
    chat_templates: ChatTemplates = NO_TEMPLATES

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def decode_keeping(self, ids: list[int], keep: frozenset[str]) -> str:
        """`decode` keeping the special tokens named (this tokenizer's BOS / EOS / PAD have no text)."""
        return self.decode(ids)


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, read with the `tokenizers` library, and the chat templates beside it
    (`chat_templates`: chat_template.jinja or tokenizer_config.json's, see server/chat_template.py)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer  # noqa: PLC0415
        try:
            self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exception)
            raise CheckpointError(f"cannot read {os.path.join(path, 'tokenizer.json')}: {e}") from None
        self.eos_token_id = None
        self.bos_token_id = None
        self.chat_templates: ChatTemplates = load_chat_templates(path)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                tc = json.load(f)
            for attr in ("eos_token", "bos_token"):
                tok = tc.get(attr)
                if isinstance(tok, dict):
                    tok = tok.get("content")
                if isinstance(tok, str):
                    setattr(self, attr + "_id", self._tok.token_to_id(tok))
        self.max_token_bytes = max_token_bytes(json.loads(self._tok.to_str()))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if len(text) < RELEASE_GIL_CHARS:
            return self._tok.encode(text, add_special_tokens=add_bos).ids
        # the same encoding, but `encode_batch` lets go of the interpreter lock while it works (`encode`
        # holds it: 0.6 s for 582 KB, during which no other thread, the server's event loop included, runs)
        return self._tok.encode_batch([text], add_special_tokens=add_bos)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_keeping(self, ids: list[int], keep: frozenset[str]) -> str:
        """`decode`, but the special tokens whose text is in `keep` stay in the text (the markers of a
        tool-call parser: Kimi's `<|tool_call_begin|>` and the like are special tokens)."""
        drop = self._special_ids - {self._tok.token_to_id(t) for t in keep}
        return self._tok.decode([i for i in ids if i not in drop], skip_special_tokens=False)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)


RELEASE_GIL_CHARS = 4096      # texts this long are encoded without holding the interpreter lock
_SPLIT_KEEPS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


def _byte_alphabet() -> set[str]:
    """The 256 characters byte-level BPE writes bytes as (GPT-2's byte-to-unicode table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {chr(b) for b in printable} | {chr(256 + i) for i in range(len(extra))}


def max_token_bytes(spec: dict) -> int | None:
    """The most bytes of input text one token can stand for, for a tokenizer.json (`spec`) where that is
    provably bounded, else None. Bounded means: every input byte ends up in exactly one token and
    none is dropped, so a text of B UTF-8 bytes has at least B / max_token_bytes tokens. That holds for
    byte-level BPE (each byte becomes one character of a 256-character alphabet, all of them in the
    vocabulary, and a token's string is the bytes it covers) with no normalizer (NFC and friends merge
    code points), no pre-tokenizer step that removes text, no truncation, and added tokens that do not
    swallow the whitespace around them (lstrip / rstrip). Anything else: None (no pre-check)."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") is not None or spec.get("truncation") is not None:
        return None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(s.get("type") == "ByteLevel" for s in steps) or not all(
            s.get("type") == "ByteLevel" or (s.get("type") == "Split" and s.get("behavior") in _SPLIT_KEEPS)
            for s in steps):
        return None
    vocab = model.get("vocab") or {}
    alphabet = _byte_alphabet()
    if not alphabet <= vocab.keys():           # a byte with no token of its own would be dropped
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest = max((len(t) for t in vocab), default=1)
    return max([longest] + [len(t["content"].encode("utf-8")) for t in added])


def load_tokenizer(path: str | None):
    """The checkpoint's tokenizer if it ships `tokenizer.json`, else None."""
    if path is not None and os.path.exists(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    return None
