"""Mamba2's SSD rule (pallas_kernels.mamba2): every implementation (reference, chunked and recurrent XLA,
both Pallas kernels in interpret mode) against a float64 recurrence written in Mamba2's own terms
(mamba2_float64.py), on awkward shapes: T = 1, T not a multiple of the chunk, groups < heads, state size !=
head dim, a head that forgets within a token, packed batches with an empty and a one-token sequence.
Relative RMS error <= 1e-5 in float32 (the bound of the GDN / KDA tests), <= 1e-2 for bf16 outputs of bf16
inputs (the reference gets the same rounded inputs). Then: state carry-over (one call == two calls split
anywhere), pooled decode rows, per-token states / updates, input errors, transformers' NemotronH torch
reference on random inputs, and Mosaic compiling the TPU kernels at Nemotron-H's shapes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mamba2_float64 import inputs, reference, rel_rms

from pallas_kernels import abi, chunk_mamba2, fused_recurrent_mamba2, state_after
from pallas_kernels.mamba2.common import TimeStep, time_step

F32_TOL, BF16_TOL = 1e-5, 1e-2
CHUNK_IMPLS = ["reference", "xla", "pallas"]
ALL = [(chunk_mamba2, i) for i in CHUNK_IMPLS] + [(fused_recurrent_mamba2, i) for i in CHUNK_IMPLS[1:]]
ALL_IDS = [f"{'chunk' if op is chunk_mamba2 else 'recurrent'}-{i}" for op, i in ALL]


def _jnp(d, dtype=jnp.float32):
    """The inputs as arrays: x, B, C in dtype; dt, A, D, dt_bias float32."""
    return {k: jnp.asarray(v).astype(dtype if k in ("x", "B", "C") else jnp.float32) for k, v in d.items()}


def _rounded(d, dtype):
    return {k: np.asarray(jnp.asarray(v).astype(dtype).astype(jnp.float32)) if k in ("x", "B", "C") else v
            for k, v in d.items()}


def run(op, impl, d, h0=None, dtype=jnp.float32, **kw):
    a = _jnp(d, dtype)
    return op(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True,
              initial_state=None if h0 is None else jnp.asarray(h0), output_final_state=True, impl=impl, **kw)


@pytest.mark.parametrize("op, impl", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("T", [1, 37, 75])
def test_matches_the_float64_recurrence(op, impl, T):
    """B = 2 rows, 4 heads over 2 groups, state size 16 != head dim 8, an initial state."""
    d, h0 = inputs(B=2, T=T, H=4, G=2, P=8, N=16, seed=T)
    y, s = run(op, impl, d, h0)
    y64, s64 = reference(**d, h0=h0)
    assert y.shape == (2, T, 4, 8) and y.dtype == jnp.float32
    assert s.shape == (2, 4, 8, 16) and s.dtype == jnp.float32        # [N, H, headdim, dstate]
    assert rel_rms(y, y64) <= F32_TOL, rel_rms(y, y64)
    assert rel_rms(s, s64) <= F32_TOL, rel_rms(s, s64)


@pytest.mark.parametrize("op, impl", ALL, ids=ALL_IDS)
def test_bf16_inputs_and_no_initial_state(op, impl):
    d, _ = inputs(B=1, T=40, H=4, G=1, P=16, N=8, seed=2)
    y, s = run(op, impl, d, dtype=jnp.bfloat16)
    y64, s64 = reference(**_rounded(d, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_rms(y, y64) <= BF16_TOL and rel_rms(s, s64) <= 10 * F32_TOL


# Packed batch: sequences of 5, 0 (empty), 1, 40 and 37 tokens, then 3 tokens of no sequence (T = 86).
CU = (0, 5, 5, 6, 46, 83)
T_VARLEN = 86


@pytest.mark.parametrize("op, impl", ALL, ids=ALL_IDS)
def test_packed_sequences(op, impl):
    """Each sequence starts from its own initial state; the empty one keeps it; tokens past the last give 0."""
    d, h0 = inputs(B=1, T=T_VARLEN, H=4, G=2, P=8, N=16, seed=4, n_states=len(CU) - 1)
    y, s = run(op, impl, d, h0, cu_seqlens=jnp.asarray(CU, jnp.int32))
    y64, s64 = reference(**d, h0=h0, cu_seqlens=CU)
    assert s.shape == (len(CU) - 1, 4, 8, 16)
    assert rel_rms(y, y64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL, (rel_rms(y, y64), rel_rms(s, s64))
    assert not np.any(np.asarray(y[:, CU[-1]:]))
    np.testing.assert_array_equal(s[1], h0[1])


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_chunk_sizes(impl, chunk_size):
    d, h0 = inputs(B=1, T=75, H=2, G=2, P=8, N=8, seed=5)
    y, s = run(chunk_mamba2, impl, d, h0, chunk_size=chunk_size)
    y64, s64 = reference(**d, h0=h0)
    assert rel_rms(y, y64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL


@pytest.mark.parametrize("split", [1, 16, 31, 32, 33, 60])
def test_state_carries_over_a_split(split):
    """Prefill up to `split` (chunked, XLA and Pallas), then the rest by either form: the outputs and the
    final state are one call's over all 61 tokens."""
    T = 61
    d, h0 = inputs(B=2, T=T, H=4, G=2, P=8, N=16, seed=6)
    y_all, s_all = run(chunk_mamba2, "reference", d, h0)
    part = lambda a, b: {k: (v[:, a:b] if v.ndim >= 3 else v) for k, v in d.items()}  # noqa: E731
    for first, second in ((chunk_mamba2, chunk_mamba2), (chunk_mamba2, fused_recurrent_mamba2),
                          (fused_recurrent_mamba2, chunk_mamba2)):
        for impl in ("xla", "pallas"):
            y1, s1 = run(first, impl, part(0, split), h0)
            y2, s2 = run(second, impl, part(split, T), s1)
            y = jnp.concatenate([y1, y2], axis=1)
            assert rel_rms(y, y_all) <= F32_TOL and rel_rms(s2, s_all) <= F32_TOL, (first, second, impl)


