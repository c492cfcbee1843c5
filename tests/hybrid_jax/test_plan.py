"""`hybrid-jax plan` on tiny models: cache bytes by kind against really allocated pools, weights against
real parameters, the capacity arithmetic, layer scaling against a whole-model compile, the CLI's table
and its errors. The programs are compiled by libtpu for a v6e device; without libtpu the tests skip."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from cache.pools import build_pools
from hybrid_jax.errors import ConfigError
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import config_from_hf_dict
from hybrid_jax.plan import PlanError, parse_topology, plan
from hybrid_jax.plan.shapes import (abstract_layout, abstract_params, bytes_by_kind, field_kind, layer_counts,
                                    pool_pages, request_bytes, select_layers, tree_nbytes)
from hybrid_jax.plan.planner import resolve_model
from conftest import BASE

try:
    import libtpu  # noqa: F401
    HAVE_LIBTPU = True
except ImportError:
    HAVE_LIBTPU = False
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu (the TPU compiler, pip install -e '.[tpu-aot]') "
                                  "is not installed")

# Eight layers of three kinds: GDN + MoE, GDN + dense MLP, full attention + MoE.
TINY = dict(BASE, model_type="qwen3_next", num_hidden_layers=8, mlp_only_layers=[1],
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])
SHAPES = dict(max_num_seqs=4, max_model_len=256, chunk=64)
V32_TINY = dict(model_type="deepseek_v32", vocab_size=211, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                index_n_heads=2, index_head_dim=32, index_topk=64, max_position_embeddings=1024)


def _real_bytes_by_kind(pools) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in pools.groups.values():
        for f in {**g.page_fields(), **g.row_fields()}:
            a = getattr(g, f)
            out[field_kind(g, f)] = out.get(field_kind(g, f), 0) + a.size * a.dtype.itemsize
    out["row_metadata"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pools)) - sum(out.values())
    return out


@pytest.mark.parametrize("d", [TINY, V32_TINY], ids=["qwen3_next", "deepseek_v32"])
def test_cache_bytes_by_kind_are_those_of_allocated_pools(d):
    cfg = config_from_hf_dict(d)
    layout = abstract_layout(cfg, jnp.bfloat16, 256, 64)
    pages = pool_pages(layout, 4, 256)
    from hybrid_jax.plan.shapes import abstract_pools  # noqa: PLC0415
    planned = bytes_by_kind(abstract_pools(layout, 5, pages))
    real = _real_bytes_by_kind(build_pools(layout, 5, pages, {}))       # allocated arrays
    assert planned == real
    if d is TINY:
        assert {"full_kv", "recurrent_state", "conv_state"} <= set(planned)
    else:
        assert {"mla_latent", "indexer_keys"} <= set(planned)


@pytest.mark.parametrize("d", [TINY, V32_TINY], ids=["qwen3_next", "deepseek_v32"])
def test_weights_bytes_are_those_of_real_params(d):
    cfg = config_from_hf_dict(d)
    model = get_model(cfg.model_type)
    for dt in (jnp.bfloat16, jnp.float32):
        real = model.init_params(cfg, seed=0, dtype=dt)
        abstract = abstract_params(cfg, dt)
        assert tree_nbytes(abstract) == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(real))
        assert jax.tree.structure(abstract) == jax.tree.structure(real)


def test_fp8_weights_are_one_byte_plus_block_scales():
    cfg = config_from_hf_dict(TINY)
    bf16, fp8 = tree_nbytes(abstract_params(cfg, jnp.bfloat16)), tree_nbytes(abstract_params(cfg, jnp.bfloat16, "fp8"))
    gu = abstract_params(cfg, jnp.bfloat16, "fp8")["layers"][0]["moe"]["gate_up"]      # [E, Hd, 2I] = [4, 64, 64]
    assert gu.w.dtype == jnp.float8_e4m3fn and gu.scale.shape == (4, 1, 1)
    assert 0.5 * bf16 < fp8 < bf16


def test_real_sizes_cost_no_memory():
    """The 80B model's parameters and 64 x 32k pools as shapes: the byte counts of the real model."""
    _, cfg = resolve_model("Qwen3-Next-80B-A3B-Instruct")
    w = tree_nbytes(abstract_params(cfg, jnp.bfloat16))
    assert 79e9 * 2 < w < 82e9 * 2
    layout = abstract_layout(cfg, jnp.bfloat16, 32768, 64)
    # 12 full-attention layers x 2 KV heads x 256 x (K, V) bf16 per token, plus 36 GDN states per request
    per_token = 12 * 2 * 256 * 2 * 2
    gdn = 36 * (32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2)
    assert request_bytes(layout, 32768) == 32768 * per_token + gdn


