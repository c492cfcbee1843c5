"""Decode programs write the per-position caches (KV, MLA latent and rope pools, indexer keys) in
place: outside in-place updates, the compiled program makes no buffer the size of a whole cache array
or of one layer's slice of it (no copy, no sliced-out layer, no stack of the layers).

Slicing a layer out of its group's [L, ...] stack, scattering the new entries into the slice and
stacking the layers back made XLA copy every slot of the cache, several times per decode step (the
batch-1 decode loop of the benchmark model ran 25% faster without them, and the copies grow with the
capacity, not with the tokens written). Read from the optimized HLO of the programs that run."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.engine import EngineConfig
from hybrid_jax.engine.runner import ModelRunner
from hybrid_jax.layers.attention import write_kv
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import config_from_hf_dict
from hybrid_jax.sampling import SamplerFlags

CAPACITY = 160        # no other array in these programs has a dimension of this size

QWEN = dict(model_type="qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            decoder_sparse_step=2, max_position_embeddings=512)
DSV4 = dict(model_type="deepseek_v4", vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8,
            sliding_window=6, o_groups=2, o_lora_rank=12, index_n_heads=4, index_head_dim=16, index_topk=3,
            hc_mult=3, hc_sinkhorn_iters=5,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe", "moe"], partial_rotary_factor=0.5)
DSV32 = dict(model_type="deepseek_v32", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
             n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,
             qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, index_topk=16, index_head_dim=16,
             index_n_heads=4, first_k_dense_replace=1, max_position_embeddings=512)


def per_position_arrays(cfg, cache) -> list:
    """The cache arrays that grow with the capacity (a step writes only T slots of them): the page
    pools [L, P, ps, ...] (full KV, MLA latent and rope, indexer keys, V4's compressed entries).
    V4's sliding window is window-sized and restacked every step by design."""
    g = cache.groups
    if cfg.model_type == "qwen3_next":
        return [g["full_attention"].k, g["full_attention"].v]
    if cfg.model_type == "deepseek_v4":
        return [grp.entries for grp in g.values() if hasattr(grp, "entries")]
    return [g["sparse_attention"].latent, g["sparse_attention"].rope, g["indexer"].keys] + (
        [] if g["indexer"].scale is None else [g["indexer"].scale])


def cache_materializations(hlo: str, arrays, whole_only=()) -> list[str]:
    """Instructions of the optimized HLO (outside fusion bodies) that produce a new buffer with the
    shape of one of the arrays or of one layer of it (the array without its leading layer axis),
    either also with a page pool's two page axes merged (seen as flat slots); axes of size 1 do not
    count (a layer sliced as [1, ...]). Allowed: in-place updates (a dynamic-update-slice or a
    scatter, or a fusion whose root is one), a gather (a read through the page table), and what
    makes no buffer (parameter, get-tuple-element, bitcast, tuple). Anything else (a copy, a slice,
    a concatenation that stacks the layers) writes a whole cache array. whole_only: shapes checked
    whole only (not per layer)."""
    def squeeze(shape):
        return tuple(d for d in shape if d != 1)

    shapes = set()
    for a in arrays:
        full = tuple(a.shape)
        shapes.update({squeeze(full), squeeze(full[1:])})
        if len(full) in (3, 4):                  # [L, P, ps(, X)] page pool: P * ps flat slots
            shapes.update({squeeze(full[:1] + (full[1] * full[2],) + full[3:]), squeeze((full[1] * full[2],) + full[3:])})
    shapes.update(squeeze(tuple(a.shape)) for a in whole_only)
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) \(", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line.strip())
    inst = re.compile(r"(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(")
    fused = set(re.findall(r"kind=k\w+, calls=%([\w.-]+)", hlo))
    root_op = {}
    for c in fused:
        for line in comps.get(c, []):
            m = inst.match(line)
            if m and line.startswith("ROOT"):
                root_op[c] = m.group(3)
    in_place, free = {"dynamic-update-slice", "scatter"}, {"parameter", "get-tuple-element", "bitcast", "tuple"}
    out = []
    for c, lines in comps.items():
        if c in fused:
            continue
        for line in lines:
            m = inst.match(line)
            if not m or squeeze(int(d) for d in m.group(2).split(",") if d) not in shapes:
                continue
            op = m.group(3)
            if op == "fusion":
                callee = re.search(r"calls=%([\w.-]+)", line)
                op = root_op.get(callee.group(1), "fusion") if callee else "fusion"
            if op not in in_place | free | {"gather"}:
                out.append(line[:160])
    return out


def _model(spec):
    cfg = config_from_hf_dict(dict(spec))
    return cfg, get_model(cfg.model_type).init_params(cfg, seed=0)


@pytest.mark.parametrize("spec", [QWEN, DSV32, DSV4], ids=["qwen3_next", "deepseek_v32", "deepseek_v4"])
@pytest.mark.parametrize("B", [1, 2])
def test_engine_decode_loop_writes_pools_in_place(spec, B):
    """The engine's decode program: B rows of its pools, reached through block tables, decoded in a
    while loop; the page pools are only written in place and read through the tables."""
    cfg, params = _model(spec)
    runner = ModelRunner(cfg, params, jnp.float32, EngineConfig(max_num_seqs=2, max_model_len=CAPACITY,
                                                                compilation_cache_dir=None, warmup="none"))
    arrays = per_position_arrays(cfg, runner.cache)
    z = np.zeros((B,), np.int32)
    hlo = runner._decode.lower(params, runner.cache, runner.slot_last, runner.inputs.rows([], B), z, z.astype(bool),
                               np.full((B, 1), -1, np.int32), z + 8, None, None, steps=16,
                               flags=SamplerFlags(False, False, False), top_n=0).compile().as_text()
    assert "while" in hlo
    assert cache_materializations(hlo, arrays) == []


def test_verify_step_writes_cache_in_place():
    """The engine's verify + rollback-by-selection step (the one verify body, pools donated): the
    page pools are only written in place."""
    cfg, params = _model(QWEN)
    B, K = 2, 4
    runner = ModelRunner(cfg, params, jnp.float32, EngineConfig(max_num_seqs=2, max_model_len=CAPACITY,
                                                                compilation_cache_dir=None, warmup="none"))
    meta = np.stack([np.full((B,), K + 1), np.full((B,), K)]).astype(np.int32)
    hlo = runner._verify.lower(params, runner.cache, runner.inputs.rows([], B), np.ones((B, K + 1), np.int32), meta, None,
                               None, flags=SamplerFlags(False, False, False), replay=False).compile().as_text()
    assert cache_materializations(hlo, per_position_arrays(cfg, runner.cache)) == []


def test_the_check_sees_the_old_stacking_copies():
    """The reader is not vacuous: the old write (slice the layer out, scatter, stack the layers
    back) in a decode-like loop compiles to whole-cache writes it finds, the in-place write to none."""
    def loop(stacked: bool):
        def f(k, x, n):
            def step(s):
                i, k, x = s
                pos = jnp.full((1, 1), i, jnp.int32)
                table = jnp.zeros((1, 1), jnp.int32)      # one row, one page of CAPACITY slots
                layers = []
                for l in range(k.shape[0]):       # write this step's entry, then attend over the layer
                    if stacked:
                        layers.append(write_kv(k[l], x, table, pos, pos >= 0))
                        kl = layers[-1]
                    else:
                        k = write_kv(k, x, table, pos, pos >= 0, layer=l)
                        kl = k[l]
                    p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", x, kl), axis=-1)
                    x = jnp.einsum("bhts,bshd->bthd", p, kl)
                return i + 1, jnp.stack(layers) if stacked else k, x
            return jax.lax.while_loop(lambda s: s[0] < n, step, (0, k, x))
        return jax.jit(f, donate_argnums=(0,))

    k, x = jnp.zeros((2, 1, CAPACITY, 2, 8)), jnp.ones((1, 1, 2, 8))
    assert cache_materializations(loop(True).lower(k, x, 4).compile().as_text(), [k]) != []
    assert cache_materializations(loop(False).lower(k, x, 4).compile().as_text(), [k]) == []


@pytest.mark.parametrize("B", [1, 2])
def test_speculative_device_loop_writes_cache_in_place(B):
    """The n-gram device loop: its iterations branch between a decode chunk and verifies of several
    lengths. The branches only read the KV cache and one write after them puts the new entries in
    (a cache written inside the branches was copied at the loop level and at each branch entry)."""
    from hybrid_jax.speculative.device_loop import LoopConfig, loop_buckets, ngram_generate  # noqa: PLC0415
    cfg, params = _model(QWEN)
    cache = get_model(cfg.model_type).new_cache(cfg, B, CAPACITY, jnp.float32)
    K = 8
    lc = LoopConfig(K=K, buckets=loop_buckets(K, True), lookup_min=1, lookup_max=4, dynamic_k=True, max_new=32,
                    chunk=4, max_chunk=16)
    z = np.zeros((B,), np.int32)
    hlo = ngram_generate.lower(params, cache, np.zeros((B, 128), np.int32), z, np.stack([z + 8, z + 1, z, z + 32]),
                               np.asarray([0.3, 0.9], np.float32), np.full((B, 1), -1, np.int32),
                               z.astype(np.uint32), z.astype(np.float32), z - 1, z.astype(np.float32) + 1,
                               cfg=cfg, impl="auto", flags=SamplerFlags(False, False, False), lc=lc).compile().as_text()
    assert hlo.count("conditional(") >= 1 and "while" in hlo
    assert cache_materializations(hlo, per_position_arrays(cfg, cache)) == []


def _decode_hlo(runner, params, B: int) -> str:
    z = np.zeros((B,), np.int32)
    return runner._decode.lower(params, runner.cache, runner.slot_last, runner.inputs.rows([], B), z, z.astype(bool),
                                np.full((B, 1), -1, np.int32), z + 8, None, None, steps=16,
                                flags=SamplerFlags(False, False, False), top_n=0).compile().as_text()


@pytest.mark.parametrize("B", [1, 2])
def test_engine_decode_loop_moves_recurrent_state_in_place(B, monkeypatch):
    """The decode program lends the Gated DeltaNet state pool to the recurrent op, which reads and writes
    the batch's rows of it in place: no copy of the pool or of a layer of it, and no [L, B, ...] stack of
    the batch's states (gathering the rows of every layer into a view, slicing a layer out, stacking the
    layers back and scattering the view into the pool moved each state five times or more per token;
    compiled for a TPU that was a third of Qwen3-Next-80B's decode bytes). The conv windows, (W-1) x C
    a row, are gathered into the view; their pool is not copied either. The same program taken with
    the old gathered view makes such buffers: the check can fail."""
    import hybrid_jax.engine.steps as steps_mod  # noqa: PLC0415
    cfg, params = _model(QWEN)
    runner = ModelRunner(cfg, params, jnp.float32, EngineConfig(max_num_seqs=2, max_model_len=CAPACITY,
                                                                compilation_cache_dir=None, warmup="none"))
    rec = runner.cache.groups["linear_attention"]
    stacked = [jax.ShapeDtypeStruct((rec.ssm.shape[0], B) + rec.ssm.shape[2:], rec.ssm.dtype)]
    arrays = [rec.conv, rec.ssm]
    assert cache_materializations(_decode_hlo(runner, params, B), arrays, stacked) == []

    take = steps_mod.take_view
    monkeypatch.setattr(steps_mod, "take_view", lambda *a, in_place=False, **k: take(*a, **k))
    runner = ModelRunner(cfg, params, jnp.float32, EngineConfig(max_num_seqs=2, max_model_len=CAPACITY,
                                                                compilation_cache_dir=None, warmup="none"))
    assert cache_materializations(_decode_hlo(runner, params, B), arrays, stacked) != []
