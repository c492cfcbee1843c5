"""Kimi Delta Attention's Pallas kernels (the gated delta rule with a decay per key channel) against a float64
numpy recurrence (kda_float64.py), in interpret mode on the CPU:

  * the chunked prefill kernel, pallas_kernels/kda/pallas_chunk.py (`chunk_kda_pallas`);
  * Gated DeltaNet's fused recurrent kernel (pallas_recurrent.py) given a per-channel g [B, T, HV, K].

Shapes are awkward on purpose: T = 1 (one token in a padded chunk), 63, 75 (partial chunks and partial
recurrent time blocks), 200 (several chunks), K != V, HV = 2 H, packed batches with an empty and a
one-token sequence, an initial state. The decay is drawn per channel: some channels near 0 (g ~ -20 a
token: exp(-gc) of a chunk would overflow f32, which the kernel must never form), some near 1
(g = -1e-4), the rest moderate. Error metric: relative RMS error, ||x - ref|| / ||ref|| (see
test_gated_delta_rule.py): <= 1e-5 in f32, <= 1e-2 for the bf16 outputs of bf16 q / k / v (the reference
gets the same rounded inputs), states always f32 (1e-4 with bf16 inputs, as for GDN).
`TestTPU` runs the Mosaic TPU variants, `TestGPU` the Triton ones (power-of-two K and V).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kda_float64 import reference

from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.gated_delta_rule.pallas_chunk import ChunkConfig
from pallas_kernels.gated_delta_rule.pallas_recurrent import RecurrentConfig, fused_recurrent_gated_delta_rule_pallas
from pallas_kernels.kda import pallas_chunk
from pallas_kernels.kda.pallas_chunk import chunk_kda_pallas

H = 2
F32_TOL, BF16_TOL = 1e-5, 1e-2


def make_inputs(T, r, K, V, dtype=jnp.float32, B=1, init=True, N=None, seed=0):
    """q, k [B, T, H, K]; v [B, T, H r, V] in dtype; g [B, T, H r, K] f32 per channel: the first K / 8
    channels near 0 (~ -20 a token), the next K / 8 near 1 (-1e-4), the rest -softplus(x - 2); beta in (0, 1)."""
    HV = H * r
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q, k, v = (jnp.asarray(normal(*s)).astype(dtype) for s in ((B, T, H, K), (B, T, H, K), (B, T, HV, V)))
    g = -np.logaddexp(0.0, normal(B, T, HV, K) - 2.0)
    n8 = max(K // 8, 1)
    g[..., :n8] = -20.0 + normal(B, T, HV, n8)
    g[..., n8:2 * n8] = -1e-4
    beta = 1.0 / (1.0 + np.exp(-normal(B, T, HV)))
    h0 = jnp.asarray(0.1 * normal(N or B, HV, K, V)) if init else None
    return (q, k, v, jnp.asarray(g.astype(np.float32)), jnp.asarray(beta.astype(np.float32))), h0


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def tol(dtype):
    return F32_TOL if dtype == jnp.float32 else BF16_TOL


def state_tol(dtype):
    return F32_TOL if dtype == jnp.float32 else 10 * F32_TOL


@functools.lru_cache(maxsize=None)
def cached_reference(T, r, K, V, dtype_name, init, B=1, l2=True, cu=None, seed=0):
    """reference() of make_inputs(T, r, K, V, dtype, B=B, init=init, seed=seed), once per case."""
    args, h0 = make_inputs(T, r, K, V, jnp.dtype(dtype_name), B=B, init=init, N=None if cu is None else len(cu) - 1,
                           seed=seed)
    return reference(*args, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)


# Packed batch: sequences of 5, 0 (empty), 1, 64 and 67 tokens, then 3 tokens of no sequence (T = 140).
CU = (0, 5, 5, 6, 70, 137)
T_VARLEN = 140

CHUNK_CASES = [  # T, r, K, V, dtype, init, B
    (1, 2, 32, 48, jnp.float32, True, 2),
    (63, 1, 32, 32, jnp.bfloat16, False, 1),
    (75, 2, 64, 32, jnp.float32, True, 2),
    (75, 2, 32, 48, jnp.bfloat16, True, 1),
    (200, 2, 32, 64, jnp.float32, True, 1),
]
RECURRENT_CASES = [  # T, r, K, V, dtype, init, B
    (1, 2, 32, 48, jnp.float32, True, 2),
    (1, 1, 64, 64, jnp.bfloat16, True, 3),
    (63, 2, 32, 48, jnp.float32, True, 1),
    (75, 2, 64, 32, jnp.bfloat16, False, 2),
]


def _ids(cases):
    return [f"T{T}-r{r}-K{K}-V{V}-{jnp.dtype(d).name}-{'init' if i else 'zero'}-B{B}" for T, r, K, V, d, i, B in cases]


class TestTPU:
    """The Mosaic TPU variants in interpret mode."""
    BACKEND = "tpu"
    CHUNK_CASES, RECURRENT_CASES = CHUNK_CASES, RECURRENT_CASES

    def chunk(self, *a, **kw):
        return chunk_kda_pallas(*a, backend=self.BACKEND, interpret=True, **kw)

    def recurrent(self, *a, **kw):
        return fused_recurrent_gated_delta_rule_pallas(*a, backend=self.BACKEND, interpret=True, **kw)

    def check(self, run, T, r, K, V, dtype, init, B):
        args, h0 = make_inputs(T, r, K, V, dtype, B=B, init=init)
        o_ref, f_ref = cached_reference(T, r, K, V, jnp.dtype(dtype).name, init, B)[:2]
        o, f = run(*args, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)[:2]
        assert o.shape == (B, T, H * r, V) and o.dtype == dtype
        assert f.shape == (B, H * r, K, V) and f.dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(o, np.float32))) and np.all(np.isfinite(np.asarray(f)))
        assert rel_rms(o, o_ref) <= tol(dtype), rel_rms(o, o_ref)
        assert rel_rms(f, f_ref) <= state_tol(dtype), rel_rms(f, f_ref)

    def test_chunk_matches_reference(self, case):
        self.check(self.chunk, *case)

    def test_recurrent_matches_reference(self, case):
        self.check(self.recurrent, *case)

    @pytest.mark.parametrize("C", [8, 16, 24, 32])
    def test_chunk_sizes_and_no_l2norm(self, C):
        """Sub-blocks of 16 and of 8 (C = 24: three), one sub-block (C = 8, 16), no l2norm, a given scale."""
        if self.BACKEND == "gpu" and C in (8, 24):
            pytest.skip("the Triton variant takes power-of-two chunks >= 16")
        (q, k, v, g, beta), h0 = make_inputs(75, 2, 32, 32, B=2, seed=1)
        q, k = q * 0.3, k * 0.3     # without l2norm keep the delta rule contractive
        o_ref, f_ref = reference(q, k, v, g, beta, scale=0.5, initial_state=h0)[:2]
        o, f = self.chunk(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True, chunk_size=C)
        assert rel_rms(o, o_ref) <= F32_TOL and rel_rms(f, f_ref) <= F32_TOL, (rel_rms(o, o_ref), rel_rms(f, f_ref))

    def test_final_state_omitted_unless_asked(self):
        a, _ = make_inputs(5, 1, 32, 32)
        assert self.chunk(*a)[1] is None and self.recurrent(*a)[1] is None

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_varlen(self, dtype):
        """A packed batch: the state is reset at each sequence's start, an empty sequence keeps its initial
        state, tokens past the last sequence give 0; both kernels, and the recurrent one's deltas."""
        a, h0 = make_inputs(T_VARLEN, 2, 32, 64, dtype, N=len(CU) - 1, seed=3)
        o_ref, f_ref, _, d_ref = cached_reference(T_VARLEN, 2, 32, 64, jnp.dtype(dtype).name, True, cu=CU, seed=3)
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=jnp.asarray(CU, jnp.int32))
        results = [self.chunk(*a, **kw), self.recurrent(*a, output_deltas=True, **kw)]
        for o, f, *d in results:
            assert f.shape == (len(CU) - 1, 2 * H, 32, 64)
            assert rel_rms(o, o_ref) <= tol(dtype), rel_rms(o, o_ref)
            assert rel_rms(f, f_ref) <= state_tol(dtype), rel_rms(f, f_ref)
            assert not np.any(np.asarray(o[:, CU[-1]:], np.float32))     # tokens in no sequence
            np.testing.assert_array_equal(f[1], h0[1])                    # the empty sequence
        assert rel_rms(results[1][2], d_ref) <= state_tol(dtype)

    def test_all_states_and_deltas_with_value_blocks(self):
        """output_all_states / output_deltas equal the reference's per-token states and updates, with value
        blocks (V = 256, block_v = 128), HV = 2 H, T = 19 (a partial time block of the TPU variant)."""
        (q, k, v, g, beta), h0 = make_inputs(19, 2, 32, 256, B=2, seed=5)
        o_ref, f_ref, s_ref, d_ref = reference(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  config=RecurrentConfig(block_v=128))
        o, f, states = self.recurrent(q, k, v, g, beta, output_all_states=True, **kw)
        o2, f2, deltas = self.recurrent(q, k, v, g, beta, output_deltas=True, **kw)
        assert states.shape == (2, 19, 2 * H, 32, 256) and deltas.shape == (2, 19, 2 * H, 256)
        for got, want in ((o, o_ref), (f, f_ref), (states, s_ref), (o2, o_ref), (f2, f_ref), (deltas, d_ref)):
            assert rel_rms(got, want) <= F32_TOL, rel_rms(got, want)
        o, f = self.chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                          config=ChunkConfig(chunk_size=16, block_v=128))
        assert rel_rms(o, o_ref) <= F32_TOL and rel_rms(f, f_ref) <= F32_TOL

    def test_decay_to_zero_stays_finite(self):
        """Every channel decaying to ~0 (g = -30 a token: exp(+-gc) over a chunk is far out of f32 range): the
        state forgets everything before the token, the outputs stay finite and right."""
        (q, k, v, g, beta), h0 = make_inputs(40, 1, 32, 32, seed=7)
        g = jnp.full(g.shape, -30.0)
        o_ref, f_ref = reference(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)[:2]
        for run in (self.chunk, self.recurrent):
            o, f = run(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)[:2]
            assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(f)))
            assert rel_rms(o, o_ref) <= F32_TOL and rel_rms(f, f_ref) <= F32_TOL

    def test_prefill_then_decode_equals_long_prefill(self):
        """The chunked kernel's final state continues in the recurrent kernel (decode windows of 4)."""
        T, T1 = 75, 67
        (q, k, v, g, beta), h0 = make_inputs(T, 2, 32, 32, seed=9)
        kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
        o_long, s_long = self.chunk(q, k, v, g, beta, initial_state=h0, **kw)
        sl = lambda x, a, b: x[:, a:b]  # noqa: E731
        o1, s = self.chunk(*(sl(x, 0, T1) for x in (q, k, v, g, beta)), initial_state=h0, **kw)
        outs = [o1]
        for t in range(T1, T, 4):
            o_t, s = self.recurrent(*(sl(x, t, t + 4) for x in (q, k, v, g, beta)), initial_state=s, **kw)
            outs.append(o_t)
        assert rel_rms(jnp.concatenate(outs, axis=1), o_long) <= F32_TOL and rel_rms(s, s_long) <= F32_TOL


