"""Run by test_parallel.py and test_parallel_models.py in a subprocess that sees 8 CPU devices on one
core (multi_device.py; the rest of the suite keeps one device). Prints one JSON line "RESULT {...}" with, per
layout, what the test compares against one device.

    python parallel_worker.py CHECKPOINT_DIR [deepseek_v32 | glm_moe_dsa | deepseek_v4 | kimi_linear | nemotron_h | qwen4_exp | fp8 | disk DIRECTORY]
"""
from __future__ import annotations

import json
import re
import sys

from multi_device import eight_devices  # noqa: E402

eight_devices()

import jax  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.engine.data_parallel import DataParallelEngine  # noqa: E402
from hybrid_jax.errors import ConfigError  # noqa: E402

# tp2 splits the experts' columns (gate | up per device) and the KV heads; tp4 the same over 4 devices,
# each KV head kept twice (2 heads, 4 devices); tp4_ep splits the experts whole, the KV heads as tp4;
# dp2_tp4 runs two tp4 engines, on devices 0-3 and 4-7.
LAYOUTS = {"tp1": dict(tensor_parallel_size=1), "tp2": dict(tensor_parallel_size=2),
           "tp4": dict(tensor_parallel_size=4),
           "tp4_ep": dict(tensor_parallel_size=4, enable_expert_parallel=True),
           "dp2_tp4": dict(tensor_parallel_size=4, data_parallel_size=2)}
PROMPTS = [{"prompt_token_ids": [5, 9, 13, 200, 7, 41] * 12}, {"prompt_token_ids": [3, 4, 5, 6] * 20}]
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
COLLECTIVES = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def weight_bytes(llm) -> dict:
    """Bytes of the parameters: in all, on device 0, and of the leaves replicated on every device."""
    total = dev0 = replicated = 0
    for leaf in jax.tree_util.tree_leaves(llm.params):
        n = leaf.size * leaf.dtype.itemsize
        total += n
        dev0 += sum(s.data.size * s.data.dtype.itemsize for s in leaf.addressable_shards if s.device.id == 0)
        if leaf.sharding.is_fully_replicated:
            replicated += n
    return {"total": total, "device0": dev0, "replicated": replicated}


def whole_matrices(params) -> list:
    """The parameters of two or more dimensions held whole on every device, by path ("layers/*/attn/idx_k")."""
    from hybrid_jax.parallel.placement import path_name  # noqa: PLC0415
    return sorted({re.sub(r"/\d+/", "/*/", path_name(p)) for p, leaf in jax.tree_util.tree_leaves_with_path(params)
                   if leaf.ndim >= 2 and leaf.sharding.is_fully_replicated})


def decode_collectives(path: str, kw: dict) -> list:
    """(kind, "f32[1,2048]{0,1}") of every collective in the engine's compiled decode program (a
    plain engine: with speculation, decoding runs through the verify step)."""
    llm = LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=4, **kw)
    runner = llm.engine.runner
    seen = {}
    jitted = runner._decode

    def spy(*a, **k):
        seen.setdefault("args", (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                              if isinstance(x, jax.Array) else x, a), k))
        return jitted(*a, **k)
    runner._decode = spy
    try:
        # 4 rows: with 2 of 4 experts each, the MoE runs every expert densely (a lone row gathers its two)
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4 + i]} for i in range(4)],
                     SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        runner._decode = jitted
    a, k = seen["args"]
    text = jitted.lower(*a, **k).compile().as_text()
    return [(m.group(2), m.group(1)) for m in COLLECTIVES.finditer(text)]


def placed_from(build) -> tuple[object, dict]:
    """build()'s result and the bytes of the parameters it placed on the mesh by where they came from:
    weights read from the file by parts (each device's slice read alone), host arrays (each device
    receives its slice), or arrays already on one device."""
    import numpy as np  # noqa: PLC0415

    from hybrid_jax.lazy_weights import Lazy  # noqa: PLC0415
    from hybrid_jax.parallel import Layout  # noqa: PLC0415
    seen = {"by_parts": 0, "host": 0, "device": 0}
    put = Layout.put

    def spy(self, tree, shardings):
        for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Lazy)):
            kind = "by_parts" if isinstance(leaf, Lazy) else "host" if isinstance(leaf, np.ndarray) else "device"
            seen[kind] += leaf.size * leaf.dtype.itemsize
        return put(self, tree, shardings)
    Layout.put = spy
    try:
        return build(), seen
    finally:
        Layout.put = put


