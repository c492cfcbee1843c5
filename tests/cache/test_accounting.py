"""Memory accounting (cache/accounting.py) against real allocations: the split into fixed and per-token
bytes read off abstract caches must equal the nbytes of allocated ones, grow linearly, agree with each
group's own declaration, and show DeepSeek-V4's compressed kinds below full attention by their rate.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from cache import ModelCache, bytes_per_token, init_cache, init_mla_groups, nbytes_by_group
from cache import accounting as acc_mod
from hybrid_jax.models import deepseek_v4 as v4
from hybrid_jax.models.deepseek_v4_config import deepseek_v4_config

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
TINY = dict(model_type="deepseek_v4", vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8,
            sliding_window=6, o_groups=2, o_lora_rank=12, index_n_heads=4, index_head_dim=8, index_topk=3, hc_mult=2,
            layer_types=[SWA, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], partial_rotary_factor=0.5)


def _tiny(dtype=jnp.float32):
    cfg = deepseek_v4_config(TINY)
    return cfg, (lambda b, c: v4.new_cache(cfg, b, c, dtype))


def _full_attention_twin(cfg, dtype):
    """The same V4 model with every layer a sliding layer whose window is the whole capacity."""
    def new_cache(b, c):
        full = dataclasses.replace(cfg, layer_types=(SWA,) * cfg.num_hidden_layers, sliding_window=c)
        return v4.new_cache(full, b, c, dtype)
    return new_cache


def _qwen_like(b, c):
    """A Gated-DeltaNet hybrid's cache (recurrent + full KV groups) of cache.state."""
    return init_cache(batch_size=b, capacity=c, layer_types=("linear_attention", "full_attention") * 2,
                      dtype=jnp.bfloat16, conv_dim=24, conv_width=4, linear_heads=(2, 8, 8), kv_heads=2, head_dim=8)


def _mla(b, c):
    """A DSA cache (paged MLA latent + fp8 indexer keys) of cache.mla."""
    return ModelCache(groups=init_mla_groups(batch_size=b, capacity=c, layer_ids=(0, 2), kv_lora_rank=16, rope_dim=8,
                                             index_dim=32, dtype=jnp.bfloat16, latent_page_size=16,
                                             index_page_size=32, index_dtype=jnp.float8_e4m3fn),
                      lengths=jnp.zeros((b,), jnp.int32), version=jnp.zeros((b,), jnp.int32))


CACHES = {"deepseek_v4": _tiny()[1], "qwen_like": _qwen_like, "mla": _mla,
          "full_kv": acc_mod.full_kv_cache_fn(3, 2, 8, jnp.bfloat16)}


@pytest.mark.parametrize("name", list(CACHES))
@pytest.mark.parametrize("B,C", [(1, 64), (3, 128)])
def test_accounting_equals_allocated_nbytes(name, B, C):
    """fixed + per_token * C per row (and the shared parts) is what an allocated cache really holds."""
    new_cache = CACHES[name]
    acc = acc_mod.measure(new_cache)
    cache = new_cache(B, C)
    real = {n: sum(x.nbytes for x in jax.tree_util.tree_leaves(g)) for n, g in cache.groups.items()}
    real[acc_mod.ROW_METADATA] = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) - sum(real.values())
    assert set(real) == set(acc.groups)
    for n, g in acc.groups.items():
        predicted = B * (g.fixed + g.per_token * C) + g.shared_fixed + g.shared_per_token * C
        assert predicted == pytest.approx(real[n], abs=1e-6), n
    by_group = nbytes_by_group(cache)
    assert {n: v["total"] for n, v in by_group.items()} == {n: v for n, v in real.items() if n in cache.groups}