def test_select_layers_keeps_each_layers_kind():
    cfg = config_from_hf_dict(TINY)
    counts = layer_counts(cfg)
    assert counts == {("linear_attention", "moe"): 5, ("linear_attention", "dense"): 1, ("full_attention", "moe"): 2}
    sub = select_layers(cfg, [3, 1, 1, 0])
    assert layer_counts(sub) == {("full_attention", "moe"): 1, ("linear_attention", "dense"): 2,
                                 ("linear_attention", "moe"): 1}
    v = config_from_hf_dict(V32_TINY)
    assert layer_counts(select_layers(v, [2, 0])) == {("sparse_attention", "sparse"): 1, ("sparse_attention", "dense"): 1}


def test_resolve_model_and_bad_input():
    assert resolve_model("qwen3_next_80b_a3b_instruct")[0] == "qwen3_next_80b_a3b_instruct"
    assert resolve_model("deepseek-ai/DeepSeek-V3.2")[0] == "deepseek_v32"
    with pytest.raises(Exception, match="published"):
        resolve_model("no-such-model")
    assert parse_topology("v6e:2x4")[1] == 8 and parse_topology("v5p:2x2x2")[1] == 8
    for bad in ("v6e", "v9x:2x2", "v6e:2"):
        with pytest.raises(PlanError):
            parse_topology(bad)


# ---- compiled -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plans():
    cfg = config_from_hf_dict(TINY)
    return {layers: plan("tiny", "v6e:2x2", layers=layers, config=cfg, **SHAPES) for layers in ("full", "reduced")}


@needs_libtpu
def test_plan_memory_and_capacity_arithmetic(plans):
    p = plans["full"]
    cfg = config_from_hf_dict(TINY)
    m = p.memory
    assert m.weights == tree_nbytes(abstract_params(cfg, jnp.bfloat16))
    assert m.free == pytest.approx(m.capacity - m.weights - m.cache - m.temporaries)
    assert m.temporaries > 0 and p.roofline.decode_flops > 0 and p.roofline.prefill_flops > 0
    layout = abstract_layout(cfg, jnp.bfloat16, 256, 64)
    # the pools hold max_num_seqs requests of max_model_len, plus the null row
    assert m.cache_by_kind["full_kv"] == 4 * request_bytes(layout, 256) - 4 * request_bytes(layout, 0)
    # capacity: the batch at 256 tokens fills what the weights and temporaries leave, one more would not
    meta = m.cache_by_kind["row_metadata"] / 5
    left = m.capacity - m.weights - m.temporaries - request_bytes(layout, 0) - meta
    per = request_bytes(layout, 256) + meta
    c = p.capacity
    assert c.batch_at_context * per <= left < (c.batch_at_context + 1) * per
    assert 4 * (request_bytes(layout, c.context_at_batch) + meta) <= left
    assert 4 * (request_bytes(layout, c.context_at_batch + 64) + meta) > left
    # minimum bytes: weights + 4 requests' cache at 256 tokens
    assert p.roofline.min_decode_bytes == m.weights + 4 * request_bytes(layout, 256)
    chip = p.chip
    t = max(p.roofline.decode_flops / chip.peak_bf16_flops, p.roofline.decode_bytes / chip.hbm_bandwidth)
    assert p.roofline.decode_tok_s == pytest.approx(4 / t)


