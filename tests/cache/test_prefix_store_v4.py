"""The prefix store's layouts for DeepSeek-V4's groups: checkpoint groups (window ring, tails with
their counts, overlap states) are copied from a request row into checkpoint units and back, with the
unit versions checked inside the compiled load (a stale version writes nothing); entry groups are
paged, shared by reference, and a row resuming at a boundary gets its entry counts from it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_manager import BlockManager
from cache.compressed import init_compressed_groups
from cache.pools import pool_geometry
from cache.prefix_cache import PrefixCache, PrefixCacheConfig
from cache.prefix_store import init_versions, load_checkpoints, save_checkpoints, stored_fields
from cache.segments import Kind
from cache.state import ModelCache

CAP, B, ROWS = 64, 5, 3       # rows 0..2 hold requests, rows 3..4 of the slot groups are checkpoint units


def _cache(seed=0):
    """Five rows of random contents; row 0 holds 32 tokens (CSA rate 4: 8 entries, HCA rate 8: 4)."""
    groups = init_compressed_groups(batch_size=B, capacity=CAP, dtype=jnp.float32, window=6, head_dim=4,
                                    all_layers=(0, 1, 2), csa_layers=(1,), csa_rate=4, index_dim=2, hca_layers=(2,),
                                    hca_rate=8, entry_page_tokens=16)
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree_util.tree_flatten(groups)
    leaves = [jnp.asarray(rng.normal(size=a.shape), a.dtype) if a.dtype == jnp.float32 else a for a in leaves]
    groups = jax.tree_util.tree_unflatten(tree, leaves)
    for name in ("csa_tail", "csa_indexer_tail", "hca_tail"):
        groups[name] = groups[name].replace(count=jnp.asarray([0, 3, 1, 2, 2], jnp.int32))
    for name, n in (("compressed_sparse_attention", 8), ("csa_indexer", 8), ("heavily_compressed_attention", 4)):
        groups[name] = groups[name].replace(count=jnp.asarray([n, 1, 2, 0, 0], jnp.int32))
    return ModelCache(groups=groups, lengths=jnp.asarray([32, 5, 9, 0, 0], jnp.int32),
                      version=jnp.zeros((B,), jnp.int32))


def _row(g, r):
    """What row r of a slot group holds, field by field."""
    return {f: np.asarray(jnp.take(getattr(g, f), r, axis=ax)) for f, ax in stored_fields(g).items()}


SLOTS = ("sliding_window", "csa_tail", "csa_overlap", "csa_indexer_tail", "csa_indexer_overlap", "hca_tail")


def test_v4_groups_have_kinds_and_block_geometry():
    groups = _cache().groups
    assert {n: g.store_kind() for n, g in groups.items()} == {
        "sliding_window": Kind.SWA_WINDOW, "compressed_sparse_attention": Kind.COMPRESSED_KV,
        "csa_tail": Kind.UNCOMPRESSED_TAIL, "csa_overlap": Kind.CSA_OVERLAP, "csa_indexer": Kind.INDEXER_KEYS,
        "csa_indexer_tail": Kind.UNCOMPRESSED_TAIL, "csa_indexer_overlap": Kind.CSA_OVERLAP,
        "heavily_compressed_attention": Kind.COMPRESSED_KV, "hca_tail": Kind.UNCOMPRESSED_TAIL}
    assert groups["compressed_sparse_attention"].page_tokens == 16                # 4 entries x rate 4
    assert groups["heavily_compressed_attention"].page_tokens == 16               # 2 entries x rate 8
    assert groups["heavily_compressed_attention"].page_table.shape[1] == 4       # 8 entries in pages of 2
    assert {n for n, g in groups.items() if not g.paged} == set(SLOTS)
    assert stored_fields(groups["csa_tail"]) == {"kv": 1, "gate": 1, "count": 0}   # the count is part of a tail
    cache = _cache()
    blocks = BlockManager(pool_geometry(cache, ROWS), num_rows=ROWS - 1)
    pc = PrefixCache(cache, PrefixCacheConfig(cap_bytes=1 << 20, fingerprint="f", dtype="float32", block_size=16),
                     blocks)
    spec = {s.name: s for s in pc.specs}
    assert pc.geometry.lcm == 16 and spec["sliding_window"].is_checkpoint and spec["csa_tail"].closes_into == (
        "compressed_sparse_attention")
    assert not spec["compressed_sparse_attention"].is_checkpoint and not spec["compressed_sparse_attention"].needs_tail
    assert blocks.reclaimer is pc and blocks.free_units("csa_tail") == B - ROWS


def test_checkpoints_move_between_rows_and_units():
    cache = _cache()
    versions = init_versions(cache, SLOTS)
    boundary = 32
    cache, versions = save_checkpoints(cache, versions, jnp.int32(0), {n: jnp.int32(3) for n in SLOTS})
    assert all(int(versions[n][3]) == 1 and int(versions[n][4]) == 0 for n in SLOTS)
    for n in SLOTS:
        for f, a in _row(_cache().groups[n], 0).items():
            np.testing.assert_array_equal(_row(cache.groups[n], 3)[f], a, err_msg=f"{n}.{f} unit 3")
    before = jax.tree_util.tree_map(np.asarray, cache.groups)
    plan = {n: (jnp.int32(3), jnp.int32(1)) for n in SLOTS}
    out, ok = load_checkpoints(cache, versions, jnp.int32(2), plan, jnp.int32(boundary))
    assert bool(ok)
    for n in SLOTS:
        want = _row(cache.groups[n], 3)
        for f in want:
            np.testing.assert_array_equal(_row(out.groups[n], 2)[f], want[f], err_msg=f"{n}.{f}")
        for r in (0, 1, 3, 4):                                   # other rows are untouched
            for f, a in _row(cache.groups[n], r).items():
                np.testing.assert_array_equal(_row(out.groups[n], r)[f], a, err_msg=f"{n}.{f} row {r}")
    for n in ("compressed_sparse_attention", "csa_indexer", "heavily_compressed_attention"):
        g = out.groups[n]
        assert int(g.count[2]) == boundary // g.rate and int(g.count[1]) == 1, n     # derived from the boundary
        np.testing.assert_array_equal(np.asarray(g.entries), before[n].entries)      # pages: never copied
    stale = dict(plan, csa_tail=(jnp.int32(3), jnp.int32(2)))
    out, ok = load_checkpoints(cache, versions, jnp.int32(2), stale, jnp.int32(boundary))
    assert not bool(ok)
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.tree_util.tree_map(np.asarray, out.groups))
