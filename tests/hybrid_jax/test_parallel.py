"""Tensor and expert parallelism (hybrid_jax.parallel): the layout options, the rule table, and a
Qwen3-Next model split over 2 and 4 CPU devices against one device.

The multi-device checks run in a subprocess that sees 8 CPU devices (parallel_worker.py through
multi_device.py), so the rest of the suite keeps one device. DeepSeek-V3.2 and an FP8 release split
are in test_parallel_models.py, the ops that run per device in test_parallel_ops.py."""
from __future__ import annotations

import math
import os

import jax
import pytest
from conftest import make_checkpoint
from jax.sharding import Mesh, PartitionSpec
from multi_device import run_worker

from hybrid_jax.errors import ConfigError
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import load_config
from hybrid_jax.parallel import Layout, ParallelConfig
from hybrid_jax.parallel.rules import partition_spec, rules

# Head and expert counts that 2 and 4 divide; 2 key-value heads, so tensor size 4 replicates them.
SPLITTABLE = dict(vocab_size=320, num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
                  linear_num_value_heads=8, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                         "full_attention"], mlp_only_layers=[1])


@pytest.fixture(scope="module")
def splittable(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tp") / "m", seed=3, **SPLITTABLE)


@pytest.fixture(scope="module")
def worker(splittable):
    return run_worker("parallel_worker.py", splittable)


# ---- one process, one device -------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(data_parallel_size=-1), "data_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2.0), "tensor_parallel_size must be a positive integer"),
    (dict(enable_expert_parallel="yes"), "enable_expert_parallel must be true or false"),
])
def test_bad_options_are_named(kw, words):
    with pytest.raises(ConfigError, match=words):
        ParallelConfig(**kw)


def test_layout_checks_name_the_count_it_cannot_split(splittable):
    cfg = load_config(splittable)
    with pytest.raises(ConfigError, match=r"does not divide the model's attention heads \(num_attention_heads = 8\)"):
        ParallelConfig(tensor_parallel_size=3).check(cfg, 3)
    with pytest.raises(ConfigError, match=r"linear-attention key heads \(linear_num_key_heads = 4\)"):
        ParallelConfig(tensor_parallel_size=8).check(cfg, 8)
    with pytest.raises(ConfigError, match="does not divide the model's 4 routed experts"):
        ParallelConfig(tensor_parallel_size=8, enable_expert_parallel=True).check(
            load_config(make_checkpoint(os.path.join(os.path.dirname(splittable), "h16"), num_attention_heads=16,
                                        linear_num_key_heads=8, linear_num_value_heads=16, vocab_size=320)), 8)
    with pytest.raises(ConfigError, match=r"must equal the number of devices \(4\)"):
        ParallelConfig(tensor_parallel_size=2).check(cfg, 4)
    ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).check(cfg, 4)   # 2 KV heads: replicated


def test_more_devices_than_jax_has_is_an_error_before_any_weight(splittable, monkeypatch):
    import hybrid_jax.weights as w
    from hybrid_jax import LLM
    monkeypatch.setattr(w.CheckpointReader, "get", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(ConfigError, match=f"= 2 devices, but JAX sees {len(jax.devices())}"):
        LLM(model=splittable, tensor_parallel_size=2)


def test_rule_table_maps_logical_axes_and_names_what_it_cannot_split():
    tp = rules(ParallelConfig(tensor_parallel_size=4))
    ep = rules(ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True))
    mesh = {"data": 1, "model": 4}
    assert partition_spec(("embed", "heads"), (64, 128), tp, mesh, "w") == PartitionSpec(None, "model")
    assert partition_spec(("experts", "embed", "expert_mlp"), (4, 64, 64), tp, mesh, "w") == \
        PartitionSpec(None, None, "model")
    assert partition_spec(("experts", "embed", "expert_mlp"), (4, 64, 64), ep, mesh, "w") == \
        PartitionSpec("model", None, None)
    # 2 KV heads over 4 devices, and a vocabulary of 259: replicated (vLLM replicates the heads and pads
    # the vocabulary); a head dimension it cannot split is an error
    assert partition_spec((None, "kv_heads", None), (8, 2, 16), tp, mesh, "k") == PartitionSpec(None, None, None)
    assert partition_spec(("vocab", "embed"), (259, 64), tp, mesh, "embed") == PartitionSpec(None, None)
    assert partition_spec(("vocab", "embed"), (320, 64), tp, mesh, "embed") == PartitionSpec("model", None)
    with pytest.raises(ConfigError, match=r"layers/0/attn/o_proj: its heads dimension \(6\) is not divisible"):
        partition_spec(("heads", "embed"), (6, 64), tp, mesh, "layers/0/attn/o_proj")
    with pytest.raises(ConfigError, match="unknown logical axis 'head'"):
        partition_spec(("head",), (8,), tp, mesh, "w")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_every_parameter_has_logical_axes(name, splittable):
    """Every parameter leaf (MoE, dense MLP, MTP block, attention bias) matches a pattern of the family's
    table with one name per dimension: a new parameter without one fails here, not on a mesh."""
    import dataclasses

    from hybrid_jax.models.qwen3_next import init_params
    cfg = dataclasses.replace(load_config(splittable), attention_bias=True)
    params = jax.eval_shape(lambda: init_params(cfg))
    norm = params["final_norm"]
    params["mtp"] = {"fc": jax.ShapeDtypeStruct((2 * cfg.hidden_size, cfg.hidden_size), norm.dtype), "enorm": norm,
                     "hnorm": norm, "norm": norm, "layers": params["layers"][3:]}
    layout = Layout(ParallelConfig(), Mesh(jax.devices()[:1], ("model",)))
    shardings = layout.param_shardings(get_model(name), params)
    assert len(jax.tree_util.tree_leaves(shardings)) == len(jax.tree_util.tree_leaves(params))


