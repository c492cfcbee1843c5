"""Gathering scattered rows of paged pools into VMEM on TPU: one DMA per selected row, double-buffered
along a sequential grid axis. Used by the kernels that read Top-K selected tokens (DSA sparse MLA, the
DeepSeek-V4 CSA read).

Why not BlockSpecs: a block must cover whole (8, 128) tiles of the pool's last two dims, so it cannot pick
one row of a page; and viewing a pool [P, ps, X] as [P * ps, 1, X] (one row per block) pads every row to
a tile in HBM, which made XLA copy the whole pool on every call (640 MiB of temporaries for one
DeepSeek-V3.2 decode step at 32k context, caught by the TPU compile tests). So the pools stay in HBM
(`memory_space=pl.ANY`) and the kernel copies the rows it needs.

DMAs start at tile-aligned rows: a 32-bit row is copied alone; a 16-bit row travels with the aligned
8-row group that holds it (8x the row's bytes, still a small fraction of the context) and is picked out
on chip. Pages must then hold a multiple of 8 rows. A kernel that reads every position of a row in order
reads runs of consecutive rows instead (`RowRun`: one DMA per run, each row moved once).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.dispatch import KernelUnsupported


def group_rows(dtype) -> int:
    """Rows one DMA moves to fetch one row of a pool of `dtype` (its HBM tile's alignment)."""
    return 1 if jnp.dtype(dtype).itemsize >= 4 else 8


def check_pool(dtype, ps: int, what: str) -> int:
    """The group size for a pool of `dtype` with `ps`-row pages; KernelUnsupported if pages can't hold groups."""
    G = group_rows(dtype)
    if ps % G:
        raise KernelUnsupported(f"the TPU {what} kernel gathers {jnp.dtype(dtype).name} rows in aligned groups of "
                                f"{G}: the page size must be a multiple of {G}; got {ps}")
    return G


def scratch(pools: list[tuple[int, Any]], bk: int, G: int) -> list:
    """VMEM buffers [2, bk, G, X] per pool (X, dtype), and the DMA semaphores [2, n_pools, bk]."""
    return [pltpu.VMEM((2, bk, G, x), dt) for x, dt in pools] + [pltpu.SemaphoreType.DMA((2, len(pools), bk))]


@dataclasses.dataclass(frozen=True)
class RowGather:
    """Inside a kernel: rows_ref SMEM [n] int32 flat pool rows (page * ps + slot); pools HBM refs
    [P, ps, X_p]; bufs VMEM refs [2, bk, G, X_p]; sem DMA semaphores [2, n_pools, bk]. A step's rows are
    rows_ref[base .. base + bk - 1]. locate: instead of rows_ref, a function k -> (page, slot) of the
    step's k-th row (a kernel that turns logical positions into pages itself, from its page table in
    SMEM)."""
    rows_ref: Any
    pools: tuple
    bufs: tuple
    sem: Any
    ps: int
    bk: int
    G: int
    locate: Callable | None = None

    def _offset(self, base, i):
        if self.locate is not None:
            return self.locate(base + i)
        r = self.rows_ref[base + i]
        return jax.lax.div(r, self.ps), jax.lax.rem(r, self.ps)

    def _copies(self, base, slot):
        out = []
        for i in range(self.bk):
            page, off = self._offset(base, i)
            start = off if self.G == 1 else pl.multiple_of(jax.lax.div(off, self.G) * self.G, self.G)
            for p, (pool, buf) in enumerate(zip(self.pools, self.bufs)):
                out.append(pltpu.make_async_copy(pool.at[page, pl.ds(start, self.G)], buf.at[slot, i],
                                                 self.sem.at[slot, p, i]))
        return out

    def pipeline(self, j, nj, base_of):
        """At step j of nj along a sequential grid axis: starts step 0's rows at j == 0, prefetches step
        j + 1's into the other buffer, waits for step j's. base_of(j) is step j's first index into
        rows_ref. Returns the buffer slot that holds step j's rows."""
        return _pipeline(self._copies, j, nj, base_of)

    def row(self, p: int, slot, i: int, base) -> jax.Array:
        """Row i of the step (pool p) as [1, X] f32."""
        x = self.bufs[p][slot, i].astype(jnp.float32)                     # [G, X]
        if self.G == 1:
            return x
        _, off = self._offset(base, i)
        pick = jax.lax.broadcasted_iota(jnp.int32, (self.G, 1), 0) == jax.lax.rem(off, self.G)
        return jnp.sum(jnp.where(pick, x, 0.0), axis=0, keepdims=True)


def _pipeline(copies, j, nj, base_of):
    """Double-buffered DMAs along a sequential grid axis (RowGather.pipeline): copies(base, slot) are the
    DMAs of the step whose first index is base into buffer `slot`."""
    slot = jax.lax.rem(j, 2)

    @pl.when(j == 0)
    def _():
        for c in copies(base_of(0), 0):
            c.start()

    @pl.when(j + 1 < nj)
    def _():
        for c in copies(base_of(j + 1), 1 - slot):
            c.start()

    for c in copies(base_of(j), slot):
        c.wait()
    return slot


def run_scratch(pools: list[tuple[int, Any]], bk: int) -> list:
    """RowRun's VMEM buffers [2, bk, X] per pool (X, dtype), and its DMA semaphores [2, n_pools]."""
    return [pltpu.VMEM((2, bk, x), dt) for x, dt in pools] + [pltpu.SemaphoreType.DMA((2, len(pools)))]


@dataclasses.dataclass(frozen=True)
class RowRun:
    """RowGather's interface for a step whose bk rows are consecutive positions of one page, the first a
    multiple of bk (bk dividing the page size): ONE DMA per pool moves the bk rows, where RowGather moves
    a row (with its aligned group of G rows, for 16-bit pools) per DMA. A kernel that reads every
    position of a row in order reads each row once this way, not G times. pools: HBM refs [P, ps, X_p];
    bufs: VMEM refs [2, bk, X_p] (`run_scratch`); sem: DMA semaphores [2, n_pools]; locate(k) -> (page,
    slot) of the step's first position k."""
    pools: tuple
    bufs: tuple
    sem: Any
    bk: int
    locate: Callable

    def _copies(self, base, slot):
        page, off = self.locate(base)
        start = pl.multiple_of(jax.lax.div(off, self.bk) * self.bk, self.bk)
        return [pltpu.make_async_copy(pool.at[page, pl.ds(start, self.bk)], buf.at[slot], self.sem.at[slot, p])
                for p, (pool, buf) in enumerate(zip(self.pools, self.bufs))]

    def pipeline(self, j, nj, base_of):
        """As RowGather.pipeline."""
        return _pipeline(self._copies, j, nj, base_of)

    def row(self, p: int, slot, i: int, base) -> jax.Array:
        """Row i of the step (pool p) as [1, X] f32."""
        return self.bufs[p][slot].astype(jnp.float32)[i:i + 1]            # [bk, X] -> row i
