"""MTP heads: the multi-token-prediction block of Qwen3-Next / Qwen3.5 (`mtp.*`), DeepSeek-V3.2 (layer
`num_hidden_layers`) and DeepSeek-V4 (the release's `mtp.0.*`) is loaded, and
`speculative_config={"method": "mtp"}` drafts with it in the engine. Greedy output equals plain
decoding (both rollbacks, chunked prefill, requests joining and leaving); on a checkpoint whose MTP
block is a copy of the target's attention layer fed the next token's embedding, drafts are
meaningful and mostly accepted. An MTP layout the loader does not know, a missing MTP tensor, or
method "mtp" on a checkpoint without the block each fail naming the problem.

The tiny checkpoints are written by transformers (which drops MTP weights) and get their MTP
tensors here, by hand, in the published layout."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import make_checkpoint
from release_formats import (
    load,
    quantize_release,
    read_config,
    save,
    with_mtp,
    with_v4_mtp,
    write_config,
)

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.errors import CheckpointError, InputError
from hybrid_jax.layers.linear import Fp8Weight

LIN, FULL = "linear_attention", "full_attention"


@pytest.fixture(scope="module")
def qwen_mtp(tmp_path_factory):
    """Qwen3-Next: [linear_attention (dense MLP), full_attention (MoE)], MTP layer = the MoE attention layer."""
    root = tmp_path_factory.mktemp("mtp")
    src = make_checkpoint(root / "src", seed=5, layer_types=[LIN, FULL], num_hidden_layers=2, mlp_only_layers=[0])
    return {"copy": with_mtp(src, str(root / "copy"), layer=1),
            "random": with_mtp(src, str(root / "random"), layer=1, mode="random"),
            "none": src, "root": root}


def _prompts(n, vocab=211, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(5, 40, n)]


def _engine(llm, **spec):
    return LLMEngine(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, decode_steps=1,
                                       compilation_cache_dir=None, warmup="none",
                                       speculative_config={"method": "mtp", **spec}))


def _mtp_equals_plain(llm, seed: int, n: int = 4, max_tokens: int = 12):
    """n prompts (token ids < 97), max_tokens greedy tokens each: the engine with the MTP drafter
    (K = 2 fixed) emits what plain decoding does. Returns (prompts, the tokens, the speculative stats)."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(n, vocab=97, seed=seed)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    eng = _engine(llm, num_speculative_tokens=2, dynamic_k=False)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    return prompts, want, eng.spec_stats()


def test_mtp_block_is_loaded(qwen_mtp):
    llm = LLM(model=qwen_mtp["copy"], max_model_len=128)
    mp, Hd = llm.params["mtp"], llm.config.hidden_size
    assert mp["fc"].shape == (2 * Hd, Hd) and len(mp["layers"]) == 1
    assert set(mp["layers"][0]) == {"input_norm", "post_norm", "attn", "moe"}
    np.testing.assert_array_equal(np.asarray(mp["fc"])[:Hd], np.eye(Hd))        # fc over [embedding | hidden]
    for a, b in zip(np.asarray(mp["layers"][0]["moe"]["down"]), np.asarray(llm.params["layers"][1]["moe"]["down"])):
        np.testing.assert_array_equal(a, b)
    assert "mtp" not in LLM(model=qwen_mtp["none"], max_model_len=128).params


@pytest.mark.parametrize("kind,rollback,k", [("copy", "selection", 3), ("copy", "replay", 2), ("random", "selection", 2)])
def test_mtp_greedy_output_equals_plain_decoding(qwen_mtp, kind, rollback, k):
    """Prompts longer than the token budget (chunked prefill), four requests sharing steps; the
    meaningful MTP block's drafts are mostly accepted."""
    llm = LLM(model=qwen_mtp[kind], max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in _prompts(5, seed=1)]
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    eng = _engine(llm, num_speculative_tokens=k, dynamic_k=False, rollback=rollback)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    st = eng.spec_stats()
    assert st["method"] == "mtp" and st["verify_steps"] > 0 and st["draft_tokens"] > 0
    if kind == "copy":
        assert st["acceptance_rate"] > 0.5, st
        assert st["mean_accepted_length"] > 1.5, st
    else:
        assert st["acceptance_rate"] < 0.5, st            # noise drafts: the copy's acceptance is the block's doing