def run(path: str, layouts: dict = LAYOUTS, full: bool = True) -> dict:
    """Per layout: tokens, log-probabilities, prefix hits, placement; with `full`, also the decode
    program's collectives and the layouts that must be refused."""
    out = {"devices": len(jax.devices())}
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    for name, kw in layouts.items():
        llm, placed = placed_from(lambda kw=kw: LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=4,
                                                    enable_prefix_caching=True, speculative_config=SPEC, **kw))
        first = llm.generate(PROMPTS, sp)
        again = llm.generate(PROMPTS, sp)          # served from the prefix cache
        engine = llm.engine
        dp = isinstance(engine, DataParallelEngine)
        runner = engine.replicas[0].runner if dp else engine.runner
        kept = all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(jax.tree_util.tree_leaves(runner.cache),
                                                   jax.tree_util.tree_leaves(runner.cache_shardings))) \
            if runner.cache_shardings is not None else None
        out[name] = {
            "tokens": [o.outputs[0].token_ids for o in first], "again": [o.outputs[0].token_ids for o in again],
            "logprobs": [o.outputs[0].cumulative_logprob for o in first],
            "hits": llm.cache_stats()["hits"], "sharding_key": runner.layout.key if runner.layout else "replicated",
            "pools_keep_shardings": kept, "weights": weight_bytes(llm), "placed_from": placed,
            # KV heads each device's pages hold (the KV group's [L, P, ps, Hkv, D] shard on device 0)
            "kv_heads_on_device0": [next(sh.data.shape[3] for sh in g.k.addressable_shards if sh.device.id == 0)
                                    for g in runner.cache.groups.values() if g.kind == "full_kv"],
            # recurrent-state heads and conv channels of device 0's shard ([L, R, H, K, V], [L, R, W-1, C])
            "state_heads_on_device0": [[next(sh.data.shape[axis] for sh in a.addressable_shards if sh.device.id == 0)
                                        for a, axis in ((g.ssm, 2), (g.conv, 3))]
                                       for g in runner.cache.groups.values() if g.kind == "recurrent_state"],
            "split_weights": sorted({tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(llm.params)
                                     if leaf.ndim >= 2 and not leaf.sharding.is_fully_replicated}),
            "whole_matrices": whole_matrices(llm.params),
            "collectives": decode_collectives(path, kw) if name != "tp1" and full and not dp else [],
            "routed": engine.routed if dp else None,
            "replica_devices": [sorted({d.id for leaf in jax.tree_util.tree_leaves(r.params) for d in leaf.devices()})
                                for r in llm.replicas()],
        }
    if not full:
        return out
    errors = {}
    for name, kw in {"tp3": dict(tensor_parallel_size=3), "tp16": dict(tensor_parallel_size=16),
                     "dp2_tp3": dict(tensor_parallel_size=3, data_parallel_size=2)}.items():
        import hybrid_jax.weights as w  # noqa: PLC0415
        read = []
        orig = w.CheckpointReader.get
        w.CheckpointReader.get = lambda self, name, _o=orig: read.append(name) or _o(self, name)
        try:
            LLM(model=path, dtype="float32", **kw)
            errors[name] = None
        except ConfigError as e:
            errors[name] = {"message": str(e), "tensors_read": len(read)}
        finally:
            w.CheckpointReader.get = orig
    out["errors"] = errors
    return out


def disk_across_layouts(path: str, directory: str) -> dict:
    """Prompts served at tensor size 2 with a disk tier, then by a new engine at tensor size 4 (experts
    whole: each KV head kept twice) reading the same directory: tokens, spans restored, misses."""
    import numpy as np  # noqa: PLC0415
    rng = np.random.default_rng(7)
    system = rng.integers(0, 300, 100).tolist()
    prompts = [{"prompt_token_ids": system + rng.integers(0, 300, k).tolist()} for k in (9, 21)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = {"prefix_block_size": 16, "prefix_checkpoint_interval": 2, "warmup": "none"}
    out = {}
    for name, kw in {"tp2": LAYOUTS["tp2"], "tp4_ep": LAYOUTS["tp4_ep"]}.items():
        llm = LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=2, enable_prefix_caching=True,
                  kv_cache_dir=directory, engine_config=engine, **kw)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        llm.engine.prefix.disk.flush()
        st = llm.cache_stats()
        out[name] = {"tokens": tokens, "spans_restored": st["disk"]["spans_restored"], "writes": st["disk"]["writes"],
                     "misses": st["misses_by_reason"], "copies": [list(c) for c in llm.engine.runner.copies]}
    return out


