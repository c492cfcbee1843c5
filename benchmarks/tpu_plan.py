"""Plans of real models on TPU slices, built by the TPU compiler on this CPU host (no TPU, no weights).

    python benchmarks/tpu_plan.py [qwen] [deepseek] [nemotron] [glm] [qwen4_exp]

- Qwen3-Next-80B-A3B-Instruct on v6e:2x4, tensor parallel over its 8 chips with expert parallelism:
  compiled for the 8 devices with the engine's layout (hybrid_jax.parallel: the rule table's shardings,
  the Pallas kernels per device, one copy of a KV head per device), so every figure is one chip's;
- DeepSeek-V3.2 (FP8 weights kept, as released) on the smallest v5p slice that holds it at 32k
  context, tensor parallel over its chips with expert parallelism, the same way: MLA heads and experts
  split, the FP8 codes with their block scales, the latent and indexer whole on every chip;
- NVIDIA-Nemotron-3-Nano-30B-A3B (bf16) on v6e:2x4, tensor parallel over its 8 chips with expert
  parallelism: Mamba2 heads split by whole groups (8 groups, one per chip), attention heads with each of
  its 2 KV heads kept on 4 chips, the relu2 experts whole;
- GLM-5 (DeepSeek-V3.2's family with GLM's shapes, FP8 as released) the same way (`glm`, not in the
  default set: its compile took 21 minutes on a loaded 2-core host);

- Qwen4-Exp (the reconstructed release config, bf16) on the smallest v5p slice that holds it, tensor
  parallel over its chips with expert parallelism (`qwen4_exp`, not in the default set): DeltaNet and
  attention heads split, each of its 2 KV heads kept on 4 chips, the 512 experts whole, the ~95 GiB PLE
  n-gram table split by rows; its minimum leaves that table out (a step gathers a few rows of it);

each at max_num_seqs 64 and 32k context: per-chip HBM, the batch that fits at 32k, decode bytes per step
against the minimum (weights + cache read once; the goal is <= 1.2x), the collectives of a decode step
and the modeled decode tok/s per chip. Both models are compiled with one layer of each kind and scaled
by the layer counts (hybrid_jax/plan/compile.py). Beside them, a figure MEASURED ELSEWHERE on real TPUs
by tpu-inference, for scale only.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybrid_jax.plan import CHIPS, format_plan, parse_topology, plan  # noqa: E402
from hybrid_jax.plan.planner import DTYPES, resolve_model  # noqa: E402
from hybrid_jax.plan.shapes import abstract_params, tree_nbytes  # noqa: E402

CONTEXT, SEQS = 32768, 64
# slices libtpu names, smallest first
SLICES = {"v6e": ("v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:4x8", "v6e:8x8", "v6e:8x16", "v6e:16x16"),
          "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8")}
PUBLISHED = ("tpu-inference (vLLM TPU), Qwen3.5-397B-A17B-FP8, 8k in / 1k out, concurrency 256: 3,161 output tok/s "
             "(tpu-inference issue 3050) -- MEASURED ELSEWHERE on real TPUs, not by this script")


def smallest_slice(model: str, quantization: str | None, chip: str) -> tuple[str, int]:
    """The first slice of `chip` whose chips hold the weights with at least a fifth of HBM left for cache
    and temporaries (an ideal split), and its chip count."""
    _, cfg = resolve_model(model)
    w = tree_nbytes(abstract_params(cfg, DTYPES["bfloat16"], quantization))
    for name in SLICES[chip]:
        n = parse_topology(name)[1]
        if w / n <= 0.8 * CHIPS[chip].hbm_bytes:
            return name, n
    raise SystemExit(f"{model} does not fit the largest {chip} slice")


def run(label: str, model: str, topo: str, n: int, quantization: str | None = None, ep: bool = False):
    t = time.perf_counter()
    p = plan(model, topo, tensor_parallel_size=n, enable_expert_parallel=ep, max_num_seqs=SEQS, max_model_len=CONTEXT,
             quantization=quantization, layers="reduced")
    print(f"==== {label} ({time.perf_counter() - t:.0f} s to compile and plan)")
    print(format_plan(p))
    print()
    return p


def main(argv: list[str]):
    """argv: which models to plan ("qwen", "deepseek", "nemotron", "glm", "qwen4_exp"; default all but glm and
    qwen4_exp)."""
    which = set(argv) or {"qwen", "deepseek", "nemotron"}
    rows = []
    if "qwen" in which:
        p = run("Qwen3-Next-80B-A3B on v6e:2x4, tp 8 + expert parallel", "qwen3_next_80b_a3b_instruct", "v6e:2x4", 8,
                ep=True)
        rows.append(("Qwen3-Next-80B-A3B bf16", p))
    if "deepseek" in which:
        topo, n = smallest_slice("deepseek_v32", "fp8", "v5p")
        p = run(f"DeepSeek-V3.2 FP8 on {topo} (smallest v5p slice holding it), tp {n} + expert parallel",
                "deepseek_v32", topo, n, "fp8", ep=True)
        rows.append(("DeepSeek-V3.2 fp8", p))
    if "nemotron" in which:
        p = run("Nemotron-3-Nano-30B-A3B on v6e:2x4, tp 8 + expert parallel", "nemotron_3_nano_30b_a3b", "v6e:2x4", 8,
                ep=True)
        rows.append(("Nemotron-3-Nano-30B bf16", p))
    if "glm" in which:
        topo, n = smallest_slice("glm_5", "fp8", "v5p")
        p = run(f"GLM-5 FP8 on {topo} (smallest v5p slice holding it), tp {n} + expert parallel", "glm_5", topo, n,
                "fp8", ep=True)
        rows.append(("GLM-5 fp8", p))
    if "qwen4_exp" in which:
        topo, n = smallest_slice("qwen4_exp_reconstructed", None, "v5p")
        p = run(f"Qwen4-Exp (reconstructed config) on {topo} (smallest v5p slice holding it), tp {n} + expert "
                f"parallel", "qwen4_exp_reconstructed", topo, n, ep=True)
        rows.append(("Qwen4-Exp bf16", p))
    print("==== summary (per chip; ESTIMATES from the TPU compiler's cost analysis and published chip peaks)")
    print(f"{'model':<26}{'slice':<11}{'split':<8}{'HBM used':>10}{'of':>8}{'batch@32k':>11}{'bytes/min':>11}"
          f"{'collectives':>13}{'decode tok/s/chip':>19}{'at min bytes':>14}")
    for label, p in rows:
        used = p.memory.capacity - p.memory.free
        coll = f"{p.roofline.decode_collectives:.0f}" if p.sharded else "-"
        print(f"{label:<26}{p.topology:<11}{'layout' if p.sharded else 'ideal':<8}{used / 2**30:>8.1f}Gi"
              f"{p.memory.capacity / 2**30:>6.1f}Gi{p.capacity.batch_at_context:>11}{p.roofline.bytes_over_min:>10.2f}"
              f"{'x*' if p.costs.decode.loops else 'x '}{coll:>13}"
              f"{p.roofline.decode_tok_s:>18,.0f}{p.roofline.decode_tok_s_at_min:>14,.0f}")
    print("split: 'layout' = compiled with the engine's sharding over the chips; 'ideal' = one chip's program / N")
    print("goal: decode bytes accessed <= 1.2x the minimum")
    if any(p.costs.decode.loops for _, p in rows):
        print("* the decode step runs loops (HLO while) whose iterations after the first the compiler's cost analysis "
              "does not count. Qwen3-Next's is the ragged attention kernel's metadata search over the sequences "
              "(searchsorted: negligible; the KV pages are read by the kernel, whose cost it reports). DeepSeek-V3.2's "
              "are searchsorted scans of 16 values over a 9-entry table inside its layers (negligible).")
    print()
    print("for scale:", PUBLISHED)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
