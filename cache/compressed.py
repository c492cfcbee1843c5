"""Cache groups of compressed attention (DeepSeek-V4): the five objects a compressed layer keeps.

Every group stacks its layers on a leading axis and keeps one row per request on axis 1, so
`take_rows` / `put_rows` gather and scatter axis 1 (a row flagged in `reset` comes back empty).

  SlidingWindowGroup   (sliding_window)  kv [L, B, W, D]: the last W raw entries (K = V) of every
                                         layer, a ring indexed by position % W
  CompressedKVGroup    (compressed_kv / indexer_entries)
                                         entries [L, B, NE, D]: one per closed window of `rate` tokens,
                                         entry j covers positions j*rate .. j*rate + rate - 1;
                                         count [B] int32 entries written per row
  TailGroup            (uncompressed_tail)
                                         kv, gate (f32) [L, B, rate, C]: the projections of the not-yet-closed
                                         window (slot s = position % rate; C = 2D with CSA's two series),
                                         count [B] int32 tokens in it (0 .. rate-1)
  OverlapGroup         (csa_overlap)     kv, gate (f32) [L, B, rate, D]: the first series (Ca, gate with its
                                         position bias) of the last closed window, which the next CSA
                                         entry blends with its own second series (Cb)

A tail reaching `rate` tokens closes: it becomes one compressed entry, the tail empties, and (CSA)
its Ca half becomes the overlap state. `close_tail` names that transition; model layers compute
the entries and hand the arrays back through the group's `replace`.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels import abi as kernel_abi

COMPRESSOR = kernel_abi.register(kernel_abi.KernelABI("v4_compressor", "entries[L,B,NE,D]+tail[L,B,m,C]", 1))
SLIDING_WINDOW = kernel_abi.register(kernel_abi.KernelABI("v4_window", "kv[L,B,W,D]:ring", 1))


def _take(a, rows, reset, empty=0):
    sub = a[:, rows]
    if reset is None:
        return sub
    mask = reset.reshape((1, -1) + (1,) * (sub.ndim - 2))
    return jnp.where(mask, jnp.asarray(empty, sub.dtype), sub)


def _take_count(c, rows, reset):
    sub = c[rows]
    return sub if reset is None else jnp.where(reset, 0, sub)


@flax.struct.dataclass
class SlidingWindowGroup:
    """Raw shared K=V entries of the last W positions of every layer (all layer types have one)."""
    kv: jax.Array              # [L, B, W, D]
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=SLIDING_WINDOW.id)

    kind = "swa_window"

    @property
    def window(self) -> int:
        return self.kv.shape[2]

    def bytes_per_token(self) -> int:
        return 0      # fixed per row: W entries whatever the length

    def take_rows(self, rows, reset=None):
        return self.replace(kv=_take(self.kv, rows, reset))

    def put_rows(self, rows, sub):
        return self.replace(kv=self.kv.at[:, rows].set(sub.kv))


@flax.struct.dataclass
class CompressedKVGroup:
    """Compressed entries of every layer of one compressed type (or the CSA indexer's keys)."""
    entries: jax.Array         # [L, B, NE, D]
    count: jax.Array           # [B] int32 entries written per row
    rate: int = flax.struct.field(pytree_node=False, default=1)
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    kind: str = flax.struct.field(pytree_node=False, default="compressed_kv")
    writer_abi: str = flax.struct.field(pytree_node=False, default=COMPRESSOR.id)

    def bytes_per_token(self) -> float:
        L, _, _, D = self.entries.shape
        return L * D * self.entries.dtype.itemsize / self.rate

    def take_rows(self, rows, reset=None):
        return self.replace(entries=_take(self.entries, rows, reset), count=_take_count(self.count, rows, reset))

    def put_rows(self, rows, sub):
        return self.replace(entries=self.entries.at[:, rows].set(sub.entries), count=self.count.at[rows].set(sub.count))


@flax.struct.dataclass
class TailGroup:
    """The uncompressed tail: projections of the tokens of the window that has not closed yet."""
    kv: jax.Array              # [L, B, rate, C]
    gate: jax.Array            # [L, B, rate, C] f32 raw gate logits (the position bias is added on close)
    count: jax.Array           # [B] int32 tokens in the tail, 0 .. rate - 1
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=COMPRESSOR.id)

    kind = "uncompressed_tail"

    @property
    def rate(self) -> int:
        return self.kv.shape[2]

    def bytes_per_token(self) -> int:
        return 0

    def take_rows(self, rows, reset=None):
        return self.replace(kv=_take(self.kv, rows, reset), gate=_take(self.gate, rows, reset),
                            count=_take_count(self.count, rows, reset))

    def put_rows(self, rows, sub):
        return self.replace(kv=self.kv.at[:, rows].set(sub.kv), gate=self.gate.at[:, rows].set(sub.gate),
                            count=self.count.at[rows].set(sub.count))