@pytest.mark.parametrize("impl", CHUNK_IMPLS)
def test_per_token_states_and_updates(impl):
    """output_all_states: the state after every token; output_deltas: the updates dt x, from which
    state_after rebuilds the state after any token (a speculative verify's rollback)."""
    d, h0 = inputs(B=2, T=5, H=4, G=2, P=8, N=16, seed=7)
    _, _, states = run(fused_recurrent_mamba2, impl, d, h0, output_all_states=True)
    _, s, deltas = run(fused_recurrent_mamba2, impl, d, h0, output_deltas=True)
    for t in range(5):
        s64 = reference(**{k: (v[:, :t + 1] if v.ndim >= 3 else v) for k, v in d.items()}, h0=h0)[1]
        assert rel_rms(states[:, t], s64) <= F32_TOL
    dt = time_step(jnp.asarray(d["dt"]), jnp.asarray(d["dt_bias"]), TimeStep(softplus=True))
    np.testing.assert_allclose(deltas, dt[..., None] * d["x"], rtol=1e-6, atol=1e-6)
    idx = jnp.asarray([1, 4], jnp.int32)
    rebuilt = state_after(jnp.swapaxes(jnp.asarray(h0), -1, -2), jnp.asarray(d["B"]), dt * jnp.asarray(d["A"]), deltas,
                          idx)                                  # the gated delta rule's [K, V] = [dstate, headdim]
    assert rel_rms(jnp.swapaxes(rebuilt, -1, -2), states[jnp.arange(2), idx]) <= F32_TOL


