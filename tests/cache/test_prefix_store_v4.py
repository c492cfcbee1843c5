"""The prefix store's layouts for DeepSeek-V4's groups: a row saved at a boundary and loaded into another
row gives that row the same entries (pages through its own page table), window ring, tail with its
count and overlap state, with entry counts derived from the boundary; a stale version writes nothing."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cache.compressed import init_compressed_groups
from cache.prefix_cache import PrefixCache, PrefixCacheConfig, kind_of
from cache.prefix_store import group_block_size, init_pool, load_row, max_blocks_per_row, save_row
from cache.segments import Kind
from cache.state import ModelCache

CAP, B = 64, 3


def _cache(seed=0):
    """Three rows of random contents; row 0 holds 32 tokens (CSA rate 4: 8 entries, HCA rate 8: 4)."""
    groups = init_compressed_groups(batch_size=B, capacity=CAP, dtype=jnp.float32, window=6, head_dim=4,
                                    all_layers=(0, 1, 2), csa_layers=(1,), csa_rate=4, index_dim=2, hca_layers=(2,),
                                    hca_rate=8, entry_page_tokens=16)
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree_util.tree_flatten(groups)
    leaves = [jnp.asarray(rng.normal(size=a.shape), a.dtype) if a.dtype == jnp.float32 else a for a in leaves]
    groups = jax.tree_util.tree_unflatten(tree, leaves)
    for name in ("csa_tail", "csa_indexer_tail", "hca_tail"):
        groups[name] = groups[name].replace(count=jnp.asarray([0, 3, 1], jnp.int32))
    for name, n in (("compressed_sparse_attention", 8), ("csa_indexer", 8), ("heavily_compressed_attention", 4)):
        groups[name] = groups[name].replace(count=jnp.asarray([n, 1, 2], jnp.int32))
    return ModelCache(groups=groups, lengths=jnp.asarray([32, 5, 9], jnp.int32), version=jnp.zeros((B,), jnp.int32))


def _row(g, r):
    """What row r of a group holds: paged entries through its table, or its slice of every field."""
    if hasattr(g, "page_table"):
        return {"entries": np.asarray(g.entries[:, g.page_table[r]]), "count": int(g.count[r])}
    return {f: np.asarray(getattr(g, f)[..., r, :, :] if getattr(g, f).ndim > 1 else getattr(g, f)[r])
            for f in ("kv", "gate", "count") if hasattr(g, f)}


def test_v4_groups_have_kinds_and_block_geometry():
    groups = _cache().groups
    assert {n: kind_of(g) for n, g in groups.items()} == {
        "sliding_window": Kind.SWA_WINDOW, "compressed_sparse_attention": Kind.COMPRESSED_KV,
        "csa_tail": Kind.UNCOMPRESSED_TAIL, "csa_overlap": Kind.CSA_OVERLAP, "csa_indexer": Kind.INDEXER_KEYS,
        "csa_indexer_tail": Kind.UNCOMPRESSED_TAIL, "csa_indexer_overlap": Kind.CSA_OVERLAP,
        "heavily_compressed_attention": Kind.COMPRESSED_KV, "hca_tail": Kind.UNCOMPRESSED_TAIL}
    assert group_block_size(groups["compressed_sparse_attention"], 16) == 16       # 4 entries x rate 4
    assert group_block_size(groups["heavily_compressed_attention"], 16) == 16      # 2 entries x rate 8
    assert max_blocks_per_row(groups["heavily_compressed_attention"], 16) == 4     # 8 entries in pages of 2
    for n in ("sliding_window", "csa_tail", "csa_overlap"):
        assert group_block_size(groups[n], 16) == 0 and max_blocks_per_row(groups[n], 16) == 1
    pool = init_pool(groups["csa_tail"], 5, 16)
    assert pool.arrays["count"].shape == (1, 5) and pool.arrays["kv"].shape == (1, 5, 4, 8)
    pc = PrefixCache(_cache(), PrefixCacheConfig(cap_bytes=1 << 20, fingerprint="f", dtype="float32", block_size=16))
    spec = {s.name: s for s in pc.specs}
    assert pc.geometry.lcm == 16 and spec["sliding_window"].is_checkpoint and spec["csa_tail"].closes_into == (
        "compressed_sparse_attention")
    assert not spec["compressed_sparse_attention"].is_checkpoint and not spec["compressed_sparse_attention"].needs_tail


def test_save_then_load_moves_every_v4_object_to_another_row():
    cache = _cache()
    boundary = 32
    store = {n: init_pool(g, 8, 16) for n, g in cache.groups.items()}
    save, load = {}, {}
    for n, g in cache.groups.items():
        W = max_blocks_per_row(g, 16)
        nb = 1 if store[n].block_size == 0 else boundary // store[n].block_size
        src = np.full((W,), -1, np.int32)
        dst = np.full((W,), -1, np.int32)
        src[:nb], dst[:nb] = np.arange(nb), np.arange(nb) + 2            # blocks to slots 2, 3, ...
        save[n] = (jnp.asarray(src), jnp.asarray(dst))
        lsrc = np.full((W,), -1, np.int32)
        lsrc[:nb] = np.arange(nb) + 2
        ldst = np.zeros((W,), np.int32)
        ldst[:nb] = np.arange(nb)
        load[n] = (jnp.asarray(lsrc), jnp.asarray(ldst), jnp.ones((W,), jnp.int32))
    store = save_row(cache, store, jnp.int32(0), save)
    out, ok = load_row(cache, store, jnp.int32(2), load, jnp.int32(boundary))
    assert bool(ok) and int(out.lengths[2]) == boundary
    for n, g in out.groups.items():
        want, got = _row(cache.groups[n], 0), _row(g, 2)
        if "entries" in want:
            pages = boundary // group_block_size(g, 16)
            np.testing.assert_array_equal(got["entries"][:, :pages], want["entries"][:, :pages], err_msg=n)
            assert got["count"] == boundary // g.rate == want["count"], n
        else:
            for f in want:
                np.testing.assert_array_equal(got[f], want[f], err_msg=f"{n}.{f}")
        for r in (0, 1):                                         # other rows are untouched
            for f, a in _row(cache.groups[n], r).items():
                np.testing.assert_array_equal(_row(g, r)[f], a, err_msg=f"{n}.{f} row {r}")
    stale = dict(load, csa_tail=(load["csa_tail"][0], load["csa_tail"][1], load["csa_tail"][2] + 1))
    out, ok = load_row(cache, store, jnp.int32(2), stale, jnp.int32(boundary))
    assert not bool(ok) and int(out.lengths[2]) == 0
    for n, g in out.groups.items():
        for f, a in _row(cache.groups[n], 2).items():
            np.testing.assert_array_equal(_row(g, 2)[f], a, err_msg=f"stale load wrote {n}.{f}")
