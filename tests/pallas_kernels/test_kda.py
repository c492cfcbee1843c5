"""Kimi Delta Attention (pallas_kernels.kda), reference and XLA paths, against a float64 recurrence
(kda_float64.py) on awkward shapes: relative RMS <= 1e-5 in f32, <= 1e-2 with bf16 q / k / v (the bounds
of test_gated_delta_rule.py, for the same reasons). The Pallas kernels are in test_kda_pallas.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_float64 import inputs, reference, rel_rms

from pallas_kernels import abi, chunk_gated_delta_rule, chunk_kda, fused_recurrent_kda, state_after

F32_TOL, BF16_TOL = 1e-5, 1e-2


def _run(op, impl, args, h0, dtype=jnp.float32, **kw):
    q, k, v, g, beta = args
    q, k, v = (jnp.asarray(x).astype(dtype) for x in (q, k, v))
    return op(q, k, v, jnp.asarray(g), jnp.asarray(beta), initial_state=jnp.asarray(h0), output_final_state=True,
              use_qk_l2norm_in_kernel=True, impl=impl, **kw)


def _rounded(args, dtype):
    """The inputs as the op sees them in `dtype` (the reference starts from the same rounded values)."""
    return tuple(np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)) if i < 3 else x
                 for i, x in enumerate(args))


@pytest.mark.parametrize("T", [1, 63, 75, 500])
@pytest.mark.parametrize("op, impl", [(chunk_kda, "xla"), (fused_recurrent_kda, "xla"), (chunk_kda, "reference")])
def test_matches_the_float64_recurrence(op, impl, T):
    """K != V, two key heads with two value heads each, an initial state, decays near 0 and near 1."""
    args, h0 = inputs(B=2, T=T, H=2, HV=4, K=16, V=24, seed=T)
    o, s = _run(op, impl, args, h0)
    o64, s64, *_ = reference(*args, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda])
def test_bf16_inputs(op):
    args, h0 = inputs(B=1, T=75, H=2, HV=2, K=32, V=32, seed=3)
    o, s = _run(op, "xla", args, h0, dtype=jnp.bfloat16)
    o64, s64, *_ = reference(*_rounded(args, jnp.bfloat16), initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert o.dtype == jnp.bfloat16
    assert rel_rms(o, o64) <= BF16_TOL and rel_rms(s, s64) <= 10 * F32_TOL


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_chunk_sizes(chunk_size):
    """Chunks of one sub-block (8), of two (16) and of eight (64): the log-space products agree."""
    args, h0 = inputs(B=1, T=75, H=1, HV=2, K=16, V=8, seed=5)
    o, s = _run(chunk_kda, "xla", args, h0, chunk_size=chunk_size)
    o64, s64, *_ = reference(*args, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL


def test_a_decay_that_empties_the_state_within_a_chunk_stays_finite():
    """Every channel decays by e^-30 a token: over a 32-token chunk exp(-gc) would be e^960 (inf in f32)."""
    args, h0 = inputs(B=1, T=64, H=1, HV=1, K=8, V=8, seed=7)
    args = args[:3] + (np.full_like(args[3], -30.0),) + args[4:]
    o, s = _run(chunk_kda, "xla", args, h0)
    o64, s64, *_ = reference(*args, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert np.isfinite(np.asarray(o)).all() and rel_rms(o, o64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL


@pytest.mark.parametrize("op, impl", [(chunk_kda, "xla"), (fused_recurrent_kda, "xla"), (chunk_kda, "reference")])
def test_packed_sequences_with_an_empty_and_a_one_token_one(op, impl):
    lens = [5, 0, 1, 40, 17]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    args, h0 = inputs(B=1, T=int(cu[-1]) + 3, H=2, HV=2, K=16, V=8, seed=11, N=len(lens))  # 3 tokens in no sequence
    o, s = _run(op, impl, args, h0, cu_seqlens=jnp.asarray(cu))
    o64, s64, *_ = reference(*args, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o64) <= F32_TOL and rel_rms(s, s64) <= F32_TOL
    assert np.array_equal(np.asarray(s[1]), h0[1])                    # the empty sequence keeps its state
    assert not np.asarray(o[0, int(cu[-1]):]).any()


def test_all_states_and_the_states_rebuilt_from_deltas():
    """The speculative verify's two ways to keep the state after each token: output_all_states writes
    them, output_deltas writes each token's update and `state_after` rebuilds any one (decay per channel)."""
    args, h0 = inputs(B=2, T=9, H=1, HV=2, K=16, V=8, seed=13)
    _, _, states64, _ = reference(*args, initial_state=h0, use_qk_l2norm_in_kernel=True)
    _, _, states = _run(fused_recurrent_kda, "xla", args, h0, output_all_states=True)
    assert rel_rms(states, states64) <= F32_TOL
    _, _, deltas = _run(fused_recurrent_kda, "xla", args, h0, output_deltas=True)
    for idx in ([0, 8], [4, 2]):
        rebuilt = state_after(jnp.asarray(h0), jnp.asarray(args[1]), jnp.asarray(args[3]), deltas,
                              jnp.asarray(idx, jnp.int32), use_qk_l2norm_in_kernel=True)
        assert rel_rms(rebuilt, states64[np.arange(2), idx]) <= F32_TOL


def test_a_gate_equal_on_every_channel_is_gated_deltanet():
    """KDA with g[..., d] = g for every channel d is the gated delta rule with the scalar g."""
    args, h0 = inputs(B=1, T=40, H=2, HV=4, K=16, V=16, seed=17)
    scalar = args[3][..., 0]
    per_channel = np.repeat(scalar[..., None], 16, axis=-1)
    o, s = _run(chunk_kda, "xla", args[:3] + (per_channel,) + args[4:], h0)
    q, k, v, _, beta = (jnp.asarray(x) for x in args)
    o_gdn, s_gdn = chunk_gated_delta_rule(q, k, v, jnp.asarray(scalar), beta, initial_state=jnp.asarray(h0),
                                          output_final_state=True, use_qk_l2norm_in_kernel=True, impl="xla")
    assert rel_rms(o, o_gdn) <= F32_TOL and rel_rms(s, s_gdn) <= F32_TOL


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda])
def test_a_per_head_gate_is_refused_by_name(op):
    args, h0 = inputs(B=1, T=4, H=1, HV=1, K=8, V=8)
    args = args[:3] + (args[3][..., 0],) + args[4:]
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV, K\]"):
        _run(op, "xla", args, h0)


def test_its_state_has_its_own_abi_id():
    assert abi.get("kimi_delta_attention").id != abi.get("gated_delta_rule").id
