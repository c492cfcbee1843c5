"""Ragged (flat, token-major) steps: a family's forward_ragged (Qwen3-Next; DeepSeek-V3.2, its indexer's Top-K
shorter than the contexts; DeepSeek-V4; Kimi-Linear; Nemotron-H; Qwen4-Exp) over sequences of unequal lengths (a long prefill
chunk, a decode token, a chunk on a cached prefix, an empty sequence) gives the logits and the cache the padded
[B, T] forward gives, and the ragged causal conv never reads across sequences."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import LLM
from hybrid_jax.layers.gated_deltanet import causal_conv, ragged_causal_conv
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import config_from_hf_dict
from hybrid_jax.models.ragged import pack


# A DeepSeek-V3.2 miniature whose Top-K (16) is shorter than the rows' contexts, so the indexer selects.
DSV32 = dict(model_type="deepseek_v32", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
             n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,
             qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, index_topk=16, index_head_dim=16,
             index_n_heads=8, first_k_dense_replace=1, max_position_embeddings=512, routed_scaling_factor=2.5)


# A DeepSeek-V4 miniature: window 6, CSA rate 4 (indexer Top-K 3) and HCA rate 8, so the 37-token chunk
# closes windows of both compressors across several tiles and every tail length occurs.
DSV4 = dict(model_type="deepseek_v4", vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8,
            sliding_window=6, o_groups=2, o_lora_rank=12, index_n_heads=8, index_head_dim=16, index_topk=3,
            hc_mult=3, hc_sinkhorn_iters=5, compress_rates={"compressed_sparse_attention": 4,
                                                            "heavily_compressed_attention": 8},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"], partial_rotary_factor=0.5)


# A Kimi-Linear miniature: KDA layers around an MLA layer (no positional encoding, dense over the latent pages).
KIMI = dict(model_type="kimi_linear", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, num_experts=8, num_experts_per_token=2, first_k_dense_replace=1,
            linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 3],
                                "full_attn_layers": [2]})
# A Nemotron-H miniature: Mamba2 (two groups) around an attention block, a relu2 MLP and a MoE block.
NEMOTRON_H = dict(model_type="nemotron_h", vocab_size=97, hidden_size=32, hybrid_override_pattern="M*-EM",
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
                  mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24)
# A Qwen4-Exp miniature: PLE on both Gated DeltaNet layers (an EOS, id 1, restarts the n-grams) and QSA selecting
# 2 blocks of 4 (fewer than the rows' contexts hold), run on tiles as rows.
QWEN4 = dict(model_type="qwen4_exp_text", vocab_size=97, hidden_size=32, num_hidden_layers=4,
             layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             shared_expert_intermediate_size=24, hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=32,
             heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, indexer_n_heads=8,
             indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, eos_token_id=1,
             rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
MINIATURES = {"deepseek_v32": DSV32, "deepseek_v4": DSV4, "kimi_linear": KIMI, "nemotron_h": NEMOTRON_H,
              "qwen4_exp": QWEN4}


@pytest.fixture(scope="module", params=["qwen3_next", "deepseek_v32", "deepseek_v4", "kimi_linear", "nemotron_h",
                                        "qwen4_exp"])
def model(request):
    """(config, params, family): the embedded default (Gated DeltaNet + gated full attention + MoE), or a
    random miniature of DeepSeek-V3.2 (MLA + the DSA indexer over paged latent and indexer-key pools),
    DeepSeek-V4, Kimi-Linear (KDA + MLA over a paged latent pool), Nemotron-H (Mamba2, attention, relu2 MLP and MoE)
    or Qwen4-Exp (Gated DeltaNet with PLE, QSA-indexed attention, hyper-connections)."""
    if request.param == "qwen3_next":
        llm = LLM()
        return llm.config, llm.params, get_model(llm.config.model_type)
    cfg = config_from_hf_dict(MINIATURES[request.param])
    fam = get_model(cfg.model_type)
    return cfg, fam.init_params(cfg, seed=1), fam


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


@pytest.mark.parametrize("tile", [None, 8])
def test_ragged_forward_equals_the_padded_forward(model, tile, monkeypatch):
    """tile 8 (DeepSeek-V4 and Qwen4-Exp): the 37-token chunk runs as 5 tiles in a row, each on the state the
    previous one left (V4's window ring, compressor tails and overlaps; Qwen4-Exp's recurrent and PLE rows)."""
    cfg, params, fam = model
    if tile is not None:
        if cfg.model_type not in ("deepseek_v4", "qwen4_exp_text"):
            pytest.skip("only DeepSeek-V4 and Qwen4-Exp run on tiles as rows")
        from hybrid_jax.models import deepseek_v4, qwen4_exp  # noqa: PLC0415
        monkeypatch.setattr(deepseek_v4 if cfg.model_type == "deepseek_v4" else qwen4_exp, "RAGGED_TILE", tile)
    rng = np.random.default_rng(0)
    B, CAP = 4, 192
    held = [0, 20, 64, 10]                  # tokens each row holds before the step
    cache = fam.new_cache(cfg, B, CAP, jnp.float32)
    t = np.zeros((B, 64), np.int32)
    for i, n in enumerate(held):
        t[i, :n] = rng.integers(0, cfg.vocab_size, n)
    cache = fam.forward(cfg, params, cache, jnp.asarray(t), jnp.asarray(held, jnp.int32)).cache
    new = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 1, 9, 0)]
    tp = np.zeros((B, 64), np.int32)
    for i, a in enumerate(new):
        tp[i, :len(a)] = a
    n_new = jnp.asarray([len(a) for a in new], jnp.int32)
    ref = fam.forward(cfg, params, jax.tree_util.tree_map(jnp.copy, cache), jnp.asarray(tp), n_new)
    batch = pack(new, held, 64, B)
    assert batch.cu_seqlens.tolist() == [0, 37, 38, 47, 47] and not batch.valid[47:].any()
    got = jax.jit(lambda c, b: fam.forward_ragged(cfg, params, c, b))(jax.tree_util.tree_map(jnp.copy, cache), batch)
    for i in range(3):                      # the empty sequence's logits mean nothing
        assert _rel(got.logits[i], ref.logits[i]) < 1e-5, i
    assert got.cache.lengths.tolist() == ref.cache.lengths.tolist() == [37, 21, 73, 10]
    compared = 0
    for name, g in ref.cache.groups.items():
        for f in ("conv", "ssm", "k", "v", "latent", "rope", "keys", "scale", "kv", "gate", "entries", "count", "ctx"):
            if getattr(g, f, None) is not None:
                a, b = getattr(got.cache.groups[name], f), getattr(g, f)
                if f in ("count", "ctx"):
                    np.testing.assert_array_equal(a[:B], b[:B], err_msg=f"{name}.{f}")
                else:
                    assert _rel(a, b) < 1e-5, (name, f)
                compared += 1
    assert compared >= 3
    if "linear_attention" in cache.groups:  # the row that fed nothing kept its state bit for bit
        rec = got.cache.groups["linear_attention"]
        np.testing.assert_array_equal(np.asarray(rec.ssm[:, 3]), np.asarray(cache.groups["linear_attention"].ssm[:, 3]))
    if "sparse_attention" in cache.groups:  # the resident fraction of the selected positions, per sequence
        np.testing.assert_allclose(got.cache.groups["sparse_attention"].hit_rate[:3],
                                   ref.cache.groups["sparse_attention"].hit_rate[:3], rtol=1e-6)


def test_ragged_causal_conv_stays_inside_each_sequence():
    rng = np.random.default_rng(1)
    W, C, lens = 4, 6, [5, 1, 0, 2]
    S = len(lens)
    state = jnp.asarray(rng.normal(size=(S, W - 1, C)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(W, C)), jnp.float32)
    xs = [rng.normal(size=(n, C)).astype(np.float32) for n in lens]
    N = 10
    flat = np.zeros((N, C), np.float32)
    flat[:sum(lens)] = np.concatenate([x for x in xs if len(x)])
    b = pack([[0] * n for n in lens], [0] * S, N, S)
    y, new_state = ragged_causal_conv(jnp.asarray(flat), state, w, jnp.asarray(b.seq), jnp.asarray(b.cu_seqlens))
    for s, x in enumerate(xs):
        # each sequence alone through the padded conv, from its own state
        xp = np.zeros((1, 5, C), np.float32)
        xp[0, :len(x)] = x
        ry, rs = causal_conv(jnp.asarray(xp), state[s:s + 1], w, jnp.asarray([len(x)], jnp.int32))
        a, e = b.cu_seqlens[s], b.cu_seqlens[s + 1]
        np.testing.assert_allclose(np.asarray(y[a:e]), np.asarray(ry[0, :len(x)]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_state[s]), np.asarray(rs[0]), rtol=1e-6, atol=1e-6)


def test_pack_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        pack([[1, 2, 3], [4]], [0, 0], 3, 2)
    with pytest.raises(ValueError, match="does not fit"):
        pack([[1], [2], [3]], [0, 0, 0], 8, 2)
