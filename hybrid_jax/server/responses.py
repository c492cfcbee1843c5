"""Response bodies of /v1/completions and /v1/chat/completions: each choice built from its engine
outputs (`ChoiceAcc`), the log-probability blocks in OpenAI's two shapes (completions: the legacy
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists; chat: `content[]` entries with
token, logprob, bytes and top_logprobs), echo and usage. A chat choice with a parser (its tool calls and
reasoning: server/chat_output.py) is built, whole or streamed, from the deltas that parser gave."""
from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.engine.request import EngineOutput
from hybrid_jax.server import chat_output
from hybrid_jax.server.chat_output import ChatOutput
from hybrid_jax.server.tool_parsers import Delta, MessageStream, collect


@dataclasses.dataclass(frozen=True)
class Format:
    """How a response shows its tokens: the tokenizer that names them (`token_id:N` with
    return_tokens_as_token_ids, or without a tokenizer), the log-probabilities asked for, echo."""
    tokenizer: Any
    logprobs: int | None = None
    tokens_as_ids: bool = False
    echo: bool = False
    drop_generated: bool = False     # echo with max_tokens 0: the engine made 1 token, the response shows none
    prompt_logprobs: bool = False    # vLLM's prompt_logprobs asked for by name: returned in its own field

    def token(self, t: int) -> str:
        if self.tokens_as_ids or self.tokenizer is None:
            return f"token_id:{t}"
        return self.tokenizer.decode([t])


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt as the response shows it (echo): its text and token ids."""
    text: str
    ids: list[int]


@dataclasses.dataclass
class ChoiceAcc:
    """One choice's outputs so far."""
    index: int
    prompt: Prompt
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None
    finish_reason: str | None = None
    reading: ChatOutput | None = None        # chat: how the text is parsed (tool calls, reasoning)
    stream: MessageStream | None = dataclasses.field(default=None, init=False)   # the parser's state
    deltas: list[Delta] = dataclasses.field(default_factory=list, init=False)      # all the parser gave
    new_deltas: list[Delta] = dataclasses.field(default_factory=list, init=False)  # what the last output added

    def __post_init__(self):
        if self.reading is not None:
            self.stream = self.reading.parser.stream(self.prompt.text)

    def add(self, out: EngineOutput):
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.finish_reason = out.finish_reason
        if self.stream is not None:
            self.new_deltas = self.stream.feed(out.new_text) + (self.stream.finish() if out.finished else [])
            self.deltas += self.new_deltas

    @property
    def reported_finish(self) -> str | None:
        """The finish_reason a response shows: "tool_calls" once calls were parsed."""
        if self.finish_reason is not None and self.stream is not None and self.stream.made_calls:
            return "tool_calls"
        return self.finish_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(fmt: Format, lps: list[dict | None], offset: int = 0,
                        prompt_ids: list[int] | None = None) -> dict:
    """OpenAI's completions logprobs block. `lps` entries {"token_id", "logprob", "top": [(id, lp)]};
    None (the first prompt token of an echo, with `prompt_ids` naming it): logprob and top null.
    `offset`: the text offset of the first token."""
    out = {"tokens": [], "token_ids": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for k, x in enumerate(lps):
        tid = x["token_id"] if x is not None else prompt_ids[k]
        tok = fmt.token(tid)
        out["tokens"].append(tok)
        out["token_ids"].append(tid)
        out["token_logprobs"].append(None if x is None else x["logprob"])
        out["top_logprobs"].append(None if x is None else {fmt.token(t): v for t, v in x["top"]})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def _joined(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def echo_logprobs(fmt: Format, prompt: Prompt, prompt_lps: list[dict | None] | None) -> dict:
    """The prompt's part of an echo's logprobs block: the first token's logprob null, as OpenAI / vLLM."""
    entries = list(prompt_lps) if prompt_lps is not None else [None] * len(prompt.ids)
    return completion_logprobs(fmt, entries, 0, prompt.ids)


def chat_logprobs(fmt: Format, lps: list[dict]) -> dict:
    """OpenAI's chat logprobs block: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(t: int, lp: float) -> dict:
        s = fmt.token(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(x["token_id"], x["logprob"]), "top_logprobs": [entry(t, v) for t, v in x["top"]]}
                        for x in lps]}


def vllm_prompt_logprobs(fmt: Format, prompt: Prompt, lps: list[dict | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob,
    decoded_token}} for the token itself and the top ones."""
    if lps is None:
        return None
    out: list = []
    for tid, x in zip(prompt.ids, lps):
        if x is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": v, "decoded_token": fmt.token(t)} for t, v in x["top"]}
        d[str(tid)] = {"logprob": x["logprob"], "decoded_token": fmt.token(tid)}
        out.append(d)
    return out


def completion_choice(acc: ChoiceAcc, fmt: Format) -> dict:
    """A completions choice: with echo, the prompt's text (and log-probabilities) first."""
    text, ids, lps = acc.text, acc.token_ids, acc.logprobs
    if fmt.drop_generated:
        text, ids, lps = "", [], []
    block = None
    if fmt.logprobs is not None:
        block = completion_logprobs(fmt, lps)
        if fmt.echo:
            head = echo_logprobs(fmt, acc.prompt, acc.prompt_logprobs)
            shift = len(acc.prompt.text)
            block = _joined(head, {**block, "text_offset": [o + shift for o in block["text_offset"]]})
    choice = {"index": acc.index, "text": (acc.prompt.text if fmt.echo else "") + text, "token_ids": ids,
              "finish_reason": acc.finish_reason, "logprobs": block}
    if fmt.prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(fmt, acc.prompt, acc.prompt_logprobs)
    return choice


def chat_choice(acc: ChoiceAcc, fmt: Format) -> dict:
    msg = {"role": "assistant", "content": acc.text} if acc.reading is None else \
        chat_output.message(collect(acc.deltas), acc.reading)
    return {"index": acc.index, "message": msg, "finish_reason": acc.reported_finish,
            "logprobs": chat_logprobs(fmt, acc.logprobs) if fmt.logprobs is not None else None}


def completion_delta(acc: ChoiceAcc, out: EngineOutput, fmt: Format, first: bool) -> dict:
    """A streamed completions choice for one output (`acc` already holds it); the first of a choice
    carries the echo."""
    text, ids, lps = out.new_text, out.new_token_ids, out.new_logprobs
    if fmt.drop_generated:
        text, ids, lps = "", [], []
    block = completion_logprobs(fmt, lps) if fmt.logprobs is not None else None
    if first and fmt.echo:
        text = acc.prompt.text + text
        if block is not None:
            head = echo_logprobs(fmt, acc.prompt, acc.prompt_logprobs)
            block = _joined(head, {**block, "text_offset": [o + len(acc.prompt.text) for o in block["text_offset"]]})
    return {"index": acc.index, "text": text, "token_ids": ids, "finish_reason": out.finish_reason, "logprobs": block}


def completion_deltas(acc: ChoiceAcc, out: EngineOutput, fmt: Format, first: bool) -> list[dict]:
    return [completion_delta(acc, out, fmt, first)]


def chat_delta(acc: ChoiceAcc, out: EngineOutput, fmt: Format, first: bool) -> list[dict]:
    """The streamed chat choices for one output (`acc` already holds it): one, or with a parser one per
    piece it gave (none while it holds text back); the role on a choice's first, the log-probabilities
    on the output's first, the finish_reason on its last."""
    lps = chat_logprobs(fmt, out.new_logprobs) if fmt.logprobs is not None else None
    if acc.reading is None:
        deltas = [{"content": out.new_text}]
    else:
        deltas = [d for x in acc.new_deltas if (d := chat_output.delta(x, acc.reading)) is not None]
        if not deltas and (out.finish_reason is not None or lps is not None):
            deltas = [{}]
    entries = [{"index": acc.index, "delta": d, "finish_reason": None, "logprobs": None} for d in deltas]
    if entries:
        if first:
            entries[0]["delta"] = {"role": "assistant", **entries[0]["delta"]}
        entries[0]["logprobs"] = lps
        entries[-1]["finish_reason"] = acc.reported_finish if out.finish_reason is not None else None
    return entries
