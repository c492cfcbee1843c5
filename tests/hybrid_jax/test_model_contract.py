"""The typed contract between the engine and the model families: one registry, StepOutput whatever the
mode, each family's layer-type registry naming exactly the cache groups its cache has, every
group implementing the cache-group protocol, and every family's config the FamilyConfig interface."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache.group import ROLLBACKS, CacheGroup
from cache.segments import Kind
from hybrid_jax import LLM
from hybrid_jax.errors import ConfigError
from hybrid_jax.models import REGISTRY, config_parser, get_model
from hybrid_jax.models.config_common import FamilyConfig, config_from_hf_dict
from hybrid_jax.models.contract import ModelFamily, StepOutput
from hybrid_jax.parallel.config import HEAD_FIELDS
from hybrid_jax.plan.planner import PUBLISHED, resolve_model

PUBLISHED_NAMES = sorted(p.stem for p in PUBLISHED.glob("*.json"))


def test_one_registry_gives_each_model_type_its_family_and_parser():
    for model_type in REGISTRY:
        fam = get_model(model_type)
        assert isinstance(fam, ModelFamily) and fam.layer_types
        assert callable(config_parser(model_type))
        if fam.write_deferred_kv is None:
            assert fam.deferred_groups == ()
    with pytest.raises(ConfigError, match="unknown model_type 'llama'.*qwen3_next"):
        config_from_hf_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        get_model("llama")


@pytest.mark.parametrize("name", PUBLISHED_NAMES)
def test_layer_types_name_exactly_the_cache_groups(name):
    """A real model's layer types are all in its family's registry, and the family's cache has exactly
    the groups those layer types name, each a CacheGroup with a store kind and a rollback rule."""
    _, cfg = resolve_model(name)
    fam = get_model(cfg.model_type)
    assert set(cfg.layer_types) <= set(fam.layer_types), name
    cache = jax.eval_shape(lambda: fam.new_cache(cfg, 1, 256, jnp.bfloat16))    # shapes only: nothing allocated
    assert set(cache.groups) == set(fam.groups_of(cfg.layer_types))
    for gname, g in cache.groups.items():
        assert isinstance(g, CacheGroup), gname
        assert isinstance(g.store_kind(), Kind) and g.ROLLBACK in ROLLBACKS, gname
        assert g.paged == bool(g.page_fields()) and (g.page_tokens > 0) == g.paged, gname


def _one_config_per_parser() -> dict:
    """A real config of every registered parser (the published configs cover them all)."""
    out: dict = {}
    for name in PUBLISHED_NAMES:
        _, cfg = resolve_model(name)
        out.setdefault(REGISTRY[cfg.model_type].parser, cfg)
    return out


def test_every_family_config_has_the_shared_interface():
    """FamilyConfig is what the engine, the loaders, the planner and the parallel checks read from a
    config: every registered family's config has each member, of its type, and its layer-stack
    methods keep each layer's mixer and feed-forward kind."""
    configs = _one_config_per_parser()
    assert set(configs) == {r.parser for r in REGISTRY.values()}
    for parser, cfg in configs.items():
        assert isinstance(cfg, FamilyConfig), parser
        n = cfg.num_hidden_layers
        assert isinstance(cfg.model_type, str) and get_model(cfg.model_type).layer_types, parser
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
            v = getattr(cfg, f)
            assert isinstance(v, int) and not isinstance(v, bool) and v > 0, (parser, f, v)
        assert isinstance(cfg.layer_types, tuple) and len(cfg.layer_types) == n, parser
        assert set(cfg.layer_types) <= set(get_model(cfg.model_type).layer_types), parser
        assert sorted(i for t in set(cfg.layer_types) for i in cfg.layers_of(t)) == list(range(n)), parser
        assert isinstance(cfg.eos_token_ids, tuple) and all(isinstance(i, int) for i in cfg.eos_token_ids), parser
        assert all(v is None or isinstance(v, int) for v in (cfg.bos_token_id, cfg.pad_token_id)), parser
        assert isinstance(cfg.dtype, str) and isinstance(cfg.tie_word_embeddings, bool), parser
        kinds = [(cfg.layer_types[i], cfg.ffn_kind(i)) for i in range(n)]
        assert all(isinstance(k, str) and k for _, k in kinds), parser
        idx = [n - 1, 0, 0]
        sub = cfg.with_layers(idx)
        assert type(sub) is type(cfg) and sub.num_hidden_layers == 3 and sub.vocab_size == cfg.vocab_size, parser
        assert [(sub.layer_types[j], sub.ffn_kind(j)) for j in range(3)] == [kinds[i] for i in idx], parser
        counts = cfg.head_counts()
        fields = {f.name for f in dataclasses.fields(cfg)}
        assert set(counts) == {f for f in HEAD_FIELDS if f in fields}, parser
        assert all(getattr(cfg, f) == c for f, c in counts.items()), parser
        assert isinstance(cfg.routed_experts, int) and cfg.routed_experts >= 0, parser
        assert (cfg.routed_experts > 0) == any(k != "dense" for _, k in kinds), parser


