"""DeepSeek-V3.2, DeepSeek-V4, Kimi-Linear and an FP8 release (kept in FP8) split over 2 and 4 CPU devices and over
two replicas of 4 against one device, and a disk prefix tier written under one layout and read under another (parallel_worker.py in a
subprocess with 8 CPU devices, through multi_device.py)."""
from __future__ import annotations

import pytest
from conftest import make_checkpoint
from multi_device import run_worker
from test_parallel import SPLITTABLE


@pytest.fixture(scope="module")
def deepseek_worker(tmp_path_factory):
    from test_deepseek_v32 import make_checkpoint as make_v32  # noqa: PLC0415
    ckpt = make_v32(tmp_path_factory.mktemp("tp_v32") / "m", seed=5, vocab_size=320)
    return run_worker("parallel_worker.py", ckpt, "deepseek_v32")


@pytest.fixture(scope="module")
def fp8_worker(tmp_path_factory):
    from release_formats import quantize_release  # noqa: PLC0415
    from test_quantized_checkpoints import QWEN_FP8, SKIP, _fp8_selected  # noqa: PLC0415
    splittable = make_checkpoint(tmp_path_factory.mktemp("tp") / "m", seed=3, **SPLITTABLE)
    dst = str(tmp_path_factory.mktemp("tp_fp8") / "fp8")
    quantize_release(splittable, dst, fp8=_fp8_selected(SKIP), quantization_config=QWEN_FP8)
    return run_worker("parallel_worker.py", dst, "fp8")


