"""Stand-in tokenizers of the served families' vocabulary sizes, for grammar benchmarks without the hub.

The real tokenizers (Qwen3 151,936 logits; DeepSeek-V3 129,280; Kimi 163,840) cannot be downloaded
here, and a grammar library's mask time depends on the vocabulary: how many tokens, how long they
are, how many hold JSON punctuation, digits and runs of whitespace. So each stand-in is a byte-level
BPE (GPT-2's byte-to-character mapping, as Qwen's and DeepSeek's tokenizer.json use) trained with the
`tokenizers` library on a corpus assembled on this machine: Python sources of the installed
packages, JSON documents generated here (compact, indented by 2 and 4, with numbers, nested keys
and escapes), and the King James text under tests/data. Its pre-tokenizer splits as the family's
released regex does (Qwen: one digit per token; DeepSeek and Kimi: up to three), then the family's
added tokens follow the BPE ids and the logits row is padded to the model's size, as in the release.

What differs from the real vocabularies: no CJK or other scripts beyond what the Python sources
hold (the real ones spend tens of thousands of ids on them), merges learned from code and JSON
rather than from web text (so more punctuation/indentation tokens), Kimi's tiktoken ranks become a
byte-level BPE, and DeepSeek's added tokens are named as in its release only for the first few (the
rest are placeholders, as the release's are). Built once and cached under a temp directory.
"""
from __future__ import annotations

import json
import os
import random
import site
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Pre-tokenizer split patterns, written after the families' released tokenizer.json / tiktoken
# pattern: Qwen splits every digit alone; DeepSeek and Kimi keep runs of up to three digits.
_LETTERS_AND_PUNCT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = r"\p{N}|" + _LETTERS_AND_PUNCT
THREE_DIGIT_SPLIT = r"\p{N}{1,3}|" + _LETTERS_AND_PUNCT

_QWEN_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
               "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
               "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
               "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
               "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
               "<think>", "</think>")
_DEEPSEEK_NAMED = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                   "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                   "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
                   "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>")
_KIMI_NAMED = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
               "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|tool_calls_section_begin|>",
               "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
               "<|tool_call_end|>", "<|im_middle|>", "<think>", "</think>")


@dataclass(frozen=True)
class VocabSpec:
    """One family's vocabulary shape: BPE ids, then added tokens, then padding up to the logits row."""
    name: str
    bpe_tokens: int
    added: tuple[str, ...]
    logits_size: int
    split: str
    eos: str

    @property
    def tokenizer_size(self) -> int:
        return self.bpe_tokens + len(self.added)


def _padded(named: tuple[str, ...], total: int, fmt: str) -> tuple[str, ...]:
    return named + tuple(fmt.format(i) for i in range(total - len(named)))


VOCABS: dict[str, VocabSpec] = {
    # Qwen3: 151,643 BPE + 26 added = 151,669 in the tokenizer, 151,936 logits.
    "qwen3-151k": VocabSpec("qwen3-151k", 151_643, _QWEN_ADDED, 151_936, QWEN_SPLIT, "<|im_end|>"),
    # DeepSeek-V3 / V3.2: 128,000 BPE + 815 added (mostly placeholders) = 128,815, 129,280 logits.
    "deepseek-129k": VocabSpec("deepseek-129k", 128_000,
                               _padded(_DEEPSEEK_NAMED, 815, "<｜place▁holder▁no▁{}｜>"), 129_280,
                               THREE_DIGIT_SPLIT, "<｜end▁of▁sentence｜>"),
    # Kimi (K2 / Linear): 163,584 tiktoken ranks + 256 reserved specials = 163,840 = logits.
    "kimi-163k": VocabSpec("kimi-163k", 163_584, _padded(_KIMI_NAMED, 256, "<|reserved_token_{}|>"),
                           163_840, THREE_DIGIT_SPLIT, "<|im_end|>"),
}

CORPUS_PYTHON_BYTES = 48_000_000
CORPUS_JSON_DOCS = 40_000


def cache_dir() -> Path:
    """Where built tokenizers live: $HYBRID_JAX_BENCH_TOKENIZERS or <tmp>/hybrid_jax_bench_tokenizers."""
    d = os.environ.get("HYBRID_JAX_BENCH_TOKENIZERS") or os.path.join(tempfile.gettempdir(),
                                                                     "hybrid_jax_bench_tokenizers")
    Path(d).mkdir(parents=True, exist_ok=True)
    return Path(d)