@flax.struct.dataclass
class OverlapGroup:
    """CSA's overlap state: Ca (kv, biased gate) of the last closed window; unread before window 1."""
    kv: jax.Array              # [L, B, rate, D]
    gate: jax.Array            # [L, B, rate, D] f32 (with the position bias)
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=COMPRESSOR.id)

    kind = "csa_overlap"

    def bytes_per_token(self) -> int:
        return 0

    def take_rows(self, rows, reset=None):
        return self.replace(kv=_take(self.kv, rows, reset), gate=_take(self.gate, rows, reset))

    def put_rows(self, rows, sub):
        return self.replace(kv=self.kv.at[:, rows].set(sub.kv), gate=self.gate.at[:, rows].set(sub.gate))


def close_tail(tail_count: jax.Array, n_new: jax.Array, rate: int):
    """The tail's state transition for a step adding n_new [B] tokens to a tail of tail_count [B]:
    (windows closed [B], new tail count [B]). Closed windows leave the tail as compressed entries."""
    total = tail_count + n_new
    return total // rate, total % rate


def init_compressed_groups(*, batch_size: int, capacity: int, dtype, window: int, head_dim: int,
                           all_layers: tuple[int, ...], csa_layers: tuple[int, ...] = (), csa_rate: int = 4,
                           index_dim: int = 0, hca_layers: tuple[int, ...] = (), hca_rate: int = 128) -> dict:
    """Empty groups for `batch_size` rows of up to `capacity` tokens: the window of every layer, and per
    compressed type its entries (NE = capacity // rate, at least 1), tail and (CSA) overlap state and
    indexer entries / tail / overlap."""
    B, D = batch_size, head_dim
    z = (lambda *s, dt=dtype: jnp.zeros(s, dt))       # a fresh buffer each: the steps donate the cache
    cnt = (lambda: jnp.zeros((B,), jnp.int32))
    f32 = jnp.float32
    groups = {"sliding_window": SlidingWindowGroup(kv=z(len(all_layers), B, window, D), layer_ids=tuple(all_layers))}
    if csa_layers:
        L, m, ne = len(csa_layers), csa_rate, max(1, capacity // csa_rate)
        ids = tuple(csa_layers)
        groups["compressed_sparse_attention"] = CompressedKVGroup(entries=z(L, B, ne, D), count=cnt(), rate=m,
                                                                  layer_ids=ids)
        groups["csa_tail"] = TailGroup(kv=z(L, B, m, 2 * D), gate=z(L, B, m, 2 * D, dt=f32), count=cnt(),
                                       layer_ids=ids)
        groups["csa_overlap"] = OverlapGroup(kv=z(L, B, m, D), gate=z(L, B, m, D, dt=f32), layer_ids=ids)
        groups["csa_indexer"] = CompressedKVGroup(entries=z(L, B, ne, index_dim), count=cnt(), rate=m, layer_ids=ids,
                                                  kind="indexer_entries")
        groups["csa_indexer_tail"] = TailGroup(kv=z(L, B, m, 2 * index_dim), gate=z(L, B, m, 2 * index_dim, dt=f32),
                                               count=cnt(), layer_ids=ids)
        groups["csa_indexer_overlap"] = OverlapGroup(kv=z(L, B, m, index_dim), gate=z(L, B, m, index_dim, dt=f32),
                                                     layer_ids=ids)
    if hca_layers:
        L, m, ne = len(hca_layers), hca_rate, max(1, capacity // hca_rate)
        ids = tuple(hca_layers)
        groups["heavily_compressed_attention"] = CompressedKVGroup(entries=z(L, B, ne, D), count=cnt(), rate=m,
                                                                   layer_ids=ids)
        groups["hca_tail"] = TailGroup(kv=z(L, B, m, D), gate=z(L, B, m, D, dt=f32), count=cnt(), layer_ids=ids)
    return groups


def nbytes_compressed(groups: dict) -> dict[str, int]:
    """Bytes held per compressed-attention group, read off the pytrees."""
    kinds = (SlidingWindowGroup, CompressedKVGroup, TailGroup, OverlapGroup)
    return {name: sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(g))
            for name, g in groups.items() if isinstance(g, kinds)}
