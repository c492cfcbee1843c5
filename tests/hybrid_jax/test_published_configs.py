"""The published configs in hybrid_jax/published_configs: every file says where its values came from, and
the ones the parsers take load with the real models' shapes (the kernel and plan tests rely on them)."""
from __future__ import annotations

import json
import pathlib

import pytest

from hybrid_jax.models.config_common import config_from_hf_dict

ROOT = pathlib.Path(__file__).parents[2] / "hybrid_jax" / "published_configs"
FILES = sorted(ROOT.glob("*.json"))


def _load(name):
    return json.loads((ROOT / name).read_text())


def test_there_are_configs_of_the_real_models():
    assert {f.name for f in FILES} >= {"qwen3_next_80b_a3b_instruct.json", "deepseek_v32.json",
                                       "deepseek_v4_flash.json", "qwen3_5_397b_a17b.json"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_config_names_its_sources(path):
    d = json.loads(path.read_text())
    assert d["_sources"] and all(isinstance(v, str) and v for v in d["_sources"].values())
    assert "not included" in d["_sources"]


def test_qwen3_next_80b():
    cfg = config_from_hf_dict(_load("qwen3_next_80b_a3b_instruct.json"))
    assert cfg.layer_types.count("linear_attention") == 36 and cfg.layer_types.count("full_attention") == 12
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 32, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 2, 256)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (512, 10, 512)


def test_deepseek_v32_without_its_yarn_block():
    """The release's YaRN rope_scaling is not parsed yet; the rest of the file is (YaRN changes the rotary
    frequencies and the softmax scale, no shape)."""
    d = {k: v for k, v in _load("deepseek_v32.json").items() if k != "rope_scaling"}
    cfg = config_from_hf_dict(d)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (61, 128, 512, 64)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)


def test_deepseek_v4_flash():
    cfg = config_from_hf_dict(_load("deepseek_v4_flash.json"))
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window) == (43, 64, 512, 128)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 512)
    kinds = {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)}
    assert kinds == {"compressed_sparse_attention": 20, "heavily_compressed_attention": 23}


def test_kimi_linear_48b():
    cfg = config_from_hf_dict(_load("kimi_linear_48b_a3b_instruct.json"))
    assert cfg.layer_types.count("linear_attention") == 20 and cfg.layers_of("full_attention") == (3, 7, 11, 15, 19, 23, 26)
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim) == (32, 128, 4)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (256, 8, 1)
    assert cfg.mlp_layer_types == ("dense",) + ("sparse",) * 26


def test_nemotron_3_nano_30b():
    """The release's 52-character pattern: 23 Mamba2, 23 MoE and 6 attention blocks; Mamba2 64 heads of 64
    in 8 groups of state 128 (a conv over 64 * 64 + 2 * 8 * 128 channels)."""
    cfg = config_from_hf_dict(_load("nemotron_3_nano_30b_a3b.json"))
    kinds = {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)}
    assert kinds == {"linear_attention": 23, "moe": 23, "full_attention": 6}
    assert cfg.layers_of("full_attention") == (5, 12, 19, 26, 33, 42)
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size) == (64, 64, 8, 128)
    assert cfg.mamba_conv_dim == 6144 and cfg.time_step_limit == (0.0, float("inf"))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 2, 128)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 6, 1856)
    assert (cfg.moe_shared_expert_intermediate_size, cfg.routed_scaling_factor) == (3712, 2.5)


def test_qwen4_exp_reconstructed():
    """48 layers, every 4th QSA-indexed (the release's "full_attention" name), PLE on the second; the n-gram
    table this config's hash implies (16 heads of the primes from 20,000,000, padded to 128 rows) is the
    ~102.4 GB in bf16 one source states for it, a check independent of the values copied."""
    from hybrid_jax.layers.ple import ngram_hash, table_rows  # noqa: PLC0415
    cfg = config_from_hf_dict(_load("qwen4_exp_reconstructed.json"))
    assert cfg.layer_types.count("indexed_attention") == 12 and cfg.layers_of("indexed_attention")[:2] == (3, 7)
    assert cfg.ple_layers == (1,) and cfg.layer_types[1] == "linear_attention" and cfg.output_gate == "sigmoid"
    assert (cfg.qsa_block_topk, cfg.rotary_dim, cfg.indexer_head_dim) == (512, 64, 128)
    rows = table_rows(ngram_hash(cfg, 0), cfg.ngram_vocab_multiple)
    assert round(rows * (cfg.ple_embed_dim // cfg.ngram_heads) * 2 / 1e9, 1) == 102.4
