"""The cache pytree: one group per layer type, stacked per layer, sizes read off the tree."""
from __future__ import annotations

import jax
import numpy as np

from cache import KVGroup, RecurrentGroup, init_cache, nbytes_by_group
from pallas_kernels import abi


def _cache():
    return init_cache(batch_size=2, capacity=16, layer_types=("linear_attention", "full_attention",
                                                               "linear_attention"),
                      dtype=np.float32, conv_dim=24, conv_width=4, linear_heads=(4, 8, 8), kv_heads=2, head_dim=8)


def test_groups_and_shapes():
    c = _cache()
    rec, kv = c.groups["linear_attention"], c.groups["full_attention"]
    assert isinstance(rec, RecurrentGroup) and isinstance(kv, KVGroup)
    assert rec.layer_ids == (0, 2) and kv.layer_ids == (1,)
    assert rec.conv.shape == (2, 2, 3, 24) and rec.ssm.shape == (2, 2, 4, 8, 8)
    assert rec.ssm.dtype == np.float32
    assert kv.k.shape == (1, 2, 16, 2, 8) and kv.page_size == 16 and kv.capacity == 16   # [L, P, ps, Hkv, D]
    assert kv.page_table.tolist() == [[0], [1]]            # row b owns page b
    assert c.slot("linear_attention", 2) == 1


def test_writer_abi_is_static_metadata():
    c = _cache()
    leaves, treedef = jax.tree_util.tree_flatten(c)
    assert all(hasattr(x, "shape") for x in leaves)       # ids are not traced arrays
    assert c.groups["linear_attention"].writer_abi == abi.GATED_DELTA_RULE.id
    other = c.replace(groups={**c.groups, "linear_attention": c.groups["linear_attention"].replace(
        writer_abi="gated_delta_rule/other/v9")})
    assert jax.tree_util.tree_structure(other) != treedef  # a different writer is a different tree


def test_nbytes_by_group():
    sizes = nbytes_by_group(_cache())
    assert sizes["full_attention"]["k"] == 1 * 2 * 16 * 2 * 8 * 4
    assert sizes["full_attention"]["total"] == 2 * sizes["full_attention"]["k"] + 2 * 1 * 4   # + page table
    assert sizes["linear_attention"]["ssm"] == 2 * 2 * 4 * 8 * 8 * 4
