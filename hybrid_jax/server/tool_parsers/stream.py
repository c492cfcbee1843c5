"""The streaming parser: text deltas in, `Delta`s out — reasoning, content, tool calls.

Text first goes through the reasoning splitter (when the family has reasoning), then the answer
through the tool-call scanner: outside a block, text is content up to the block's begin marker (a
tail that may be its beginning is held back, so `<tool_` never leaks before `call>`); inside, the
block is buffered whole until its end marker, then parsed. A block that parses becomes calls (for
each, a start delta with index, id and name, then its whole arguments as one fragment); one that
does not, or one the text ends inside, is given back as content, markers and all. So the deltas
never depend on where the text was split, and `parse` (the whole text fed at once) gives what a
client accumulating the stream gets."""
from __future__ import annotations

import dataclasses
import enum

from hybrid_jax.server.tool_parsers.arguments import Schemas
from hybrid_jax.server.tool_parsers.formats import ToolFormat
from hybrid_jax.server.tool_parsers.markers import TextRun, split_at
from hybrid_jax.server.tool_parsers.reasoning import ReasoningFormat, ReasoningSplitter
from hybrid_jax.server.tool_parsers.types import Delta, ParsedMessage, collect, new_call_id


class _Where(enum.Enum):
    TEXT = "text"
    BLOCK = "block"


class ToolCallScanner:
    """The answer's text -> content and call deltas (see the module's docstring)."""

    def __init__(self, fmt: ToolFormat, schemas: Schemas, parallel: bool):
        self.fmt, self.schemas, self.parallel = fmt, schemas, parallel
        self.where = _Where.TEXT
        self.buffer = ""
        self.run = TextRun()
        self.blank_before = ""                # the whitespace before the open block (content again if it fails)
        self.begins = tuple(fmt.blocks)
        self.begin = fmt.begin                # the open block's begin marker
        self.searched = 0                     # how far the open block was searched for its end, less a marker
        self.n_calls = 0

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while True:
            if self.where is _Where.TEXT:
                s = split_at(self.buffer, self.begins, final)
                out += self._content(self.run.add(s.before))
                self.buffer = s.after
                if not s.found:
                    if final:
                        out += self._content(self.run.cut())
                    return out
                self.blank_before, self.where, self.begin = self.run.cut(), _Where.BLOCK, s.marker
                self.searched = 0
            end = self.fmt.blocks[self.begin]
            at = self.buffer.find(end, self.searched)      # (a long block is searched once, not per delta)
            if at < 0:
                self.searched = max(0, len(self.buffer) - len(end) + 1)
                if final:                      # the text ended inside a block: it is content
                    out += self._content(self.blank_before + self.begin + self.buffer)
                    self.buffer = ""
                return out
            out += self._block(self.buffer[:at])
            self.buffer, self.where = self.buffer[at + len(end):], _Where.TEXT

    def _block(self, body: str) -> list[Delta]:
        calls = self.fmt.parse_block(body, self.schemas)
        if calls is None:
            self.run = TextRun()
            return self._content(self.blank_before + self.begin + body + self.fmt.blocks[self.begin])
        self.run.after_marker()
        out = []
        for c in calls:
            if self.n_calls and not self.parallel:
                break                          # parallel_tool_calls false: the first call only
            i = self.n_calls
            self.n_calls += 1
            out += [Delta(call_index=i, call_id=c.id or new_call_id(), name=c.name, arguments=""),
                    Delta(call_index=i, arguments=c.arguments)]
        return out

    @staticmethod
    def _content(text: str) -> list[Delta]:
        return [Delta(content=text)] if text else []


class _PlainText:
    """The answer when no tool calls are parsed: all content, as it comes."""
    n_calls = 0

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        return [Delta(content=text)] if text else []


@dataclasses.dataclass(frozen=True)
class MessageParser:
    """How one request's output is split: its family's tool format (None: no tool calls parsed, e.g.
    tool_choice "none"), reasoning format (None: no reasoning split), the request's tools' schemas, and
    whether more than one call is kept."""
    tool_format: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None
    schemas: Schemas = dataclasses.field(default_factory=dict)
    parallel: bool = True

    def stream(self, prompt: str = "") -> MessageStream:
        """A streaming state for an output that follows `prompt` (its rendered text: it decides whether
        the output starts inside reasoning)."""
        return MessageStream(self, prompt)

    def parse(self, text: str, prompt: str = "") -> ParsedMessage:
        """The whole output at once."""
        st = self.stream(prompt)
        return collect(st.feed(text) + st.finish())

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker strings the parser reads (the detokenizer keeps them in the text)."""
        tool = self.tool_format.markers if self.tool_format else ()
        think = (self.reasoning.start, self.reasoning.end) if self.reasoning else ()
        return tool + think


class MessageStream:
    """One output's streaming state: `feed` each text delta, then `finish` once."""

    def __init__(self, parser: MessageParser, prompt: str):
        self.splitter = ReasoningSplitter(parser.reasoning, parser.reasoning.starts_inside(prompt)) \
            if parser.reasoning else None
        self.answer = ToolCallScanner(parser.tool_format, parser.schemas, parser.parallel) \
            if parser.tool_format else _PlainText()

    def feed(self, text: str) -> list[Delta]:
        return self._step(text, False)

    def finish(self) -> list[Delta]:
        return self._step("", True)

    @property
    def made_calls(self) -> bool:
        return self.answer.n_calls > 0

    def _step(self, text: str, final: bool) -> list[Delta]:
        out: list[Delta] = []
        if self.splitter is not None:
            pieces = self.splitter.feed(text, final)
            if pieces.reasoning:
                out.append(Delta(reasoning=pieces.reasoning))
            text = pieces.answer
        return out + self.answer.feed(text, final)
