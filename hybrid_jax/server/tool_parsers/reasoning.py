"""Reasoning separation: the text between a family's reasoning markers (`<think>` ... `</think>` for
every family served here) is the message's `reasoning_content`, the rest its answer.

Where the output starts is decided by the rendered prompt, not by the family: a generation prompt
that opened the reasoning block (Qwen3.5 and Qwen3 Thinking put `<think>\\n` at its end, DeepSeek's
thinking mode `<think>`) starts the output inside it; otherwise the output may open one itself, as
its first non-blank text. Without the end marker, all the text after the start is reasoning
(a generation cut by max_tokens while thinking). Whitespace next to a marker is dropped."""
from __future__ import annotations

import dataclasses
import enum

from hybrid_jax.server.tool_parsers.markers import TextRun, split_at


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str

    def starts_inside(self, prompt: str) -> bool:
        """Whether a prompt ends inside an open reasoning block (its last start after its last end)."""
        at = prompt.rfind(self.start)
        return at >= 0 and prompt.rfind(self.end) < at


THINK = ("<think>", "</think>")
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    name: ReasoningFormat(name, *THINK) for name in ("qwen3", "deepseek_v3", "deepseek_v4", "kimi_k2")}


class _State(enum.Enum):
    BEFORE = "before"        # may still open a block (only blank text so far)
    INSIDE = "inside"
    AFTER = "after"


@dataclasses.dataclass(frozen=True)
class Pieces:
    reasoning: str
    answer: str


class ReasoningSplitter:
    """Splits streamed text into reasoning and answer (`feed` each piece, then `finish`)."""

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        self.state = _State.INSIDE if inside else _State.BEFORE
        self.buffer = ""
        self.run = TextRun(skip_leading=True)
        self.answer_blank = False            # after the end marker: the answer's leading blanks are dropped

    def feed(self, text: str, final: bool = False) -> Pieces:
        self.buffer += text
        reasoning, answer = [], []
        while True:
            if self.state is _State.BEFORE:
                head = self.buffer.lstrip()
                if head.startswith(self.fmt.start):
                    self.buffer, self.state = head[len(self.fmt.start):], _State.INSIDE
                    continue
                if not final and (not head or self.fmt.start.startswith(head)):
                    break                        # blank so far, or the start marker's beginning
                self.state = _State.AFTER
            if self.state is _State.AFTER:
                if self.answer_blank:
                    self.buffer = self.buffer.lstrip()
                    self.answer_blank = not self.buffer
                answer.append(self.buffer)
                self.buffer = ""
                break
            s = split_at(self.buffer, self.fmt.end, final)
            reasoning.append(self.run.add(s.before))
            self.buffer = s.after
            if not s.found:
                break
            self.run.cut()
            self.state, self.answer_blank = _State.AFTER, True
        return Pieces("".join(reasoning), "".join(answer))

    def finish(self) -> Pieces:
        return self.feed("", final=True)