@needs_libtpu
def test_split_plan_compiles_the_engines_layout(plans):
    """tensor_parallel_size 2 compiles for 2 devices with the rule table's shardings: per-chip cache and
    weights are the shards' bytes, FLOPs those of one device's program, and its collectives are counted."""
    from hybrid_jax.parallel import Layout, ParallelConfig, build_mesh  # noqa: PLC0415
    from hybrid_jax.plan.chips import topology  # noqa: PLC0415
    cfg = config_from_hf_dict(TINY)
    p1 = plans["full"]
    p2 = plan("tiny", "v6e:2x2", layers="full", tensor_parallel_size=2, config=cfg, **SHAPES)
    assert p2.sharded and not p1.sharded and any("engine's layout (dp1.tp2" in n for n in p2.notes)
    # 2 KV heads, 2 key / 4 value heads over 2 chips: every per-request cache kind halves; page tables stay whole
    for kind in ("full_kv", "recurrent_state", "conv_state"):
        assert p2.memory.cache_by_kind[kind] == p1.memory.cache_by_kind[kind] / 2
    assert p2.memory.cache_by_kind["row_metadata"] == p1.memory.cache_by_kind["row_metadata"]
    # weights: split leaves halve, replicated ones (norms, the router, ...) are whole on each chip
    pc = ParallelConfig(tensor_parallel_size=2)
    layout = Layout(pc, build_mesh(pc, topology("v6e:2x2").devices[:2]))
    params = abstract_params(cfg, jnp.bfloat16)
    shardings = jax.tree.leaves(layout.param_shardings(get_model("qwen3_next"), params))
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(params)]
    replicated = sum(n for n, sh in zip(sizes, shardings) if sh.is_fully_replicated)
    assert 0 < replicated < 0.2 * sum(sizes)
    assert p2.memory.weights == (sum(sizes) - replicated) / 2 + replicated
    assert p2.roofline.min_decode_bytes == pytest.approx(
        p2.memory.weights + (p1.roofline.min_decode_bytes - p1.memory.weights) / 2)
    # one device's program: about half the FLOPs, and collectives where one chip had none
    assert p2.roofline.decode_flops < 0.7 * p1.roofline.decode_flops
    assert p2.roofline.decode_collectives > 0 == p1.roofline.decode_collectives
    with pytest.raises(PlanError, match="exceeds"):
        plan("tiny", "v6e:2x2", tensor_parallel_size=8, config=cfg, **SHAPES)


@needs_libtpu
def test_a_family_without_sharding_rules_gets_an_ideal_split(plans, monkeypatch):
    """A family that declares no parameter axes cannot be compiled split: its split is an ideal one (one
    chip's program, every figure / N), and the plan says why."""
    import dataclasses  # noqa: PLC0415

    from hybrid_jax.plan import planner  # noqa: PLC0415
    ruleless = dataclasses.replace(get_model("qwen3_next"), param_axes=None)
    monkeypatch.setattr(planner, "get_model", lambda model_type: ruleless)
    cfg = config_from_hf_dict(TINY)
    p1, p2 = plans["full"], plan("tiny", "v6e:2x2", layers="full", tensor_parallel_size=2, config=cfg, **SHAPES)
    assert not p2.sharded
    assert p2.memory.weights == p1.memory.weights / 2
    assert p2.memory.cache == pytest.approx(p1.memory.cache / 2)
    assert p2.roofline.decode_flops == pytest.approx(p1.roofline.decode_flops / 2)
    assert p2.roofline.decode_tok_s == pytest.approx(p1.roofline.decode_tok_s)      # per chip: 2x the rate on 2 chips
    assert any("ideal split (the qwen3_next family has no sharding rules yet)" in n for n in p2.notes)


