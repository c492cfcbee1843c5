"""Gated delta rule: every implementation against the token-level reference.

Error metric: relative RMS error, ||x - ref|| / ||ref||.
  * fp32 inputs: 1e-5. Both sides compute in fp32 with HIGHEST-precision dots; the chunked form
    reorders the sums (WY/UT form, inverse by repeated squaring), which costs a few fp32 ulps.
  * bf16 inputs: 1e-2. Both sides read the same bf16 inputs and compute in fp32, but each writes its
    output in bf16 (8-bit mantissa): one rounding is up to 2^-9 relative, so two outputs of values
    that differ by a few fp32 ulps can land one bf16 ulp (2^-8 ~ 4e-3) apart; the RMS over many
    elements stays well under 1e-2. States are fp32 in every case, so states use the fp32 bound x 10.

The XLA path gets the full cross product; the Pallas kernels run in interpret mode on CPU, so they
get a reduced but still awkward subset (T = 1 and 75: a single token, a partial second chunk).
`TestPallasTPU` runs the Mosaic TPU variant; `TestPallasGPU` re-runs the same tests on the Triton
variant (jax's style: one test class, re-run per kernel variant in interpret mode).
"""
from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import abi
from pallas_kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    pallas_chunk,
    pallas_recurrent,
    state_after,
)
from pallas_kernels.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

H = 2
F32_TOL, BF16_TOL = 1e-5, 1e-2


def make_inputs(T, r, K, dtype=jnp.float32, B=1, init=False, N=None, seed=0, V=None):
    """q, k [B, T, H, K]; v [B, T, H r, V]; g (log decay, mostly mild) and beta [B, T, H r].
    Drawn with numpy: no compilation per shape."""
    V = V or K
    HV = H * r
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    q = jnp.asarray(normal(B, T, H, K)).astype(dtype)
    k = jnp.asarray(normal(B, T, H, K)).astype(dtype)
    v = jnp.asarray(normal(B, T, HV, V)).astype(dtype)
    g = jnp.asarray(-np.logaddexp(0.0, normal(B, T, HV) - 2.0).astype(np.float32))    # -softplus
    beta = jnp.asarray((1.0 / (1.0 + np.exp(-normal(B, T, HV)))).astype(np.float32))
    h0 = jnp.asarray(0.1 * normal(N or B, HV, K, V)) if init else None
    return (q, k, v, g, beta), h0


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def tol(dtype):
    return F32_TOL if dtype == jnp.float32 else BF16_TOL


@functools.lru_cache(maxsize=None)
def reference(T, r, K, dtype_name, init):
    """Reference (o fp32, final state) for make_inputs(T, r, K, dtype, init=init), cached across tests.
    The reference computes in fp32 anyway, so it gets the (rounded) inputs upcast to fp32, and a zero
    state for `init=False`: one compilation per shape serves every dtype and both init cases."""
    args, h0 = make_inputs(T, r, K, jnp.dtype(dtype_name), init=init)
    h0 = jnp.zeros((1, H * r, K, K)) if h0 is None else h0
    return naive_recurrent_gated_delta_rule(*(x.astype(jnp.float32) for x in args), initial_state=h0,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)


def check_against_reference(T, r, K, dtype, init, run):
    args, h0 = make_inputs(T, r, K, dtype, init=init)
    o_ref, s_ref = reference(T, r, K, jnp.dtype(dtype).name, init)
    o, s = run(args, h0)[:2]
    chex.assert_shape(o, (1, T, H * r, K))
    chex.assert_type(o, dtype)
    chex.assert_shape(s, (1, H * r, K, K))
    assert rel_rms(o, o_ref) < tol(dtype), rel_rms(o, o_ref)
    assert rel_rms(s, s_ref) < 10 * F32_TOL, rel_rms(s, s_ref)