def test_a_config_missing_a_member_of_the_interface_is_not_a_family_config():
    """The isinstance check above is not vacuous: an object with every FamilyConfig member but one fails it."""
    _, cfg = resolve_model("qwen3_next_80b_a3b_instruct")
    members = sorted(m for m in dir(FamilyConfig) if not m.startswith("_"))
    assert {"model_type", "vocab_size", "layer_types", "max_position_embeddings", "eos_token_ids", "ffn_kind",
            "with_layers", "head_counts", "routed_experts"} <= set(members)
    assert isinstance(SimpleNamespace(**{m: getattr(cfg, m) for m in members}), FamilyConfig)
    for missing in members:
        stub = SimpleNamespace(**{m: getattr(cfg, m) for m in members if m != missing})
        assert not isinstance(stub, FamilyConfig), missing


def test_forward_returns_a_step_output_whatever_the_mode():
    llm = LLM()                                    # the embedded default: Gated DeltaNet + full attention
    cfg, fam = llm.config, get_model(llm.config.model_type)
    B, T = 2, 5
    tokens = jnp.asarray(np.arange(B * T).reshape(B, T) % cfg.vocab_size, jnp.int32)
    n_new = jnp.asarray([T, 3], jnp.int32)

    def run(**kw):
        return fam.forward(cfg, llm.params, fam.new_cache(cfg, B, 16, llm.dtype), tokens, n_new, **kw)

    plain = run()
    assert isinstance(plain, StepOutput)
    assert plain.logits.shape == (B, cfg.vocab_size) and plain.hidden is None and plain.states is None
    assert plain.deferred is None and plain.cache.lengths.tolist() == [T, 3]
    full = run(logits_at="all", return_hidden=True, per_token_states=True, defer_kv_write=True)
    assert full.logits.shape == (B, T, cfg.vocab_size)
    assert len(full.hidden) == cfg.num_hidden_layers + 1 and full.hidden[0].shape == (B, T, cfg.hidden_size)
    n_lin = cfg.layer_types.count("linear_attention")
    assert full.states["k"].shape[:3] == (n_lin, B, T)
    n_full = cfg.layer_types.count("full_attention")
    assert full.deferred["k"].shape[:3] == (n_full, B, T) and fam.deferred_groups == ("full_attention",)
    # the deferred entries were not written: the returned cache's KV is the input's (zeros)
    assert not np.any(np.asarray(full.cache.groups["full_attention"].k))
    np.testing.assert_allclose(np.asarray(full.logits[:, -1][:1]), np.asarray(plain.logits[:1]), rtol=1e-5, atol=1e-5)


def test_a_family_that_cannot_defer_writes_says_so():
    fam = get_model("deepseek_v4")
    assert fam.write_deferred_kv is None
    _, cfg = resolve_model("deepseek_v4_flash")
    with pytest.raises(ValueError, match="cannot defer"):
        fam.forward(cfg, {}, None, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), defer_kv_write=True)
