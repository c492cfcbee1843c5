"""Tensor, expert and data parallelism on CPU devices: per layout, what each device holds and what one
decode step moves between devices, read off the compiled program; the step time is for the record
only (8 CPU "devices" share this machine's cores: it is not a speed figure).

Runs itself in a child process that sees 8 CPU devices (XLA_FLAGS is set before jax is imported).
The model is the benchmark's tiny Qwen3-Next with head counts 2 and 4 divide (benchmarks/tiny_qwen3_next.py).
Per layout: device 0's parameter and cache-pool bytes against the totals, the collectives of the
engine's compiled decode program (count and bytes by kind): the all-reduces of the hidden state
against what the layout needs (one per row-parallel projection, two a layer: the mixer's output
projection and the MLP's / experts' down projection, and one for the vocabulary-split embedding),
and the sampler's all-reduces of a number per row over the split vocabulary apart. A data-parallel layout (dp2_tp4: two engines of 4 devices)
shows replica 0's figures: each replica is a tp4 engine; its step time is the pair's, 4 requests each.

    python benchmarks/parallel.py [--layouts tp1,tp2,tp4,tp4_ep,dp2_tp4] [--steps 32]
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = {"tp1": dict(tensor_parallel_size=1), "tp2": dict(tensor_parallel_size=2),
           "tp4": dict(tensor_parallel_size=4), "tp4_ep": dict(tensor_parallel_size=4, enable_expert_parallel=True),
           "dp2_tp4": dict(data_parallel_size=2, tensor_parallel_size=4)}
COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                        r"(?:-start)?\(")
ITEMSIZE = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2}


def device0_bytes(tree) -> tuple[int, int]:
    import jax  # noqa: PLC0415
    total = dev0 = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        total += leaf.size * leaf.dtype.itemsize
        dev0 += sum(s.data.size * s.data.dtype.itemsize for s in leaf.addressable_shards if s.device.id == 0)
    return total, dev0


def child(layouts: list[str], steps: int):
    import jax  # noqa: PLC0415
    sys.path.insert(0, HERE)
    from tiny_qwen3_next import CONFIG, write_checkpoint  # noqa: PLC0415

    from hybrid_jax import LLM, SamplingParams  # noqa: PLC0415
    from hybrid_jax.engine.data_parallel import DataParallelEngine  # noqa: PLC0415
    cfg = dict(CONFIG, num_attention_heads=8, linear_num_key_heads=4, linear_num_value_heads=8)
    path = write_checkpoint(os.path.join(tempfile.mkdtemp(), "m"), config=cfg)
    layers = cfg["num_hidden_layers"]
    print(f"tiny Qwen3-Next: {layers} layers, hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']} "
          f"(KV {cfg['num_key_value_heads']}), linear heads {cfg['linear_num_key_heads']} / "
          f"{cfg['linear_num_value_heads']}, {cfg['num_experts']} experts; {len(jax.devices())} CPU devices")
    print(f"{'layout':<8}{'weights/dev':>13}{'of total':>9}{'cache/dev':>12}{'of total':>9}  "
          f"{'hidden-sum':>11}{'(max)':>6}{'sampler':>8}{'all-gather':>11}{'permute':>9}{'other':>7}{'KiB moved':>11}"
          f"{'step ms':>9}")
    for name in layouts:
        llm = LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=8, **LAYOUTS[name])
        engine = llm.engine
        runner = (engine.replicas[0] if isinstance(engine, DataParallelEngine) else engine).runner
        seen = {}
        jitted = runner._decode

        def spy(*a, _j=jitted, **k):
            seen.setdefault("args", (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                                  if isinstance(x, jax.Array) else x, a), k))
            return _j(*a, **k)
        spy._cache_size = jitted._cache_size
        runner._decode = spy
        prompts = [{"prompt_token_ids": list(range(1 + i, 41 + i))} for i in range(8)]
        sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, sp)                                   # compile
        t = time.perf_counter()
        llm.generate(prompts, sp)
        ms = (time.perf_counter() - t) * 1e3 / steps
        runner._decode = jitted
        a, k = seen["args"]
        text = jitted.lower(*a, **k).compile().as_text()
        count, moved = collections.Counter(), 0
        for m in COLLECTIVE.finditer(text):
            dims = [int(d) for d in m.group(2).split(",") if d]
            kind = m.group(3)
            if kind == "all-reduce":          # of the hidden state, or the sampler's numbers per row
                kind = "hidden-sum" if dims and dims[-1] == cfg["hidden_size"] else "sampler-sum"
            count[kind] += 1
            moved += math.prod(dims) * ITEMSIZE.get(m.group(1), 4)
        wt, w0 = device0_bytes(llm.params)
        ct, c0 = device0_bytes(runner.cache)
        tp = LAYOUTS[name]["tensor_parallel_size"]
        other = sum(v for k2, v in count.items()
                    if k2 not in ("hidden-sum", "sampler-sum", "all-gather", "collective-permute"))
        print(f"{name:<8}{w0 / 1024:>11.0f}Ki{w0 / wt:>9.2f}{c0 / 1024:>10.0f}Ki{c0 / ct:>9.2f}  "
              f"{count['hidden-sum']:>11}{2 * layers + 1 if tp > 1 else 0:>6}{count['sampler-sum']:>8}"
              f"{count['all-gather']:>11}"
              f"{count['collective-permute']:>9}{other:>7}{moved / 1024:>11.1f}{ms:>9.2f}")
    print("(the decode program loops over its steps: its collectives are per step. hidden-sum: all-reduces of "
          "the hidden state; 'max': what the layout needs, one per row-parallel projection (two a layer) and one "
          "for the vocabulary-split embedding; XLA may merge some. sampler: all-reduces of a number per row over "
          "the split vocabulary. Step ms: 8 requests, CPU devices sharing 2 cores; for the record only.)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="tp1,tp2,tp4,tp4_ep,dp2_tp4")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.layouts.split(","), args.steps)
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--layouts", args.layouts,
                           "--steps", str(args.steps)], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
