"""Run by test_parallel_ops.py in a subprocess that sees 8 CPU devices (on one core: multi_device.py): the ops that run per device under a
layout (`hybrid_jax.parallel.context.per_device`) against the same op on one device. Prints one JSON
line "RESULT {...}": per case, the largest relative difference and what the compiled program holds.

    python per_device_worker.py
"""
from __future__ import annotations

import json
import sys

from multi_device import eight_devices  # noqa: E402

eight_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from hybrid_jax.layers.attention import ragged_read  # noqa: E402
from hybrid_jax.layers.gated_deltanet import _rule  # noqa: E402
from hybrid_jax.layers.mlp import routed_experts  # noqa: E402
from hybrid_jax.parallel import Layout, ParallelConfig, build_mesh  # noqa: E402
from hybrid_jax.parallel.context import active, per_device  # noqa: E402

import pallas_kernels  # noqa: E402

RNG = np.random.default_rng(0)


def rand(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale, jnp.float32)


def layout(tp: int, ep: bool = False) -> Layout:
    pc = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep)
    return Layout(pc, build_mesh(pc, jax.devices()[:tp]))


def split_run(lay: Layout, fn, args, axes):
    """fn(*args) jitted with each argument placed by its logical axes (None: replicated), traced with
    `lay` current. Returns (output, HLO text of the compiled program); the text ends with a line saying
    whether the lowered program has a per-device (manual) computation."""
    placed = [jax.device_put(a, NamedSharding(lay.mesh, lay.spec(ax, a.shape, "arg")) if ax else lay.replicated)
              for a, ax in zip(args, axes)]
    jitted = jax.jit(fn)
    with active(lay):
        out = jitted(*placed)
        lowered = jitted.lower(*placed)
    manual = "manual_computation" in lowered.as_text() or "SPMDFullToShardShape" in lowered.as_text()
    return out, lowered.compile().as_text() + f"\nPER_DEVICE {manual}"


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def gdn_cases() -> dict:
    """The chunked and fused-recurrent gated delta rule (Pallas kernels, interpreted here) per device on
    2 of 4 key heads with their 4 of 8 value heads, against one device."""
    B, T, H, HV, K, V = 2, 37, 4, 8, 16, 16
    q, k = rand(B, T, H, K), rand(B, T, H, K)
    v = rand(B, T, HV, V)
    g = -jnp.abs(rand(B, T, HV, scale=0.1))
    beta = jax.nn.sigmoid(rand(B, T, HV))
    s0 = rand(B, HV, K, V, scale=0.1)
    axes = [(None, None, "heads", None)] * 3 + [(None, None, "heads")] * 2 + [(None, "heads", None, None)]
    out = {}
    for name, kernel in (("chunk", pallas_kernels.chunk_gated_delta_rule),
                         ("fused_recurrent", pallas_kernels.fused_recurrent_gated_delta_rule)):
        def fn(q, k, v, g, beta, s0, kernel=kernel):
            return _rule(kernel, q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=True, impl="pallas")
        ref = jax.jit(fn)(q, k, v, g, beta, s0)
        got, text = split_run(layout(2), fn, (q, k, v, g, beta, s0), axes)
        out[name] = {"rel": max(rel(got[0], ref[0]), rel(got[1], ref[1])),
                     "state_sharding": str(got[1].sharding.spec), "per_device": "PER_DEVICE True" in text,
                     "all_gathers": text.count(" all-gather(") + text.count(" all-gather-start(")}
    return out