@pytest.mark.parametrize("name", list(CACHES))
def test_growth_is_linear_and_matches_declarations(name):
    """Exact abstract caches at several lengths lie on the fitted line, and each group's slope is what
    the group itself declares (cache.state.bytes_per_token without a constructor). Declarations count
    the data arrays only; a paged group's page table and residency flags add a little (under 1%)."""
    new_cache = CACHES[name]
    acc = acc_mod.measure(new_cache)
    exact = acc_mod.bytes_per_token_at(new_cache, [256, 2048, 1 << 14, 1 << 20])
    for n, per_group in exact.items():
        fit = acc.per_token_at(n)
        for g, v in per_group.items():
            assert v == pytest.approx(fit[g], rel=1e-9, abs=1e-12), (g, n)
    declared = bytes_per_token(new_cache(1, 64))
    measured = bytes_per_token(new_cache(1, 64), new_cache=new_cache)
    for g in declared:
        assert measured[g] == pytest.approx(acc.groups[g].per_token)
        assert declared[g] <= measured[g] <= declared[g] * 1.01, g
    assert any(g.per_token > 0 for g in acc.groups.values())        # something grows in every model here


def test_recurrent_and_window_objects_are_fixed_per_row():
    kinds_fixed = {"recurrent_state", "swa_window", "uncompressed_tail", "csa_overlap", "row_metadata"}
    for name in ("deepseek_v4", "qwen_like"):
        acc = acc_mod.measure(CACHES[name])
        for g in acc.groups.values():
            if g.kind in kinds_fixed:
                assert g.per_token == 0 and g.fixed > 0, (name, g)
            else:
                assert g.per_token > 0, (name, g)


@pytest.fixture(scope="module")
def v4_real():
    """DeepSeek-V4's cache shape: 43 layers (3 HCA, then CSA / HCA alternating), head_dim 512, window 128,
    rates 4 / 128, index_head_dim 128. Everything but the layer count is deepseek_v4_config's default,
    which mirrors transformers' DeepseekV4Config (not imported here: it loads torch, ~10 s)."""
    return deepseek_v4_config(dict(model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
                                   num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024))


def test_every_v4_group_has_a_known_kind(v4_real):
    cache = acc_mod.abstract_cache(lambda b, c: v4.new_cache(v4_real, b, c, jnp.bfloat16), 1, 1 << 20)
    kinds = acc_mod.kinds_of(cache)
    assert set(kinds) == set(cache.groups) | {acc_mod.ROW_METADATA}
    assert set(kinds.values()) <= set(acc_mod.KIND_ORDER), kinds
    assert {"swa_window", "compressed_kv", "indexer_entries", "uncompressed_tail", "csa_overlap"} <= set(kinds.values())

    @dataclasses.dataclass
    class Nameless:
        x: int = 0
    with pytest.raises(ValueError, match="'odd'.*no `kind`"):
        acc_mod.kind_of("odd", Nameless())


def test_compressed_kinds_below_full_attention_by_their_rate(v4_real):
    """Per layer, a compressed group stores one entry of D per `rate` tokens where full attention over
    every token stores one of D per token: the ratio of their slopes is the rate."""
    dt = jnp.bfloat16
    cfg = v4_real
    acc = acc_mod.measure(lambda b, c: v4.new_cache(cfg, b, c, dt))
    twin = acc_mod.measure(_full_attention_twin(cfg, dt))
    full = acc_mod.measure(acc_mod.full_kv_cache_fn(cfg.num_hidden_layers, 1, cfg.head_dim, dt))
    assert full.per_token == pytest.approx(2 * twin.per_token)       # separate K and V vs V4's shared K = V
    per_layer = twin.per_token / cfg.num_hidden_layers
    cache = acc_mod.abstract_cache(lambda b, c: v4.new_cache(cfg, b, c, dt), 1, 1 << 16)
    seen = 0
    for name, g in cache.groups.items():
        if g.kind != "compressed_kv":
            continue
        rate = cfg.rate_of(cfg.layer_types[g.layer_ids[0]])
        assert {cfg.layer_types[i] for i in g.layer_ids} == {cfg.layer_types[g.layer_ids[0]]}
        ratio = per_layer * len(g.layer_ids) / acc.groups[name].per_token
        assert ratio == pytest.approx(rate, rel=0.05), name
        seen += 1
    assert seen == 2
    for n in (8192, 1 << 17, 1 << 20):           # whole cache, window / tails amortised: still far below
        assert acc.total_per_token_at(n) * min(cfg.csa_rate, cfg.hca_rate) < twin.total_per_token_at(n)
    assert acc.total_per_token_at(1 << 20) < acc.total_per_token_at(8192)    # fixed parts amortise away
