"""Cache groups as device pools, and the per-step view a model's forward reads and writes.

Every cache group class names the roles of its array fields (class attributes, not pytree fields):

  PAGE_FIELDS  field -> page axis   per-position objects in fixed-size pages, shared by every request
                                    and reached through a page table [B, NP] (full KV, MLA latent and
                                    RoPE key, indexer keys, V4 compressed / indexer entries)
  ROW_FIELDS   field -> row axis    fixed-size state, one row per request (recurrent conv + state,
                                    SWA ring, V4 tails and overlaps, per-row counters)
  FILL         field -> value       what a fresh page / row holds (0 when absent)

From those tables alone (no isinstance ladders) this module builds the engine's pools, gathers a
step's view and scatters it back:

  build_pools(abstract, rows, pages, units)   zeros of the pools: paged groups get P_g pages, slot
                                              groups `rows` rows for requests plus units_g rows for
                                              prefix-cache checkpoints (a group's *units*)
  take_view(pools, rows, tables, reset)       what one step's forward reads: each paged group with
                                              the step's block tables [Bb, NP_g] (from the host's
                                              block manager), each row field gathered at the step's
                                              rows (a `reset` row comes back empty)
  put_view(pools, rows, view)                 the step's writes back: pages as the forward left
                                              them (written in place), row fields scattered
  take_rows / put_rows                        the same for a cache whose rows own contiguous pages
                                              (`model.new_cache`): the page table is gathered too

Shapes: rows [Bb] int32 (row ids; the engine's null row pads a batch bucket), tables
{group: [Bb, NP_g] int32}, reset [Bb] bool.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_manager import GroupGeometry
from cache.state import ModelCache


def page_fields(group) -> dict[str, int]:
    """The group's paged fields present in this instance (an absent optional field, e.g. the fp8
    scale of bf16 indexer keys, is skipped): field -> page axis."""
    return {f: ax for f, ax in getattr(type(group), "PAGE_FIELDS", {}).items() if getattr(group, f) is not None}


def row_fields(group) -> dict[str, int]:
    """The group's per-row fields present in this instance: field -> row axis."""
    return {f: ax for f, ax in getattr(type(group), "ROW_FIELDS", {}).items() if getattr(group, f) is not None}


def is_paged(group) -> bool:
    """Whether the group keeps per-position objects in pages (it has PAGE_FIELDS and a page table)."""
    return bool(getattr(type(group), "PAGE_FIELDS", None))


def _fill(group, field: str):
    return getattr(type(group), "FILL", {}).get(field, 0)