# ---- 8 CPU devices, in a subprocess -----------------------------------------------------------------

@pytest.mark.parametrize("layout", ["tp2", "tp4", "tp4_ep"])
def test_split_model_generates_what_one_device_does(worker, layout):
    """Greedy tokens identical to one device, with the prefix cache (the second pass hits) and n-gram
    speculation on; log-probabilities equal to float32 rounding."""
    one, split = worker["tp1"], worker[layout]
    assert worker["devices"] == 8
    assert split["tokens"] == one["tokens"] and split["again"] == one["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2 and one["hits"] >= 2
    assert split["pools_keep_shardings"] is True          # donated step after step, never re-laid
    assert split["sharding_key"] != one["sharding_key"] == "replicated"


@pytest.mark.parametrize("layout, tp", [("tp2", 2), ("tp4", 4), ("tp4_ep", 4)])
def test_each_device_holds_its_share_of_the_weights(worker, layout, tp):
    w = worker[layout]["weights"]
    assert w["total"] == worker["tp1"]["weights"]["total"]
    assert w["device0"] == (w["total"] - w["replicated"]) // tp + w["replicated"]
    assert w["replicated"] < 0.1 * w["total"]            # norms, the router, the MTP-free rest is split


@pytest.mark.parametrize("layout", ["tp2", "tp4_ep"])
def test_weights_are_converted_on_the_host_and_sent_to_each_device_in_parts(worker, layout):
    """Loading a split model puts no weight on one device first: the conversion gives host weights and
    each device receives its own slices; all but the small re-laid ones (the conv taps' channel order,
    K | V per head) are read from the file by parts, fused projections and expert stacks included."""
    placed = worker[layout]["placed_from"]
    assert placed["device"] == 0 and placed["host"] + placed["by_parts"] == worker["tp1"]["weights"]["total"]
    assert placed["by_parts"] > 0.95 * worker["tp1"]["weights"]["total"]


@pytest.mark.parametrize("layout, heads", [("tp1", 2), ("tp2", 1), ("tp4_ep", 1)])
def test_each_device_holds_only_the_kv_heads_its_query_heads_read(worker, layout, heads):
    """2 KV heads: split over 2 devices; over 4, each head is kept twice and each device holds one copy
    (not both heads whole on every device)."""
    assert worker[layout]["kv_heads_on_device0"] == [heads]


def _dims(shape: str) -> tuple:
    return tuple(int(d) for d in shape[shape.index("[") + 1:shape.index("]")].split(",") if d)


@pytest.mark.parametrize("layout", ["tp2", "tp4_ep"])
def test_decode_step_gathers_no_weight_matrix(worker, splittable, layout):
    """The compiled decode program moves activations between devices, never a parameter: no all-gather
    has the shape of a split weight matrix. Partial sums of the hidden state are all-reduced at most
    twice a layer (the mixer's output projection, the MLP's or experts' down projection) and once for
    the vocabulary-split embedding; every other all-reduce is the sampler's, a number per row (the
    maximum, the chosen token, its log-probability over the split vocabulary)."""
    split = worker[layout]
    weights = {tuple(s) for s in split["split_weights"]}
    assert weights
    gathered = {_dims(shape) for kind, shape in split["collectives"] if kind == "all-gather"}
    assert not gathered & weights
    cfg = load_config(splittable)
    layers, rows, hidden = cfg.num_hidden_layers, 4, cfg.hidden_size
    reduced = [_dims(shape) for kind, shape in split["collectives"] if kind == "all-reduce"]
    hidden_sums = [d for d in reduced if d and d[-1] == hidden]
    assert layers <= len(hidden_sums) <= 2 * layers + 1
    assert all(math.prod(d) <= rows for d in reduced if d not in hidden_sums)


def test_bad_layouts_fail_before_loading_weights(worker):
    e = worker["errors"]
    assert "does not divide the model's attention heads (num_attention_heads = 8)" in e["tp3"]["message"]
    assert "16 devices, but JAX sees 8" in e["tp16"]["message"]
    assert "does not divide the model's attention heads (num_attention_heads = 8)" in e["dp2_tp3"]["message"]
    assert all(x["tensors_read"] == 0 for x in e.values())


def test_data_parallel_replicas_each_serve_on_their_own_devices(worker):
    """data_parallel_size 2 x tensor_parallel_size 4: two engines, on devices 0-3 and 4-7, each with its
    own copy of the weights; one prompt goes to each, the second pass to the replica that cached it;
    the greedy tokens of one device."""
    one, dp = worker["tp1"], worker["dp2_tp4"]
    assert dp["tokens"] == one["tokens"] and dp["again"] == one["tokens"]
    assert dp["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert dp["replica_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and one["replica_devices"] == [[0]]
    assert dp["routed"] == [2, 2] and dp["hits"] >= 2
    assert dp["sharding_key"] == "dp1.tp4"            # a replica's cache is a tensor-size-4 cache
    assert dp["weights"]["device0"] == (dp["weights"]["total"] - dp["weights"]["replicated"]) // 4 + \
        dp["weights"]["replicated"]
