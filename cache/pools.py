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

from cache.block_manager import GroupGeometry
from cache.state import ModelCache


def build_pools(abstract: ModelCache, rows: int, pages: dict[str, int], units: dict[str, int]) -> ModelCache:
    """The engine's pools, filled (FILL or 0), from `abstract`: a cache of the model as shapes (e.g.
    `jax.eval_shape` of `new_cache(cfg, 1, max_model_len, dtype)`: nothing of it is allocated).

    rows: request rows of every group (the engine's rows, null row included); pages: paged group ->
    pages in its pool; units: group -> extra rows for prefix-cache checkpoints (0 if absent). Page
    tables are [rows, NP_g] zeros: the engine passes block tables per step (`take_view`)."""
    groups: dict[str, Any] = {}
    for name, g in abstract.groups.items():
        upd = {}
        for f, ax in g.page_fields().items():
            a = getattr(g, f)
            shape = a.shape[:ax] + (pages[name],) + a.shape[ax + 1:]
            upd[f] = jnp.full(shape, g.fill(f), a.dtype)
        n = rows + units.get(name, 0)
        for f, ax in g.row_fields().items():
            a = getattr(g, f)
            shape = a.shape[:ax] + (n,) + a.shape[ax + 1:]
            upd[f] = jnp.full(shape, g.fill(f), a.dtype)
        if g.paged:
            upd["page_table"] = jnp.zeros((rows, g.page_table.shape[1]), jnp.int32)
        groups[name] = g.replace(**upd)
    return ModelCache(groups=groups, lengths=jnp.zeros((rows,), jnp.int32), version=jnp.zeros((rows,), jnp.int32))


def take_view(pools: ModelCache, rows: jax.Array, tables: dict[str, jax.Array], lengths: jax.Array,
              reset: jax.Array | None = None, in_place: bool = False) -> ModelCache:
    """The cache a step's forward reads for rows [Bb]: paged groups keep their whole pools and get the
    step's block tables [Bb, NP_g]; row fields are gathered (empty where `reset`), or, with in_place,
    kept whole where the group can be read in place (its `view_rows` = rows: the layers read and write
    their rows of the pools; a decode step's recurrent states move once). lengths [Bb]: tokens each row
    holds before the step (the host's count)."""
    groups = {name: g.take(rows, tables[name] if g.paged else None, reset, in_place)
              for name, g in pools.groups.items()}
    return ModelCache(groups=groups, lengths=lengths, version=pools.version[rows] + 1)


def put_view(pools: ModelCache, rows: jax.Array, view: ModelCache) -> ModelCache:
    """The pools after a step: paged fields as the forward left them (it wrote them in place), row
    fields scattered back to `rows`; the pools' page tables stay (the host owns the block tables)."""
    groups = {name: g.put(rows, view.groups[name]) for name, g in pools.groups.items()}
    return ModelCache(groups=groups, lengths=pools.lengths, version=pools.version.at[rows].set(view.version))


def take_rows(cache: ModelCache, rows: jax.Array, reset: jax.Array | None = None) -> ModelCache:
    """The sub-cache of `rows` [R] (repeats allowed) of a cache whose rows own their pages (their page
    tables are gathered too). Rows flagged in `reset` [R] come back empty (length 0, zero state)."""
    groups = {name: g.take(rows, g.page_table[rows] if g.paged else None, reset) for name, g in cache.groups.items()}
    lengths = cache.lengths[rows]
    if reset is not None:
        lengths = jnp.where(reset, 0, lengths)
    return ModelCache(groups=groups, lengths=lengths, version=cache.version[rows] + 1)


def put_rows(cache: ModelCache, rows: jax.Array, sub: ModelCache) -> ModelCache:
    """Writes the sub-cache of `rows` back into the full cache (inverse of take_rows)."""
    groups = {name: g.put(rows, sub.groups[name], table=g.paged) for name, g in cache.groups.items()}
    return ModelCache(groups=groups, lengths=cache.lengths.at[rows].set(sub.lengths),
                      version=cache.version.at[rows].set(sub.version))


def copy_rows(pools: ModelCache, names, src: jax.Array, dst: jax.Array, valid: jax.Array) -> ModelCache:
    """Copies rows src [M] -> dst [M] of the row fields of groups `names` where valid [M]: a
    request's state into a checkpoint unit (publish) or back (a prefix hit)."""
    groups = dict(pools.groups)
    for name in names:
        groups[name] = groups[name].copy(groups[name].row_fields(), src, dst, valid)
    return pools.replace(groups=groups)


def copy_pages(pools: ModelCache, plan: dict[str, tuple[jax.Array, jax.Array]]) -> ModelCache:
    """Copy-on-write: page src [M] -> dst [M] of every page field of each group in plan (-1: none)."""
    groups = dict(pools.groups)
    for name, (src, dst) in plan.items():
        groups[name] = groups[name].copy(groups[name].page_fields(), src, dst, (src >= 0) & (dst >= 0))
    return pools.replace(groups=groups)


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
    paged = {n: g for n, g in abstract.groups.items() if g.paged}
    slots = {n: g for n, g in abstract.groups.items() if not g.paged}
    row_bytes = sum(g.row_nbytes() for g in abstract.groups.values())
    per_token = {n: g.page_nbytes() / g.page_tokens for n, g in paged.items()}
    left = budget_bytes - rows * row_bytes
    tokens = int(left // sum(per_token.values())) if per_token and left > 0 else 0
    pages = {n: max(tokens // g.page_tokens, 0) for n, g in paged.items()}
    short = [n for n, g in paged.items() if pages[n] < -(-min_tokens // g.page_tokens)]
    if short or left < 0:
        need = rows * row_bytes + sum(-(-min_tokens // g.page_tokens) * g.page_nbytes() for g in paged.values())
        raise ValueError(f"a cache budget of {budget_bytes} bytes cannot hold one request of {min_tokens} tokens"
                         f" beside {rows} rows of fixed-size state ({row_bytes} bytes each): it needs at least"
                         f" {need} bytes")
    units = {}
    ckpt_row = sum(g.row_nbytes() for g in slots.values())
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
        if g.paged:
            out.append(GroupGeometry(n, g.kind, g.page_tokens, g.num_pages(), g.page_nbytes()))
        else:
            out.append(GroupGeometry(n, g.kind, 0, g.num_rows() - request_rows, g.row_nbytes(), first_unit=request_rows))
    return out
