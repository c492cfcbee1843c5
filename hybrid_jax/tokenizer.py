"""Tokenizers: a byte-level one for the embedded default model, and a checkpoint's own
`tokenizer.json` (Hugging Face tokenizers) when the checkpoint directory has one."""
from __future__ import annotations

import json
import os

from hybrid_jax.errors import CheckpointError


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS = 256, EOS = 257, PAD = 258."""
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, read with the `tokenizers` library."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer  # noqa: PLC0415
        try:
            self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exception)
            raise CheckpointError(f"cannot read {os.path.join(path, 'tokenizer.json')}: {e}") from None
        self.eos_token_id = None
        self.bos_token_id = None
        self.chat_template = None
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                tc = json.load(f)
            self.chat_template = tc.get("chat_template")
            for attr in ("eos_token", "bos_token"):
                tok = tc.get(attr)
                if isinstance(tok, dict):
                    tok = tok.get("content")
                if isinstance(tok, str):
                    setattr(self, attr + "_id", self._tok.token_to_id(tok))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | None):
    """The checkpoint's tokenizer if it ships `tokenizer.json`, else None."""
    if path is not None and os.path.exists(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    return None
