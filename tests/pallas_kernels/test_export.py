"""The public ops lower the Pallas kernel of the platform they are lowered for, proven on a CPU-only machine.

`jax.export.export(jax.jit(f), platforms=[...])` runs the whole lowering for the named platform
without the device:
  * TPU: Mosaic TPU lowering, the kernel embedded as a `tpu_custom_call` (export allows it).
  * CUDA: Triton lowering (the kernels pass `pallas.triton.CompilerParams`), embedded as the
    `__gpu$xla.gpu.triton` custom call, which export only accepts with
    `DisabledSafetyCheck.custom_call(...)`: its compatibility across jaxlib versions is not
    guaranteed, so such an artifact must be re-exported per jaxlib release.
Every test goes through the public op (`impl="pallas"` / `"auto"`), so what is proven is what a user
gets: the kernel follows the lowering platform, not `jax.default_backend()` (pallas_kernels.dispatch).
Whether Mosaic then accepts the kernel is tests/pallas_kernels/test_tpu_compile.py's business.
"""
from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu  # noqa: F401  registers the Mosaic GPU lowering
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, ops
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda

TRITON_CALL = "__gpu$xla.gpu.triton"
CALLS = {"tpu": "tpu_custom_call", "cuda": TRITON_CALL}
S = jax.ShapeDtypeStruct


def _args(T, dtype=jnp.bfloat16, B=1, H=2, HV=4, K=128, V=128, N=None):
    return (S((B, T, H, K), dtype), S((B, T, H, K), dtype), S((B, T, HV, V), dtype),
            S((B, T, HV), jnp.float32), S((B, T, HV), jnp.float32), S((N or B, HV, K, V), jnp.float32))


def _kda_args(T, dtype=jnp.bfloat16, B=1, H=2, HV=4, K=128, V=128, N=None):
    """_args with Kimi Delta Attention's per-channel log decay g [B, T, HV, K] f32."""
    a = _args(T, dtype, B, H, HV, K, V, N)
    return a[:3] + (S((B, T, HV, K), jnp.float32),) + a[4:]


def _export(fn, platform, args):
    exported = jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exported.mlir_module()


OPS = {
    "chunk": lambda **kw: lambda *a, **k2: chunk_gated_delta_rule(*a, **kw, **k2),
    "recurrent": lambda **kw: lambda *a, **k2: fused_recurrent_gated_delta_rule(*a, **kw, **k2),
    "recurrent_all_states": lambda **kw: lambda *a, **k2: fused_recurrent_gated_delta_rule(
        *a, output_all_states=True, **kw, **k2),
    "recurrent_deltas": lambda **kw: lambda *a, **k2: fused_recurrent_gated_delta_rule(
        *a, output_deltas=True, **kw, **k2),
}
# Kimi Delta Attention: its own chunked kernel, and the recurrent kernel above with a per-channel decay.
KDA_OPS = {
    "kda_chunk": lambda **kw: lambda *a, **k2: chunk_kda(*a, **kw, **k2),
    "kda_recurrent": lambda **kw: lambda *a, **k2: fused_recurrent_kda(*a, **kw, **k2),
    "kda_recurrent_all_states": lambda **kw: lambda *a, **k2: fused_recurrent_kda(
        *a, output_all_states=True, **kw, **k2),
    "kda_recurrent_deltas": lambda **kw: lambda *a, **k2: fused_recurrent_kda(*a, output_deltas=True, **kw, **k2),
}


