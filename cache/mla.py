"""Paged cache groups of DeepSeek sparse attention (DSA): the MLA latent and the indexer keys.

  MLALatentGroup  (sparse_attention)  latent [L, P, ps, R], rope [L, P, ps, Wr] (Wr: rope_width(Dr)), page_table [B, NP],
                                      page_resident [P] bool, hit_rate [B] f32 (last step)
  IndexerKeyGroup (indexer)           keys [L, P2, ps2, D] (bf16/f32, or fp8 with scale [L, P2, ps2])
                                      page_table [B, NP2]; its own block size ps2

Each group records the kernel ABI id that wrote it (static, in the treedef). Pages are assigned
contiguously per row at creation (row b owns pages b*NP .. b*NP + NP - 1); every reader and writer
goes through the page table, so an allocator can hand out any pages later without touching a kernel.
`page_resident` marks pages held on the device; `sparse_hit_rate` (pallas_kernels) turns a step's
selected indices into the fraction that was resident, kept per row in `hit_rate` for the metrics.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from cache.group import CacheGroup
from cache.segments import Kind
from pallas_kernels import abi as kernel_abi


@flax.struct.dataclass
class MLALatentGroup(CacheGroup):
    """Compressed KV (normed latent) and decoupled RoPE key of every sparse-attention layer."""
    latent: jax.Array          # [L, P, ps, R]
    rope: jax.Array            # [L, P, ps, Wr]: Wr = rope_width(Dr), the channels past Dr zero
    page_table: jax.Array      # [B, NP] int32
    page_resident: jax.Array   # [P] bool
    hit_rate: jax.Array        # [B] f32: resident fraction of the last step's selected positions
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=kernel_abi.SPARSE_MLA_LATENT.id)

    kind = "mla_latent"
    STORE_KIND = Kind.COMPRESSED_KV        # an MLA latent is compressed KV with no uncompressed tail
    PARTIAL_RESUME = True
    PAGE_FIELDS = {"latent": 1, "rope": 1, "page_resident": 0}
    ROW_FIELDS = {"hit_rate": 0}
    FILL = {"page_resident": True, "hit_rate": 1.0}      # what a new page / row holds (else 0)

    @property
    def page_size(self) -> int:
        return self.latent.shape[2]

    @property
    def page_tokens(self) -> int:
        return self.page_size

    def bytes_per_token(self) -> int:
        """Bytes one token adds across all layers (latent + RoPE key)."""
        L, _, _, R = self.latent.shape
        return L * (R * self.latent.dtype.itemsize + self.rope.shape[-1] * self.rope.dtype.itemsize)

    @property
    def capacity(self) -> int:
        return self.page_table.shape[1] * self.page_size


@flax.struct.dataclass
class IndexerKeyGroup(CacheGroup):
    """The indexer's keys of every sparse-attention layer (fp8 keys carry a per-token scale)."""
    keys: jax.Array            # [L, P, ps, D]
    scale: jax.Array | None    # [L, P, ps] f32 when keys are fp8, else None
    page_table: jax.Array      # [B, NP] int32
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=kernel_abi.INDEXER_KEYS.id)

    kind = "indexer_keys"
    STORE_KIND = Kind.INDEXER_KEYS
    PARTIAL_RESUME = True
    PAGE_FIELDS = {"keys": 1, "scale": 1}
    FILL = {"scale": 1.0}

    @property
    def page_size(self) -> int:
        return self.keys.shape[2]

    @property
    def page_tokens(self) -> int:
        return self.page_size

    def bytes_per_token(self) -> int:
        """Bytes one token adds across all layers (key, plus its fp8 scale)."""
        L, _, _, D = self.keys.shape
        return L * (D * self.keys.dtype.itemsize + (4 if self.scale is not None else 0))


