"""The protocol every cache group implements: what the engine's pools, the prefix store and speculative
rollback ask of a group, answered by the group itself (no isinstance ladders anywhere else).

A group is a flax.struct pytree whose class names the roles of its array fields:

  PAGE_FIELDS  field -> page axis   per-position objects in fixed-size pages, shared by every request
                                    and reached through a page table [B, NP] (full KV, MLA latent and
                                    RoPE key, indexer keys, V4 compressed / indexer entries)
  ROW_FIELDS   field -> row axis    fixed-size state, one row per request (recurrent conv + state,
                                    SWA ring, V4 tails and overlaps, per-row counters); checkpoints of
                                    the prefix store are extra rows (units) of the same arrays
  FILL         field -> value       what a fresh page / row holds (0 when absent)
  kind                              the object kind for byte accounting ("full_kv", ...; "" when a
                                    class does not name one: accounting refuses it)
  closes_into                       a tail group: the name of the group its windows close into ("": none)
  STORE_KIND                        the segment kind the prefix store keeps (cache.segments.Kind)
  ROLLBACK                          how a speculative verify's rejected tokens are undone:
                                    "hide"   per-position objects: the row's length hides them, the
                                             next step overwrites them (nothing to do)
                                    "select" rebuilt from the per-token parts the verify forward
                                             emits (`truncate`; the Gated DeltaNet state)
                                    "replay" rewritten state that cannot be selected (a ring, a tail,
                                             a counter): only rollback by snapshot + replay is exact

and inherits the behaviour below from `CacheGroup`:

  take(rows, table, reset, in_place) / put(rows, view)
                                               the rows [R] of a step's view, and back
  copy(fields, src, dst, valid)                index copies along each field's axis (publish a
                                               checkpoint, load one on a hit, copy-on-write a page)
  truncate(states, n_keep)                     the group after the first n_keep [B] fed tokens
  page_nbytes() / row_nbytes()                 bytes of one page / one row (a unit)
  bytes_per_token()                            bytes one more token of capacity adds to a row
  store_kind()                                 the prefix store's object kind (publish / lookup)
  resume_row(row, boundary, ok)                per-row fields a prefix hit sets from its length
"""
from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from cache.segments import Kind

ROLLBACKS = ("hide", "select", "replay")


