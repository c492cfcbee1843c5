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
