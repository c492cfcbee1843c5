"""Incremental detokenization: the streamed pieces add up to decoding everything at once, and no
piece ends inside an unfinished UTF-8 character."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax.engine.detokenize import IncrementalDetokenizer
from hybrid_jax.tokenizer import ByteTokenizer


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_pieces_add_up_to_full_decode(seed, chunk):
    tok = ByteTokenizer()
    text = "héllo wörld — ünïcode ✓ 漢字 " * 3
    ids = list(text.encode("utf-8"))
    rng = np.random.default_rng(seed)
    ids = ids + rng.integers(0, 256, 40).tolist()        # arbitrary bytes too, invalid UTF-8 included
    d = IncrementalDetokenizer(tok)
    pieces = []
    for i in range(0, len(ids), chunk):
        piece = d.add(ids[i:i + chunk])
        assert not piece.endswith("\ufffd") or i + chunk >= len(ids) or piece == ""
        pieces.append(piece)
    pieces.append(d.finish())
    assert "".join(pieces) == tok.decode(ids)
    assert d.text == tok.decode(ids)


def test_multibyte_character_is_held_until_complete():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok)
    b = "✓".encode("utf-8")                                # three bytes
    assert d.add([b[0]]) == "" and d.add([b[1]]) == ""
    assert d.add([b[2]]) == "✓"


def test_special_tokens_named_by_the_request_stay_in_the_text(tmp_path):
    """Kimi's tool-call markers are special tokens: skipped like any other, unless the request's
    `keep_special_tokens` names them (the chat endpoint's parser does); the others stay skipped."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    from hybrid_jax.tokenizer import HFTokenizer  # noqa: PLC0415
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "call": 1, "x": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<|tool_call_begin|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path))
    ids = hf.encode("call <|tool_call_begin|> x <|im_end|>", add_bos=False)
    assert len(ids) == 4 and hf.decode(ids) == "call x"
    plain, kept = IncrementalDetokenizer(hf), IncrementalDetokenizer(hf, ("<|tool_call_begin|>",))
    for t in ids:
        plain.add([t])
        kept.add([t])
    plain.finish(), kept.finish()
    assert "<|tool_call_begin|>" not in plain.text
    assert "<|tool_call_begin|>" in kept.text and "<|im_end|>" not in kept.text
    assert kept.text.replace("<|tool_call_begin|>", "").split() == ["call", "x"]
