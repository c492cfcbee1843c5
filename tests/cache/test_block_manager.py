"""The block manager: rows, pages and checkpoint units handed out and taken back with reference counts,
all-or-nothing growth, zero-copy sharing, copy-on-write, versions bumped on every hand-out, and a
reclaimer asked for store-held units when a pool runs dry."""
from __future__ import annotations

import numpy as np
import pytest

from cache.block_manager import BlockManager, GroupGeometry

KV = GroupGeometry("full_attention", "full_kv", page_tokens=16, num_units=8, unit_nbytes=100)
LAT = GroupGeometry("latent", "mla_latent", page_tokens=64, num_units=3, unit_nbytes=10)
REC = GroupGeometry("linear_attention", "recurrent_state", page_tokens=0, num_units=2, unit_nbytes=1000, first_unit=5)


class StoreStub:
    """A reclaimer holding some units by reference, giving them back on request."""

    def __init__(self, bm):
        self.bm, self.held = bm, []

    def reclaimable(self, group):
        return sum(1 for g, u in self.held if g == group and self.bm.refcount(g, u) == 1)

    def reclaim(self, group, n):
        freed = 0
        for g, u in list(self.held):
            if freed < n and g == group and self.bm.refcount(g, u) == 1:
                self.held.remove((g, u))
                self.bm.release(g, u)
                freed += 1
        return freed


def test_rows_pages_and_growth_are_all_or_nothing():
    bm = BlockManager([KV, LAT, REC], num_rows=2)
    assert bm.take_row("a") == 0 and bm.take_row("b") == 1 and bm.take_row("c") is None
    assert bm.missing("a", 70) == {"full_attention": 5, "latent": 2}
    assert bm.grow("a", 70) and bm.table("a", "full_attention") == [0, 1, 2, 3, 4]
    assert bm.grow("a", 70) and len(bm.table("a", "full_attention")) == 5          # nothing more needed
    assert not bm.grow("b", 64 * 2)                    # latent has 1 page left: nothing taken for b
    assert bm.table("b", "full_attention") == [] and bm.free_units("full_attention") == 3
    bm.check()
    bm.release_request("a")
    assert bm.free_rows() == 1 and bm.free_units("full_attention") == 8 and bm.free_units("latent") == 3
    assert bm.grow("b", 128)
    bm.check()


def test_versions_bump_on_every_hand_out():
    bm = BlockManager([KV], num_rows=1)
    bm.take_row("a")
    bm.grow("a", 16)
    p = bm.table("a", "full_attention")[0]
    v = bm.version("full_attention", p)
    bm.release_request("a")
    bm.take_row("b")
    bm.grow("b", 16 * 8)                             # every page handed out again, p among them
    assert bm.version("full_attention", p) == v + 1


def test_sharing_counts_references_and_the_store_keeps_pages_alive():
    bm = BlockManager([KV], num_rows=3)
    bm.take_row("a")
    bm.grow("a", 40)
    pages = bm.table("a", "full_attention")[:2]      # two whole pages of a
    for p in pages:
        bm.retain("full_attention", p)               # the store takes a reference
    bm.release_request("a")
    assert [bm.refcount("full_attention", p) for p in pages] == [1, 1]
    assert bm.free_units("full_attention") == 8 - 2
    bm.take_row("b")
    bm.share("b", "full_attention", pages)
    assert bm.table("b", "full_attention") == pages and bm.refcount("full_attention", pages[0]) == 2
    with pytest.raises(ValueError, match="empty block table"):
        bm.share("b", "full_attention", pages)
    bm.unshare("b")
    assert bm.table("b", "full_attention") == [] and bm.refcount("full_attention", pages[0]) == 1
    bm.check()


def test_copy_on_write_gives_a_private_page_for_a_shared_one():
    bm = BlockManager([KV], num_rows=2)
    bm.take_row("a")
    bm.grow("a", 24)                                 # pages for 24 tokens: the second is half full
    shared = bm.table("a", "full_attention")
    bm.take_row("b")
    bm.share("b", "full_attention", shared)          # b continues a's prefix from token 24
    assert bm.writable("b", 32, 40) == {}            # past the shared pages: nothing to copy
    cow = bm.writable("b", 24, 30)
    (src, dst), = cow["full_attention"]
    assert src == shared[1] and dst not in shared
    assert bm.table("b", "full_attention") == [shared[0], dst]
    assert bm.refcount("full_attention", src) == 1 and bm.table("a", "full_attention") == shared
    assert bm.writable("b", 24, 30) == {} and bm.copies_on_write == 1   # private now
    bm.check()


def test_a_dry_pool_asks_the_reclaimer_for_store_only_units():
    bm = BlockManager([KV, REC], num_rows=2)
    store = StoreStub(bm)
    bm.reclaimer = store
    bm.take_row("a")
    assert bm.grow("a", 16 * 8)
    for p in bm.table("a", "full_attention")[:6]:
        bm.retain("full_attention", p)
        store.held.append(("full_attention", p))
    u = bm.alloc_unit("linear_attention")
    assert u in (5, 6)
    store.held.append(("linear_attention", u))
    assert store.reclaimable("full_attention") == 0          # a still lists them
    bm.release_request("a")
    assert bm.free_units("full_attention") == 2 and bm.available("full_attention") == 8
    bm.take_row("b")
    assert bm.grow("b", 16 * 5)                             # 2 free + 3 reclaimed from the store
    assert len(store.held) == 1 + 3 and bm.free_units("full_attention") == 0
    assert bm.alloc_unit("linear_attention") is not None
    assert bm.alloc_unit("linear_attention") is not None     # the store's checkpoint unit reclaimed
    assert bm.alloc_unit("linear_attention") is None
    bm.check()


def test_block_tables_pad_with_minus_one():
    bm = BlockManager([KV, LAT], num_rows=2)
    bm.take_row("a")
    bm.grow("a", 20)
    t = bm.block_tables(["a", None], {"full_attention": 4, "latent": 2})
    assert t["full_attention"].tolist() == [[0, 1, -1, -1], [-1, -1, -1, -1]]
    assert t["latent"].dtype == np.int32 and t["latent"].tolist() == [[0, -1], [-1, -1]]
