"""Writers of the published checkpoint formats, for tests: block-scaled FP8 (Hugging Face
`weight_scale_inv` float32 or DeepSeek-V4 `.scale` float8_e8m0fnu), DeepSeek-V4's packed FP4 experts,
and the comparison with transformers every format test makes.

The quantizers here are written from the format's definition (amax per block / the format's largest
value; e2m1 codes rounded to nearest, two per byte, low nibble first), independently of the loader's
decoder. `quantize_release` turns a checkpoint written by transformers into its quantized release and
returns the dequantized values, from which `write_reference` builds the float32 checkpoint
transformers runs as the reference.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)     # codes 0..7; bit 3 is the sign


def fp8_blocks(w: np.ndarray, block=(128, 128), pow2: bool = False):
    """w [..., O, I] -> (codes float8_e4m3fn [..., O, I], scale float32 [..., ceil(O/bo), ceil(I/bi)]):
    scale = amax of the block / 448 (pow2: rounded up to a power of two, DeepSeek's ue8m0)."""
    *lead, O, I = w.shape
    bo, bi = block
    nbo, nbi = math.ceil(O / bo), math.ceil(I / bi)
    scale = np.zeros((*lead, nbo, nbi), np.float32)
    codes = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(nbo):
        for j in range(nbi):
            blk = w[..., i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].astype(np.float32)
            s = np.max(np.abs(blk), axis=(-2, -1)) / E4M3_MAX
            s = np.where(s == 0, 1.0, s)
            if pow2:
                s = 2.0 ** np.ceil(np.log2(s))
            scale[..., i, j] = s
            codes[..., i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk / s[..., None, None]).astype(
                ml_dtypes.float8_e4m3fn)
    return codes, scale


def fp8_dequantize(codes: np.ndarray, scale: np.ndarray, block=(128, 128)) -> np.ndarray:
    """The reference decoding, block by block."""
    out = codes.astype(np.float32)
    bo, bi = block
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            out[..., i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] *= scale[..., i, j, None, None].astype(np.float32)
    return out


def fp4_blocks(w: np.ndarray):
    """w [..., O, I] (I even) -> (packed int8 [..., O, I/2] low nibble first, scale float8_e8m0fnu
    [..., O, ceil(I/32)], values float32 [..., O, I] they decode to)."""
    *lead, O, I = w.shape
    nb = math.ceil(I / 32)
    scale = np.zeros((*lead, O, nb), np.float32)
    codes = np.zeros(w.shape, np.uint8)
    values = np.zeros(w.shape, np.float32)
    for j in range(nb):
        blk = w[..., j * 32:(j + 1) * 32].astype(np.float32)
        s = 2.0 ** np.ceil(np.log2(np.maximum(np.max(np.abs(blk), axis=-1), 1e-30) / 6.0))
        scale[..., j] = s
        mag = np.abs(blk) / s[..., None]
        idx = np.argmin(np.abs(mag[..., None] - E2M1), axis=-1).astype(np.uint8)
        sign = (blk < 0) & (idx > 0)
        codes[..., j * 32:(j + 1) * 32] = idx | (sign.astype(np.uint8) << 3)
        values[..., j * 32:(j + 1) * 32] = np.where(sign, -1.0, 1.0) * E2M1[idx] * s[..., None]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, scale.astype(ml_dtypes.float8_e8m0fnu), values


def _torch(a: np.ndarray) -> torch.Tensor:
    views = {np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
             np.dtype(ml_dtypes.float8_e8m0fnu): torch.float8_e8m0fnu}
    if a.dtype in views:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(views[a.dtype])
    return torch.from_numpy(np.ascontiguousarray(a))


def save(path: str, tensors: dict[str, np.ndarray]):
    os.makedirs(path, exist_ok=True)
    save_file({k: _torch(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})


def load(path: str) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in load_file(os.path.join(path, "model.safetensors")).items()}


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def write_config(path: str, cfg: dict):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def quantize_release(src: str, dst: str, *, fp8=lambda name, a: False, fp4=lambda name, a: False,
                     block=(128, 128), v4_names: bool = False, rename=lambda name: name,
                     quantization_config: dict | None = None, config_update: dict | None = None):
    """Writes src's tensors to dst with fp8(name, array) ones as FP8 blocks and fp4(name, array) ones as
    packed FP4; scales beside them as `<name>_scale_inv` float32 (Hugging Face) or, with v4_names,
    `<module>.scale` float8_e8m0fnu (power-of-two scales). `rename` maps every tensor name (release
    layouts); config.json gets quantization_config (and config_update, where None removes a key). Returns {src name: the
    float32 values the release decodes to}."""
    tensors, out, values = load(src), {}, {}
    for name, a in tensors.items():
        new = rename(name)
        scale_name = (new[:-len(".weight")] + ".scale") if v4_names else new + "_scale_inv"
        if fp4(name, a):
            packed, scale, values[name] = fp4_blocks(a)
            out[new], out[scale_name] = packed, scale
        elif fp8(name, a):
            codes, scale = fp8_blocks(a, block, pow2=v4_names)
            values[name] = fp8_dequantize(codes, scale, block)
            out[new] = codes
            out[scale_name] = scale.astype(ml_dtypes.float8_e8m0fnu) if v4_names else scale
        else:
            out[new] = a
            values[name] = a
    save(dst, out)
    cfg = read_config(src)
    cfg.update(config_update or {})
    cfg = {k: v for k, v in cfg.items() if v is not None or k not in (config_update or {})}   # None: removed
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    write_config(dst, cfg)
    return values


def write_reference(src: str, values: dict[str, np.ndarray], dst: str, config_update: dict | None = None):
    """A float32 copy of src (transformers' names and config) holding `values`."""
    save(dst, {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in values.items()})
    cfg = read_config(src)
    cfg.update(config_update or {})
    write_config(dst, cfg)
    for f in ("generation_config.json",):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))