@needs_libtpu
def test_fp8_weights_split_with_their_scales():
    """FP8 weights kept on the device split codes and block scales alike and run per device (Mosaic's FP8
    kernels refuse to be partitioned); FP8 experts split whole only."""
    cfg = config_from_hf_dict(TINY)
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        plan("tiny", "v6e:2x2", layers="full", tensor_parallel_size=2, quantization="fp8", config=cfg, **SHAPES)
    p1, p2 = (plan("tiny", "v6e:2x2", layers="full", tensor_parallel_size=n, enable_expert_parallel=n > 1,
                   quantization="fp8", config=cfg, **SHAPES) for n in (1, 2))
    assert p2.sharded and p2.roofline.decode_collectives > 0
    # the expert stacks (codes and scales) halve; TINY's 2-D weights are narrower than two 128-wide scale
    # blocks, so no device's part of them would be whole blocks: they stay whole
    params = abstract_params(cfg, jnp.bfloat16, "fp8")
    experts = sum(tree_nbytes(lp["moe"][k]) for lp in params["layers"] if "moe" in lp for k in ("gate_up", "down"))
    assert experts > 0.2 * p1.memory.weights
    assert p2.memory.weights == pytest.approx(p1.memory.weights - experts / 2, abs=0.05 * experts)



@needs_libtpu
def test_fp8_gate_up_wide_enough_to_split_plans_from_abstract_weights():
    """A dense MLP wide enough that each device's gate and up halves are whole 128-column scale blocks is
    split [gate_d | up_d] per device; from abstract weights (a plan's shapes) that layout keeps the shapes
    and the plan compiles, the MLP's codes and scales halved per chip."""
    cfg = config_from_hf_dict(dict(TINY, intermediate_size=512))
    p1, p2 = (plan("tiny", "v6e:2x2", layers="full", tensor_parallel_size=n, enable_expert_parallel=n > 1,
                   quantization="fp8", config=cfg, **SHAPES) for n in (1, 2))
    mlp = tree_nbytes(abstract_params(cfg, jnp.bfloat16, "fp8")["layers"][1]["mlp"]["gate_up"])
    assert mlp > 0
    assert p2.sharded and p2.memory.weights < p1.memory.weights - mlp / 2 * 0.99

@needs_libtpu
def test_deepseek_v32_plan_compiles_split_with_every_kernel_per_device():
    """Mosaic refuses a kernel the partitioner would have to split ("wrap the call in a shard_map"): a
    split DeepSeek-V3.2 plan compiles only if the indexer, sparse MLA and FP8-free paths all run per
    device. Its latent and indexer caches are whole on every chip, its heads' weights split."""
    cfg = config_from_hf_dict(V32_TINY)
    p1, p2 = (plan("v32", "v6e:2x2", layers="full", tensor_parallel_size=n, config=cfg, **SHAPES) for n in (1, 2))
    assert p2.sharded and p2.roofline.decode_collectives > 0
    assert p2.memory.cache_by_kind == p1.memory.cache_by_kind
    assert any("whole on every chip (no head axis to split): indexer keys, MLA latent" in n for n in p2.notes)
    assert p1.memory.weights / 2 < p2.memory.weights < p1.memory.weights


def test_collectives_are_counted_with_their_result_bytes():
    from hybrid_jax.plan.compile import collectives_of  # noqa: PLC0415
    hlo = ("  %all-reduce.1 = bf16[64,2048]{1,0} all-reduce(bf16[64,2048]{1,0} %x), channel_id=1\n"
           "  %ags = (f32[4,8]{1,0}, f32[2]{0}) all-gather-start(f32[1,8]{1,0} %y), dimensions={0}\n"
           "  %agd = f32[4,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[2]{0}) %ags)\n"
           "  %add = f32[2]{0} add(f32[2]{0} %a, f32[2]{0} %b)\n")
    assert collectives_of(hlo) == (2, 64 * 2048 * 2 + (4 * 8 + 2) * 4)


@needs_libtpu
def test_layer_scaling_matches_a_whole_model_compile(plans):
    full, red = plans["full"].costs, plans["reduced"].costs
    assert red.layers == "reduced" and len(red.per_layer) == 3 and red.compiled_layers == (3, 4, 4, 4)
    for a, b in ((full.decode, red.decode), (full.prefill, red.prefill)):
        assert b.flops == pytest.approx(a.flops, rel=0.05)
        assert b.bytes_accessed == pytest.approx(a.bytes_accessed, rel=0.05)
        assert b.temp_bytes == pytest.approx(a.temp_bytes, rel=0.5)        # extrapolated: an approximation
    assert any("one layer of each kind" in n for n in plans["reduced"].notes)


