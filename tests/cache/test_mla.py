"""DSA cache groups: shapes, ABI stamps, the paged writer's drop rules, pytree round trip."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache.mla import IndexerKeyGroup, MLALatentGroup, contiguous_page_table, init_mla_groups, write_paged
from pallas_kernels import abi


def test_groups_shapes_and_abi():
    g = init_mla_groups(batch_size=2, capacity=100, layer_ids=(0, 1, 2), kv_lora_rank=16, rope_dim=8, index_dim=32,
                        dtype=jnp.bfloat16, latent_page_size=32, index_page_size=64)
    lat, idx = g["sparse_attention"], g["indexer"]
    assert isinstance(lat, MLALatentGroup) and isinstance(idx, IndexerKeyGroup)
    chex.assert_shape(lat.latent, (3, 8, 32, 16))          # 2 rows x ceil(100 / 32) pages
    chex.assert_shape(lat.rope, (3, 8, 32, 128))            # Dr 8, stored 128 lanes wide (rope_width)
    chex.assert_shape(idx.keys, (3, 4, 64, 32))             # its own block size
    assert lat.writer_abi == abi.SPARSE_MLA_LATENT.id and idx.writer_abi == abi.INDEXER_KEYS.id
    assert abi.get("sparse_mla") is abi.SPARSE_MLA_LATENT and abi.get("dsa_indexer") is abi.INDEXER_KEYS
    assert lat.capacity == 128 and idx.scale is None
    np.testing.assert_array_equal(np.asarray(lat.page_table), [[0, 1, 2, 3], [4, 5, 6, 7]])
    leaves, tree = jax.tree_util.tree_flatten(g)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back["indexer"].writer_abi == idx.writer_abi and back["sparse_attention"].layer_ids == (0, 1, 2)
    # a page: latent + RoPE key [L, ps, R + 128] in bf16, and its residency flag (one bool)
    assert lat.page_nbytes() == 3 * 32 * (16 + 128) * 2 + 1 and idx.page_nbytes() == 3 * 64 * 32 * 2


def test_fp8_indexer_group_has_scales():
    g = init_mla_groups(batch_size=1, capacity=16, layer_ids=(0,), kv_lora_rank=8, rope_dim=4, index_dim=16,
                        dtype=jnp.float32, index_dtype=jnp.float8_e4m3fn)
    assert g["indexer"].keys.dtype == jnp.float8_e4m3fn
    chex.assert_shape(g["indexer"].scale, g["indexer"].keys.shape[:3])


def test_write_paged_follows_the_table_and_drops_padding():
    pool = jnp.zeros((4, 2, 1))
    table = jnp.asarray([[3, 1], [0, 2]], jnp.int32)                   # row 0 -> pages 3, 1
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(2, 3, 1)
    pos = jnp.asarray([[0, 1, 2], [3, 4, 1]], jnp.int32)               # row 1: position 4 is past its table
    valid = jnp.asarray([[True, True, False], [True, True, True]])
    out = np.asarray(write_paged(pool, new, table, pos, valid))[..., 0]
    expect = np.zeros((4, 2))
    expect[3, 0], expect[3, 1] = 1, 2                                  # row 0 pos 0, 1 -> page 3
    expect[2, 1] = 4                                                   # row 1 pos 3 -> page 2 slot 1
    expect[0, 1] = 6                                                   # row 1 pos 1 -> page 0 slot 1
    np.testing.assert_array_equal(out, expect)
    bad = jnp.asarray([[9, 1], [0, 2]], jnp.int32)                     # a page outside the pool: dropped
    out = np.asarray(write_paged(pool, new, bad, pos, valid))[..., 0]
    assert out[3].sum() == 0 and out[1].sum() == 0 and out[0, 1] == 6


def test_rope_width_rounds_up_to_whole_lanes():
    from cache.mla import rope_width  # noqa: PLC0415
    assert [rope_width(d) for d in (4, 64, 128, 129, 192)] == [128, 128, 128, 256, 256]


def test_contiguous_table_rejects_bad_sizes():
    with pytest.raises(ValueError, match="page_size"):
        contiguous_page_table(2, 10, 0)


def test_bytes_per_token_counts_every_layer():
    import jax.numpy as jnp  # noqa: PLC0415
    from cache.mla import init_mla_groups  # noqa: PLC0415
    g = init_mla_groups(batch_size=2, capacity=64, layer_ids=(0, 1, 2), kv_lora_rank=16, rope_dim=8,
                        index_dim=32, dtype=jnp.bfloat16)
    assert g["sparse_attention"].bytes_per_token() == 3 * (16 + 128) * 2      # the rope pool's zero lanes count
    assert g["indexer"].bytes_per_token() == 3 * 32 * 2