@pytest.mark.parametrize("impl", CHUNK_IMPLS)
def test_pooled_decode_updates_only_its_rows(impl):
    """state_indices: row b reads and writes pool[rows[b]]; the other rows are left as they were."""
    d, _ = inputs(B=3, T=1, H=4, G=2, P=8, N=16, seed=8)
    pool = jnp.asarray(np.random.default_rng(8).standard_normal((6, 4, 8, 16)), jnp.float32)
    rows = jnp.asarray([4, 0, 2], jnp.int32)
    y, new_pool = run(fused_recurrent_mamba2, impl, d, pool, state_indices=rows)
    y64, s64 = reference(**d, h0=np.asarray(pool)[np.asarray(rows)])
    assert rel_rms(y, y64) <= F32_TOL and rel_rms(new_pool[rows], s64) <= F32_TOL
    for untouched in (1, 3, 5):
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_time_step_limit_clamps():
    """dt_limit clamps the softplus'd step (transformers' time_step_limit) in every implementation."""
    d, h0 = inputs(B=1, T=20, H=2, G=1, P=8, N=8, seed=9)
    limit = (0.05, 0.3)
    y64, s64 = reference(**d, h0=h0, limit=limit)
    assert rel_rms(reference(**d, h0=h0)[0], y64) > 0.05       # the clamp changes the result
    for op, impl in ALL:
        y, s = run(op, impl, d, h0, dt_limit=limit)
        assert rel_rms(y, y64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL, (op, impl)


def test_abi_is_its_own():
    assert abi.get("mamba2_ssd") is abi.MAMBA2_SSD
    assert abi.MAMBA2_SSD.id != abi.GATED_DELTA_RULE.id


@pytest.mark.parametrize("bad, match", [
    (dict(dt=np.zeros((1, 8, 3), np.float32)), r"dt must be \[B, T, H\]"),
    (dict(A=np.zeros((3,), np.float32)), r"A must be \[H\]"),
    (dict(B=np.zeros((1, 8, 3, 16), np.float32), C=np.zeros((1, 8, 3, 16), np.float32)),
     r"must be a multiple of the groups G=3"),
    (dict(C=np.zeros((1, 8, 2, 8), np.float32)), r"B and C must both be \[B, T, G, N\]"),
    (dict(D=np.zeros((2,), np.float32)), r"D must be \[H\]"),
])
def test_bad_shapes_are_named(bad, match):
    d, _ = inputs(B=1, T=8, H=4, G=2, P=8, N=16)
    d.update(bad)
    for op in (chunk_mamba2, fused_recurrent_mamba2):
        with pytest.raises(ValueError, match=match):
            run(op, "xla", d)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, headdim, dstate\]"):
        run(chunk_mamba2, "xla", inputs(B=1, T=8, H=4, G=2, P=8, N=16)[0], np.zeros((1, 4, 16, 8), np.float32))


# ---------------------------------------------------------------- transformers' NemotronH torch reference

def _torch_ssd():
    pytest.importorskip("torch")
    nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    return nh


@pytest.mark.parametrize("impl", CHUNK_IMPLS)
def test_chunk_matches_transformers_nemotron_h(impl):
    """transformers' NemotronH chunked scan (mamba2_chunk_scan, its torch path, chunk 16) on random inputs with
    an initial state and a time step limit: the same outputs and final state (transformers' [headdim, dstate]
    layout is ours)."""
    import torch  # noqa: PLC0415
    nh = _torch_ssd()
    d, h0 = inputs(B=2, T=45, H=4, G=2, P=8, N=16, seed=11)
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in d.items()}
    y_t, s_t = nh.mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=16, D=t["D"],
                                    dt_bias=t["dt_bias"], initial_states=torch.from_numpy(h0),
                                    dt_softplus=True, dt_limit=(0.0, 2.0), return_final_states=True)
    y, s = run(chunk_mamba2, impl, d, h0, dt_limit=(0.0, 2.0))
    assert rel_rms(y, y_t.numpy()) <= F32_TOL, rel_rms(y, y_t.numpy())
    assert rel_rms(s, s_t.numpy()) <= F32_TOL