DTYPES = [jnp.float32, jnp.bfloat16]


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("T", [1, 63, 64, 75, 500])
def test_chunk_xla_matches_reference(T, r, K, dtype, init):
    check_against_reference(T, r, K, dtype, init, lambda a, h0: chunk_gated_delta_rule(
        *a, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, impl="xla"))


@pytest.mark.parametrize("T,r,K,V,l2", [(1, 1, 32, 32, True), (33, 2, 32, 32, True), (63, 3, 16, 48, False),
                                        (75, 2, 64, 32, True)])
def test_fused_recurrent_xla_matches_reference(T, r, K, V, l2):
    """The XLA token scan (K-major state, one contraction per token) against the reference scan:
    outputs, final state, every per-token state and every delta."""
    (q, k, v, g, beta), h0 = make_inputs(T, r, K, B=2, init=True, V=V)
    if not l2:
        q, k = q * 0.2, k * 0.2
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o_ref, s_ref, states_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_all_states=True, **kw)
    _, _, deltas_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_deltas=True, **kw)
    o, s, states = fused_recurrent_gated_delta_rule(q, k, v, g, beta, output_all_states=True, impl="xla", **kw)
    o2, s2, deltas = fused_recurrent_gated_delta_rule(q, k, v, g, beta, output_deltas=True, impl="xla", **kw)
    chex.assert_shape(states, (2, T, H * r, K, V))
    for got, want in ((o, o_ref), (s, s_ref), (states, states_ref), (o2, o_ref), (s2, s_ref), (deltas, deltas_ref)):
        assert rel_rms(got, want) < F32_TOL, rel_rms(got, want)


@pytest.mark.parametrize("T", [1, 75])
def test_chunk_xla_chunk_sizes_and_no_l2norm(T):
    (q, k, v, g, beta), h0 = make_inputs(T, 2, 32, init=True)
    q, k = q * 0.2, k * 0.2   # without l2norm keep the delta rule contractive
    ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for C in (16, 32, 64, 128):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      chunk_size=C, impl="xla")
        assert rel_rms(o, ref[0]) < F32_TOL and rel_rms(s, ref[1]) < F32_TOL


def test_final_state_omitted_unless_asked():
    a, _ = make_inputs(5, 1, 32)
    for impl in ("reference", "xla", "pallas"):
        assert chunk_gated_delta_rule(*a, impl=impl)[1] is None
        assert fused_recurrent_gated_delta_rule(*a, impl=impl)[1] is None


def test_chunk_final_state_equals_recurrent_final_state():
    a, h0 = make_inputs(200, 2, 64, init=True, B=2)
    _, s_chunk = chunk_gated_delta_rule(*a, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, impl="xla")
    _, s_rec = fused_recurrent_gated_delta_rule(*a, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, impl="xla")
    assert rel_rms(s_chunk, s_rec) < F32_TOL


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_prefill_then_decode_equals_long_prefill(impl):
    T, T1 = 75, 67
    (q, k, v, g, beta), h0 = make_inputs(T, 2, 32, init=True)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True, impl=impl)
    o_long, s_long = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw)
    sl = lambda x, a, b: x[:, a:b]  # noqa: E731
    o1, s = chunk_gated_delta_rule(*(sl(x, 0, T1) for x in (q, k, v, g, beta)), initial_state=h0, **kw)
    outs = [o1]
    for t in range(T1, T, 4):   # decode / verify windows of up to 4 tokens
        o_t, s = fused_recurrent_gated_delta_rule(*(sl(x, t, t + 4) for x in (q, k, v, g, beta)),
                                                  initial_state=s, **kw)
        outs.append(o_t)
    assert rel_rms(jnp.concatenate(outs, axis=1), o_long) < F32_TOL
    assert rel_rms(s, s_long) < F32_TOL


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_all_states_equal_single_steps(impl):
    T = 6
    (q, k, v, g, beta), h0 = make_inputs(T, 2, 32, init=True, B=2)
    kw = dict(use_qk_l2norm_in_kernel=True, impl=impl)
    o, final, states = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                        output_final_state=True, output_all_states=True, **kw)
    chex.assert_shape(states, (2, T, 2 * H, 32, 32))
    s = h0
    for t in range(T):
        o_t, s = fused_recurrent_gated_delta_rule(*(x[:, t:t + 1] for x in (q, k, v, g, beta)),
                                                  initial_state=s, output_final_state=True, **kw)
        assert rel_rms(states[:, t], s) < F32_TOL
        assert rel_rms(o[:, t:t + 1], o_t) < F32_TOL
    assert rel_rms(final, s) < F32_TOL