class CacheGroup:
    """Base of every cache group (see the module docstring). Subclasses are flax.struct dataclasses."""
    PAGE_FIELDS: ClassVar[dict[str, int]] = {}
    ROW_FIELDS: ClassVar[dict[str, int]] = {}
    FILL: ClassVar[dict[str, object]] = {}
    # field -> the logical axis names of its dimensions (hybrid_jax.parallel.rules): how the field is
    # split over a device mesh; fields not named here (page tables, counters) are replicated
    AXES: ClassVar[dict[str, tuple]] = {}
    STORE_KIND: ClassVar[Kind]
    # the object kind for byte accounting (cache.accounting); a subclass names it (a class attribute, or a
    # dataclass field where one class serves several kinds); "" is refused by the accounting
    kind: ClassVar[str] = ""
    # a tail group: the name of the (paged) group its windows close into; "" for every other group
    closes_into: ClassVar[str] = ""
    # an in-place view's rows of the pools ([R] int32, see take(in_place=True)); a group with
    # IN_PLACE_FIELDS declares it as a dataclass field, None everywhere else
    view_rows: ClassVar[jax.Array | None] = None
    ROLLBACK: ClassVar[str] = "hide"
    # a page holds one entry per token, so a prefix may end inside a page: a hit shares the page and
    # the request's first write into it copies it (copy-on-write); the prefix store can resume such a
    # group on a grid finer than its pages (cache.prefix_index.BlockGeometry.resume)
    PARTIAL_RESUME: ClassVar[bool] = False
    # row fields an in-place view keeps whole: take(in_place=True) leaves them as the pools and records
    # the step's rows in the group's `view_rows` field ([R] int32); the layers read and write their rows
    # of those pools through it (a decode step then moves each recurrent state once, inside the kernel,
    # not as a gathered copy in and a scattered copy out). Small row fields are still gathered.
    IN_PLACE_FIELDS: ClassVar[tuple[str, ...]] = ()

    @property
    def entry_tokens(self) -> int:
        """Tokens one page entry stands for (1; a compressed group: its rate). A prefix ending inside a
        page needs the page's entries up to the last whole one before it."""
        return 1

    # ---- structure -------------------------------------------------------------------------------
    def page_fields(self) -> dict[str, int]:
        """The paged fields present in this instance (an absent optional field, e.g. the fp8 scale of
        bf16 indexer keys, is skipped): field -> page axis."""
        return {f: ax for f, ax in self.PAGE_FIELDS.items() if getattr(self, f) is not None}

    def row_fields(self) -> dict[str, int]:
        """The per-row fields present in this instance: field -> row axis."""
        return {f: ax for f, ax in self.ROW_FIELDS.items() if getattr(self, f) is not None}

    @property
    def paged(self) -> bool:
        """Whether the group keeps per-position objects in pages (it then has a page table)."""
        return bool(self.PAGE_FIELDS)

    @property
    def page_tokens(self) -> int:
        """Tokens one page covers (the prefix store's block size for a paged group; 0 for a slot group)."""
        return 0

    def fill(self, field: str):
        return self.FILL.get(field, 0)

    def num_rows(self) -> int:
        """Rows of the row fields (requests + checkpoint units); 0 for a group without any."""
        fields = self.row_fields()
        if not fields:
            return 0
        f, ax = next(iter(fields.items()))
        return getattr(self, f).shape[ax]

    def num_pages(self) -> int:
        f, ax = next(iter(self.page_fields().items()))
        return getattr(self, f).shape[ax]

    # ---- bytes -----------------------------------------------------------------------------------
    def _unit_bytes(self, fields: dict[str, int]) -> int:
        total = 0
        for f, ax in fields.items():
            a = getattr(self, f)
            total += int(np.prod(a.shape, dtype=np.int64) // a.shape[ax]) * np.dtype(a.dtype).itemsize
        return total

    def page_nbytes(self) -> int:
        """Bytes one page holds over every layer and paged field (0 for a slot group)."""
        return self._unit_bytes(self.page_fields()) if self.paged else 0

    def row_nbytes(self) -> int:
        """Bytes one row (a request's slot, or a checkpoint unit) of the row fields holds."""
        return self._unit_bytes(self.row_fields())

    def bytes_per_token(self) -> float:
        """Bytes one more token of capacity adds to one row across every layer: a paged group's page
        bytes over the tokens a page covers, 0 for state fixed per row. Groups may declare it exactly
        (data arrays only)."""
        return self.page_nbytes() / self.page_tokens if self.paged and self.page_tokens else 0.0

    # ---- take / put / copy -----------------------------------------------------------------------
    def take(self, rows: jax.Array, table: jax.Array | None = None, reset: jax.Array | None = None,
             in_place: bool = False):
        """The group as a step over rows [R] reads it: row fields gathered (rows flagged in `reset` [R]
        come back as FILL), paged fields whole, the page table replaced by `table` [R, NP] when given.
        in_place (no reset): the IN_PLACE_FIELDS stay whole and `view_rows` holds `rows`; a group without
        them ignores it."""
        upd, whole = {}, ()
        if in_place and self.IN_PLACE_FIELDS:
            if reset is not None:
                raise ValueError(f"{type(self).__name__}: an in-place view cannot reset rows (take them gathered)")
            upd["view_rows"], whole = rows, self.IN_PLACE_FIELDS
        for f, ax in self.row_fields().items():
            if f in whole:
                continue
            # rows are engine rows, always in bounds: jnp.take's default (fill out-of-bounds) adds a select
            # that the TPU compiler materialises, a second copy of every recurrent state a decode step reads
            a = jnp.take(getattr(self, f), rows, axis=ax, mode="clip")
            if reset is not None:
                mask = reset.reshape((1,) * ax + (-1,) + (1,) * (a.ndim - ax - 1))
                a = jnp.where(mask, jnp.asarray(self.fill(f), a.dtype), a)
            upd[f] = a
        if table is not None:
            upd["page_table"] = table
        return self.replace(**upd)

    def put(self, rows: jax.Array, view, table: bool = False):
        """The group after a step over rows [R] whose result is `view`: row fields scattered back,
        paged fields as the step left them (written in place); with table, the view's page table rows
        too (a cache whose rows own their pages). An in-place view's IN_PLACE_FIELDS are the pools, as
        the step wrote them."""
        whole = self.IN_PLACE_FIELDS if view.view_rows is not None else ()
        upd = {f: getattr(view, f) if f in whole else getattr(self, f).at[(slice(None),) * ax + (rows,)].set(
                   getattr(view, f)) for f, ax in self.row_fields().items()}
        upd.update({f: getattr(view, f) for f in self.page_fields()})
        if table:
            upd["page_table"] = self.page_table.at[rows].set(view.page_table)
        return self.replace(**upd)

    def copy(self, fields: dict[str, int], src: jax.Array, dst: jax.Array, valid: jax.Array):
        """Index src [M] -> dst [M] copied along each field's axis where valid [M] (others dropped,
        never clamped onto a live index)."""
        upd = {}
        for f, ax in fields.items():
            a = getattr(self, f)
            d = jnp.where(valid, dst, a.shape[ax])                      # out of range: dropped
            vals = jnp.take(a, jnp.clip(src, 0, a.shape[ax] - 1), axis=ax)
            upd[f] = a.at[(slice(None),) * ax + (d,)].set(vals, mode="drop")
        return self.replace(**upd)

    # ---- speculative rollback --------------------------------------------------------------------
    def truncate(self, states: dict, n_keep: jax.Array):
        """The group after the first n_keep [B] int32 of the tokens a verify step fed (rows with
        n_keep = 0 fed nothing). `states`: the forward's per-token parts ({} without them). A "hide"
        group has nothing to undo; a "replay" group cannot be truncated (ValueError: the rollback
        must be snapshot + replay)."""
        if self.ROLLBACK == "replay":
            raise ValueError(f"{type(self).__name__} ({self.kind}) cannot be rolled back by selection: its "
                             f"state is rewritten in place; use rollback by replay")
        return self

    # ---- prefix store ----------------------------------------------------------------------------
    def store_kind(self) -> Kind:
        """The object kind the prefix store keeps for this group."""
        return self.STORE_KIND

    def resume_row(self, row: jax.Array, boundary: jax.Array, ok: jax.Array):
        """A prefix hit resumes request row `row` [] at `boundary` [] tokens (where ok [] bool): per-row
        fields derived from the length are set here (default: none; checkpointed rows were copied)."""
        return self