def _python_sources(limit: int) -> list[str]:
    out, size = [], 0
    for root in sorted(site.getsitepackages()):
        for path in sorted(Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.append(text)
            size += len(text)
            if size >= limit:
                return out
    return out


_WORDS = ("id", "name", "type", "value", "items", "user", "email", "status", "created_at", "price",
          "count", "tags", "address", "city", "country", "zip", "description", "enabled", "score",
          "metadata", "version", "children", "parent", "title", "url", "message", "error", "code",
          "arguments", "function", "tool_calls", "content", "role", "latitude", "longitude", "unit")


def _json_value(rng: random.Random, depth: int):
    kind = rng.choice(("obj", "arr", "str", "int", "float", "bool", "null") if depth < 4
                      else ("str", "int", "float", "bool", "null"))
    if kind == "obj":
        return {rng.choice(_WORDS) + ("" if rng.random() < 0.7 else f"_{rng.randint(0, 9)}"):
                _json_value(rng, depth + 1) for _ in range(rng.randint(1, 6))}
    if kind == "arr":
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    if kind == "str":
        s = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))
        return s + rng.choice(("", "", "\n", "\"quoted\"", " é", "/path"))
    if kind == "int":
        return rng.choice((rng.randint(0, 100), rng.randint(-10**6, 10**6), rng.randint(0, 10**12)))
    if kind == "float":
        return round(rng.uniform(-1000, 1000), rng.randint(1, 6))
    return {"bool": rng.random() < 0.5, "null": None}[kind]


def _json_documents(n: int) -> list[str]:
    rng = random.Random(52)
    return [json.dumps(_json_value(rng, 0), indent=rng.choice((None, None, 2, 4)),
                       ensure_ascii=rng.random() < 0.5) for _ in range(n)]


def corpus() -> list[str]:
    """The training texts: Python sources, generated JSON, and the King James text of tests/data."""
    data = Path(__file__).resolve().parents[2] / "tests" / "data"
    kjv = [p.read_text(encoding="utf-8") for p in sorted(data.glob("kjv_*.txt"))]
    return _python_sources(CORPUS_PYTHON_BYTES) + _json_documents(CORPUS_JSON_DOCS) + kjv


def _empty_tokenizer(spec: VocabSpec) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train(spec: VocabSpec, texts: list[str]) -> Tokenizer:
    """Trains the BPE part to exactly `spec.bpe_tokens` ids, then appends the added tokens."""
    tok = _empty_tokenizer(spec)
    trainer = trainers.BpeTrainer(vocab_size=spec.bpe_tokens, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size()
    if got != spec.bpe_tokens:
        raise RuntimeError(f"{spec.name}: BPE training reached {got} ids, not {spec.bpe_tokens}; "
                           "the corpus is too small")
    tok.add_special_tokens(list(spec.added))
    assert tok.get_vocab_size() == spec.tokenizer_size
    return tok


def load(name: str) -> Tokenizer:
    """The stand-in tokenizer `name` (a key of VOCABS), trained on first use and cached as JSON."""
    spec = VOCABS[name]
    path = cache_dir() / f"{name}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = train(spec, corpus())
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return tok


def hf_tokenizer(name: str):
    """The stand-in wrapped as transformers' fast tokenizer (what both grammar libraries read)."""
    from transformers import PreTrainedTokenizerFast
    spec = VOCABS[name]
    return PreTrainedTokenizerFast(tokenizer_object=load(name), eos_token=spec.eos)


@dataclass(frozen=True)
class VocabStats:
    """What in a vocabulary drives mask cost: how many tokens of each shape, and how long."""
    name: str
    bpe_tokens: int
    added: int
    logits_size: int
    whitespace_runs: int
    digit_tokens: int
    json_punct_tokens: int
    non_ascii_tokens: int
    mean_bytes: float


def _byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table: printable bytes map to themselves, the other
    188 bytes to U+0100 onward in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


def token_bytes(tok: Tokenizer, bpe_tokens: int) -> list[bytes]:
    """Each BPE id's bytes."""
    table = _byte_of_char()
    return [bytes(table[c] for c in tok.id_to_token(i)) for i in range(bpe_tokens)]


def describe(name: str) -> VocabStats:
    spec = VOCABS[name]
    pieces = token_bytes(load(name), spec.bpe_tokens)
    json_punct = set(b'{}[]:,"')
    return VocabStats(
        name, spec.bpe_tokens, len(spec.added), spec.logits_size,
        whitespace_runs=sum(len(p) > 1 and p.isspace() for p in pieces),
        digit_tokens=sum(p.strip().isdigit() for p in pieces),
        json_punct_tokens=sum(len(p) > 1 and any(b in json_punct for b in p) for p in pieces),
        non_ascii_tokens=sum(any(b > 127 for b in p) for p in pieces),
        mean_bytes=sum(map(len, pieces)) / len(pieces))
