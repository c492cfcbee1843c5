"""The engine's compiled programs, by key: what a step calls instead of a jit dispatch.

A step program is identified by a `ProgramKey`: its kind (mixed, ragged, decode, verify, ...), the
bucket it is padded to (`shape`: decode (Bb,), mixed (Bb, T), ragged (Bb, N), verify and draft
(Bb, K), the fixed-width programs ()) and its static options. The `ProgramTable` holds the compiled
executables (`jax.stages.Compiled`) of the keys compiled so far, whether by the start-up (from the
program store, or compiled: engine/compile.py) or on first use (offline, `warmup="none"`).

`cover` answers "which compiled program serves a step that needs this bucket": the key itself, or
else the smallest compiled key of the same kind and options whose every dimension is at least as
large (the step is padded to it). That is how a server becomes ready before every bucket exists:
the start-up compiles the largest buckets first, and a step runs padded until its own bucket is
compiled in the background.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any


@dataclasses.dataclass(frozen=True, order=True)
class ProgramKey:
    """kind: a step kind (engine/compile.KINDS); shape: its bucket's dimensions; statics: its static
    options as sorted (name, value) pairs (values hashable: ints, bools, frozen dataclasses)."""
    kind: str
    shape: tuple[int, ...] = ()
    statics: tuple = ()

    @classmethod
    def of(cls, kind: str, shape: tuple[int, ...] = (), **statics) -> "ProgramKey":
        return cls(kind, tuple(int(s) for s in shape), tuple(sorted(statics.items())))

    def static_kwargs(self) -> dict[str, Any]:
        return dict(self.statics)

    def covers(self, other: "ProgramKey") -> bool:
        """Whether a step that needs `other` can run padded in this program."""
        return (self.kind == other.kind and self.statics == other.statics and len(self.shape) == len(other.shape)
                and all(a >= b for a, b in zip(self.shape, other.shape)))

    def describe(self) -> str:
        """e.g. 'decode[8] steps=4 top_n=20' (the sampler's flags left out)."""
        shape = f"[{'x'.join(map(str, self.shape))}]" if self.shape else ""
        opts = " ".join(f"{k}={v}" for k, v in self.statics if k != "flags" and not hasattr(v, "__dataclass_fields__"))
        return f"{self.kind}{shape}" + (f" {opts}" if opts else "")


@dataclasses.dataclass
class CompiledProgram:
    """A compiled executable and where it came from: "store" (read from the program store), "compiled"
    (lowered and compiled at start-up or in the background) or "on_demand" (compiled when a step first
    needed it); seconds spent lowering and compiling (or loading) it; its program-store key when it was
    read from the store."""
    executable: Any
    source: str
    lower_s: float = 0.0
    compile_s: float = 0.0
    store_key: str | None = None


class ProgramTable:
    """The compiled programs of one runner's step context, by key. Read on the engine thread, added
    to from the start-up's compile threads (a dict insert under a lock)."""

    def __init__(self):
        self._programs: dict[ProgramKey, CompiledProgram] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, key: ProgramKey) -> bool:
        return key in self._programs

    def get(self, key: ProgramKey) -> CompiledProgram | None:
        return self._programs.get(key)

    def add(self, key: ProgramKey, program: CompiledProgram):
        with self._lock:
            self._programs.setdefault(key, program)

    def replace(self, key: ProgramKey, program: CompiledProgram):
        """key's program swapped for another (one read from the store that could not run)."""
        with self._lock:
            self._programs[key] = program

    def drop(self, key: ProgramKey):
        """key's program removed (one read from the store that failed when its results were read): the
        next step that needs it builds it again."""
        with self._lock:
            self._programs.pop(key, None)

    def keys(self) -> list[ProgramKey]:
        with self._lock:
            return list(self._programs)

    def cover(self, need: ProgramKey) -> ProgramKey | None:
        """`need` if compiled, else the compiled key that covers it with the least padded work (the
        product of its dimensions), None when none does."""
        if need in self._programs:
            return need
        best = [k for k in self.keys() if k.covers(need)]
        return min(best, key=lambda k: (math.prod(k.shape), k.shape), default=None)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.keys():
            out[k.kind] = out.get(k.kind, 0) + 1
        return out

    def by_source(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for p in self._programs.values():
                out[p.source] = out.get(p.source, 0) + 1
        return out
