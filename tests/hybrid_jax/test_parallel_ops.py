"""The ops that run per device under a layout (Pallas kernels, ragged paged attention, expert-parallel
MoE, FP8 linears, the DSA indexer split by heads) against the same op on one device, in a subprocess with 8 CPU devices
(per_device_worker.py through multi_device.py)."""
from __future__ import annotations

import pytest
from multi_device import run_worker


@pytest.fixture(scope="module")
def per_device():
    return run_worker("per_device_worker.py")



@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_gated_delta_rule_kernels_run_on_each_devices_heads(per_device, kernel):
    """The Pallas kernels (interpreted on CPU) under shard_map on 2 devices' heads: the outputs and final
    states of one device, the state left split by heads, nothing gathered."""
    c = per_device["gdn"][kernel]
    assert per_device["devices"] == 8
    assert c["per_device"] and c["rel"] <= 1e-6
    assert c["state_sharding"] == "P(None, 'model')" and c["all_gathers"] == 0


@pytest.mark.parametrize("tp, kv_split", [(2, True), (4, False)])
def test_ragged_attention_reads_the_kv_heads_of_each_devices_query_heads(per_device, tp, kv_split):
    """8 query heads, 2 KV heads: at tensor size 2 the KV pages are split with the heads; at 4 they are
    whole on every device and each device's 2 query heads must read their own KV head."""
    c = per_device["attention"][f"tp{tp}"]
    assert c["per_device"] and c["kv_split"] is kv_split
    assert c["rel"] <= 1e-6
    assert c["stacked_rel"] <= 1e-6            # layer 1 of a stack of pools, read in place


@pytest.mark.parametrize("form", ["gather", "dense", "sorted"])
def test_expert_parallel_moe_sums_each_devices_experts(per_device, form):
    """Experts split whole over 4 devices, every routed form: one device's output, one all-reduce, no
    expert weight gathered."""
    c = per_device["moe"][form]
    assert c["per_device"] and c["rel"] <= 1e-5
    assert c["all_reduces"] == 1 and c["all_gathers"] == 0


@pytest.mark.parametrize("split, shard", [("columns", [512, 384]), ("rows", [256, 768])])
def test_fp8_linear_runs_on_each_devices_block(per_device, split, shard):
    """An FP8 weight's codes and scales split alike over 2 devices; the linear runs per device and equals
    one device's (rows split: partial sums all-reduced)."""
    c = per_device["fp8"][split]
    assert c["per_device"] and c["codes_on_device0"] == shard
    assert c["rel"] <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas", "ragged"])
def test_indexer_split_by_heads_selects_the_global_top_k(per_device, impl):
    """8 indexer heads over 4 devices: each device scores with its 2 heads, the partial scores are
    all-reduced before the selection (not the queries gathered), and every device selects the keys one
    device selects over all 8 heads."""
    c = per_device["indexer"][impl]
    assert c["per_device"] and c["same"] and c["devices_agree"]
    assert c["all_reduces"] >= 1 and not c["q_gathered"]