@needs_libtpu
def test_auto_layers_compiles_small_models_whole_and_large_ones_reduced():
    from hybrid_jax.plan.chips import parse_topology as chip_of  # noqa: PLC0415
    from hybrid_jax.plan.planner import costs_mode  # noqa: PLC0415
    chip = chip_of("v6e:2x2")[0]
    small = config_from_hf_dict(dict(TINY, num_hidden_layers=4, layer_types=TINY["layer_types"][:4]))
    assert costs_mode("auto", small, 10 << 20, chip) == "full"                  # fewer layers than the reduced set
    deep = config_from_hf_dict(dict(TINY, num_hidden_layers=12, layer_types=TINY["layer_types"] + TINY["layer_types"][:4]))
    assert costs_mode("auto", deep, 10 << 20, chip) == "reduced"               # 12 layers of 3 kinds: fewer compiled
    assert costs_mode("auto", small, chip.hbm_bytes + 1, chip) == "reduced"      # whole weights exceed one chip
    assert costs_mode("full", config_from_hf_dict(TINY), chip.hbm_bytes + 1, chip) == "full"


def test_unknown_topology_is_an_error():
    cfg = config_from_hf_dict(TINY)
    with pytest.raises(PlanError, match="refused"):
        plan("tiny", "v6e:3x3", config=cfg, **SHAPES)


@needs_libtpu
def test_cli_prints_the_plan(tmp_path, capsys):
    from hybrid_jax.cli import main  # noqa: PLC0415
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    rc = main(["plan", "--model", str(tmp_path), "--topology", "v6e:2x2", "--max-num-seqs", "4",
               "--max-model-len", "256", "--prefill-chunk", "64", "--layers", "full"])
    out = capsys.readouterr().out
    assert rc == 0
    for s in ("HBM per chip", "weights", "cache: full KV", "cache: recurrent state", "cache: conv state",
              "compiler temporaries", "free", "largest batch at 256 tokens", "context at batch 4", "FLOPs",
              "bytes accessed", "minimum bytes", "roofline ESTIMATE", "decode", "prefill"):
        assert s in out, s
    rc = main(["plan", "--model", str(tmp_path), "--topology", "v6e:2x2", "--max-num-seqs", "4", "--max-model-len",
               "256", "--prefill-chunk", "64", "--layers", "full", "-tp", "2", "--enable-expert-parallel"])
    out = capsys.readouterr().out
    assert rc == 0 and "split over 2 chips (expert parallel)" in out and "dp1.tp2.ep" in out
    assert "collectives" in out
    assert main(["plan", "--model", str(tmp_path), "--topology", "v9:2x2"]) == 2
    assert "unknown TPU chip" in capsys.readouterr().err


