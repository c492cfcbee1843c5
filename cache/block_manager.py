"""One owner of every pool's pages, checkpoint units and request rows: free lists, reference counts,
versions and the requests' block tables. Host side only: cache.pools holds the device arrays; this
decides which page or unit each object goes to.

  rows   one per running request, shared by every slot group (the request's recurrent state, SWA
         ring, tails ... live at that row); the engine's null row is not among them
  pages  per paged group (full KV, MLA latent, indexer keys, V4 entries): a request's block table
         lists its pages in token order; a page is referenced once by every block table that lists
         it and once by the prefix store while the store holds it (a cached prefix *is* pages with a
         reference count > 0, shared by reference, never copied)
  units  per slot group: the checkpoint rows after the request rows, referenced by the prefix store

A page or unit is free exactly when its count is 0; every hand-out of a free one bumps its version,
so a reader that recorded an older version knows it changed owner. A request never writes a page
somebody else references: `reserve` swaps such a page for a private copy first (copy-on-write),
taking every page a step writes before the step is scheduled.

When a group runs out of pages or units, the manager asks its `reclaimer` (the prefix cache) to let
go of pages or units only the store holds, least recently used first; a request's own pages are
never taken from it here (the scheduler preempts requests instead).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class GroupGeometry:
    """name: the cache group; kind: its object kind (accounting); page_tokens: tokens a page covers
    (0 for a slot group, whose units are checkpoint rows); num_units: pages or checkpoint units;
    unit_nbytes: bytes of one; first_unit: id of the first (a slot group's checkpoint rows follow its
    request rows)."""
    name: str
    kind: str
    page_tokens: int
    num_units: int
    unit_nbytes: int
    first_unit: int = 0

    @property
    def paged(self) -> bool:
        return self.page_tokens > 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens) if self.paged else 0


class Reclaimer(Protocol):
    """Who may give units back when a group runs out (the prefix cache)."""

    def reclaimable(self, group: str) -> int:
        """Units of `group` it holds that nobody else references."""

    def reclaim(self, group: str, n: int) -> int:
        """Lets go of up to n such units of `group`; returns how many it released."""


class BlockManager:
    def __init__(self, groups: Sequence[GroupGeometry], num_rows: int, reclaimer: Reclaimer | None = None):
        self.groups = {g.name: g for g in groups}
        self.num_rows = num_rows
        self.reclaimer = reclaimer
        self._free = {g.name: list(range(g.first_unit + g.num_units - 1, g.first_unit - 1, -1)) for g in groups}
        self._ref = {g.name: np.zeros(g.first_unit + g.num_units, np.int32) for g in groups}
        self._version = {g.name: np.zeros(g.first_unit + g.num_units, np.int64) for g in groups}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.rows: dict[str, int] = {}                       # request id -> row
        self.tables: dict[str, dict[str, list[int]]] = {}   # request id -> paged group -> pages
        self.copies_on_write = 0

    # --- rows ----------------------------------------------------------------------------------------
    def free_rows(self) -> int:
        return len(self._free_rows)

    def take_row(self, rid: str) -> int | None:
        """A row for a new request (None when every row is taken); its block tables start empty."""
        if rid in self.rows:
            raise ValueError(f"request {rid!r} already holds row {self.rows[rid]}")
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self.rows[rid] = row
        self.tables[rid] = {n: [] for n, g in self.groups.items() if g.paged}
        return row

    def release_request(self, rid: str):
        """A finished, aborted or preempted request: its row and its references to pages go back."""
        row = self.rows.pop(rid, None)
        if row is None:
            return
        self._free_rows.append(row)
        for name, pages in self.tables.pop(rid).items():
            for p in pages:
                self.release(name, p)

    # --- units ---------------------------------------------------------------------------------------
    def free_units(self, group: str) -> int:
        return len(self._free[group])

    def available(self, group: str) -> int:
        """Free units plus those the reclaimer could give back."""
        extra = self.reclaimer.reclaimable(group) if self.reclaimer is not None else 0
        return len(self._free[group]) + extra

    def can_supply(self, need: dict[str, int]) -> bool:
        """Whether every group can supply its count of units now (free ones and those the reclaimer
        could give back), without taking any."""
        return self._enough(need)

    def _enough(self, need: dict[str, int]) -> bool:
        """Whether every group can supply its count (the reclaimer is asked only when the free list is short)."""
        return all(k <= len(self._free[n]) or k <= self.available(n) for n, k in need.items())

    def _take(self, group: str) -> int | None:
        free = self._free[group]
        if not free and self.reclaimer is not None:
            self.reclaimer.reclaim(group, 1)
        if not free:
            return None
        u = free.pop()
        self._ref[group][u] = 1
        self._version[group][u] += 1
        return u

    def alloc_unit(self, group: str) -> int | None:
        """A free unit (page or checkpoint row) with one reference, reclaiming one if none is free."""
        return self._take(group)

    def retain(self, group: str, unit: int):
        if self._ref[group][unit] <= 0:
            raise ValueError(f"retain of free unit {unit} of group {group!r}")
        self._ref[group][unit] += 1

    def release(self, group: str, unit: int):
        """Drops one reference; the unit is free again at 0."""
        r = self._ref[group]
        if r[unit] <= 0:
            raise ValueError(f"release of free unit {unit} of group {group!r}: its count would go negative")
        r[unit] -= 1
        if r[unit] == 0:
            self._free[group].append(unit)

    def refcount(self, group: str, unit: int) -> int:
        return int(self._ref[group][unit])

    def version(self, group: str, unit: int) -> int:
        return int(self._version[group][unit])

    # --- block tables --------------------------------------------------------------------------------
    def table(self, rid: str, group: str) -> list[int]:
        return self.tables[rid][group]

    def missing(self, rid: str, num_tokens: int) -> dict[str, int]:
        """Pages each paged group lacks for the request to hold `num_tokens` tokens."""
        t = self.tables[rid]
        return {n: max(0, g.pages_for(num_tokens) - len(t[n])) for n, g in self.groups.items() if g.paged}

    def can_grow(self, rid: str, num_tokens: int) -> bool:
        return self._enough(self.missing(rid, num_tokens))

    def grow(self, rid: str, num_tokens: int) -> bool:
        """Appends pages so that every paged group of the request covers `num_tokens` tokens; all or
        nothing (False, and no page taken, when a group cannot supply them). `reserve` with nothing
        to write."""
        return self.reserve(rid, num_tokens, num_tokens) is not None

    def share(self, rid: str, group: str, pages: Sequence[int]):
        """A prefix hit: the request's (empty) block table of `group` starts with `pages`, each one
        more reference; no byte is copied."""
        t = self.tables[rid][group]
        if t:
            raise ValueError(f"request {rid!r} already has {len(t)} pages of group {group!r}: a prefix is"
                             f" shared into an empty block table only")
        for p in pages:
            self.retain(group, p)
        t.extend(int(p) for p in pages)

    def unshare(self, rid: str):
        """Undoes a prefix hit that failed at use: the request's tables are emptied, row kept."""
        for name, pages in self.tables[rid].items():
            for p in pages:
                self.release(name, p)
            pages.clear()

    def shared_in(self, rid: str, first: int, end: int) -> dict[str, int]:
        """Pages of the request's block tables covering token positions [first, end) that somebody
        else also references: each needs a private copy before the request writes there."""
        out: dict[str, int] = {}
        for name, t in self.tables[rid].items():
            g = self.groups[name]
            ref = self._ref[name]
            out[name] = sum(1 for i in range(first // g.page_tokens, min(len(t), -(-end // g.page_tokens)))
                            if ref[t[i]] > 1)
        return out

    def reserve(self, rid: str, first: int, end: int) -> dict[str, list[tuple[int, int]]] | None:
        """Every page a step that writes token positions [first, end) of the request needs, taken now,
        all or nothing: the pages that extend its block tables to `end` tokens, and a private copy of
        each page in that range somebody else also references (copy-on-write: the copy replaces it
        in the request's table). Returns, per group, the (source, copy) page pairs the caller copies on
        the device before the step writes; None, and nothing taken, when a group cannot supply them
        even after the reclaimer let go of what only it holds. After a successful reserve the step
        writes only pages that the request alone references and that exist: it cannot fail for want
        of a page (docs/architecture.md, "Reserve before you schedule")."""
        grow = self.missing(rid, end)
        copy = self.shared_in(rid, first, end)
        need = {n: grow[n] + copy[n] for n in grow}
        if not self._enough(need):
            return None
        for n, k in need.items():
            short = k - len(self._free[n])
            if short > 0 and self.reclaimer is not None:    # one reclaim for the group, not one per page
                self.reclaimer.reclaim(n, short)
        if not all(k <= len(self._free[n]) for n, k in need.items()):
            return None                                     # the reclaimer promised more than it gave
        out: dict[str, list[tuple[int, int]]] = {}
        for name, t in self.tables[rid].items():
            g = self.groups[name]
            for i in range(first // g.page_tokens, min(len(t), -(-end // g.page_tokens))):
                if self._ref[name][t[i]] > 1:
                    new = self._take(name)
                    out.setdefault(name, []).append((t[i], new))
                    self.release(name, t[i])
                    t[i] = new
                    self.copies_on_write += 1
            for _ in range(grow[name]):
                t.append(self._take(name))
        return out

    def block_tables(self, rids: Sequence[str | None], widths: dict[str, int]) -> dict[str, np.ndarray]:
        """[len(rids), widths[g]] int32 per paged group, rows in the order given (None: a padding row);
        entries past a table's end are -1 (never read: reads stop at a row's length, writes to them are
        dropped)."""
        out = {}
        for n, w in widths.items():
            a = np.full((len(rids), w), -1, np.int32)
            for i, rid in enumerate(rids):
                if rid is not None:
                    t = self.tables[rid][n]
                    a[i, :len(t)] = t[:w]
            out[n] = a
        return out

    # --- accounting ----------------------------------------------------------------------------------
    def used_units(self, group: str) -> int:
        return self.groups[group].num_units - len(self._free[group])

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes of the units in use (referenced), per object kind."""
        out: dict[str, int] = {}
        for n, g in self.groups.items():
            out[g.kind] = out.get(g.kind, 0) + self.used_units(n) * g.unit_nbytes
        return out

    def check(self):
        """Invariants (tests): every referenced page is counted once per table listing it plus the
        store's holds; free lists hold exactly the units at count 0, each once."""
        for n, g in self.groups.items():
            ref = self._ref[n]
            free = self._free[n]
            assert len(set(free)) == len(free), f"{n}: a unit is free twice"
            lo, hi = g.first_unit, g.first_unit + g.num_units
            zero = {u for u in range(lo, hi) if ref[u] == 0}
            assert set(free) == zero, f"{n}: free list {sorted(free)[:8]} != units at count 0 {sorted(zero)[:8]}"
            assert (ref >= 0).all(), f"{n}: a negative count"
            if g.paged:
                listed = np.zeros_like(ref)
                for t in self.tables.values():
                    for p in t[n]:
                        listed[p] += 1
                assert (listed <= ref).all(), f"{n}: a page is listed by more tables than its count"
        assert len(set(self._free_rows)) == len(self._free_rows)
        assert not set(self._free_rows) & set(self.rows.values())
        assert len(self._free_rows) + len(self.rows) == self.num_rows