def _unit_bytes(group, fields: dict[str, int]) -> int:
    """Bytes of one index along each field's axis (one page or one row), over the given fields."""
    total = 0
    for f, ax in fields.items():
        a = getattr(group, f)
        total += int(np.prod(a.shape, dtype=np.int64) // a.shape[ax]) * np.dtype(a.dtype).itemsize
    return total


def page_nbytes(group) -> int:
    """Bytes one page of a paged group holds over every layer and paged field (0 for a slot group)."""
    return _unit_bytes(group, page_fields(group)) if is_paged(group) else 0


def row_nbytes(group) -> int:
    """Bytes one row (a request's slot, or a checkpoint unit) of the group's row fields holds."""
    return _unit_bytes(group, row_fields(group))


def num_rows(group) -> int:
    """Rows of a group's row fields (requests + checkpoint units); 0 for a group without any."""
    fields = row_fields(group)
    if not fields:
        return 0
    f, ax = next(iter(fields.items()))
    return getattr(group, f).shape[ax]


def num_pages(group) -> int:
    fields = page_fields(group)
    f, ax = next(iter(fields.items()))
    return getattr(group, f).shape[ax]


def build_pools(abstract: ModelCache, rows: int, pages: dict[str, int], units: dict[str, int]) -> ModelCache:
    """The engine's pools, filled (FILL or 0), from `abstract`: a cache of the model as shapes (e.g.
    `jax.eval_shape` of `new_cache(cfg, 1, max_model_len, dtype)`: nothing of it is allocated).

    rows: request rows of every group (the engine's rows, null row included); pages: paged group ->
    pages in its pool; units: group -> extra rows for prefix-cache checkpoints (0 if absent). Page
    tables are [rows, NP_g] zeros: the engine passes block tables per step (`take_view`)."""
    groups: dict[str, Any] = {}
    for name, g in abstract.groups.items():
        upd = {}
        for f, ax in page_fields(g).items():
            a = getattr(g, f)
            shape = a.shape[:ax] + (pages[name],) + a.shape[ax + 1:]
            upd[f] = jnp.full(shape, _fill(g, f), a.dtype)
        n = rows + units.get(name, 0)
        for f, ax in row_fields(g).items():
            a = getattr(g, f)
            shape = a.shape[:ax] + (n,) + a.shape[ax + 1:]
            upd[f] = jnp.full(shape, _fill(g, f), a.dtype)
        if is_paged(g):
            upd["page_table"] = jnp.zeros((rows, g.page_table.shape[1]), jnp.int32)
        groups[name] = g.replace(**upd)
    return ModelCache(groups=groups, lengths=jnp.zeros((rows,), jnp.int32), version=jnp.zeros((rows,), jnp.int32))


def _gather(group, rows, reset):
    upd = {}
    for f, ax in row_fields(group).items():
        # rows are engine rows, always in bounds: jnp.take's default (fill out-of-bounds) adds a select that
        # the TPU compiler materialises, a second copy of every recurrent state a decode step reads
        a = jnp.take(getattr(group, f), rows, axis=ax, mode="clip")
        if reset is not None:
            mask = reset.reshape((1,) * ax + (-1,) + (1,) * (a.ndim - ax - 1))
            a = jnp.where(mask, jnp.asarray(_fill(group, f), a.dtype), a)
        upd[f] = a
    return upd


def _scatter(group, rows, sub):
    upd = {}
    for f, ax in row_fields(group).items():
        idx = (slice(None),) * ax + (rows,)
        upd[f] = getattr(group, f).at[idx].set(getattr(sub, f))
    return upd


def take_view(pools: ModelCache, rows: jax.Array, tables: dict[str, jax.Array], lengths: jax.Array,
              reset: jax.Array | None = None) -> ModelCache:
    """The cache a step's forward reads for rows [Bb]: paged groups keep their whole pools and get the
    step's block tables [Bb, NP_g]; row fields are gathered (empty where `reset`). lengths [Bb]: tokens
    each row holds before the step (the host's count)."""
    groups = {}
    for name, g in pools.groups.items():
        upd = _gather(g, rows, reset)
        if is_paged(g):
            upd["page_table"] = tables[name]
        groups[name] = g.replace(**upd)
    return ModelCache(groups=groups, lengths=lengths, version=pools.version[rows] + 1)


def put_view(pools: ModelCache, rows: jax.Array, view: ModelCache) -> ModelCache:
    """The pools after a step: paged fields as the forward left them (it wrote them in place), row
    fields scattered back to `rows`; the pools' page tables stay (the host owns the block tables)."""
    groups = {}
    for name, g in pools.groups.items():
        v = view.groups[name]
        upd = _scatter(g, rows, v)
        upd.update({f: getattr(v, f) for f in page_fields(g)})
        groups[name] = g.replace(**upd)
    return ModelCache(groups=groups, lengths=pools.lengths, version=pools.version.at[rows].set(view.version))


def take_rows(cache: ModelCache, rows: jax.Array, reset: jax.Array | None = None) -> ModelCache:
    """The sub-cache of `rows` [R] (repeats allowed) of a cache whose rows own their pages (their page
    tables are gathered too). Rows flagged in `reset` [R] come back empty (length 0, zero state)."""
    groups = {}
    for name, g in cache.groups.items():
        upd = _gather(g, rows, reset)
        if is_paged(g):
            upd["page_table"] = g.page_table[rows]
        groups[name] = g.replace(**upd)
    lengths = cache.lengths[rows]
    if reset is not None:
        lengths = jnp.where(reset, 0, lengths)
    return ModelCache(groups=groups, lengths=lengths, version=cache.version[rows] + 1)


def put_rows(cache: ModelCache, rows: jax.Array, sub: ModelCache) -> ModelCache:
    """Writes the sub-cache of `rows` back into the full cache (inverse of take_rows)."""
    groups = {}
    for name, g in cache.groups.items():
        sg = sub.groups[name]
        upd = _scatter(g, rows, sg)
        upd.update({f: getattr(sg, f) for f in page_fields(g)})
        if is_paged(g):
            upd["page_table"] = g.page_table.at[rows].set(sg.page_table)
        groups[name] = g.replace(**upd)
    return ModelCache(groups=groups, lengths=cache.lengths.at[rows].set(sub.lengths),
                      version=cache.version.at[rows].set(sub.version))


def _copy(group, fields: dict[str, int], src: jax.Array, dst: jax.Array, valid: jax.Array):
    """The group with index src [M] -> dst [M] copied along each field's axis where valid [M]
    (others dropped, never clamped onto a live index)."""
    upd = {}
    for f, ax in fields.items():
        a = getattr(group, f)
        d = jnp.where(valid, dst, a.shape[ax])                      # out of range: dropped
        vals = jnp.take(a, jnp.clip(src, 0, a.shape[ax] - 1), axis=ax)
        upd[f] = a.at[(slice(None),) * ax + (d,)].set(vals, mode="drop")
    return group.replace(**upd)


def copy_rows(pools: ModelCache, names, src: jax.Array, dst: jax.Array, valid: jax.Array) -> ModelCache:
    """Copies rows src [M] -> dst [M] of the row fields of groups `names` where valid [M]: a
    request's state into a checkpoint unit (publish) or back (a prefix hit)."""
    groups = dict(pools.groups)
    for name in names:
        groups[name] = _copy(groups[name], row_fields(groups[name]), src, dst, valid)
    return pools.replace(groups=groups)


def copy_pages(pools: ModelCache, plan: dict[str, tuple[jax.Array, jax.Array]]) -> ModelCache:
    """Copy-on-write: page src [M] -> dst [M] of every page field of each group in plan (-1: none)."""
    groups = dict(pools.groups)
    for name, (src, dst) in plan.items():
        groups[name] = _copy(groups[name], page_fields(groups[name]), src, dst, (src >= 0) & (dst >= 0))
    return pools.replace(groups=groups)


def page_tokens(group) -> int:
    """Tokens one page of a paged group covers (0 for a slot group)."""
    return group.page_tokens if is_paged(group) else 0


def size_pools(abstract: ModelCache, *, rows: int, budget_bytes: int, min_tokens: int,
               prefix_cap_bytes: int = 0, checkpoint_every: int = 1, min_units: int = 4
               ) -> tuple[dict[str, int], dict[str, int]]:
    """How many pages each paged group and how many checkpoint units each slot group gets.

    abstract: the model's cache for one row (shapes); rows: request rows (null row included), whose
    fixed-size state comes out of `budget_bytes` first; the rest goes to pages, split between the
    paged groups so that they all hold the same number of tokens. min_tokens: tokens one request may
    need (max_model_len); a budget whose pages cannot hold them raises ValueError naming the figures.
    Checkpoint units (prefix caching, `prefix_cap_bytes` > 0) come on top: the prefix store's cap is
    split between pages and checkpoints by what each costs per cached token (a checkpoint, one unit in
    every slot group, about every `checkpoint_every` tokens, doubled for the last one of each prompt),
    and every slot group gets the same number of units, at least `min_units`.
    Returns (pages {paged group: P}, units {slot group: C})."""
    paged = {n: g for n, g in abstract.groups.items() if is_paged(g)}
    slots = {n: g for n, g in abstract.groups.items() if not is_paged(g)}
    row_bytes = sum(row_nbytes(g) for g in abstract.groups.values())
    per_token = {n: page_nbytes(g) / page_tokens(g) for n, g in paged.items()}
    left = budget_bytes - rows * row_bytes
    tokens = int(left // sum(per_token.values())) if per_token and left > 0 else 0
    pages = {n: max(tokens // page_tokens(g), 0) for n, g in paged.items()}
    short = [n for n, g in paged.items() if pages[n] < -(-min_tokens // page_tokens(g))]
    if short or left < 0:
        need = rows * row_bytes + sum(-(-min_tokens // page_tokens(g)) * page_nbytes(g) for g in paged.values())
        raise ValueError(f"a cache budget of {budget_bytes} bytes cannot hold one request of {min_tokens} tokens"
                         f" beside {rows} rows of fixed-size state ({row_bytes} bytes each): it needs at least"
                         f" {need} bytes")
    units = {}
    ckpt_row = sum(row_nbytes(g) for g in slots.values())
    if prefix_cap_bytes > 0 and ckpt_row > 0:
        ckpt_pt = 2 * ckpt_row / checkpoint_every
        share = prefix_cap_bytes * ckpt_pt / (ckpt_pt + sum(per_token.values()))
        units = {n: max(min_units, int(share // ckpt_row)) for n in slots}
    return pages, units


def pool_geometry(pools: ModelCache, request_rows: int) -> list[GroupGeometry]:
    """What a block manager hands out of these pools: every paged group's pages, every slot group's
    checkpoint units (its rows from `request_rows` on: the request rows, null row included, come first)."""
    out = []
    for n, g in pools.groups.items():
        if is_paged(g):
            out.append(GroupGeometry(n, g.kind, page_tokens(g), num_pages(g), page_nbytes(g)))
        else:
            out.append(GroupGeometry(n, g.kind, 0, num_rows(g) - request_rows, row_nbytes(g), first_unit=request_rows))
    return out