def test_llm_with_method_mtp(qwen_mtp):
    """LLM(speculative_config={"method": "mtp"}) generates through the engine, dynamic K included."""
    plain = LLM(model=qwen_mtp["copy"], max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=2)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    llm = LLM(model=qwen_mtp["copy"], max_model_len=128, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    st = llm.spec_stats()
    assert st["enabled"] and st["method"] == "mtp" and st["accepted_tokens"] > 0
    sampled = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in sampled)


def test_fp8_release_mtp_block_stays_fp8(qwen_mtp):
    """An FP8 release quantizes the MTP block's linear weights like the rest (weight_scale_inv per
    128 x 128 block): with quantization="fp8" they stay FP8 on the device, and MTP drafting keeps the
    greedy output of the same model decoding plainly."""
    nc = ("lm_head", "model.embed_tokens", "mlp.gate", "mlp.shared_expert_gate")
    dst = str(qwen_mtp["root"] / "fp8")
    quantize_release(qwen_mtp["copy"], dst, fp8=lambda n, a: n.endswith(".weight") and a.ndim == 2 and not any(
        n.rsplit(".", 1)[0].endswith(x) for x in nc), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": list(nc)})
    llm = LLM(model=dst, max_model_len=128, quantization="fp8")
    mp = llm.params["mtp"]
    assert isinstance(mp["fc"], Fp8Weight) and isinstance(mp["layers"][0]["attn"]["o_proj"], Fp8Weight)
    prompts = [{"prompt_token_ids": p} for p in _prompts(2, seed=6)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    eng = _engine(llm, num_speculative_tokens=2, dynamic_k=False)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    assert eng.spec_stats()["accepted_tokens"] > 0


def test_mtp_errors(qwen_mtp):
    root = qwen_mtp["root"]
    with pytest.raises(InputError, match="method 'mtp' needs the checkpoint's multi-token-prediction block") as e:
        LLM(model=qwen_mtp["none"], max_model_len=128, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert qwen_mtp["none"] in str(e.value)
    with pytest.raises(InputError, match="only used with method 'draft_model'"):
        LLM(model=qwen_mtp["copy"], speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": "x"})
    bad = with_mtp(qwen_mtp["none"], str(root / "unknown"), layer=1, extra={"mtp.layers.0.mystery.weight": np.ones(4)})
    with pytest.raises(CheckpointError, match="mtp.layers.0.mystery.weight"):
        LLM(model=bad, max_model_len=128)
    missing = with_mtp(qwen_mtp["none"], str(root / "missing"), layer=1, drop=("mtp.norm.weight",))
    with pytest.raises(CheckpointError, match="mtp.norm.weight"):
        LLM(model=missing, max_model_len=128)
    no_fc = with_mtp(qwen_mtp["none"], str(root / "no_fc"), layer=1, drop=("mtp.fc.weight",))
    with pytest.raises(CheckpointError, match="MTP tensors"):
        LLM(model=no_fc, max_model_len=128)


# --- DeepSeek-V3.2: the MTP module as layer num_hidden_layers (enorm / hnorm / eh_proj / shared_head) ---

def with_deepseek_mtp(src: str, dst: str, *, mode: str = "copy", drop=(), extra=None, seed: int = 0) -> str:
    """src (DeepSeek-V3.2, two layers: dense, MoE) plus an MTP layer `model.layers.2.*` whose decoder
    layer is a copy of layer 1; mode "copy" silences layer 0 and makes enorm / eh_proj pass the next
    token's (RMS-1) embedding through, as in `with_mtp`."""
    t = load(src)
    cfg = read_config(src)
    n = cfg["num_hidden_layers"]
    Hd = cfg["hidden_size"]
    last, p = f"model.layers.{n - 1}.", f"model.layers.{n}."
    mtp = {p + k[len(last):]: v.copy() for k, v in t.items() if k.startswith(last)}
    rng = np.random.default_rng(seed)
    if mode == "copy":
        e = t["model.embed_tokens.weight"]
        rms = np.sqrt(np.mean(e * e, axis=1, keepdims=True))
        t["model.embed_tokens.weight"] = e / np.where(rms > 0, rms, 1.0)
        for k in list(t):
            if k.startswith("model.layers.") and not k.startswith(last) and k.endswith(("o_proj.weight",
                                                                                     "down_proj.weight")):
                t[k] = np.zeros_like(t[k])
        mtp[p + "eh_proj.weight"] = np.concatenate([np.eye(Hd), np.zeros((Hd, Hd))], axis=1).astype(np.float32)
        mtp[p + "enorm.weight"], mtp[p + "hnorm.weight"] = np.ones((Hd,), np.float32), np.ones((Hd,), np.float32)
        mtp[p + "shared_head.norm.weight"] = t["model.norm.weight"].copy()
    else:
        mtp[p + "eh_proj.weight"] = rng.normal(0, 0.05, (Hd, 2 * Hd)).astype(np.float32)
        for k in ("enorm", "hnorm", "shared_head.norm"):
            mtp[f"{p}{k}.weight"] = (1 + rng.normal(0, 0.1, (Hd,))).astype(np.float32)
    mtp[p + "shared_head.head.weight"] = t["lm_head.weight"].copy()
    mtp[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"].copy()
    for k in drop:
        mtp.pop(p + k)
    save(dst, {**t, **mtp, **(extra or {})})
    write_config(dst, cfg)
    return dst


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    from test_deepseek_v32 import make_checkpoint as make_deepseek  # noqa: PLC0415
    root = tmp_path_factory.mktemp("mtp_dsv32")
    src = make_deepseek(root / "src", seed=3, num_hidden_layers=2, first_k_dense_replace=1)
    return {"copy": with_deepseek_mtp(src, str(root / "copy")), "none": src, "root": root,
            "random": with_deepseek_mtp(src, str(root / "random"), mode="random")}


def test_deepseek_mtp_layer_is_loaded(deepseek_mtp):
    llm = LLM(model=deepseek_mtp["copy"], max_model_len=128)
    mp, Hd = llm.params["mtp"], llm.config.hidden_size
    assert mp["eh_proj"].shape == (2 * Hd, Hd) and set(mp["layers"][0]) == {"input_norm", "post_norm", "attn", "moe"}
    assert "head" not in mp and "embed" not in mp          # the release's copies of the shared head / embedding
    assert llm.config.num_hidden_layers == 2 and len(llm.params["layers"]) == 2
    root = deepseek_mtp["root"]
    other = with_deepseek_mtp(deepseek_mtp["none"], str(root / "own_head"), mode="random",
                              extra={"model.layers.2.shared_head.head.weight": np.ones((97, Hd), np.float32)})
    np.testing.assert_array_equal(np.asarray(LLM(model=other, max_model_len=128).params["mtp"]["head"]), 1.0)
    with pytest.raises(CheckpointError, match="model.layers.2.hnorm.weight"):
        LLM(model=with_deepseek_mtp(deepseek_mtp["none"], str(root / "missing"), drop=("hnorm.weight",)))
    with pytest.raises(CheckpointError, match="model.layers.2.mystery"):
        LLM(model=with_deepseek_mtp(deepseek_mtp["none"], str(root / "unknown"),
                                    extra={"model.layers.2.mystery": np.ones(3, np.float32)}))


@pytest.mark.parametrize("kind", ["copy", "random"])
def test_deepseek_mtp_greedy_output_equals_plain_decoding(deepseek_mtp, kind):
    llm = LLM(model=deepseek_mtp[kind], max_model_len=128)
    _, _, st = _mtp_equals_plain(llm, seed=4)
    assert st["verify_steps"] > 0 and st["draft_tokens"] > 0
    if kind == "copy":
        assert st["acceptance_rate"] > 0.5, st


def test_qwen3_5_mtp_block(tmp_path):
    """Qwen3.5's multimodal release keeps the text model under model.language_model.* and the MTP block
    (`mtp_num_hidden_layers: 1`) at the top level, `mtp.*`, in Qwen3-Next's layout."""
    from test_qwen3_5 import _write  # noqa: PLC0415
    src = _write(tmp_path / "src", moe=False, seed=0, tie=True)
    ckpt = with_mtp(src, str(tmp_path / "mtp"), prefix="model.language_model.", layer=2)
    llm = LLM(model=ckpt, max_model_len=128)
    assert set(llm.params["mtp"]["layers"][0]) == {"input_norm", "post_norm", "attn", "mlp"}
    _, _, st = _mtp_equals_plain(llm, seed=5, n=3)
    assert st["acceptance_rate"] > 0.5, st


# --- DeepSeek-V4: the release's `mtp.0.*` block (e_proj / h_proj / enorm / hnorm / norm / hc_head_*) ---

V4_MTP = dict(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "sliding_attention"],
              mlp_layer_types=["hash_moe", "moe"])


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    """test_deepseek_v4's model with two layers, [CSA (hash MoE), sliding window (Top-K MoE)], and an MTP
    block copied from the sliding-window layer (the published V4-Flash's MTP layer is sliding-window)."""
    from test_deepseek_v4 import make_checkpoint as make_v4  # noqa: PLC0415
    root = tmp_path_factory.mktemp("mtp_dsv4")
    src = make_v4(root / "src", seed=2, **V4_MTP)
    return {"copy": with_v4_mtp(src, str(root / "copy")), "none": src, "root": root,
            "random": with_v4_mtp(src, str(root / "random"), mode="random")}


def test_deepseek_v4_mtp_block_is_loaded(v4_mtp, caplog):
    """The `mtp.0.*` tensors become params["mtp"] (nothing dropped, nothing left unread); a missing or
    unknown MTP tensor and an MTP layer whose tensors disagree with config.json fail naming them."""
    import logging  # noqa: PLC0415

    import jax  # noqa: PLC0415
    with caplog.at_level(logging.WARNING, logger="hybrid_jax.speculative.mtp"):
        llm = LLM(model=v4_mtp["copy"], dtype="float32", max_model_len=128)
    assert "not loaded" not in caplog.text
    mp, Hd, N = llm.params["mtp"], llm.config.hidden_size, llm.config.hc_mult
    assert llm.config.mtp_layer_type == "sliding_attention" and len(llm.params["layers"]) == 2
    assert mp["e_proj"].shape == mp["h_proj"].shape == (Hd, Hd) and mp["hc_head"]["fn"].shape == (N * Hd, N)
    np.testing.assert_array_equal(np.asarray(mp["e_proj"]), np.eye(Hd))
    np.testing.assert_array_equal(np.asarray(mp["hc_head"]["fn"]), np.asarray(llm.params["hc_head"]["fn"]))
    (layer,) = mp["layers"]
    assert "bias" in layer["moe"] and "tid2eid" not in layer["moe"] and "c_kv" not in layer["attn"]
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), layer, llm.params["layers"][1])
    assert all(jax.tree.leaves(same))                        # every tensor of the copied layer, as loaded
    assert "mtp" not in LLM(model=v4_mtp["none"], max_model_len=128).params
    root, none = v4_mtp["root"], v4_mtp["none"]
    with pytest.raises(CheckpointError, match="mtp.0.hnorm.weight"):
        LLM(model=with_v4_mtp(none, str(root / "missing"), drop=("hnorm.weight",)))
    with pytest.raises(CheckpointError, match="mtp.0.ffn.mystery"):
        LLM(model=with_v4_mtp(none, str(root / "unknown"), extra={"mtp.0.ffn.mystery": np.ones(3, np.float32)}))
    with pytest.raises(CheckpointError, match="MTP tensors"):              # no e_proj: the block is not understood
        LLM(model=with_v4_mtp(none, str(root / "no_e_proj"), drop=("e_proj.weight",)))
    hca = {"layer_types": V4_MTP["layer_types"] + ["heavily_compressed_attention"]}
    with pytest.raises(CheckpointError, match="heavily_compressed_attention"):   # config: HCA; tensors: window only
        LLM(model=with_v4_mtp(none, str(root / "wrong_type"), config_update=hca))


@pytest.mark.parametrize("kind", ["copy", "random"])
def test_deepseek_v4_mtp_greedy_output_equals_plain_decoding(v4_mtp, kind):
    """float32; prompts longer than the token budget; K = 2 fixed. The copied block's drafts are mostly
    accepted, through LLM(speculative_config=...) as well as the engine."""
    llm = LLM(model=v4_mtp[kind], dtype="float32", max_model_len=128)
    prompts, want, st = _mtp_equals_plain(llm, seed=7)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert st["method"] == "mtp" and st["verify_steps"] > 0 and st["draft_tokens"] > 0
    assert st["rollback"] == "replay"        # V4's window ring and compressor tails: selection cannot restore them
    if kind == "copy":
        assert st["acceptance_rate"] > 0.5, st
        assert st["mean_accepted_length"] > 1.5, st
        spec = LLM(model=v4_mtp[kind], dtype="float32", max_model_len=128,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == want
        assert spec.spec_stats()["accepted_tokens"] > 0


def test_deepseek_v4_compressed_mtp_layer(v4_mtp):
    """An MTP layer with a compressor (config.json's entry num_hidden_layers of layer_types /
    compress_ratios: here HCA, rate 8, a copy of the target's HCA layer): its paged entries and tail
    live in the MTP state's one-layer cache; greedy output equals plain decoding, drafts are accepted."""
    from test_deepseek_v4 import make_checkpoint as make_v4  # noqa: PLC0415
    root = v4_mtp["root"]
    types = ["compressed_sparse_attention", "heavily_compressed_attention"]
    src = make_v4(root / "src_hca", seed=4, num_hidden_layers=2, layer_types=types,
                  mlp_layer_types=["hash_moe", "moe"])
    ckpt = with_v4_mtp(src, str(root / "hca"), config_update={"layer_types": types + [types[1]]})
    llm = LLM(model=ckpt, dtype="float32", max_model_len=128)
    assert llm.config.mtp_layer_type == "heavily_compressed_attention" and "c_kv" in llm.params["mtp"]["layers"][0]["attn"]
    _, _, st = _mtp_equals_plain(llm, seed=8, max_tokens=16)
    assert st["accepted_tokens"] > 0, st


def test_deepseek_v4_release_mtp_block_kept_in_fp8(v4_mtp):
    """The release's quantization covers the MTP block like the rest (FP8 with float8_e8m0fnu `.scale`
    blocks for attention, shared expert and e_proj / h_proj; FP4 routed experts; names unprefixed): with
    quantization="fp8" they stay FP8 on the device, and MTP drafting keeps the greedy output of the same
    model decoding plainly."""
    import re  # noqa: PLC0415

    from test_deepseek_release import V4_QUANT, v4_release_name  # noqa: PLC0415
    dst = str(v4_mtp["root"] / "fp8")
    quantize_release(v4_mtp["copy"], dst, v4_names=True, rename=v4_release_name,
                     quantization_config=V4_QUANT, config_update={"expert_dtype": "fp4"},
                     fp4=lambda n, a: re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", n) is not None,
                     fp8=lambda n, a: a.ndim == 2 and n.endswith(".weight") and "weights_proj" not in n and (
                         ".attn." in n or ".shared_experts." in n or n.endswith(("e_proj.weight", "h_proj.weight"))))
    assert "mtp.0.e_proj.scale" in load(dst)
    llm = LLM(model=dst, dtype="float32", max_model_len=128, quantization="fp8")
    mp = llm.params["mtp"]
    assert isinstance(mp["e_proj"], Fp8Weight) and isinstance(mp["layers"][0]["attn"]["q_a"], Fp8Weight)
    assert isinstance(mp["layers"][0]["moe"]["gate_up"], Fp8Weight)
    assert _mtp_equals_plain(llm, seed=9, n=2, max_tokens=10)[2]["accepted_tokens"] > 0
