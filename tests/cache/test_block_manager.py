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
    assert bm.reserve("b", 32, 32) == {}             # past the shared pages: nothing to copy
    cow = bm.reserve("b", 24, 30)
    (src, dst), = cow["full_attention"]
    assert src == shared[1] and dst not in shared
    assert bm.table("b", "full_attention") == [shared[0], dst]
    assert bm.refcount("full_attention", src) == 1 and bm.table("a", "full_attention") == shared
    assert bm.reserve("b", 24, 30) == {} and bm.copies_on_write == 1    # private now
    bm.check()


def test_reserve_takes_the_pages_of_a_write_and_its_copies_all_or_nothing():
    """A step's pages are reserved before it is scheduled: growth and copy-on-write together. With
    one page short of both, nothing is taken, and the shared pages stay shared."""
    bm = BlockManager([KV], num_rows=3)
    bm.take_row("a")
    bm.grow("a", 24)                                 # pages 0, 1 (the second half full)
    bm.take_row("b")
    bm.share("b", "full_attention", bm.table("a", "full_attention"))
    bm.take_row("c")
    assert bm.grow("c", 16 * 5)                      # 5 of the 8 pages: one left
    # b writes tokens 24..40: a copy of its shared second page and one new page: two, one is free
    assert bm.shared_in("b", 24, 40) == {"full_attention": 1}
    assert bm.reserve("b", 24, 40) is None
    assert bm.table("b", "full_attention") == bm.table("a", "full_attention") and bm.free_units("full_attention") == 1
    bm.release_request("c")
    cow = bm.reserve("b", 24, 40)
    (src, dst), = cow["full_attention"]
    t = bm.table("b", "full_attention")
    assert len(t) == 3 and t[1] == dst and src == bm.table("a", "full_attention")[1]
    assert all(bm.refcount("full_attention", p) == 1 for p in t[1:])    # b writes only its own pages
    assert bm.shared_in("b", 24, 40) == {"full_attention": 0}
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


def test_reserved_writes_touch_only_private_existing_pages():
    """A state machine: requests take rows, start from a stored prefix (shared pages, the last one
    possibly partial), reserve the pages of their next write (growth and copy-on-write at once) or,
    when the pool cannot supply them, preempt the newest request as the scheduler does; the store
    takes references to pages (publishes) and lets go of what only it holds. After every reserve, the
    write range lies in pages the writer alone references; counts and free lists always add up."""
    from hypothesis import HealthCheck, settings  # noqa: PLC0415
    from hypothesis import strategies as st  # noqa: PLC0415
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: PLC0415
    seen = {"copies": 0, "preempted": 0}

    class M(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.bm = BlockManager([KV, REC], num_rows=4)
            self.store = StoreStub(self.bm)
            self.bm.reclaimer = self.store
            self.len: dict[str, int] = {}          # request -> tokens written
            self.order: list[str] = []             # admission order (newest last)
            self.n = 0

        @precondition(lambda self: self.bm.free_rows() > 0)
        @rule(shared=st.integers(0, 40))
        def admit(self, shared):
            self.n += 1
            rid = f"r{self.n}"
            self.bm.take_row(rid)
            pages = [u for g, u in self.store.held if g == "full_attention"][:-(-shared // 16)] if shared else []
            shared = min(shared, 16 * len(pages))
            self.bm.share(rid, "full_attention", pages[: -(-shared // 16)])
            self.len[rid], self.order = shared, self.order + [rid]

        @precondition(lambda self: bool(self.order))
        @rule(pick=st.integers(0, 10), n=st.integers(1, 40))
        def write(self, pick, n):
            rid = self.order[pick % len(self.order)]
            first = self.len[rid]
            while self.bm.reserve(rid, first, first + n) is None:
                victim = self.order.pop()           # newest first, as the scheduler preempts
                seen["preempted"] += 1
                self.bm.release_request(victim)
                del self.len[victim]
                if victim == rid:
                    return
            seen["copies"] = max(seen["copies"], self.bm.copies_on_write)
            t = self.bm.table(rid, "full_attention")
            assert len(t) * 16 >= first + n
            for i in range(first // 16, -(-(first + n) // 16)):
                assert self.bm.refcount("full_attention", t[i]) == 1, "a reserved write range holds a shared page"
            self.len[rid] = first + n

        @precondition(lambda self: bool(self.order))
        @rule(pick=st.integers(0, 10))
        def publish(self, pick):
            """The store takes a reference to every page the request has written (a published prefix)."""
            rid = self.order[pick % len(self.order)]
            for p in self.bm.table(rid, "full_attention")[: -(-self.len[rid] // 16)]:
                if ("full_attention", p) not in self.store.held:
                    self.bm.retain("full_attention", p)
                    self.store.held.append(("full_attention", p))

        @precondition(lambda self: bool(self.order))
        @rule(pick=st.integers(0, 10))
        def finish(self, pick):
            rid = self.order.pop(pick % len(self.order))
            self.bm.release_request(rid)
            del self.len[rid]

        @rule(n=st.integers(1, 4))
        def reclaim(self, n):
            self.store.reclaim("full_attention", n)

        @invariant()
        def counts_add_up(self):
            self.bm.check()
            for u in range(KV.num_units):
                listed = sum(t["full_attention"].count(u) for t in self.bm.tables.values())
                held = self.store.held.count(("full_attention", u))
                assert self.bm.refcount("full_attention", u) == listed + held

    M.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                                   suppress_health_check=list(HealthCheck))
    M.TestCase().runTest()
    assert seen["copies"] > 0 and seen["preempted"] > 0, seen       # it went where it says it goes