def handoff_across_layouts(path: str, directory: str) -> dict:
    """Prefill at tensor size 4 (experts whole: each KV head kept twice) hands two prompts over to a decode
    engine at tensor size 2 through one directory: the receiver's tokens, handoffs taken, misses; and the
    tokens of one device serving alone."""
    import numpy as np  # noqa: PLC0415
    from cache.handoff import KVTransfer, wait_marker_blocking  # noqa: PLC0415
    rng = np.random.default_rng(11)
    prompts = [{"prompt_token_ids": rng.integers(0, 300, k).tolist()} for k in (90, 133)]
    engine = {"prefix_block_size": 16, "warmup": "none"}
    kw = dict(dtype="float32", max_model_len=256, max_num_seqs=2, enable_prefix_caching=True, kv_cache_dir=directory,
              engine_config=engine)
    sender = LLM(model=path, **kw, **LAYOUTS["tp4_ep"])
    marks = []
    for room, p in enumerate(prompts):
        sender.generate(p, SamplingParams(max_tokens=1, temperature=0.0, kv_transfer=KVTransfer("send", room)))
        marks.append(wait_marker_blocking(directory, room, 60.0))
    del sender
    receiver = LLM(model=path, **kw, **LAYOUTS["tp2"])
    tokens = [receiver.generate(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, kv_transfer=KVTransfer(
        "receive", m.room, m.end, m.key)))[0].outputs[0].token_ids for p, m in zip(prompts, marks)]
    st = receiver.cache_stats()
    alone = LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                                                   ignore_eos=True))]
    return {"tokens": tokens, "alone": want, "ends": [m.end for m in marks], "status": [m.status for m in marks],
            "received": st["disk"]["handoffs"]["received"], "misses": st["misses_by_reason"],
            "copies": [list(c) for c in receiver.engine.runner.copies]}


if __name__ == "__main__":
    # the DeepSeek families' tp4 split runs as dp2_tp4's two replicas (each compared with one device), not alone too
    if sys.argv[2:] == ["deepseek_v32"]:      # 4 heads, 8 experts: split over 2, and over 4 with experts whole
        result = run(sys.argv[1], {k: LAYOUTS[k] for k in ("tp1", "tp2", "tp4_ep", "dp2_tp4")}, full=False)
    elif sys.argv[2:] == ["glm_moe_dsa"]:     # GLM-5: DeepSeek-V3.2's layout (4 heads, 32 indexer heads, 8 experts)
        result = run(sys.argv[1], {k: LAYOUTS[k] for k in ("tp1", "tp2", "tp4_ep")}, full=False)
    elif sys.argv[2:] == ["fp8"]:             # an FP8 release kept in FP8, experts split whole
        result = run(sys.argv[1], {"tp1": dict(quantization="fp8"),
                                   "tp2_ep": dict(tensor_parallel_size=2, enable_expert_parallel=True,
                                                  quantization="fp8")}, full=False)
    elif sys.argv[2:] == ["deepseek_v4"]:     # 4 heads in 4 output groups, 32 indexer heads, 8 experts
        result = run(sys.argv[1], {k: LAYOUTS[k] for k in ("tp1", "tp2", "tp4_ep", "dp2_tp4")}, full=False)
    elif sys.argv[2:] == ["kimi_linear"]:     # 4 MLA heads, 4 KDA heads, 8 experts
        result = run(sys.argv[1], {k: LAYOUTS[k] for k in ("tp1", "tp2", "tp4", "tp4_ep")}, full=False)
    elif sys.argv[2:] == ["nemotron_h"]:      # 4 attention heads (2 KV), 8 Mamba2 heads in 4 groups, 8 experts
        result = run(sys.argv[1], {k: LAYOUTS[k] for k in ("tp1", "tp2", "tp4", "tp4_ep")}, full=False)
    elif sys.argv[2:] == ["qwen4_exp"]:       # 4 attention heads (2 KV), 4 / 8 DeltaNet heads, 8 experts
        result = run(sys.argv[1], {k: LAYOUTS[k] for k in ("tp1", "tp2", "tp4_ep")}, full=False)
    elif sys.argv[2:3] == ["handoff"]:        # prefill at tensor size 4 hands over to decode at 2
        result = handoff_across_layouts(sys.argv[1], sys.argv[3])
    elif sys.argv[2:3] == ["disk"]:           # a disk tier written at tensor size 2, read at 4
        result = disk_across_layouts(sys.argv[1], sys.argv[3])
    else:
        result = run(sys.argv[1])
    print("RESULT " + json.dumps(result))