@needs_libtpu
def test_cli_says_when_the_model_does_not_fit(tmp_path, capsys):
    from hybrid_jax.cli import main  # noqa: PLC0415
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    # 4 requests of 2^24 tokens: the compiler's temporaries alone exceed a v5e's 16 GB
    rc = main(["plan", "--model", str(tmp_path), "--topology", "v5e:2x2", "--max-num-seqs", "4", "--max-model-len",
               str(1 << 24), "--prefill-chunk", "64", "--layers", "full"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit one v5e chip" in err and "exceeds available HBM" in err


def test_memory_that_does_not_fit_has_negative_free():
    from hybrid_jax.plan import Memory  # noqa: PLC0415
    m = Memory(capacity=100, weights=60, cache_by_kind={"full_kv": 30, "recurrent_state": 5}, temporaries=10)
    assert m.cache == 35 and m.free == -5


def test_no_libtpu_is_a_clear_error(monkeypatch):
    import builtins  # noqa: PLC0415

    from hybrid_jax.plan import chips  # noqa: PLC0415
    real_import = builtins.__import__

    def fake(name, *a, **k):
        if name == "libtpu":
            raise ImportError("no libtpu here")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    chips.topology.cache_clear()
    try:
        with pytest.raises(PlanError, match="not installed"):
            chips.topology("v6e:2x2")
    finally:
        chips.topology.cache_clear()


@needs_libtpu
def test_loops_the_cost_analysis_counts_once_are_counted():
    """XLA's cost analysis counts one iteration of a loop (Qwen3-Next's paged attention read walks the KV pages
    in one): a plan's StepCost counts the program's loops so the plan can say its figures omit the rest."""
    from hybrid_jax.plan.chips import topology  # noqa: PLC0415
    from hybrid_jax.plan.compile import _cost  # noqa: PLC0415
    from pallas_kernels.aot import on_device  # noqa: PLC0415

    def step(x, n):
        return jax.lax.fori_loop(0, n, lambda i, a: a + x[i] * 2.0, jnp.zeros(x.shape[1:], x.dtype))
    S = jax.ShapeDtypeStruct
    dev = topology("v6e:2x2").device
    costs = [_cost(jax.jit(step).lower(*on_device((S((rows, 1024, 1024), jnp.float32), S((), jnp.int32)), dev)).compile())
             for rows in (4, 64)]
    assert [c.loops for c in costs] == [1, 1]
    assert costs[1].bytes_accessed < 2 * costs[0].bytes_accessed        # 16x the rows to walk, not 16x the bytes


@needs_libtpu
@pytest.mark.parametrize("lane_dense", [True, False], ids=["rope_pool_128_lanes", "rope_pool_64_lanes"])
def test_deepseek_v32_decode_reads_its_pools_where_they_lie(monkeypatch, lane_dense):
    """A TPU lays a pool whose last dimension is 64 wide transposed (a larger dimension minor), and the
    sparse MLA kernel reads the row-major tiled layout: with DeepSeek's 64-channel RoPE key stored as it
    comes, XLA copied the whole rope stack before every layer's kernel (and back for the next write).
    Stored 128 lanes wide (cache.mla.rope_width) the decode step compiled for a TPU copies no pool; with
    the old 64-wide pool (monkeypatched back) the same check finds the copies."""
    import re  # noqa: PLC0415

    import cache.mla  # noqa: PLC0415
    import hybrid_jax.plan.compile as plan_compile  # noqa: PLC0415
    if not lane_dense:
        monkeypatch.setattr(cache.mla, "rope_width", lambda d: d)
    texts = []
    cost = plan_compile._cost
    monkeypatch.setattr(plan_compile, "_COMPILED", {})        # compile afresh: the pools' width is not in its key
    monkeypatch.setattr(plan_compile, "_cost", lambda c: texts.append(c.as_text()) or cost(c))
    cfg = config_from_hf_dict(dict(V32_TINY, qk_rope_head_dim=64, index_head_dim=128, kv_lora_rank=128,
                                   hidden_size=128))
    shapes = dict(SHAPES, max_model_len=4096)     # 256 pages: a pool small enough is left row-major
    plan("v32", "v6e:2x2", layers="full", config=cfg, **shapes)
    decode = texts[0]
    layout = abstract_layout(cfg, jnp.bfloat16, shapes["max_model_len"], 64)
    lat = layout.groups["sparse_attention"]
    assert lat.rope.shape[-1] == (128 if lane_dense else 64)
    P = pool_pages(layout, shapes["max_num_seqs"], shapes["max_model_len"])["sparse_attention"]
    pools = {f"bf16[{len(lat.layer_ids)},{P},{lat.page_size},{x}]" for x in (lat.latent.shape[-1], lat.rope.shape[-1])}
    copies = [ln for ln in decode.splitlines() if re.search(r"= (\S+)\{[^}]*\} copy\(", ln)
              and re.search(r"= (\S+)\{", ln).group(1) in pools]
    assert (not copies) if lane_dense else copies, copies[:2]


@needs_libtpu
def test_dsa_decode_reads_the_latent_once_when_the_top_k_covers_the_table():
    """A Top-K at least as wide as the table (max_model_len <= index_topk) selects every causal position.
    Gathered one by one, each selected bf16 row moves with its aligned group of 8 (pallas_kernels.row_gather):
    8x the latent rows a step, which made a mid-size DeepSeek / GLM plan at 1k context read 5x its minimum.
    Read in order (row_gather.RowRun) each row moves once and the indexer only writes its keys. A Top-K of
    half the table, gathered, moves 4x the table's rows: the in-order read of the whole table must cost
    well under half of that step (the MLA read 4x smaller, the rest of the step alike)."""
    shapes = dict(max_num_seqs=16, max_model_len=2048, chunk=64)
    big = dict(V32_TINY, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, hidden_size=256)
    wide, half = (plan("v32", "v6e:2x2", layers="full", config=config_from_hf_dict(dict(big, index_topk=k)), **shapes)
                  for k in (2048, 1024))
    assert wide.roofline.min_decode_bytes == half.roofline.min_decode_bytes
    assert wide.roofline.decode_bytes < 0.5 * half.roofline.decode_bytes


@needs_libtpu
@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16", "fp8"])
def test_few_rows_read_only_the_chosen_experts_once(monkeypatch, quantization):
    """A decode step with fewer routed assignments than experts (rows x k <= E) lowered for a TPU takes the sorted
    form: its grouped matmul (ragged_dot, or the FP8 kernel dequantizing tiles in VMEM) visits only the groups
    with rows. The gather form gathered every row's experts as slabs, FP8 ones dequantized whole (one v5p chip
    at 8 rows: DeepSeek-V3.2 FP8 588 -> 25 GB a token; one v6e chip: Nemotron-3-Nano bf16 27.5 -> 8.4 GB).
    Lowered for the CPU the gather form stays (layers.mlp._routed_few)."""
    import hybrid_jax.layers.mlp as mlp  # noqa: PLC0415
    import hybrid_jax.plan.compile as plan_compile  # noqa: PLC0415
    from hybrid_jax.plan.planner import decode_cost_per_token  # noqa: PLC0415
    # 16 experts of [512, 2 x 256] (the FP8 kernel's 128-multiples; the experts most of the layer's bytes), 2 a
    # token: 4 rows (bucket 8) choose 16
    cfg = config_from_hf_dict(dict(V32_TINY, hidden_size=512, moe_intermediate_size=256, n_routed_experts=16,
                                   num_hidden_layers=2))
    texts = []
    cost = plan_compile._cost
    monkeypatch.setattr(plan_compile, "_cost", lambda c: texts.append(c.as_text()) or cost(c))
    figures = {}
    for form in ("sorted", "gather"):
        monkeypatch.setattr(plan_compile, "_COMPILED", {})
        if form == "gather":           # the form every few-row step took before
            few = mlp._form
            monkeypatch.setattr(mlp, "_form", lambda M, k, E: mlp._routed_gather if M * k <= E else few(M, k, E))
        figures[form] = decode_cost_per_token("v32", "v5p", config=cfg, quantization=quantization, max_num_seqs=4,
                                              max_model_len=256, layers="full")

    def expert_kernels(text):        # the grouped matmul over the 16 routed experts (not the shared expert's)
        kind = ("fp8_grouped_matmul", "f8e4m3fn[16,") if quantization else ("ragged-dot", "bf16[16,")
        return [ln for ln in text.splitlines() if "custom-call(" in ln and all(x in ln for x in kind)]
    sorted_text, gather_text = texts
    assert len(expert_kernels(sorted_text)) == 2 and not expert_kernels(gather_text)    # up and down of layer 1
    # at this size the FP8 slabs' whole dequantization is most of the difference; a bf16 gather
    # only copies its slabs (0.88x here, 0.31x at Nemotron-3-Nano's 128 experts of [2688, 1920])
    bound = 0.75 if quantization else 0.95
    assert figures["sorted"]["bytes_accessed"] < bound * figures["gather"]["bytes_accessed"], figures
