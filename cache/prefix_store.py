"""The prefix store's device side: what a cached object is in the engine's pools, and the compiled
copies that move fixed-size state between a request's row and a checkpoint unit.

A cached prefix lives in the pools themselves (cache.pools), never in a second copy:

  paged groups    a stored block *is* a page of the group's pool ([L, P, ps, ...] fields): publishing
                  takes a reference to the request's page, a hit lists the page in the new request's
                  block table. Nothing is copied either way.
  slot groups     (recurrent conv + state, V4 window, tail, overlap) a checkpoint is a *unit*: an extra
                  row of the group's row fields, after the request rows. Publishing copies the
                  request's row into a unit (`save_checkpoints`); a hit copies the unit back into the
                  new request's row (`load_checkpoints`). These are the only bytes a hit moves.

Every unit has a version [N] on the device, bumped by each write into it. `load_checkpoints` compares
the versions the host recorded when it validated the hit with the device's *inside the compiled
program*; if any differs (the unit was rewritten between check and use) nothing is written and `ok` is
False, so the host recomputes instead of reading changed data. Pages need no such check: a page the
store or a block table references is never rewritten (cache.block_manager: copy-on-write).

For the disk tier, `read_units` / `write_units` move whole units (pages or checkpoint rows) of the
stored fields (`stored_fields`) between the pools and the host.

Plans are fixed-width int32 arrays (one program per engine, whatever the hit): entries with a negative
unit are padding and are dropped (`mode="drop"` on an out-of-range index), never clamped onto a live
unit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cache.pools import copy_rows
from cache.state import ModelCache


def stored_fields(group) -> dict[str, int]:
    """The fields a stored object of the group consists of, with the axis that indexes units: a
    paged group's per-layer page fields ([L, P, ...], axis 1; bookkeeping such as the residency flags
    [P] is not data), a slot group's row fields (all of them: a tail's count belongs to its state)."""
    if group.paged:
        return {f: ax for f, ax in group.page_fields().items() if ax == 1}
    return group.row_fields()


def init_versions(pools: ModelCache, names) -> dict[str, jax.Array]:
    """Device versions [N] of the units of slot groups `names` (N = rows of the group, request rows
    included: only the checkpoint rows' versions are ever read), committed beside the pools (replicated
    on a mesh), as the save program's outputs are: its first call then compiles the program every later
    call runs (a jitted program keys its cache on whether an argument is committed)."""
    out = {}
    for n in names:
        g = pools.groups[n]
        f, ax = next(iter(g.row_fields().items()))
        field = getattr(g, f)
        where = field.sharding
        if isinstance(where, jax.sharding.NamedSharding):
            where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
        out[n] = jax.device_put(jnp.zeros((field.shape[ax],), jnp.int32), where)
    return out


def save_checkpoints(pools: ModelCache, versions: dict[str, jax.Array], row: jax.Array,
                     plan: dict[str, jax.Array]) -> tuple[ModelCache, dict[str, jax.Array]]:
    """Copies request row `row` [] of each slot group in `plan` into unit plan[g] [] (-1: none), and
    bumps the written units' versions. Returns (pools, versions)."""
    new_v = dict(versions)
    for name, unit in plan.items():
        ok = unit >= 0
        pools = copy_rows(pools, (name,), row[None], unit[None], ok[None])
        v = versions[name]
        new_v[name] = v.at[jnp.where(ok, unit, v.shape[0])].add(1, mode="drop")
    return pools, new_v


def load_checkpoints(pools: ModelCache, versions: dict[str, jax.Array], row: jax.Array,
                     plan: dict[str, tuple[jax.Array, jax.Array]], boundary: jax.Array
                     ) -> tuple[ModelCache, jax.Array]:
    """Copies unit plan[g][0] [] (-1: none) into request row `row` [] of each slot group, if every used
    unit still has the version plan[g][1] [] the host validated; then the row resumes at `boundary`
    [] tokens (groups with per-row fields derived from the length, e.g. V4's entry counts, are set from
    it). Otherwise nothing is written. Returns (pools, ok [] bool)."""
    ok = jnp.bool_(True)
    for name, (unit, expect) in plan.items():
        v = versions[name][jnp.clip(unit, 0, versions[name].shape[0] - 1)]
        ok = ok & jnp.where(unit >= 0, v == expect, True)
    for name, (unit, _) in plan.items():
        pools = copy_rows(pools, (name,), unit[None], row[None], (ok & (unit >= 0))[None])
    groups = {name: g.resume_row(row, boundary, ok) for name, g in pools.groups.items()}
    return pools.replace(groups=groups), ok


def read_units(pools: ModelCache, plan: dict[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
    """Gathers units for a copy to the host. plan: group -> units [W] (-1 = padding, read as unit 0).
    Returns group -> field -> the field with its unit axis of size W; the caller keeps the
    non-padding entries."""
    out = {}
    for name, units in plan.items():
        g = pools.groups[name]
        out[name] = {}
        for f, ax in stored_fields(g).items():
            a = getattr(g, f)
            out[name][f] = jnp.take(a, jnp.clip(units, 0, a.shape[ax] - 1), axis=ax)
    return out


def write_units(pools: ModelCache, versions: dict[str, jax.Array], plan: dict[str, jax.Array],
                data: dict[str, dict[str, jax.Array]]) -> tuple[ModelCache, dict[str, jax.Array]]:
    """Writes host data into units (a restore from a tier). plan: group -> units [W] (-1 = padding,
    dropped); data: group -> field -> the field with a unit axis of size W. Written checkpoint units'
    versions are bumped. Returns (pools, versions)."""
    groups = dict(pools.groups)
    new_v = dict(versions)
    for name, units in plan.items():
        g = groups[name]
        upd = {}
        for f, ax in stored_fields(g).items():
            a = getattr(g, f)
            d = jnp.where(units >= 0, units, a.shape[ax])
            upd[f] = a.at[(slice(None),) * ax + (d,)].set(data[name][f].astype(a.dtype), mode="drop")
        groups[name] = g.replace(**upd)
        if name in versions:
            v = versions[name]
            new_v[name] = v.at[jnp.where(units >= 0, units, v.shape[0])].add(1, mode="drop")
    return pools.replace(groups=groups), new_v