@pytest.mark.parametrize("impl", CHUNK_IMPLS)
def test_decode_step_matches_transformers_nemotron_h(impl):
    """transformers' one-token update (mamba2_selective_state_update, as NemotronH's decode calls it: dt, A,
    D, dt_bias expanded over the head dim) equals one token of the recurrent op."""
    import torch  # noqa: PLC0415
    nh = _torch_ssd()
    H, P, N = 4, 8, 16
    d, h0 = inputs(B=3, T=1, H=H, G=2, P=P, N=N, seed=12)
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in d.items()}
    state = torch.from_numpy(h0.copy())                                   # [B, H, P, N], updated in place
    y_t = nh.mamba2_selective_state_update(
        state, t["x"][:, 0], t["dt"][:, 0, :, None].expand(-1, -1, P), t["A"][:, None, None].expand(-1, P, N),
        t["B"][:, 0], t["C"][:, 0], t["D"][:, None].expand(-1, P), dt_bias=t["dt_bias"][:, None].expand(-1, P),
        dt_softplus=True)
    y, s = run(fused_recurrent_mamba2, impl, d, h0)
    assert rel_rms(y[:, 0], y_t.numpy()) <= F32_TOL
    assert rel_rms(s, state.numpy()) <= F32_TOL


# ---------------------------------------------------------------- Mosaic compiles the TPU kernels

# Nemotron-H's Mamba2 layers (transformers' NemotronHConfig defaults): 128 heads of 64 over 8 groups, state 128.
NH_H, NH_P, NH_G, NH_N = 128, 64, 8, 128
_S, _F32, _I32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32


def _abstract(B, T, dtype, n_states=None, pool=None):
    """Abstract (x, dt, A, B, C, D, dt_bias, state) of Nemotron-H's sizes; state: [n_states or B, ...] or a pool."""
    rows = pool or n_states or B
    return (_S((B, T, NH_H, NH_P), dtype), _S((B, T, NH_H), dtype), _S((NH_H,), _F32), _S((B, T, NH_G, NH_N), dtype),
            _S((B, T, NH_G, NH_N), dtype), _S((NH_H,), _F32), _S((NH_H,), _F32), _S((rows, NH_H, NH_P, NH_N), _F32))


def _kw(D, bias, h0):
    return dict(D=D, dt_bias=bias, dt_softplus=True, initial_state=h0, output_final_state=True, impl="pallas")


def _decode(x, dt, A, B, C, D, bias, h0, *rows, **kw):
    """A decode step over the batch's own states, or (rows given) over rows of a state pool."""
    return fused_recurrent_mamba2(x, dt, A, B, C, state_indices=rows[0] if rows else None, **_kw(D, bias, h0), **kw)


def _prefill(x, dt, A, B, C, D, bias, h0, *cu):
    return chunk_mamba2(x, dt, A, B, C, cu_seqlens=cu[0] if cu else None, **_kw(D, bias, h0))