def attention_case() -> dict:
    """The ragged paged attention (Pallas, interpreted) on 2 query heads per device of 8 with 2 KV heads:
    at tensor size 4 the pages are whole on every device and each reads its own KV head."""
    Hq, Hkv, D, P, ps = 8, 2, 16, 12, 8
    kv_lens = jnp.array([13, 30, 5], jnp.int32)
    q_lens = np.array([4, 1, 5])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    N = int(q_lens.sum())
    q = rand(N, Hq, D)
    kp, vp = rand(P, ps, Hkv, D), rand(P, ps, Hkv, D)
    table = jnp.asarray(RNG.permutation(P)[:12].reshape(3, 4), jnp.int32)

    def fn(q, kp, vp, kv_lens, table, cu):
        return ragged_read(q, kp, vp, kv_lens, table, cu, sm_scale=D ** -0.5, impl="pallas")
    ref = jax.jit(fn)(q, kp, vp, kv_lens, table, cu)
    out = {}
    for tp in (2, 4):
        kv_axes = (None, None, "kv_heads", None)
        got, text = split_run(layout(tp), fn, (q, kp, vp, kv_lens, table, cu),
                              [(None, "heads", None), kv_axes, kv_axes, None, None, None])
        # the same pools as layer 1 of a stack of 2, read in place
        def stacked(q, ks, vs, kv_lens, table, cu):
            return ragged_read(q, ks, vs, kv_lens, table, cu, sm_scale=D ** -0.5, impl="pallas", layer=1)
        stack_axes = (None,) + kv_axes
        got_stacked, _ = split_run(layout(tp), stacked, (q, jnp.stack([vp, kp]), jnp.stack([kp, vp]), kv_lens, table, cu),
                                   [(None, "heads", None), stack_axes, stack_axes, None, None, None])
        out[f"tp{tp}"] = {"rel": rel(got, ref), "kv_split": layout(tp).spec(kv_axes, kp.shape, "kv")[2] is not None,
                          "per_device": "PER_DEVICE True" in text, "stacked_rel": rel(got_stacked, ref)}
    return out


def moe_cases() -> dict:
    """Routed experts with the experts split whole over 4 devices, each form (gather, dense, sorted):
    the same output as one device, and no all-gather of an expert weight."""
    Hd, I = 32, 24
    out = {}
    for name, (M, k, E) in {"gather": (3, 2, 16), "dense": (40, 2, 8), "sorted": (64, 2, 16)}.items():
        x = rand(M, Hd)
        idx = jnp.asarray(np.stack([RNG.choice(E, k, replace=False) for _ in range(M)]), jnp.int32)
        w = jax.nn.softmax(rand(M, k), axis=-1)
        gu, dn = rand(E, Hd, 2 * I, scale=0.2), rand(E, I, Hd, scale=0.2)
        ref = jax.jit(routed_experts)(x, idx, w, gu, dn)
        got, text = split_run(layout(4, ep=True), routed_experts, (x, idx, w, gu, dn),
                              [None, None, None, ("experts", None, None), ("experts", None, None)])
        out[name] = {"rel": rel(got, ref), "per_device": "PER_DEVICE True" in text, "all_reduces": text.count(" all-reduce(") + text.count(" all-reduce-start("),
                     "all_gathers": text.count(" all-gather(") + text.count(" all-gather-start(")}
    return out


def fp8_cases() -> dict:
    """An FP8 linear (codes and 128 x 128 block scales split alike) per device on 2 devices, columns split
    (output split) and rows split (partial sums all-reduced), against one device."""
    import dataclasses  # noqa: PLC0415

    from hybrid_jax.layers.linear import Fp8Weight, linear  # noqa: PLC0415
    x = rand(5, 512)
    codes = jnp.asarray(RNG.standard_normal((512, 768)) * 8, jnp.float8_e4m3fn)      # codes and per-block scales
    scale = jnp.asarray(RNG.uniform(0.001, 0.01, (4, 6)), jnp.float32)
    w = Fp8Weight(w=codes, scale=scale, block=(128, 128))
    ref = jax.jit(linear)(x, w)
    lay = layout(2)
    out = {}
    for name, axes in (("columns", ("embed", "heads")), ("rows", ("heads", "embed"))):
        wa = dataclasses.replace(w, axes=lay.fp8_axes(axes, w, name))
        shard = dataclasses.replace(wa, w=NamedSharding(lay.mesh, lay.spec(wa.axes, codes.shape, "w")),
                                    scale=NamedSharding(lay.mesh, lay.spec(wa.axes, scale.shape, "s")))
        placed = jax.device_put(wa, shard)
        with active(lay):
            jitted = jax.jit(linear)
            got = jitted(jax.device_put(x, lay.replicated), placed)
            text = jitted.lower(jax.device_put(x, lay.replicated), placed).as_text()
        out[name] = {"rel": rel(got, ref), "axes": list(wa.axes), "per_device": "manual_computation" in text
                     or "SPMDFullToShardShape" in text, "codes_on_device0": list(placed.w.addressable_shards[0].data.shape)}
    return out