@pytest.mark.parametrize("impl", ["pallas", "auto"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("kernel", list(OPS) + list(KDA_OPS))
def test_public_op_exports_the_platforms_kernel(kernel, platform, varlen, impl):
    call = CALLS[platform]
    T = 200 if kernel.endswith("chunk") else 4   # a prefill; a verify window
    op = {**OPS, **KDA_OPS}[kernel](output_final_state=True, use_qk_l2norm_in_kernel=True, impl=impl)
    _args_of = _kda_args if kernel in KDA_OPS else _args
    if varlen:
        def fn(q, k, v, g, beta, h0, cu):
            return op(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
        args = _args_of(T, N=3) + (S((4,), jnp.int32),)
    else:
        def fn(q, k, v, g, beta, h0):
            return op(q, k, v, g, beta, initial_state=h0)
        args = _args_of(T, B=2)
    text = _export(fn, platform, args)
    assert call in text
    assert (CALLS["cuda"] if platform == "tpu" else CALLS["tpu"]) not in text
    if kernel in KDA_OPS:    # the per-channel kernels, not GDN's
        assert ("kda_chunk" if kernel == "kda_chunk" else "kda_fused_recurrent") in text


@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_cpu_lowering_has_no_accelerator_kernel(impl):
    """Lowered for the CPU, auto / xla are the XLA path and pallas the interpreter: no custom call."""
    fn = lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], impl=impl)  # noqa: E731
    text = _export(fn, "cpu", _args(64))
    assert "tpu_custom_call" not in text and TRITON_CALL not in text


@pytest.mark.parametrize("op,args_of", [(chunk_gated_delta_rule, _args), (chunk_kda, _kda_args)], ids=["gdn", "kda"])
def test_chunk_exports_with_value_blocks_fp32(op, args_of):
    """fp32 inputs and V = 256 through the public op, for both targets."""
    for platform, call in CALLS.items():
        def fn(q, k, v, g, beta, h0):
            return op(q, k, v, g, beta, initial_state=h0, impl="pallas")
        assert call in _export(fn, platform, args_of(128, jnp.float32, V=256))


def test_state_aliasing_survives_export():
    """The initial state is aliased to the final state in the lowered kernel call."""
    def fn(q, k, v, g, beta, h0):
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, impl="pallas")
    text = _export(fn, "tpu", _args(1))
    assert "output_operand_alias" in text or "tf.aliasing_output" in text


def test_pallas_without_a_kernel_for_the_shapes_is_an_error_when_lowered():
    """The Triton variant needs power-of-two tiles: with K = 48, impl="pallas" lowered for CUDA fails
    naming the reason; impl="auto" takes the XLA path there; the CPU interpreter takes it."""
    args = _args(4, jnp.float32, K=48, V=48)

    def fn(impl):
        return lambda q, k, v, g, beta, h0: fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                                             impl=impl)
    with pytest.raises(dispatch.KernelUnavailable, match="no kernel for cuda.*K a power of two; got K=48"):
        _export(fn("pallas"), "cuda", args)
    assert TRITON_CALL not in _export(fn("auto"), "cuda", args)
    assert "tpu_custom_call" in _export(fn("pallas"), "tpu", args)
    _export(fn("pallas"), "cpu", args)


def test_kernel_module_that_fails_to_import_is_an_error(monkeypatch):
    """A Pallas module that fails to import: impl="pallas" raises at once, never runs XLA instead;
    impl="auto" still runs XLA on the CPU but fails when lowered for a TPU."""
    def broken():
        raise ImportError("no module named 'pallas_kernels.gated_delta_rule.pallas_chunk' (simulated)")
    monkeypatch.setattr(ops, "_pallas_chunk", broken)
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 8, 1, 16)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 8, 1, 16)), jnp.float32)
    g, beta = jnp.full((1, 8, 1), -0.1), jnp.full((1, 8, 1), 0.5)
    with pytest.raises(dispatch.KernelUnavailable, match="failed to import.*simulated"):
        chunk_gated_delta_rule(q, k, v, g, beta, impl="pallas")
    o_auto, _ = chunk_gated_delta_rule(q, k, v, g, beta, impl="auto")
    o_xla, _ = chunk_gated_delta_rule(q, k, v, g, beta, impl="xla")
    np.testing.assert_array_equal(o_auto, o_xla)
    fn = lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], impl="auto")  # noqa: E731
    with pytest.raises(dispatch.KernelUnavailable, match="impl='auto' on an accelerator"):
        _export(fn, "tpu", _args(64))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_mosaic_gpu_default_is_not_the_gpu_target():
    """Why the GPU variants pass Triton params: without them JAX 0.10 picks Mosaic GPU, which has
    no lowering for the reductions these kernels use. (Documents the choice; if a future JAX lowers
    it, the Triton choice can be revisited.)"""
    from jax.experimental import pallas as pl  # noqa: PLC0415

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.sum(x_ref[...], axis=0, keepdims=True)

    def fn(x):
        return pl.pallas_call(kernel, out_shape=S((1, 128), jnp.float32))(x)
    with pytest.raises(NotImplementedError, match="axes"):
        _export(fn, "cuda", (S((64, 128), jnp.float32),))