@pytest.mark.parametrize("T,r,K,V,l2", [(1, 1, 32, 32, True), (33, 2, 32, 32, True), (63, 3, 16, 48, False),
                                        (75, 2, 64, 32, True)])
def test_state_after_rebuilds_every_state_from_the_deltas(T, r, K, V, l2):
    """state_after(deltas, idx) is the state after token idx, for every idx (HV != H, K != V, long
    windows whose decay products get small), and the deltas leave o and the final state alone."""
    B = 3
    (q, k, v, g, beta), h0 = make_inputs(T, r, K, B=B, init=True, V=V, seed=T)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o, final, states = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_all_states=True, **kw)
    o2, final2, deltas = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_deltas=True, **kw)
    chex.assert_shape(deltas, (B, T, H * r, V))
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(final, final2)
    rebuild = jax.jit(functools.partial(state_after, use_qk_l2norm_in_kernel=l2))
    for start in range(0, T, B):
        idx = jnp.minimum(jnp.arange(start, start + B), T - 1).astype(jnp.int32)   # a different position per row
        got = rebuild(h0, k, g, deltas, idx)
        want = states[jnp.arange(B), idx]
        assert rel_rms(got, want) < F32_TOL, (start, rel_rms(got, want))


def test_deltas_and_all_states_are_exclusive():
    (q, k, v, g, beta), h0 = make_inputs(4, 1, 16)
    with pytest.raises(ValueError, match="exclusive"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, output_all_states=True, output_deltas=True)


# ---------------------------------------------------------------- packed variable-length batches

# Sequence lengths: an empty one, one shorter than a chunk, one crossing chunk boundaries, and
# T = 140 > cu_seqlens[-1] = 137, so the last 3 tokens belong to no sequence.
CU = (0, 5, 5, 70, 137)
T_VARLEN = 140


def varlen_inputs(dtype=jnp.float32, r=2, K=32):
    a, h0 = make_inputs(T_VARLEN, r, K, dtype, init=True, N=len(CU) - 1, seed=3)
    return a, h0, jnp.asarray(CU, jnp.int32)