def indexer_cases() -> dict:
    """The DSA indexer's Top-K with its 8 heads split over 4 devices (each scores the keys with its 2
    heads; the partial scores are all-reduced before the selection), every implementation and the ragged
    form, against one device: the same selected keys, on every device."""
    from pallas_kernels.sparse_attention import indexer_topk  # noqa: PLC0415
    from pallas_kernels.sparse_attention.ragged import indexer_topk_ragged  # noqa: PLC0415
    from hybrid_jax.parallel.context import MODEL  # noqa: PLC0415
    B, T, H, D, P, ps, K = 2, 3, 8, 16, 10, 8, 12
    q, w = rand(B, T, H, D), jax.nn.softmax(rand(B, T, H), axis=-1)
    keys = rand(P, ps, D)
    table = jnp.asarray(RNG.permutation(P)[:8].reshape(2, 4), jnp.int32)
    kv_len = jnp.array([29, 17], jnp.int32)
    qpos = kv_len[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]
    lay = layout(4)
    axes = [(None, None, "heads", None), (None, None, "heads"), None, None, None, None]
    out = {}
    for impl in ("reference", "xla", "pallas"):
        ref = jax.jit(lambda *a, impl=impl: indexer_topk(*a, topk=K, impl=impl))(q, w, keys, table, qpos, kv_len)

        def fn(q, w, keys, table, qpos, kv_len, impl=impl):
            return per_device(lambda *a: indexer_topk(*a, topk=K, impl=impl, head_axis=MODEL),
                              tuple(axes), None)(q, w, keys, table, qpos, kv_len)
        got, text = split_run(lay, fn, (q, w, keys, table, qpos, kv_len), axes)
        shards = [np.sort(np.asarray(s.data), axis=-1).tolist() for s in got.addressable_shards]
        out[impl] = {"same": np.array_equal(np.sort(np.asarray(got), -1), np.sort(np.asarray(ref), -1)),
                     "devices_agree": all(x == shards[0] for x in shards), "per_device": "PER_DEVICE True" in text,
                     "all_reduces": text.count(" all-reduce(") + text.count(" all-reduce-start("),
                     "q_gathered": any(f"f32[{B},{T},{H},{D}]" in line for line in text.splitlines()
                                       if "all-gather" in line)}
    # ragged: the two rows' three tokens back to back
    cu = jnp.array([0, T, 2 * T], jnp.int32)
    ragged_axes = [(None, "heads", None), (None, "heads"), None, None, None, None]
    ref = jax.jit(lambda *a: indexer_topk_ragged(*a, topk=K, impl="xla", max_q_len=T))(
        q.reshape(B * T, H, D), w.reshape(B * T, H), keys, table, cu, kv_len)

    def rfn(q, w, keys, table, cu, kv_len):
        return per_device(lambda *a: indexer_topk_ragged(*a, topk=K, impl="xla", max_q_len=T, head_axis=MODEL),
                          tuple(ragged_axes), None)(q, w, keys, table, cu, kv_len)
    got, text = split_run(lay, rfn, (q.reshape(B * T, H, D), w.reshape(B * T, H), keys, table, cu, kv_len), ragged_axes)
    out["ragged"] = {"same": np.array_equal(np.sort(np.asarray(got), -1), np.sort(np.asarray(ref), -1)),
                     "per_device": "PER_DEVICE True" in text, "devices_agree": True,
                     "all_reduces": text.count(" all-reduce(") + text.count(" all-reduce-start("), "q_gathered": False}
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps({"devices": len(jax.devices()), "gdn": gdn_cases(), "attention": attention_case(),
                                  "moe": moe_cases(), "fp8": fp8_cases(), "indexer": indexer_cases()}))
    sys.stdout.flush()
