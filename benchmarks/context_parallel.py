"""Context-parallel prefill of one linear-attention layer, compiled by the TPU compiler on this CPU host.

    python benchmarks/context_parallel.py [--tokens 32768] [--topology v6e:2x4] [--rule gdn|kda|mamba2]

One long prompt's chunked rule (Qwen3-Next-80B's Gated DeltaNet shapes by default: 16 key heads, 32 value
heads, K = V = 128; KDA and Mamba2 at Kimi-Linear's and Nemotron-3-Nano's) is compiled for one chip of the
slice over all the tokens, and for every chip of the slice with the tokens split by position
(pallas_kernels/context_parallel.py: each chip runs its span with K extra value columns, one map per chip
is all-gathered, the outputs are corrected by a matmul). Both programs take the implementation a TPU takes
(impl="auto": the Pallas chunk kernels, compiled by Mosaic). Printed side by side, per chip, from the
compiler's cost analysis: FLOPs, HBM bytes, the roofline time at the chip's published peaks, and the
ratio of the split's time to one chip's. The roofline is an estimate, not a measurement, and leaves out
the collectives' time (their results are printed). Needs libtpu (pip install -e '.[tpu-aot]').
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from hybrid_jax.plan.chips import topology  # noqa: E402
from hybrid_jax.plan.compile import PLAN_COMPILER_OPTIONS, collectives_of  # noqa: E402
from pallas_kernels.aot import cost_of  # noqa: E402

# rule -> (H key heads, HV value heads, K, V, per-channel decay), a release's shapes
SHAPES = {"gdn": (16, 32, 128, 128, False),       # Qwen3-Next-80B-A3B
          "kda": (32, 32, 128, 128, True),        # Kimi-Linear-48B-A3B
          "mamba2": (8, 64, 128, 64, False)}      # Nemotron-3-Nano-30B-A3B (groups, heads, dstate, headdim)


def op(rule: str):
    """The rule's chunked op in the gated delta rule's argument order (Mamba2's through its rule arguments)."""
    if rule == "gdn":
        return lambda q, k, v, g, b, h, **kw: pk.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h,
                                                                         use_qk_l2norm_in_kernel=True, **kw)
    if rule == "kda":
        return lambda q, k, v, g, b, h, **kw: pk.chunk_kda(q, k, v, g, b, initial_state=h,
                                                            use_qk_l2norm_in_kernel=True, **kw)
    A = -jnp.ones((SHAPES["mamba2"][1],), jnp.float32)
    return lambda q, k, v, g, b, h, **kw: pk.chunk_mamba2(v, g, A, k, q, initial_state=h, **kw)


def args(rule: str, T: int):
    H, HV, K, V, per_channel = SHAPES[rule]
    S = jax.ShapeDtypeStruct
    if rule == "mamba2":     # x [1, T, HV, V], dt [1, T, HV], B / C [1, T, H, K]; state [1, HV, V, K]
        return (S((1, T, H, K), jnp.bfloat16), S((1, T, H, K), jnp.bfloat16), S((1, T, HV, V), jnp.bfloat16),
                S((1, T, HV), jnp.float32), S((1, T, HV), jnp.float32), S((1, HV, V, K), jnp.float32))
    g = S((1, T, HV, K) if per_channel else (1, T, HV), jnp.float32)
    return (S((1, T, H, K), jnp.bfloat16), S((1, T, H, K), jnp.bfloat16), S((1, T, HV, V), jnp.bfloat16), g,
            S((1, T, HV), jnp.float32), S((1, HV, K, V), jnp.float32))


def figures(compiled, chip):
    c = cost_of(compiled)
    n, nbytes = collectives_of(compiled.as_text())
    t = max(c.flops / chip.peak_bf16_flops, c.bytes_accessed / chip.hbm_bandwidth)
    return c.flops, c.bytes_accessed, t, n, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--topology", default="v6e:2x4")
    ap.add_argument("--rule", choices=sorted(SHAPES), default="gdn")
    a = ap.parse_args()
    topo = topology(a.topology)
    fn, shapes = op(a.rule), args(a.rule, a.tokens)
    tok = P(None, "cp")

    one = jax.jit(lambda *x: fn(*x, output_final_state=True)).lower(
        *(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.SingleDeviceSharding(topo.device))
          for s in shapes)).compile(PLAN_COMPILER_OPTIONS)
    mesh = Mesh(np.array(topo.devices), ("cp",))

    def span(q, k, v, g, b, h):
        return fn(q, k, v, g, b, h, output_final_state=True, context_axis="cp")
    specs = (tok,) * 5 + (P(),)
    split = jax.jit(jax.shard_map(span, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=False)).lower(
        *(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs))
    ).compile(PLAN_COMPILER_OPTIONS)

    f1, b1, t1, _, _ = figures(one, topo.chip)
    fs, bs, ts, n, nb = figures(split, topo.chip)
    print(f"{a.rule}: one prompt of {a.tokens} tokens, one layer, {topo.chip.name} peaks; per chip, compiled")
    print(f"{'':24s}{'FLOPs':>12s}{'HBM bytes':>14s}{'roofline ms':>14s}{'vs one chip':>14s}")
    print(f"{'one chip':24s}{f1:12.4g}{b1 / 2**30:10.3f} GiB{t1 * 1e3:14.3f}{1.0:14.3f}")
    print(f"{f'{topo.num_devices} chips, split':24s}{fs:12.4g}{bs / 2**30:10.3f} GiB{ts * 1e3:14.3f}{ts / t1:14.3f}")
    print(f"collectives of the split: {n} per layer, {nb / 2**20:.2f} MiB of results")


if __name__ == "__main__":
    main()