TPU_CASES = {   # name: (fn, abstract args, the FLOPs the step cannot avoid: 4 N P per token and head)
    "decode_B8": (_decode, lambda dt: _abstract(8, 1, dt), 8 * NH_H * 4 * NH_N * NH_P),
    "decode_pooled": (_decode, lambda dt: _abstract(8, 1, dt, pool=3 * 65) + (_S((8,), _I32),),
                      8 * NH_H * 4 * NH_N * NH_P),
    "verify_deltas_T4": (functools.partial(_decode, output_deltas=True), lambda dt: _abstract(8, 4, dt),
                         4 * 8 * NH_H * 4 * NH_N * NH_P),
    "prefill_T2048": (_prefill, lambda dt: _abstract(1, 2048, dt), 2048 * NH_H * 4 * NH_N * NH_P),
    "prefill_varlen_T75": (_prefill, lambda dt: _abstract(1, 75, dt, n_states=3) + (_S((4,), _I32),), 0),
}


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("name", list(TPU_CASES))
def test_tpu_kernels_compile_at_nemotron_h_shapes(name, dtype):
    """The TPU compiler (XLA + Mosaic, through jax.experimental.topologies on this host) accepts both kernels
    (delta_rule=False) on v5e, and its cost analysis carries the kernel's work."""
    from pallas_kernels import aot  # noqa: PLC0415
    try:
        aot.tpu_device("v5e")
    except aot.AotUnavailable as e:
        pytest.skip(str(e))
    fn, args, min_flops = TPU_CASES[name]
    program, cost = aot.compile_for(fn, args({"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype]), "v5e",
                                    donate_argnums=(7,))
    text = program.as_text()
    assert "tpu_custom_call" in text and "ssd_" in text
    if name == "decode_pooled":     # the kernel reads and writes the pool's rows in place
        assert " gather(" not in text and " scatter(" not in text
        # in the layout the TPU stores it in (abi.MAMBA2_SSD v3: [headdim, dstate], 128 lanes): no copy of
        # the pool into another layout before the kernel or back after it (v2's [dstate, headdim] had both)
        pool = f"f32[{3 * 65},{NH_H},{NH_P},{NH_N}]"
        assert not [ln for ln in text.splitlines() if f"= {pool}" in ln and " copy(" in ln]
    assert cost.flops >= min_flops, (cost.flops, min_flops)


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_triton_variants_interpreted(kernel):
    """The GPU (Triton) variants of both kernels with delta_rule=False, interpreted (power-of-two N, P): a packed
    batch against the float64 recurrence (the D term left out: it is added around the kernel)."""
    from pallas_kernels.gated_delta_rule.pallas_chunk import chunk_gated_delta_rule_pallas  # noqa: PLC0415
    from pallas_kernels.gated_delta_rule.pallas_recurrent import (  # noqa: PLC0415
        fused_recurrent_gated_delta_rule_pallas)
    from pallas_kernels.mamba2.common import as_rule_args  # noqa: PLC0415
    d, h0 = inputs(B=1, T=T_VARLEN, H=4, G=2, P=16, N=32, seed=13, n_states=len(CU) - 1)
    a = _jnp(d)
    r = as_rule_args(a["x"], a["dt"], a["A"], a["B"], a["C"], a["dt_bias"], TimeStep(softplus=True))
    kw = dict(scale=1.0, initial_state=jnp.swapaxes(jnp.asarray(h0), -1, -2), output_final_state=True,   # [K, V]
              cu_seqlens=jnp.asarray(CU, jnp.int32),
              delta_rule=False, backend="gpu", interpret=True)
    if kernel == "chunk":
        y, s = chunk_gated_delta_rule_pallas(r.q, r.k, r.v, r.g, r.beta, chunk_size=16, **kw)
    else:
        y, s = fused_recurrent_gated_delta_rule_pallas(r.q, r.k, r.v, r.g, r.beta, **kw)
    y64, s64 = reference(**dict(d, D=None), h0=h0, cu_seqlens=CU)
    s = jnp.swapaxes(s, -1, -2)
    assert rel_rms(y, y64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL, (rel_rms(y, y64), rel_rms(s, s64))


@pytest.mark.parametrize("platform, call", [("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton"),
                                            ("cpu", None)])
@pytest.mark.parametrize("op", [chunk_mamba2, fused_recurrent_mamba2], ids=["chunk", "recurrent"])
def test_auto_exports_the_platforms_kernel(op, platform, call):
    """impl="auto" lowered for a TPU carries the Mosaic kernel, for CUDA the Triton one (both the SSD
    variants), for the CPU the XLA path (no custom call) -- the platform lowered for, not this host's."""
    T = 100 if op is chunk_mamba2 else 4
    args = _abstract(2, T, jnp.bfloat16)

    def fn(x, dt, A, B, C, D, bias, h0):
        return op(x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True, initial_state=h0, output_final_state=True,
                  impl="auto")
    text = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    if call is None:
        assert "tpu_custom_call" not in text and "__gpu$xla.gpu.triton" not in text
    else:
        assert call in text and "ssd_" in text