@functools.lru_cache(maxsize=None)
def varlen_split_reference(dtype_name="float32", r=2, K=32):
    """Each sequence on its own through the reference: (o [1, T, HV, V], finals [N, HV, K, V])."""
    a, h0, _ = varlen_inputs(jnp.dtype(dtype_name), r, K)
    o = jnp.zeros(a[2].shape, jnp.float32)
    finals = []
    for n in range(len(CU) - 1):
        s, e = CU[n], CU[n + 1]
        if e == s:
            finals.append(h0[n])
            continue
        o_n, f_n = naive_recurrent_gated_delta_rule(*(x[:, s:e] for x in a), initial_state=h0[n:n + 1],
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        o = o.at[:, s:e].set(o_n.astype(jnp.float32))
        finals.append(f_n[0])
    return o, jnp.stack(finals)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("op,impl", [("chunk", "reference"), ("chunk", "xla"), ("recurrent", "xla")])
def test_varlen_matches_split_sequences(op, impl, dtype):
    a, h0, cu = varlen_inputs(dtype)
    o_ref, f_ref = varlen_split_reference(jnp.dtype(dtype).name)
    fn = chunk_gated_delta_rule if op == "chunk" else fused_recurrent_gated_delta_rule
    o, f = fn(*a, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=cu, impl=impl)
    chex.assert_shape(f, (len(CU) - 1, 4, 32, 32))
    assert rel_rms(o, o_ref) < tol(dtype)
    assert np.all(np.asarray(o[:, CU[-1]:], np.float32) == 0)      # tokens in no sequence
    assert rel_rms(f, f_ref) < 10 * F32_TOL
    np.testing.assert_array_equal(f[1], h0[1])                      # empty sequence keeps its state


def test_varlen_values_change_without_retrace():
    a, h0, _ = varlen_inputs()
    traces = []

    @jax.jit
    def f(cu):
        traces.append(1)
        return chunk_gated_delta_rule(*a, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True, impl="xla")
    f(jnp.asarray(CU, jnp.int32))
    o, fin = f(jnp.asarray((0, 140, 140, 140, 140), jnp.int32))
    ref = naive_recurrent_gated_delta_rule(*a, initial_state=h0[:1], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
    assert len(traces) == 1
    assert rel_rms(o, ref[0]) < F32_TOL and rel_rms(fin[0], ref[1][0]) < F32_TOL


# ---------------------------------------------------------------- Pallas kernels (interpret mode)

PALLAS_CASES = [(T, r, K, dtype, init)
                for i, (T, r, K) in enumerate((T, r, K) for T in (1, 75) for r in (1, 2) for K in (32, 128))
                for dtype, init in [((jnp.float32, True), (jnp.bfloat16, False))[i % 2]]]
PALLAS_IDS = [f"T{T}-r{r}-K{K}-{jnp.dtype(d).name}-{'init' if i else 'zero'}" for T, r, K, d, i in PALLAS_CASES]


POOL_ROWS = np.array([5, 1, 6, 6], np.int32)      # row 6: the null row two padding batch rows point at


def check_pooled(run, T):
    """run(q, k, v, g, beta, initial_state=pool, state_indices=rows, output_final_state=True, ...) against
    the token scan over the gathered rows."""
    (q, k, v, g, beta), pool = make_inputs(T, 2, 32, init=True, B=4, N=8, V=256, seed=3)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, f_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[POOL_ROWS], **kw)
    o, f = run(q, k, v, g, beta, initial_state=pool, state_indices=jnp.asarray(POOL_ROWS), **kw)
    chex.assert_shape(f, pool.shape)
    assert rel_rms(o[:2], o_ref[:2]) < F32_TOL
    for b in (0, 1):
        assert rel_rms(f[POOL_ROWS[b]], f_ref[b]) < 10 * F32_TOL
    assert min(rel_rms(f[6], f_ref[2]), rel_rms(f[6], f_ref[3])) < 10 * F32_TOL
    untouched = [i for i in range(8) if i not in POOL_ROWS]
    np.testing.assert_array_equal(np.asarray(f)[untouched], np.asarray(pool)[untouched])


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_pooled_state_rows_through_the_public_op(impl):
    check_pooled(functools.partial(fused_recurrent_gated_delta_rule, impl=impl), 1)


def test_pooled_state_bad_input():
    (q, k, v, g, beta), pool = make_inputs(1, 2, 32, init=True, B=2, N=5)
    rows = jnp.array([0, 3], jnp.int32)
    run = functools.partial(fused_recurrent_gated_delta_rule, q, k, v, g, beta, output_final_state=True)
    with pytest.raises(ValueError, match="initial_state, which is missing"):
        run(state_indices=rows)
    with pytest.raises(ValueError, match=r"state_indices must be \[B\]"):
        run(initial_state=pool, state_indices=rows[:1])
    with pytest.raises(ValueError, match="per-token states or deltas"):
        run(initial_state=pool, state_indices=rows, output_deltas=True)
    with pytest.raises(ValueError, match="float32"):
        run(initial_state=pool.astype(jnp.bfloat16), state_indices=rows)


class TestPallasTPU:
    """The Mosaic TPU variants in interpret mode."""
    BACKEND = "tpu"

    def chunk(self, *a, **kw):
        return pallas_chunk.chunk_gated_delta_rule_pallas(*a, backend=self.BACKEND, interpret=True, **kw)

    def recurrent(self, *a, **kw):
        return pallas_recurrent.fused_recurrent_gated_delta_rule_pallas(
            *a, backend=self.BACKEND, interpret=True, **kw)

    @pytest.mark.parametrize("T,r,K,dtype,init", PALLAS_CASES, ids=PALLAS_IDS)
    def test_matches_reference(self, T, r, K, dtype, init):
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        check_against_reference(T, r, K, dtype, init, lambda a, h0: self.chunk(*a, initial_state=h0, **kw))
        check_against_reference(T, r, K, dtype, init,
                                lambda a, h0: self.recurrent(*a, initial_state=h0, **kw))

    def test_varlen(self):
        a, h0, cu = varlen_inputs()
        o_ref, f_ref = varlen_split_reference()
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        for o, f in (self.chunk(*a, **kw), self.recurrent(*a, **kw)):
            assert rel_rms(o, o_ref) < F32_TOL and rel_rms(f, f_ref) < 10 * F32_TOL
            np.testing.assert_array_equal(f[1], h0[1])

    def test_all_states_and_value_blocks(self):
        (q, k, v, g, beta), h0 = make_inputs(5, 2, 32, init=True, B=2, V=256)
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_all_states=True, **kw)
        o, f, states = self.recurrent(q, k, v, g, beta, output_all_states=True,
                                      config=pallas_recurrent.RecurrentConfig(block_v=128), **kw)
        for x, y in zip((o, f, states), ref):
            assert rel_rms(x, y) < F32_TOL
        o, f = self.chunk(q, k, v, g, beta, config=pallas_chunk.ChunkConfig(chunk_size=16, block_v=128), **kw)
        assert rel_rms(o, ref[0]) < F32_TOL and rel_rms(f, ref[1]) < F32_TOL

    def test_deltas_equal_reference(self):
        """With value blocks and HV != H, and in a packed batch (sequence starts, an empty sequence,
        padding tokens after the last): the kernel's per-token deltas equal the token scan's."""
        (q, k, v, g, beta), h0 = make_inputs(7, 2, 32, init=True, B=2, V=256)
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, output_deltas=True)
        ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
        got = self.recurrent(q, k, v, g, beta, config=pallas_recurrent.RecurrentConfig(block_v=128), **kw)
        for x, y in zip(got, ref):
            assert rel_rms(x, y) < F32_TOL
        a, h0, cu = varlen_inputs()
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                  output_deltas=True)
        ref = naive_recurrent_gated_delta_rule(*a, **kw)
        got = self.recurrent(*a, **kw)
        assert rel_rms(got[2], ref[2]) < F32_TOL

    def test_donated_state_is_updated_in_place(self):
        a, h0 = make_inputs(9, 1, 32, init=True)
        ref = naive_recurrent_gated_delta_rule(*a, initial_state=h0, output_final_state=True)
        step = jax.jit(lambda s: self.recurrent(*a, initial_state=s, output_final_state=True)[1],
                       donate_argnums=0)
        assert rel_rms(step(jnp.array(h0)), ref[1]) < F32_TOL

    @pytest.mark.parametrize("T", [1, 3])
    def test_pooled_state_rows(self, T):
        """state_indices: the batch's states are rows of a pool (out of order, two padding rows on one null
        row), read and written in place, with value blocks; rows no batch row names are left as they were."""
        check_pooled(lambda *a, **kw: self.recurrent(*a, config=pallas_recurrent.RecurrentConfig(block_v=128), **kw),
                     T)

    def test_abi(self):
        """Every implementation writes the same state layout, so all share one ABI id."""
        from pallas_kernels.gated_delta_rule import chunk, naive  # noqa: PLC0415
        assert pallas_chunk.ABI is pallas_recurrent.ABI is chunk.ABI is naive.ABI is abi.get("gated_delta_rule")