def contiguous_page_table(batch_size: int, capacity: int, page_size: int):
    """[B, NP] with row b owning pages b*NP .. b*NP + NP - 1, NP = ceil(capacity / page_size)."""
    if page_size <= 0 or capacity <= 0:
        raise ValueError(f"page_size and capacity must be positive; got {page_size}, {capacity}")
    n = -(-capacity // page_size)
    return jnp.arange(batch_size * n, dtype=jnp.int32).reshape(batch_size, n)


LANES = 128     # a TPU vector register's lanes: the minor dimension of every HBM tile


def rope_width(rope_dim: int) -> int:
    """Channels one token's RoPE key takes in the rope pool: rope_dim rounded up to whole 128-lane rows,
    the channels past rope_dim zero (the writers pad the key and the readers' queries alike, so the
    scores are unchanged).

    Why: a TPU lays an array whose last dimension is narrower than 128 lanes either padded to 128 or,
    as the compiler prefers for a pool [L, P, ps, 64], transposed so that a larger dimension is minor.
    The sparse MLA kernel DMAs rows in the row-major tiled layout, so with a 64-wide pool XLA copied the
    whole rope stack into that layout before every layer's kernel and back after its write (DeepSeek-V3.2
    on v5p: 5 of the 8.3 GiB a decode layer accessed). Stored 128 wide, the pool is already in the
    kernel's layout: the cost is the 64 zero channels (DeepSeek's latent + rope row 1,280 instead of
    1,152 bytes, +11%), which the TPU's padded layout would hold anyway. One layout on every platform,
    so a prefix span written on one restores on another."""
    return -(-rope_dim // LANES) * LANES


def init_latent_group(*, batch_size: int, capacity: int, layer_ids: tuple[int, ...], kv_lora_rank: int,
                      rope_dim: int, dtype, page_size: int = 64) -> MLALatentGroup:
    """The MLA latent group alone (Kimi-Linear's MLA has no indexer): pages of min(page_size, capacity);
    the rope pool is `rope_width(rope_dim)` wide."""
    ps = min(page_size, capacity)
    pt = contiguous_page_table(batch_size, capacity, ps)
    L, P = len(layer_ids), pt.size
    return MLALatentGroup(latent=jnp.zeros((L, P, ps, kv_lora_rank), dtype),
                          rope=jnp.zeros((L, P, ps, rope_width(rope_dim)), dtype),
                          page_table=pt, page_resident=jnp.ones((P,), bool),
                          hit_rate=jnp.ones((batch_size,), jnp.float32), layer_ids=tuple(layer_ids))


def init_mla_groups(*, batch_size: int, capacity: int, layer_ids: tuple[int, ...], kv_lora_rank: int,
                    rope_dim: int, index_dim: int, dtype, latent_page_size: int = 64,
                    index_page_size: int = 128, index_dtype=None, index_layer_ids: tuple[int, ...] | None = None) -> dict:
    """The two DSA groups for `batch_size` rows of up to `capacity` tokens: the latent of `layer_ids`, the
    indexer keys of `index_layer_ids` (default the same; fewer where some layers reuse another's Top-K).
    index_dtype=jnp.float8_e4m3fn stores the indexer keys as fp8 with a per-token scale."""
    index_layer_ids = tuple(layer_ids if index_layer_ids is None else index_layer_ids)
    ips = min(index_page_size, capacity)
    ipt = contiguous_page_table(batch_size, capacity, ips)
    L, P2 = len(index_layer_ids), ipt.size
    idt = index_dtype or dtype
    fp8 = jnp.dtype(idt) == jnp.float8_e4m3fn
    return {
        "sparse_attention": init_latent_group(batch_size=batch_size, capacity=capacity, layer_ids=layer_ids,
                                              kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, dtype=dtype,
                                              page_size=latent_page_size),
        "indexer": IndexerKeyGroup(
            keys=jnp.zeros((L, P2, ips, index_dim), idt),
            scale=jnp.ones((L, P2, ips), jnp.float32) if fp8 else None,
            page_table=ipt, layer_ids=index_layer_ids),
    }


def write_paged(pool: jax.Array, new: jax.Array, page_table: jax.Array, positions: jax.Array,
                valid: jax.Array, layer: int | None = None) -> jax.Array:
    """Scatters new entries into their pages. pool [P, ps, X] (or [P, ps]), or with `layer` the
    group's stack [L, P, ps, ...] written in place at that layer (slicing the layer out and stacking
    the layers back would copy every pool at every step); new [B, T, X] (or [B, T]);
    page_table [B, NP]; positions, valid [B, T]. Padding tokens, positions past the row's table and
    table entries outside the pool are dropped, never clamped onto a live slot."""
    pos, ok = _in_table(pool, page_table, positions, valid, layer)
    return _scatter(pool, new, jnp.take_along_axis(page_table, pos // _page_size(pool, layer), axis=1), pos, ok,
                    layer)


def write_paged_flat(pool: jax.Array, new: jax.Array, page_table: jax.Array, seq: jax.Array, positions: jax.Array,
                     valid: jax.Array, layer: int | None = None) -> jax.Array:
    """`write_paged` for a ragged batch: new [N, X] token-major, token i of sequence seq[i] [N] at
    positions[i] [N] (where valid [N]), through the sequences' page table [S, NP]."""
    pos, ok = _in_table(pool, page_table, positions, valid, layer)
    return _scatter(pool, new, page_table[seq, pos // _page_size(pool, layer)], pos, ok, layer)


def _page_size(pool, layer) -> int:
    return pool.shape[1 if layer is None else 2]


def _in_table(pool, page_table, positions, valid, layer):
    """(positions clamped to 0 where dropped, ok): a write lands only at a valid position its table covers."""
    ok = valid & (positions >= 0) & (positions < page_table.shape[1] * _page_size(pool, layer))
    return jnp.where(ok, positions, 0), ok


def _scatter(pool, new, page, pos, ok, layer):
    """Writes new at (page, pos % ps) where ok and the page lies in the pool; the rest is dropped."""
    P = pool.shape[0 if layer is None else 1]
    ok = ok & (page >= 0) & (page < P)
    page = jnp.where(ok, page, P)                                     # P: out of range, dropped
    at = pool.at[page, pos % _page_size(pool, layer)] if layer is None else pool.at[layer, page,
                                                                                    pos % _page_size(pool, layer)]
    return at.set(new.astype(pool.dtype), mode="drop")