def test_fp8_release_kept_in_fp8_splits_like_bf16(fp8_worker):
    """An FP8 release kept in FP8 over 2 devices with the experts whole on each: the greedy tokens of one
    device, FP8 codes split with their scales (the expert stacks) and read from the file by parts
    (no weight decoded whole on the host first), the cache prefix hits."""
    one, split = fp8_worker["tp1"], fp8_worker["tp2_ep"]
    placed = split["placed_from"]
    assert placed["device"] == 0 and placed["by_parts"] > 0.9 * (placed["by_parts"] + placed["host"])
    assert split["tokens"] == one["tokens"] and split["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2 and split["pools_keep_shardings"] is True
    assert split["weights"]["device0"] < 0.8 * split["weights"]["total"]


@pytest.mark.parametrize("layout", ["tp2", "tp4_ep", "dp2_tp4"])
def test_split_deepseek_v32_generates_what_one_device_does(deepseek_worker, layout):
    """MLA heads and indexer heads split (the sparse MLA kernel per device, the indexer's partial scores
    all-reduced before its Top-K), the latent and indexer keys whole on every device, experts split by
    columns or whole, and two such engines of 4 devices (data parallel): the greedy tokens of one device,
    with the prefix cache and n-gram speculation on."""
    one, split = deepseek_worker["tp1"], deepseek_worker[layout]
    assert split["tokens"] == one["tokens"] and split["again"] == one["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2
    assert split["pools_keep_shardings"] is True
    w = split["weights"]
    assert w["device0"] < 0.75 * w["total"]              # the heads' and experts' weights are split
    # the indexer splits by its heads (its Top-K sums the devices' scores); only the projections every
    # head shares, and the router, are whole
    assert split["whole_matrices"] == ["layers/*/attn/idx_k", "layers/*/attn/kv_a", "layers/*/attn/q_a",
                                       "layers/*/moe/router"]


def test_disk_tier_written_at_tensor_size_2_serves_tensor_size_4(tmp_path_factory):
    """Spans hold the logical cache (each KV head once), keyed without the layout: an engine at tensor
    size 4, whose pools keep each of the 2 KV heads twice, restores the spans written at tensor size 2
    and answers with the same tokens; nothing is refused."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("tp") / "m", seed=3, **SPLITTABLE)
    r = run_worker("parallel_worker.py", ckpt, "disk", tmp_path_factory.mktemp("kv_tier"))
    two, four = r["tp2"], r["tp4_ep"]
    assert two["writes"] >= 2 and two["spans_restored"] == 0 and two["copies"] == []
    assert [c[:2] + [c[3]] for c in four["copies"]] == [["full_attention", "k", 2], ["full_attention", "v", 2]]
    assert four["spans_restored"] >= 2 and four["tokens"] == two["tokens"]
    assert not any(v for k, v in four["misses"].items() if k != "no_hit")


def test_a_handoff_from_tensor_size_4_is_taken_at_tensor_size_2(tmp_path_factory):
    """Prefill/decode with different layouts: the handoff holds the logical cache (each KV head once), so a
    decode engine at tensor size 2 places what a prefill engine at tensor size 4 (KV heads kept twice) wrote
    and answers as one device alone; nothing is refused."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("tp") / "m", seed=5, **SPLITTABLE)
    r = run_worker("parallel_worker.py", ckpt, "handoff", tmp_path_factory.mktemp("handoffs"))
    assert r["status"] == ["ok", "ok"] and r["ends"] == [80, 128]      # the resume grid (16) before the last token
    assert r["received"] == 2 and r["tokens"] == r["alone"]
    assert not any(v for k, v in r["misses"].items() if k != "no_hit")


@pytest.fixture(scope="module")
def v4_worker(tmp_path_factory):
    from test_deepseek_v4 import make_checkpoint as make_v4  # noqa: PLC0415
    ckpt = make_v4(tmp_path_factory.mktemp("tp_v4") / "m", seed=5, vocab_size=320, o_groups=4)
    return run_worker("parallel_worker.py", ckpt, "deepseek_v4")


@pytest.mark.parametrize("layout", ["tp2", "tp4_ep", "dp2_tp4"])
def test_split_deepseek_v4_generates_what_one_device_does(v4_worker, layout):
    """DeepSeek-V4's query heads, sinks and output groups split (the compressed read per device), its
    indexer by heads, the shared K = V, window and compressed entries whole on every device, experts by
    columns or whole, and two such engines (data parallel): one device's greedy tokens, with the prefix
    cache and n-gram speculation on."""
    one, split = v4_worker["tp1"], v4_worker[layout]
    assert split["tokens"] == one["tokens"] and split["again"] == one["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2 and split["pools_keep_shardings"] is True
    w = split["weights"]
    assert w["device0"] < 0.75 * w["total"]
    assert split["whole_matrices"] == [
        "hc_head/fn", "layers/*/attn/c_bias", "layers/*/attn/c_gate", "layers/*/attn/c_kv", "layers/*/attn/i_bias",
        "layers/*/attn/i_gate", "layers/*/attn/i_kv", "layers/*/attn/kv", "layers/*/attn/q_a",
        "layers/*/attn_hc/fn", "layers/*/ffn_hc/fn", "layers/*/moe/router", "layers/*/moe/tid2eid"]


@pytest.fixture(scope="module")
def kimi_worker(tmp_path_factory):
    from test_kimi_linear import make_checkpoint as make_kimi  # noqa: PLC0415
    ckpt = make_kimi(tmp_path_factory.mktemp("tp_kimi") / "m", seed=5, vocab_size=320,
                     linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                         "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    return run_worker("parallel_worker.py", ckpt, "kimi_linear")


@pytest.mark.parametrize("layout", ["tp2", "tp4", "tp4_ep"])
def test_split_kimi_linear_generates_what_one_device_does(kimi_worker, layout):
    """KDA heads split (the conv and the recurrent state follow them), MLA heads split over the whole
    latent, experts by columns or whole: the greedy tokens of one device, with the prefix cache (KDA state
    checkpoints, latent pages) and n-gram speculation on."""
    one, split = kimi_worker["tp1"], kimi_worker[layout]
    assert split["tokens"] == one["tokens"] and split["again"] == one["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2 and split["pools_keep_shardings"] is True
    assert split["weights"]["device0"] < 0.75 * split["weights"]["total"]
    # only what every head shares stays whole: the low-rank gate inputs, the latent projection, the router
    assert split["whole_matrices"] == ["layers/*/attn/kv_a", "layers/*/kda/f_a", "layers/*/kda/g_a",
                                       "layers/*/moe/router"]


@pytest.fixture(scope="module")
def qwen4_worker(tmp_path_factory):
    from test_qwen4_exp import make_checkpoint as make_qwen4  # noqa: PLC0415
    ckpt = make_qwen4(tmp_path_factory.mktemp("tp_qwen4") / "m", seed=5, vocab_size=320, num_hidden_layers=4,
                      layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
                      ple_layer_ids=[1, 3], linear_num_key_heads=4, linear_num_value_heads=8, num_experts=8)
    return run_worker("parallel_worker.py", ckpt, "qwen4_exp")


@pytest.mark.parametrize("layout", ["tp2", "tp4_ep"])
def test_split_qwen4_exp_generates_what_one_device_does(qwen4_worker, layout):
    """Qwen4-Exp's DeltaNet and attention heads split (KV heads kept twice at tp 4), its experts by columns or
    whole, the PLE n-gram tables by rows (vocabulary-parallel gathers), the QSA index keys, PLE state and
    hyper-connections whole: one device's greedy tokens, with the prefix cache and n-gram speculation on."""
    one, split = qwen4_worker["tp1"], qwen4_worker[layout]
    assert split["tokens"] == one["tokens"] and split["again"] == one["again"] == one["tokens"]
    assert split["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-5)
    assert split["hits"] >= 2 and split["pools_keep_shardings"] is True
    assert split["weights"]["device0"] < 0.75 * split["weights"]["total"]
    # the PLE tables [rows, E / heads] are split by rows: 2 PLE layers, none whole
    assert not any(m.endswith("ple/table") for m in split["whole_matrices"])
    # whole on every device: the index projection (one shared key head), the router, and what reads every
    # hyper-connection stream (the streams' mixers and the PLE key / value / conv)
    hc = {f"layers/*/{b}_hc/{w}" for b in ("attn", "mlp") for w in ("down", "up", "inject")}
    assert set(split["whole_matrices"]) == hc | {"mixer/down", "mixer/up", "layers/*/attn/indexer/qk",
                                                 "layers/*/moe/in_proj", "layers/*/ple/key", "layers/*/ple/value",
                                                 "layers/*/ple/conv"}