class TestPallasGPU(TestPallasTPU):
    """The same tests on the Triton variants."""
    BACKEND = "gpu"


# ---------------------------------------------------------------- bad input

def _bad_cases():
    (q, k, v, g, beta), h0 = make_inputs(8, 2, 32, init=True)
    yield "q and k", (q, k[:, :, :1], v, g, beta), {}
    yield "HV=3 must be a multiple", (q, k, v[:, :, :3], g[..., :3], beta[..., :3]), {}
    yield "v must be", (q, k, v[:, :4], g, beta), {}
    yield "g must be", (q, k, v, g[..., :1], beta), {}
    yield "beta must be", (q, k, v, g, beta[:, :4]), {}
    yield "initial_state must be", (q, k, v, g, beta), dict(initial_state=h0[..., :16])
    yield "cu_seqlens needs a packed batch", tuple(jnp.concatenate([x, x]) for x in (q, k, v, g, beta)), \
        dict(cu_seqlens=jnp.array([0, 8], jnp.int32))
    yield "cu_seqlens must be [N + 1]", (q, k, v, g, beta), dict(cu_seqlens=jnp.zeros((2, 2), jnp.int32))
    yield "cu_seqlens must be an integer", (q, k, v, g, beta), dict(cu_seqlens=jnp.array([0.0, 8.0]))
    yield "impl must be one of", (q, k, v, g, beta), dict(impl="cuda")


