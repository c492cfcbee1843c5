"""Worker of test_context_parallel.py, on 8 CPU devices: each chunked rule (Gated DeltaNet, KDA, Mamba2)
over one device and context-parallel over 8 (`context_axis`), for batches of whole rows and packed
batches whose sequences start, end and pass through the spans; prints one RESULT line of relative RMS
errors (one device's output and final states against the split's), keyed "<rule>/<batch>/<impl>"."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybrid_jax"))
from multi_device import eight_devices  # noqa: E402

eight_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_kernels.gated_delta_rule.ops import chunk_gated_delta_rule  # noqa: E402
from pallas_kernels.kda.ops import chunk_kda  # noqa: E402
from pallas_kernels.mamba2.ops import chunk_mamba2  # noqa: E402

SPAN = 40                   # positions per device: not a multiple of the chunk (32), so spans cut chunks
T = 8 * SPAN
# packed batches: a sequence through four spans, an empty one, one ending at the packed tail's padding;
# then boundaries on the spans' edges (a sequence ending and one starting at a span's first position)
PACKED = {"packed": [0, 5, 5, 130, 131, 300, 310], "edges": [0, 40, 40, 200, 320]}
TOK = P(None, "cp")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def delta_inputs(rng, B, per_channel, dtype, H=2, HV=4, K=16, V=16):
    f = (lambda *s: jnp.asarray(rng.standard_normal(s), dtype))
    g = -0.1 * np.abs(rng.standard_normal((B, T, HV) + ((K,) if per_channel else ())))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, HV))))
    return (f(B, T, H, K), f(B, T, H, K), f(B, T, HV, V), jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32))


def compare(op, token_args, fixed, cu, n_states, state_shape, rng, **kw):
    """One device against 8, and (control) 8 devices each scanning its span alone from the initial state."""
    h0 = jnp.asarray(rng.standard_normal((n_states,) + state_shape), jnp.float32)
    cuj = None if cu is None else jnp.asarray(cu, jnp.int32)
    o1, f1 = op(*token_args, *fixed, initial_state=h0, cu_seqlens=cuj, output_final_state=True, **kw)
    mesh = Mesh(np.array(jax.devices()), ("cp",))
    specs = (TOK,) * len(token_args) + (P(), None if cu is None else P())
    out = {}
    for label, axis in (("split", "cp"), ("unjoined", None)):
        def body(*a, axis=axis):
            *toks, h, c = a
            if axis is None:          # the control: no state carried between the spans
                c = None if c is None else jnp.clip(c - jax.lax.axis_index("cp") * SPAN, 0, SPAN)
                o, _ = op(*toks, *fixed, initial_state=h, cu_seqlens=c, output_final_state=True, **kw)
                return o, h
            return op(*toks, *fixed, initial_state=h, cu_seqlens=c, output_final_state=True, context_axis=axis, **kw)
        o8, f8 = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(TOK, P()), check_vma=False))(
            *token_args, h0, cuj)
        out[label] = {"o": rel(o8, o1), "final": rel(f8, f1)}
    return out


def main():
    rng = np.random.default_rng(0)
    res = {}
    batches = [("rows", None)] + list(PACKED.items())
    for name, op, per_channel in (("gdn", chunk_gated_delta_rule, False), ("kda", chunk_kda, True)):
        for batch, cu in batches:
            for impl in ("xla", "pallas") if name == "gdn" and batch == "packed" else ("xla",):
                B = 2 if cu is None else 1
                res[f"{name}/{batch}/{impl}"] = compare(
                    op, delta_inputs(rng, B, per_channel, jnp.float32), (), cu, B if cu is None else len(cu) - 1,
                    (4, 16, 16), rng, use_qk_l2norm_in_kernel=True, impl=impl)
    res["gdn/rows-bf16/xla"] = compare(chunk_gated_delta_rule, delta_inputs(rng, 2, False, jnp.bfloat16), (), None, 2,
                                       (4, 16, 16), rng, use_qk_l2norm_in_kernel=True, impl="xla")
    H, Pd, G, Ns = 4, 8, 2, 16
    A = jnp.asarray(-np.exp(rng.standard_normal(H)), jnp.float32)
    D, dt_bias = (jnp.asarray(rng.standard_normal(H), jnp.float32) for _ in range(2))
    for batch, cu in batches:
        B = 2 if cu is None else 1
        f = (lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32))
        x, dt, Bm, Cm = f(B, T, H, Pd), f(B, T, H), f(B, T, G, Ns), f(B, T, G, Ns)

        def mamba(x, dt, Bm, Cm, **kw):
            return chunk_mamba2(x, dt, A, Bm, Cm, D=D, dt_bias=dt_bias, dt_softplus=True, **kw)
        res[f"mamba2/{batch}/xla"] = compare(mamba, (x, dt, Bm, Cm), (), cu, B if cu is None else len(cu) - 1,
                                             (H, Pd, Ns), rng, impl="xla")
    res["split_over"] = whole_arrays(rng)
    print("RESULT " + json.dumps(res))


def whole_arrays(rng) -> dict:
    """`split_over`: the GDN rule (XLA) as a function of whole arrays, on the packed batch; and its error
    for a length 8 devices do not divide."""
    from pallas_kernels.context_parallel import split_over  # noqa: PLC0415
    from pallas_kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_xla  # noqa: PLC0415

    def rule(q, k, v, g, beta, h0, cu, final=True):
        return chunk_gated_delta_rule_xla(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=final,
                                          use_qk_l2norm_in_kernel=True)   # unit keys: a contracting rule
    cu = jnp.asarray(PACKED["packed"], jnp.int32)
    args = delta_inputs(rng, 1, False, jnp.float32) + (jnp.asarray(rng.standard_normal((6, 4, 16, 16)), jnp.float32), cu)
    o1, f1 = rule(*args)
    run = split_over(rule, Mesh(np.array(jax.devices()), ("cp",)), "cp")
    o8, f8 = jax.jit(run)(*args)
    try:
        run(*(a[:, :T - 4] for a in args[:5]), *args[5:])
        err = "no error"
    except ValueError as e:
        err = str(e)
    return {"o": rel(o8, o1), "final": rel(f8, f1), "indivisible": err}


if __name__ == "__main__":
    main()