def hf_load(path: str):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_matches_transformers(llm, hf, lengths=(7, 300), n_tokens: int = 16, tol: float = 1e-4, seed: int = 0):
    """For a short and a long prompt: every position's logits within `tol` of transformers', and
    n_tokens greedy tokens identical to transformers' generate."""
    from hybrid_jax import SamplingParams  # noqa: PLC0415
    vocab = llm.config.vocab_size
    prompts = [prompt(n, vocab, seed + n) for n in lengths]
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        err = np.max(np.abs(llm.logits(ids) - ref))
        assert err < tol, f"T={len(ids)}: max abs logit error {err:.3e}"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
    for ids, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
        assert o.outputs[0].token_ids == ref[0, len(ids):].tolist(), f"greedy tokens differ for T={len(ids)}"


def with_mtp(src: str, dst: str, *, prefix: str = "model.", layer: int, mode: str = "copy", drop=(), extra=None,
             seed: int = 0) -> str:
    """src's tensors plus an MTP block `mtp.*` (Qwen3-Next / Qwen3.5 layout) whose decoder layer is a copy
    of layer `layer`. mode "copy": a meaningful drafter: every layer but `layer` is silenced (its
    outputs zeroed, so the target is that one attention layer over the embeddings), the embedding rows
    get RMS 1 and fc passes the (normalised) embedding of the next token through, so the block computes
    what the target computes one position later. mode "random": fc and norms random (drafts are noise).
    drop: MTP tensors left out; extra: tensors added."""
    t = load(src)
    Hd = t[prefix + "embed_tokens.weight"].shape[1]
    rng = np.random.default_rng(seed)
    lp = f"{prefix}layers.{layer}."
    mtp = {"mtp." + "layers.0." + k[len(lp):]: v.copy() for k, v in t.items() if k.startswith(lp)}
    if mode == "copy":
        e = t[prefix + "embed_tokens.weight"]
        rms = np.sqrt(np.mean(e * e, axis=1, keepdims=True))
        t[prefix + "embed_tokens.weight"] = e / np.where(rms > 0, rms, 1.0)       # a zero (padding) row stays
        for k in list(t):
            if k.startswith(prefix + "layers.") and not k.startswith(lp) and (
                    k.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "down_proj"))):
                t[k] = np.zeros_like(t[k])
        mtp["mtp.fc.weight"] = np.concatenate([np.eye(Hd), np.zeros((Hd, Hd))], axis=1).astype(np.float32)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            mtp[f"mtp.{n}.weight"] = np.zeros((Hd,), np.float32)          # zero-centred: scale 1
        mtp["mtp.norm.weight"] = t[prefix + "norm.weight"].copy()
    else:
        mtp["mtp.fc.weight"] = rng.normal(0, 0.05, (Hd, 2 * Hd)).astype(np.float32)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            mtp[f"mtp.{n}.weight"] = rng.normal(0, 0.1, (Hd,)).astype(np.float32)
    for k in drop:
        mtp.pop(k)
    save(dst, {**t, **mtp, **(extra or {})})
    write_config(dst, read_config(src))
    for f in os.listdir(src):
        if f not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return dst


