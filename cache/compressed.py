"""Cache groups of compressed attention (DeepSeek-V4): the five objects a compressed layer keeps.

Every group stacks its layers on a leading axis and keeps one row per request on axis 1 (its
`ROW_FIELDS`; the entry pools are paged, `PAGE_FIELDS`): cache.pools gathers and scatters them.

  SlidingWindowGroup   (sliding_window)  kv [L, B, W, D]: the last W raw entries (K = V) of every
                                         layer, a ring indexed by position % W
  CompressedKVGroup    (compressed_kv / indexer_entries)
                                         entries [L, P, ps, D] paged: one entry per closed window of
                                         `rate` tokens (entry j covers positions j*rate .. j*rate + rate - 1),
                                         logical entry j of row b at page_table[b, j // ps], slot j % ps,
                                         so a page holds ps entries = ps * rate tokens;
                                         page_table [B, NP] int32; count [B] int32 entries written per row
  TailGroup            (uncompressed_tail)
                                         kv, gate (f32) [L, B, rate, C]: the projections of the not-yet-closed
                                         window (slot s = position % rate; C = 2D with CSA's two series),
                                         count [B] int32 tokens in it (0 .. rate-1)
  OverlapGroup         (csa_overlap)     kv, gate (f32) [L, B, rate, D]: the first series (Ca, gate with its
                                         position bias) of the last closed window, which the next CSA
                                         entry blends with its own second series (Cb)

A tail reaching `rate` tokens closes: it becomes one compressed entry, the tail empties, and (CSA)
its Ca half becomes the overlap state. `close_tail` names that transition on the device; model
layers compute the entries, write them with `write_entries` and read them through the page table
(every access goes through it, as in cache/mla.py), and hand the arrays back through the group's
`replace`. The host-side record of the same
transition (a published tail checkpoint superseded by the entry block its window closed into) is
`cache.segment_allocator.close_tail`.

Pages are assigned contiguously per row at creation (row b owns pages b*NP .. b*NP + NP - 1); the
engine's block manager hands them out per request instead. A reset row gets count 0: its old
entries stay in the pool, unread.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from cache.mla import contiguous_page_table, write_paged
from cache.group import CacheGroup
from cache.segments import Kind
from pallas_kernels import abi as kernel_abi

COMPRESSOR = kernel_abi.V4_COMPRESSOR      # writes entries, indexer entries, tails and overlap states
ENTRY_PAGE_TOKENS = 64      # tokens a page of compressed entries covers (ps = max(1, 64 // rate) entries)
SLIDING_WINDOW = kernel_abi.V4_WINDOW


@flax.struct.dataclass
class SlidingWindowGroup(CacheGroup):
    """Raw shared K=V entries of the last W positions of every layer (all layer types have one)."""
    kv: jax.Array              # [L, B, W, D]
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=SLIDING_WINDOW.id)

    kind = "swa_window"
    STORE_KIND = Kind.SWA_WINDOW
    ROW_FIELDS = {"kv": 1}
    ROLLBACK = "replay"          # a ring: a rejected token overwrote an entry the window still needs

    @property
    def window(self) -> int:
        return self.kv.shape[2]

    def bytes_per_token(self) -> int:
        return 0      # fixed per row: W entries whatever the length


@flax.struct.dataclass
class CompressedKVGroup(CacheGroup):
    """Paged compressed entries of every layer of one compressed type (or the CSA indexer's keys)."""
    entries: jax.Array         # [L, P, ps, D]
    page_table: jax.Array      # [B, NP] int32
    count: jax.Array           # [B] int32 entries written per row
    rate: int = flax.struct.field(pytree_node=False, default=1)
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    kind: str = flax.struct.field(pytree_node=False, default="compressed_kv")
    writer_abi: str = flax.struct.field(pytree_node=False, default=COMPRESSOR.id)

    PAGE_FIELDS = {"entries": 1}
    ROW_FIELDS = {"count": 0}
    ROLLBACK = "replay"          # count (and a closed entry) moved with the rejected tokens
    PARTIAL_RESUME = True        # entries up to the last whole window; the rest is the tail's checkpoint

    @property
    def entry_tokens(self) -> int:
        return self.rate

    def store_kind(self) -> Kind:
        """Compressed KV, or indexer keys for the CSA indexer's entries."""
        return Kind.INDEXER_KEYS if self.kind == "indexer_entries" else Kind.COMPRESSED_KV

    @property
    def page_size(self) -> int:
        """Entries per page."""
        return self.entries.shape[2]

    @property
    def page_tokens(self) -> int:
        """Tokens whose windows one page's entries summarise (the prefix store's block size)."""
        return self.page_size * self.rate

    def bytes_per_token(self) -> float:
        L, D = self.entries.shape[0], self.entries.shape[-1]
        return L * D * self.entries.dtype.itemsize / self.rate

    def resume_row(self, row, boundary, ok):
        """A prefix hit resumes request row `row` [] at `boundary` [] tokens (where ok []): its entries
        are the stored pages', so its count is boundary // rate."""
        return self.replace(count=self.count.at[row].set(jnp.where(ok, boundary // self.rate, self.count[row])))


@flax.struct.dataclass
class TailGroup(CacheGroup):
    """The uncompressed tail: projections of the tokens of the window that has not closed yet.
    closes_into: the name of the CompressedKVGroup its windows close into."""
    kv: jax.Array              # [L, B, rate, C]
    gate: jax.Array            # [L, B, rate, C] f32 raw gate logits (the position bias is added on close)
    count: jax.Array           # [B] int32 tokens in the tail, 0 .. rate - 1
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    closes_into: str = flax.struct.field(pytree_node=False, default="")
    writer_abi: str = flax.struct.field(pytree_node=False, default=COMPRESSOR.id)

    kind = "uncompressed_tail"
    STORE_KIND = Kind.UNCOMPRESSED_TAIL
    ROW_FIELDS = {"kv": 1, "gate": 1, "count": 0}
    ROLLBACK = "replay"

    @property
    def rate(self) -> int:
        return self.kv.shape[2]

    def bytes_per_token(self) -> int:
        return 0


@flax.struct.dataclass
class OverlapGroup(CacheGroup):
    """CSA's overlap state: Ca (kv, biased gate) of the last closed window; unread before window 1."""
    kv: jax.Array              # [L, B, rate, D]
    gate: jax.Array            # [L, B, rate, D] f32 (with the position bias)
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=COMPRESSOR.id)

    kind = "csa_overlap"
    STORE_KIND = Kind.CSA_OVERLAP
    ROW_FIELDS = {"kv": 1, "gate": 1}
    ROLLBACK = "replay"

    def bytes_per_token(self) -> int:
        return 0


def close_tail(tail_count: jax.Array, n_new: jax.Array, rate: int):
    """The tail's state transition for a step adding n_new [B] tokens to a tail of tail_count [B]:
    (windows closed [B], new tail count [B]). Closed windows leave the tail as compressed entries."""
    total = tail_count + n_new
    return total // rate, total % rate


def write_entries(pool: jax.Array, page_table: jax.Array, new: jax.Array, idx: jax.Array,
                  layer: int | None = None) -> jax.Array:
    """One layer's pool [P, ps, D] (or with `layer` the group's stack [L, P, ps, D], written in place
    at that layer) with new entries [B, NW, D] written at logical indices idx [B, NW] (-1: nothing
    closed) through page_table [B, NP]; indices past the row's pages are dropped."""
    return write_paged(pool, new, page_table, idx, idx >= 0, layer)


def _entry_group(L: int, B: int, capacity: int, rate: int, D: int, dtype, ids, kind: str,
                 page_tokens: int) -> CompressedKVGroup:
    ps = max(1, page_tokens // rate)
    table = contiguous_page_table(B, max(1, capacity // rate), ps)
    return CompressedKVGroup(entries=jnp.zeros((L, table.size, ps, D), dtype), page_table=table,
                             count=jnp.zeros((B,), jnp.int32), rate=rate, layer_ids=ids, kind=kind)


def init_compressed_groups(*, batch_size: int, capacity: int, dtype, window: int, head_dim: int,
                           all_layers: tuple[int, ...], csa_layers: tuple[int, ...] = (), csa_rate: int = 4,
                           index_dim: int = 0, hca_layers: tuple[int, ...] = (), hca_rate: int = 128,
                           entry_page_tokens: int = ENTRY_PAGE_TOKENS) -> dict:
    """Empty groups for `batch_size` rows of up to `capacity` tokens: the window of every layer, and per
    compressed type its paged entries (capacity // rate entries a row, at least 1, in pages of
    max(1, entry_page_tokens // rate) entries), tail and (CSA) overlap state and indexer entries /
    tail / overlap."""
    B, D = batch_size, head_dim
    z = (lambda *s, dt=dtype: jnp.zeros(s, dt))       # a fresh buffer each: the steps donate the cache
    cnt = (lambda: jnp.zeros((B,), jnp.int32))
    f32 = jnp.float32
    groups = {"sliding_window": SlidingWindowGroup(kv=z(len(all_layers), B, window, D), layer_ids=tuple(all_layers))}
    if csa_layers:
        L, m = len(csa_layers), csa_rate
        ids = tuple(csa_layers)
        groups["compressed_sparse_attention"] = _entry_group(L, B, capacity, m, D, dtype, ids, "compressed_kv",
                                                             entry_page_tokens)
        groups["csa_tail"] = TailGroup(kv=z(L, B, m, 2 * D), gate=z(L, B, m, 2 * D, dt=f32), count=cnt(),
                                       layer_ids=ids, closes_into="compressed_sparse_attention")
        groups["csa_overlap"] = OverlapGroup(kv=z(L, B, m, D), gate=z(L, B, m, D, dt=f32), layer_ids=ids)
        groups["csa_indexer"] = _entry_group(L, B, capacity, m, index_dim, dtype, ids, "indexer_entries",
                                             entry_page_tokens)
        groups["csa_indexer_tail"] = TailGroup(kv=z(L, B, m, 2 * index_dim), gate=z(L, B, m, 2 * index_dim, dt=f32),
                                               count=cnt(), layer_ids=ids, closes_into="csa_indexer")
        groups["csa_indexer_overlap"] = OverlapGroup(kv=z(L, B, m, index_dim), gate=z(L, B, m, index_dim, dt=f32),
                                                     layer_ids=ids)
    if hca_layers:
        L, m = len(hca_layers), hca_rate
        ids = tuple(hca_layers)
        groups["heavily_compressed_attention"] = _entry_group(L, B, capacity, m, D, dtype, ids, "compressed_kv",
                                                              entry_page_tokens)
        groups["hca_tail"] = TailGroup(kv=z(L, B, m, D), gate=z(L, B, m, D, dt=f32), count=cnt(), layer_ids=ids,
                                       closes_into="heavily_compressed_attention")
    return groups