class TestGPU(TestTPU):
    """The same tests on the Triton variants (K, V and the value block powers of two)."""
    BACKEND = "gpu"
    CHUNK_CASES = [(1, 2, 32, 64, jnp.float32, True, 2), (75, 2, 64, 32, jnp.bfloat16, True, 1)]
    RECURRENT_CASES = [(1, 2, 32, 64, jnp.float32, True, 2), (63, 2, 32, 16, jnp.bfloat16, False, 1)]


def pytest_generate_tests(metafunc):   # noqa: D103  (a module-level hook: per-class case lists)
    if "case" in metafunc.fixturenames:
        cases = (metafunc.cls.CHUNK_CASES if "chunk" in metafunc.function.__name__ else metafunc.cls.RECURRENT_CASES)
        metafunc.parametrize("case", cases, ids=_ids(cases))


# ---------------------------------------------------------------- input checks and GDN left alone

def test_bad_gate_shape_raises():
    (q, k, v, g, beta), _ = make_inputs(8, 1, 32, 32)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV, K\]"):
        chunk_kda_pallas(q, k, v, g[..., :16], beta, interpret=True)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV, K\]"):
        fused_recurrent_gated_delta_rule_pallas(q, k, v, g[..., :16], beta, interpret=True)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV\]"):    # a per-head g of the wrong length
        fused_recurrent_gated_delta_rule_pallas(q, k, v, g[:, :, :1, 0], beta, interpret=True)
    with pytest.raises(KernelUnsupported, match="multiple of 8"):
        chunk_kda_pallas(q, k, v, g, beta, chunk_size=12, interpret=True)


def test_sub_block():
    assert [pallas_chunk.sub_block(C) for C in (8, 16, 24, 64, 128)] == [8, 16, 8, 16, 16]


def test_gdn_recurrent_unchanged():
    """A per-head g still takes the scalar path: the same kernel name, cost and results as the reference."""
    from pallas_kernels.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: PLC0415
    (q, k, v, g, beta), h0 = make_inputs(19, 2, 32, 48, seed=11)
    g_head = g[..., 20]                                  # a moderate channel as the per-head decay
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, f = fused_recurrent_gated_delta_rule_pallas(q, k, v, g_head, beta, interpret=True, **kw)
    o_ref, f_ref = naive_recurrent_gated_delta_rule(q, k, v, g_head, beta, **kw)
    assert rel_rms(o, o_ref) <= F32_TOL and rel_rms(f, f_ref) <= F32_TOL
    # the per-channel path with every channel given the same decay computes the same thing
    o2, f2 = fused_recurrent_gated_delta_rule_pallas(q, k, v, jnp.repeat(g_head[..., None], 32, -1), beta,
                                                     interpret=True, **kw)
    assert rel_rms(o2, o) <= F32_TOL and rel_rms(f2, f) <= F32_TOL
