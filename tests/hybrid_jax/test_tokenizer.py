"""A checkpoint's own tokenizer.json is used for string prompts; text is decoded with it."""
from __future__ import annotations

import json
import shutil

from tokenizers import Tokenizer, models, pre_tokenizers

from hybrid_jax import LLM, SamplingParams


def _write_tokenizer(d, vocab_size):
    words = ["<eos>", "hello", "world", "hybrid", "jax", "[UNK]"] + [f"w{i}" for i in range(vocab_size - 6)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def test_string_prompt_uses_checkpoint_tokenizer(tiny_checkpoint, tmp_path):
    d = tmp_path / "with_tok"
    shutil.copytree(tiny_checkpoint, d)
    _write_tokenizer(d, 211)
    llm = LLM(model=str(d))
    out = llm.generate("hello hybrid jax", SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.prompt_token_ids == [1, 3, 4]
    ids = out.outputs[0].token_ids
    assert ids == llm.generate({"prompt_token_ids": [1, 3, 4]},
                               SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    # the decoded text is the tokenizer's, without the special <eos>
    assert out.outputs[0].text == llm.tokenizer.decode(ids)
    assert "<eos>" not in out.outputs[0].text
    assert 0 in llm.eos_token_ids()      # tokenizer_config's eos_token stops generation