@pytest.mark.parametrize("op", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_bad_shapes_raise_value_error(op, case):
    message, args, kw = case
    with pytest.raises(ValueError, match=re.escape(message)):
        op(*args, **{"impl": "xla", **kw})


def test_bad_kernel_configs_raise_value_error():
    a, _ = make_inputs(8, 1, 32, V=96)
    with pytest.raises(ValueError, match="block_v=64 must divide V=96"):
        pallas_chunk.chunk_gated_delta_rule_pallas(*a, config=pallas_chunk.ChunkConfig(block_v=64), interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        pallas_chunk.chunk_gated_delta_rule_pallas(*a, config=pallas_chunk.ChunkConfig(block_v=32),
                                                   backend="tpu", interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        pallas_recurrent.fused_recurrent_gated_delta_rule_pallas(*a, backend="gpu", interpret=True)
    with pytest.raises(ValueError, match="backend must be"):
        pallas_recurrent.fused_recurrent_gated_delta_rule_pallas(*a, backend="rocm", interpret=True)


# ---------------------------------------------------------------- ABI registry

def test_abi_registry_rejects_conflicting_registration():
    gdn = abi.get("gated_delta_rule")
    assert abi.register(abi.KernelABI(gdn.name, gdn.layout, gdn.version)) == gdn   # same ABI: no-op
    with pytest.raises(ValueError, match="already registered"):
        abi.register(abi.KernelABI(gdn.name, "state[N,HV,V,K]:f32", gdn.version))
    with pytest.raises(ValueError, match="already registered"):
        abi.register(abi.KernelABI(gdn.name, gdn.layout, gdn.version + 1))
    assert abi.get("gated_delta_rule") == gdn and gdn.id == "gated_delta_rule/state[N,HV,K,V]:f32/v1"
    with pytest.raises(KeyError, match="no kernel ABI"):
        abi.get("not_a_kernel")


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_varlen_all_sequences_empty(impl):
    """cu_seqlens = [0, 0, 0]: no token belongs to a sequence; outputs 0, states unchanged."""
    a, h0 = make_inputs(5, 1, 32, init=True, N=2)
    cu = jnp.zeros((3,), jnp.int32)
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o, f = fn(*a, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl=impl)
        assert not np.any(np.asarray(o)) and np.array_equal(np.asarray(f), np.asarray(h0))
