"""FP8 weights kept on the device vs the same FP8 release dequantized to bf16 at load, side by side in
one run: the parameters' device bytes and the decode throughput of the on-device decode loop
(Generator), on the shared tiny Qwen3-Next (benchmarks/tiny_qwen3_next.py) written as an FP8 release
(every linear weight FP8 in 128 x 128 blocks; embeddings, LM head, routers and norms in bf16, as in
the Qwen -FP8 and DeepSeek releases).

Both models decode the same greedy tokens from the same prompts; the two run alternately, each
timing is the best of --repeats, and the ratio is the median of the back-to-back ratios. On CPU the
FP8 weights are decoded to bf16 inside every step (XLA:CPU has no FP8 matmul), so the FP8 column
pays that conversion; what it saves is memory.

Then MTP drafting (speculative_config method "mtp") on the same tiny model with an MTP block added
in the published layout (`mtp.*`), and on the tests' tiny DeepSeek-V4 with its release's `mtp.0.*`
block, two ways each: a random block (drafts are noise: the floor) and a copy of its last attention
layer fed the next token's embedding, with the other layers silenced (the tests' meaningful drafter,
`release_formats.with_mtp` / `with_v4_mtp`; a trained release's block is what this stands in for). Per row: acceptance rate, tokens emitted per verify, verify steps, and whether the greedy output
equals plain decoding, through the engine (fixed K, every decode step a verify), in float32.

    python benchmarks/quantized.py [--sections fp8,mtp] [--batch 1,8] [--steps 64] [--repeats 7] [--mtp-k 2]
                                   [--mtp-tokens 48] [--mtp-batch 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "hybrid_jax"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from cache_writes import decode, decode_engine  # noqa: E402
from release_formats import quantize_release, with_mtp, with_v4_mtp  # noqa: E402  (the tests' release writers)
from tiny_qwen3_next import CONFIG, write_checkpoint  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: E402
from hybrid_jax.layers.linear import Fp8Weight, weight_bytes  # noqa: E402

NOT_CONVERTED = ("lm_head", "model.embed_tokens", "mlp.gate", "mlp.shared_expert_gate")
V4_MTP = dict(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "sliding_attention"],
              mlp_layer_types=["hash_moe", "moe"])      # test_mtp's tiny V4


def fp8_release(root: str) -> str:
    src = write_checkpoint(os.path.join(root, "bf16"))
    dst = os.path.join(root, "fp8")
    quantize_release(src, dst, fp8=lambda n, a: n.endswith(".weight") and a.ndim == 2 and not any(
        n.rsplit(".", 1)[0].endswith(s) for s in NOT_CONVERTED),
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128], "modules_to_not_convert": list(NOT_CONVERTED)})
    return dst


def fp8_weights(params) -> list[Fp8Weight]:
    """The weights held in FP8 on the device."""
    return [x for x in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight))
            if isinstance(x, Fp8Weight)]


def mtp_rows(root: str, k: int, tokens: int, batch: int):
    """Acceptance and tokens per verify of MTP drafting on the tiny models with a random and a copied
    MTP block (see the module docstring); greedy output checked against plain decoding."""
    from test_deepseek_v4 import make_checkpoint as make_v4  # noqa: PLC0415  (the tests' tiny V4)
    src = write_checkpoint(os.path.join(root, "mtp_src"))
    last = max(i for i, t in enumerate(CONFIG["layer_types"]) if t == "full_attention")
    v4 = make_v4(os.path.join(root, "v4_src"), seed=2, **V4_MTP)
    models = {  # label -> (vocabulary, {kind: (row label, checkpoint)})
        "Qwen3-Next": (CONFIG["vocab_size"], {
            kind: (label, with_mtp(src, os.path.join(root, f"mtp_{kind}"), layer=last, mode=kind))
            for kind, label in (("random", "random (noise drafts)"), ("copy", f"copy of layer {last}"))}),
        "DeepSeek-V4": (97, {
            kind: (label, with_v4_mtp(v4, os.path.join(root, f"v4_mtp_{kind}"), mode=kind))
            for kind, label in (("random", "random (noise drafts)"), ("copy", "copy of layer 1 (window)"))})}
    print(f"MTP drafting (speculative_config method 'mtp', K = {k} fixed), tiny Qwen3-Next + an mtp.* block and "
          f"tiny DeepSeek-V4 (layers [CSA, sliding window], mHC x3) + an mtp.0.* block, run dtype float32 (in bf16 "
          f"a multi-token verify rounds differently from one-token decode, n-gram drafts included, so greedy ties "
          f"can flip), {batch} requests of {tokens} greedy tokens (16-token prompts), through the engine")
    print(f"   {'model':<12} {'MTP block':<26} {'acceptance':>10} {'tokens/verify':>13} {'verify steps':>12} "
          f"{'rollback':>9} {'identical':>9}")
    for name, (vocab, rows) in models.items():
        for label, path in rows.values():
            llm = LLM(model=path, dtype="float32", max_model_len=256)
            prompts = [{"prompt_token_ids": np.random.default_rng(i).integers(1, vocab, 16).tolist()}
                       for i in range(batch)]
            sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            eng = LLMEngine(llm, EngineConfig(max_num_seqs=batch, max_model_len=256, decode_steps=1, warmup="none",
                                              compilation_cache_dir=None, speculative_config={
                                                  "method": "mtp", "num_speculative_tokens": k, "dynamic_k": False}))
            got = [o.token_ids for o in eng.generate(prompts, sp)]
            st = eng.spec_stats()
            print(f"   {name:<12} {label:<26} {st['acceptance_rate']:>10.3f} {st['mean_accepted_length']:>13.2f} "
                  f"{st['verify_steps']:>12} {st['rollback']:>9} {str(got == want):>9}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mtp-k", type=int, default=2)
    ap.add_argument("--mtp-tokens", type=int, default=48)
    ap.add_argument("--mtp-batch", type=int, default=4)
    ap.add_argument("--sections", default="fp8,mtp", help="fp8: bf16 vs FP8-on-device; mtp: MTP drafting")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    if "fp8" in sections:
        fp8_section(args)
    if "mtp" in sections:
        mtp_rows(tempfile.mkdtemp(), args.mtp_k, args.mtp_tokens, args.mtp_batch)


def fp8_section(args):
    path = fp8_release(tempfile.mkdtemp())
    models = {"bf16": LLM(model=path, dtype="bfloat16"), "fp8": LLM(model=path, dtype="bfloat16", quantization="fp8")}
    total = {k: weight_bytes(m.params) for k, m in models.items()}
    held = fp8_weights(models["fp8"].params)
    n_held = sum(x.w.size for x in held)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; tiny Qwen3-Next FP8 release (128 x 128 blocks), "
          f"run dtype bf16; decode loop of {args.steps} steps after a 16-token prompt; best of {args.repeats}, "
          f"the two alternating; ratio = median of back-to-back ratios")
    print(f"device weight bytes: bf16 {total['bf16'] / 2**20:.3f} MiB, fp8 {total['fp8'] / 2**20:.3f} MiB "
          f"({total['fp8'] / total['bf16']:.3f}x); the {n_held} weights held in FP8: "
          f"{weight_bytes(held) / 2**20:.3f} MiB vs {2 * n_held / 2**20:.3f} MiB in bf16 "
          f"({weight_bytes(held) / (2 * n_held):.3f}x; the rest, embeddings / LM head / routers / norms, stays bf16)")
    print(f"   {'batch':>5} {'bf16 tok/s':>11} {'fp8 tok/s':>10} {'fp8/bf16':>9} {'identical':>9}")
    for B in (int(b) for b in args.batch.split(",")):
        prompt = np.random.default_rng(B).integers(1, models["bf16"].config.vocab_size, (B, 16)).astype(np.int32)
        cap = prompt.shape[1] + args.steps + 1
        engines = {k: decode_engine(m, B, cap, args.steps) for k, m in models.items()}
        outs = {k: decode(e, prompt, args.steps)[0] for k, e in engines.items()}      # compiles
        times = {k: [] for k in models}
        for _ in range(args.repeats):
            for k in models:
                times[k].append(decode(engines[k], prompt, args.steps)[1])
        rate = {k: B * args.steps / min(v) for k, v in times.items()}
        ratio = float(np.median([b / f for f, b in zip(times["fp8"], times["bf16"])]))
        same = np.array_equal(outs["bf16"], outs["fp8"])
        print(f"   {B:>5} {rate['bf16']:>11.0f} {rate['fp8']:>10.0f} {ratio:>8.2f}x {str(same):>9}")


if __name__ == "__main__":
    main()
