"""Finding a marker in text that arrives in pieces: the text before it is safe to hand on, unless
its end could be the start of the marker (`<tool_` before `call>`), which is held back until the
next piece decides. Also the whitespace rule both parsers share: whitespace next to a marker is
dropped (text before a call or `</think>` is emitted without its trailing whitespace, text after
one without its leading whitespace), so the stream holds trailing whitespace until it knows."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Split:
    before: str          # safe to hand on
    found: bool          # a marker was found (then `after` follows it), else `after` is held back
    after: str
    marker: str = ""     # the marker found


def split_at(buffer: str, marker: str | tuple[str, ...], final: bool = False) -> Split:
    """`buffer` cut at the first of the `marker`s; without one, the longest tail that may begin one is
    held back (nothing is, when `final`: no more text will come)."""
    markers = (marker,) if isinstance(marker, str) else marker
    hits = [(at, m) for m in markers if (at := buffer.find(m)) >= 0]
    if hits:
        at, m = min(hits, key=lambda h: (h[0], -len(h[1])))
        return Split(buffer[:at], True, buffer[at + len(m):], m)
    if final:
        return Split(buffer, False, "")
    for keep in range(min(max(map(len, markers)) - 1, len(buffer)), 0, -1):
        if any(m.startswith(buffer[-keep:]) for m in markers):
            return Split(buffer[:-keep], False, buffer[-keep:])
    return Split(buffer, False, "")


@dataclasses.dataclass
class TextRun:
    """A run of text between markers, emitted as it comes except for its trailing whitespace (held
    until more text follows) and, after a marker, its leading whitespace (dropped)."""
    skip_leading: bool = False
    held: str = ""

    def add(self, text: str) -> str:
        """The part of `text` safe to emit now."""
        if self.skip_leading:
            text = text.lstrip()
            if not text:
                return ""
            self.skip_leading = False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body

    def cut(self) -> str:
        """At a marker: the held whitespace, taken out of the run (the caller drops or keeps it)."""
        held, self.held = self.held, ""
        return held

    def after_marker(self):
        self.held, self.skip_leading = "", True
