"""Block sizes of the Pallas ragged paged attention kernels: the tuned table of the chip a program is lowered
for (`hybrid-jax tune`, pallas_kernels/tuning.py), else a hand-picked table of known-good entries and the rule
that fills the gaps.

A block size is (num_kv_pages_per_block, num_queries_per_block, decode_queries_per_block):
  num_kv_pages_per_block    pages DMA'd per key block (TPU; the GPU kernel walks one page at a time)
  num_queries_per_block     query rows of a prefill tile
  decode_queries_per_block  query rows of a decode tile (one per short sequence: decode, a verify window)

The rule: a key block of about 512 tokens (at most 16 pages: every page is one DMA for K and one for V, issued by
the scalar core), a prefill tile of about 256 query rows per kv head (MXU height; rows = queries * Hq / Hkv),
decode tiles of one query. The table's entries are the rule's values for the shapes the project serves, checked
to compile for v5e and v6e at those shapes (tests/pallas_kernels/test_ragged_paged_attention.py); they have not
been timed on TPU hardware yet (none was available): timing them is how entries should change.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MAX_PAGES_PER_BLOCK = 16
TARGET_BLOCK_TOKENS = 512
TARGET_ROWS = 256


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    num_kv_pages_per_block: int
    num_queries_per_block: int
    decode_queries_per_block: int


# (kv dtype, Hq / Hkv, head dim, page size) -> block sizes. Qwen3-Next-80B: Hq 16, Hkv 2 (group 8), D 256.
TABLE: dict[tuple[str, int, int, int], BlockSizes] = {
    ("bfloat16", 8, 256, 16): BlockSizes(16, 32, 1),
    ("bfloat16", 8, 256, 32): BlockSizes(16, 32, 1),
    ("float32", 8, 256, 16): BlockSizes(16, 32, 1),
    ("float32", 8, 256, 32): BlockSizes(16, 32, 1),
}


def rule(group: int, page_size: int) -> BlockSizes:
    pages = max(1, min(MAX_PAGES_PER_BLOCK, TARGET_BLOCK_TOKENS // page_size))
    return BlockSizes(pages, max(1, TARGET_ROWS // group), 1)


def tuned_block_sizes(kv_dtype, group: int, head_dim: int, page_size: int, *, pages_per_seq: int,
                      num_tokens: int, num_kv_pages_per_block: int | None = None,
                      num_queries_per_block: int | None = None,
                      decode_queries_per_block: int | None = None, num_kv_heads: int | None = None,
                      chip: str | None = None) -> BlockSizes:
    """The block sizes for one call: explicit arguments win, then the chip's tuned entry (with num_kv_heads),
    then the hand-picked table, then the rule; clamped to the call (no more pages per block than a sequence
    has, no tile longer than the batch)."""
    base = TABLE.get((jnp.dtype(kv_dtype).name, group, head_dim, page_size)) or rule(group, page_size)
    explicit = num_kv_pages_per_block is not None and num_queries_per_block is not None
    if chip is not None and num_kv_heads is not None and not explicit:     # no table entry could apply
        from pallas_kernels import tuning  # noqa: PLC0415
        from pallas_kernels.ragged_paged_attention.tune import key_of  # noqa: PLC0415
        entry = tuning.lookup("ragged_paged_attention", chip, key_of(kv_dtype, num_kv_heads, group, head_dim,
                                                                     page_size))
        if entry is not None:
            base = BlockSizes(int(entry["num_kv_pages_per_block"]), int(entry["num_queries_per_block"]),
                              base.decode_queries_per_block)
    pick = lambda x, default: default if x is None else x  # noqa: E731
    pages = pick(num_kv_pages_per_block, base.num_kv_pages_per_block)
    queries = pick(num_queries_per_block, base.num_queries_per_block)
    decode = pick(decode_queries_per_block, base.decode_queries_per_block)
    for name, x in (("num_kv_pages_per_block", pages), ("num_queries_per_block", queries),
                    ("decode_queries_per_block", decode)):
        if x < 1:
            raise ValueError(f"{name} must be >= 1; got {x}")
    return BlockSizes(min(pages, pages_per_seq), min(queries, num_tokens), min(decode, queries, num_tokens))
