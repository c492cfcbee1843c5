"""Device pools of the prefix cache, and the two copies between them and an engine's cache rows.

The engine's cache gives each running request a row (slot). A prefix that should outlive its
request is copied, block by block, into a store pool that mirrors its group; a later request that
validates a hit copies the blocks back into its own row and resumes at the hit's boundary:

  full KV       (KVGroup)         k, v    [L, N, bs, Hkv, D]    row block i = tokens [i*bs, (i+1)*bs)
  MLA latent    (MLALatentGroup)  latent  [L, N, ps, R], rope [L, N, ps, Dr]   row block i = page_table[row, i]
  indexer keys  (IndexerKeyGroup) keys    [L, N, ps2, D] (+ scale [L, N, ps2] for fp8)
  recurrent     (RecurrentGroup)  conv    [L, N, W-1, C], ssm [L, N, HV, K, V]  one checkpoint per slot
  V4 entries    (CompressedKVGroup, compressed or indexer entries)
                                  entries [L, N, ps, D]   row block i = page_table[row, i]: a page of
                                  ps entries covers ps * rate tokens; on load the row's entry count
                                  becomes boundary // rate
  V4 window     (SlidingWindowGroup) kv   [L, N, W, D]    the ring at the boundary, one checkpoint per slot
  V4 tail       (TailGroup)       kv, gate [L, N, rate, C], count [1, N]         one checkpoint per slot
  V4 overlap    (OverlapGroup)    kv, gate [L, N, rate, D]                       one checkpoint per slot

Every pool slot has a version [N] that each write bumps. `load_row` compares the versions the host
recorded when it validated the hit with the pool's versions *inside the compiled step*; if any
differs (the slot was rewritten between check and use) nothing is written, the row comes back with
length 0 and `ok` is False, so the host recomputes instead of reading changed data.

Plans are fixed-width int32 arrays (one program per engine, whatever the hit): entries with a
negative slot are padding and are dropped by the scatters (`mode="drop"` on an out-of-range index),
never clamped onto a live block.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from cache.compressed import CompressedKVGroup, OverlapGroup, SlidingWindowGroup, TailGroup
from cache.mla import IndexerKeyGroup, MLALatentGroup
from cache.state import KVGroup, ModelCache, RecurrentGroup

# Groups stored as one whole per-row state per boundary (a checkpoint), not as blocks of tokens.
CHECKPOINT_GROUPS = (RecurrentGroup, SlidingWindowGroup, TailGroup, OverlapGroup)
# Groups whose pools are paged ([L, P, ps, ...] + page_table [B, NP]).
PAGED_GROUPS = (MLALatentGroup, IndexerKeyGroup, CompressedKVGroup)


@flax.struct.dataclass
class StorePool:
    """Stored blocks (or checkpoints) of one cache group."""
    arrays: dict[str, jax.Array]   # field -> [L, N, ...]: the group's per-block (or per-row) layout
    version: jax.Array             # [N] int32
    block_size: int = flax.struct.field(pytree_node=False, default=0)   # 0: a checkpoint pool

    @property
    def num_slots(self) -> int:
        return self.version.shape[0]

    def slot_nbytes(self) -> int:
        """Bytes one slot holds, over every field."""
        return sum(a[:, 0].size * a.dtype.itemsize for a in self.arrays.values())


def _fields(group) -> dict[str, jax.Array]:
    """The arrays of a group that the store copies (fp8 indexer scales included when present)."""
    if isinstance(group, KVGroup):
        return {"k": group.k, "v": group.v}
    if isinstance(group, RecurrentGroup):
        return {"conv": group.conv, "ssm": group.ssm}
    if isinstance(group, MLALatentGroup):
        return {"latent": group.latent, "rope": group.rope}
    if isinstance(group, IndexerKeyGroup):
        out = {"keys": group.keys}
        if group.scale is not None:
            out["scale"] = group.scale
        return out
    if isinstance(group, CompressedKVGroup):
        return {"entries": group.entries}
    if isinstance(group, SlidingWindowGroup):
        return {"kv": group.kv}
    if isinstance(group, TailGroup):         # the count [B] is kept as [1, B]: a slot replaces axis 1
        return {"kv": group.kv, "gate": group.gate, "count": group.count[None]}
    if isinstance(group, OverlapGroup):
        return {"kv": group.kv, "gate": group.gate}
    raise TypeError(f"the prefix store has no layout for cache group type {type(group).__name__}")


def _with_fields(group, upd: dict[str, jax.Array], row, boundary, ok):
    """The group with fields `upd` (in the _fields layout) written back; a compressed-entry group's
    row count becomes boundary // rate where ok (its entries are derived from the boundary)."""
    if isinstance(group, TailGroup):
        upd = dict(upd, count=upd["count"][0])
    if isinstance(group, CompressedKVGroup):
        upd = dict(upd, count=group.count.at[row].set(jnp.where(ok, boundary // group.rate, group.count[row])))
    return group.replace(**upd)


def group_block_size(group, kv_block_size: int) -> int:
    """Tokens per stored block: a paged group's page size (tokens a page of compressed entries
    covers), `kv_block_size` for full KV, 0 for a checkpoint group (recurrent state, V4 window,
    tail, overlap: placed on the LCM grid by the prefix cache)."""
    if isinstance(group, CompressedKVGroup):
        return group.page_tokens
    if isinstance(group, (MLALatentGroup, IndexerKeyGroup)):
        return group.page_size
    if isinstance(group, KVGroup):
        if group.capacity % kv_block_size:
            raise ValueError(f"full-KV capacity {group.capacity} is not a multiple of the block size {kv_block_size}")
        return kv_block_size
    if isinstance(group, CHECKPOINT_GROUPS):
        return 0
    raise TypeError(f"the prefix store has no layout for cache group type {type(group).__name__}")


def init_pool(group, num_slots: int, kv_block_size: int) -> StorePool:
    """An empty pool of `num_slots` slots shaped after `group`."""
    bs = group_block_size(group, kv_block_size)
    arrays = {}
    for f, a in _fields(group).items():
        if isinstance(group, KVGroup):
            shape = (a.shape[0], num_slots, bs) + a.shape[3:]
        else:   # paged pools [L, P, ps, ...] and checkpoints [L, B, ...]: the slot replaces axis 1
            shape = (a.shape[0], num_slots) + a.shape[2:]
        arrays[f] = jnp.zeros(shape, a.dtype)
    return StorePool(arrays=arrays, version=jnp.zeros((num_slots,), jnp.int32), block_size=bs)


def max_blocks_per_row(group, kv_block_size: int) -> int:
    """Plan width of a group: blocks a row can hold (1 for a checkpoint group)."""
    if isinstance(group, CHECKPOINT_GROUPS):
        return 1
    if isinstance(group, KVGroup):
        return group.capacity // kv_block_size
    return group.page_table.shape[1]


# --- row <-> blocks ---------------------------------------------------------------------------------

def _row_blocks(group, f: str, a: jax.Array, row, idx, bs: int) -> jax.Array:
    """Blocks `idx` [M] of `row` of field array `a`, as [L, M, block...]."""
    if isinstance(group, CHECKPOINT_GROUPS):
        return a[:, row][:, None]
    if isinstance(group, KVGroup):
        L, B, S = a.shape[:3]
        return a.reshape((L, B, S // bs, bs) + a.shape[3:])[:, row][:, idx]
    pages = group.page_table[row, idx]
    return a[:, pages]


def _write_row_blocks(group, a: jax.Array, row, idx, blocks, valid, bs: int) -> jax.Array:
    """`a` with blocks [L, M, ...] written at row blocks `idx` [M] where `valid` [M]; others dropped."""
    if isinstance(group, CHECKPOINT_GROUPS):
        r = jnp.where(valid[0], row, a.shape[1])                 # out of range: dropped
        return a.at[:, r].set(blocks[:, 0], mode="drop")
    if isinstance(group, KVGroup):
        # The plan of a full-KV group is the whole row (W = S / bs, dst = 0, 1, ..): write it as one
        # dynamic-update-slice of the row (a memcpy) instead of a scatter of W blocks; blocks that
        # are not loaded keep the row's content.
        L, B, S = a.shape[:3]
        nb = S // bs
        keep = jnp.zeros((nb,), bool).at[jnp.where(valid, idx, nb)].set(True, mode="drop")
        new = blocks.reshape((L, S) + a.shape[3:])
        cur = jax.lax.dynamic_index_in_dim(a, row, axis=1, keepdims=False)
        mask = jnp.repeat(keep, bs).reshape((1, S) + (1,) * (a.ndim - 3))
        return jax.lax.dynamic_update_index_in_dim(a, jnp.where(mask, new, cur), row, axis=1)
    pages = jnp.where(valid, group.page_table[row, jnp.clip(idx, 0, group.page_table.shape[1] - 1)], a.shape[1])
    return a.at[:, pages].set(blocks, mode="drop")


def save_row(cache: ModelCache, store: dict[str, StorePool], row: jax.Array,
             plan: dict[str, tuple[jax.Array, jax.Array]]) -> dict[str, StorePool]:
    """Copies blocks of cache row `row` [] into the store.

    plan: group -> (src [M] block index within the row, dst [M] store slot, -1 = none). A checkpoint
    group's plan has M = 1 and copies the row's current state as a checkpoint. Returns the store
    with the written slots' versions bumped."""
    out = {}
    for name, pool in store.items():
        src, dst = plan[name]
        g = cache.groups[name]
        n = pool.num_slots
        d = jnp.where(dst >= 0, dst, n)
        s = jnp.clip(src, 0, max(max_blocks_per_row(g, pool.block_size or 1) - 1, 0))
        arrays = {}
        for f, a in _fields(g).items():
            blocks = _row_blocks(g, f, a, row, s, pool.block_size)
            arrays[f] = pool.arrays[f].at[:, d].set(blocks.astype(pool.arrays[f].dtype), mode="drop")
        out[name] = pool.replace(arrays=arrays, version=pool.version.at[d].add(1, mode="drop"))
    return out


def load_row(cache: ModelCache, store: dict[str, StorePool], row: jax.Array,
             plan: dict[str, tuple[jax.Array, jax.Array, jax.Array]], boundary: jax.Array
             ) -> tuple[ModelCache, jax.Array]:
    """Copies stored blocks into cache row `row` [] and sets its length to `boundary` [].

    plan: group -> (src [M] store slot or -1, dst [M] block index within the row, expect [M] the
    slot version recorded at check). A full-KV group's plan spans the whole row: dst[j] == j. If any used slot's version differs, nothing is written and
    the row's length becomes 0. Returns (cache, ok [] bool)."""
    ok = jnp.bool_(True)
    for name, pool in store.items():
        src, _, expect = plan[name]
        used = src >= 0
        ver = pool.version[jnp.clip(src, 0, pool.num_slots - 1)]
        ok = ok & jnp.all(jnp.where(used, ver == expect, True))
    groups: dict[str, Any] = dict(cache.groups)
    for name, pool in store.items():
        src, dst, _ = plan[name]
        g = cache.groups[name]
        valid = (src >= 0) & ok
        s = jnp.clip(src, 0, pool.num_slots - 1)
        upd = {}
        for f, a in _fields(g).items():
            upd[f] = _write_row_blocks(g, a, row, dst, pool.arrays[f][:, s].astype(a.dtype), valid, pool.block_size)
        groups[name] = _with_fields(g, upd, row, boundary, ok)
    lengths = cache.lengths.at[row].set(jnp.where(ok, boundary, 0))
    return ModelCache(groups=groups, lengths=lengths, version=cache.version.at[row].add(1)), ok


# --- store slots <-> host (tiers) -------------------------------------------------------------------

def read_slots(store: dict[str, StorePool], plan: dict[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
    """Gathers slots for a copy to the host. plan: group -> slots [W] (-1 = padding, read as slot 0).
    Returns group -> field -> [L, W, ...]; the caller keeps the non-padding columns."""
    return {name: {f: a[:, jnp.clip(plan[name], 0, pool.num_slots - 1)] for f, a in pool.arrays.items()}
            for name, pool in store.items()}


def write_slots(store: dict[str, StorePool], plan: dict[str, jax.Array],
                data: dict[str, dict[str, jax.Array]]) -> dict[str, StorePool]:
    """Writes host data into slots (a restore from a tier). plan: group -> slots [W] (-1 = padding,
    dropped); data: group -> field -> [L, W, ...]. Written slots' versions are bumped."""
    out = {}
    for name, pool in store.items():
        d = jnp.where(plan[name] >= 0, plan[name], pool.num_slots)
        arrays = {f: a.at[:, d].set(data[name][f].astype(a.dtype), mode="drop") for f, a in pool.arrays.items()}
        out[name] = pool.replace(arrays=arrays, version=pool.version.at[d].add(1, mode="drop"))
    return out