def with_v4_mtp(src: str, dst: str, *, mode: str = "copy", drop=(), extra=None, seed: int = 0,
                config_update: dict | None = None) -> str:
    """src (a DeepSeek-V4 checkpoint written by transformers, which drops MTP weights) plus the MTP block
    in the release's layout, `mtp.0.*`: e_proj, h_proj, enorm, hnorm, norm, hc_head_fn / base / scale,
    and a decoder layer in the release's names (`attn.*` with `attn.kv_norm`, `ffn.*`, `hc_attn_*`, ...)
    copied from the last layer. mode "copy": a meaningful drafter: every other layer is silenced
    (attention output and experts' down projections zeroed, so the target is its last layer over the
    embedding broadcast to the mHC streams), the embedding rows get RMS 1, e_proj passes the next
    token's embedding through and h_proj is zero, and the hyper head and norm are the target's, so the
    block computes what the target computes one position later. mode "random": projections, norms and
    hyper head random (drafts are noise). drop: MTP tensors left out (names after `mtp.0.`); extra:
    tensors added; config_update: config.json keys set."""
    t = load(src)
    cfg = read_config(src)
    n, Hd, N = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["hc_mult"]
    last = f"model.layers.{n - 1}."
    mtp = {"mtp.0." + k[len(last):].replace("attn.norm.weight", "attn.kv_norm.weight"): v.copy()
           for k, v in t.items() if k.startswith(last)}
    rng = np.random.default_rng(seed)
    if mode == "copy":
        e = t["model.embed_tokens.weight"]
        t["model.embed_tokens.weight"] = e / np.sqrt(np.mean(e * e, axis=1, keepdims=True))
        for k in list(t):
            if k.startswith("model.layers.") and not k.startswith(last) and k.endswith(("attn.wo_b.weight",
                                                                                     "w2.weight")):
                t[k] = np.zeros_like(t[k])
        mtp["mtp.0.e_proj.weight"] = np.eye(Hd, dtype=np.float32)
        mtp["mtp.0.h_proj.weight"] = np.zeros((Hd, Hd), np.float32)
        mtp["mtp.0.enorm.weight"], mtp["mtp.0.hnorm.weight"] = np.ones((Hd,), np.float32), np.ones((Hd,), np.float32)
        mtp["mtp.0.norm.weight"] = t["model.norm.weight"].copy()
        for x in ("fn", "base", "scale"):
            mtp[f"mtp.0.hc_head_{x}"] = t[f"model.hc_head.hc_{x}"].copy()
    else:
        for x in ("e_proj", "h_proj"):
            mtp[f"mtp.0.{x}.weight"] = rng.normal(0, 0.2, (Hd, Hd)).astype(np.float32)
        for x in ("enorm", "hnorm", "norm"):
            mtp[f"mtp.0.{x}.weight"] = (1 + rng.normal(0, 0.1, (Hd,))).astype(np.float32)
        mtp["mtp.0.hc_head_fn"] = rng.normal(0, 0.05, (N, N * Hd)).astype(np.float32)
        mtp["mtp.0.hc_head_base"] = rng.normal(0, 0.1, (N,)).astype(np.float32)
        mtp["mtp.0.hc_head_scale"] = np.ones((1,), np.float32)
    for k in drop:
        mtp.pop("mtp.0." + k)
    save(dst, {**t, **mtp, **(extra or {})})
    write_config(dst, {**cfg, **(config_update or {})})
    for f in os.listdir(src):
        if f not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return dst
