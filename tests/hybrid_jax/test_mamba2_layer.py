"""The Mamba2 mixer (hybrid_jax/layers/mamba2.py) against transformers' NemotronHMamba2Mixer (its torch path)
on random weights in float32, and its own state carry-over: a prefill then decode steps equal one prefill,
padding tokens leave both states alone, a pooled decode touches only its rows."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.layers.mamba2 import Mamba2Dims, group_major, mamba2_mixer, mamba2_mixer_ragged, param_shapes, states_after

torch = pytest.importorskip("torch")
nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
NemotronHConfig = pytest.importorskip("transformers").NemotronHConfig

HIDDEN, LIMIT = 32, (0.0, 1.0)
DIMS = Mamba2Dims(num_heads=4, head_dim=8, n_groups=2, state_size=16, conv_kernel=4, eps=1e-5, time_step_limit=LIMIT)


def rel_rms(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def hf_mixer(seed=0):
    """A NemotronHMamba2Mixer of DIMS with every parameter random (A_log spread so heads decay at different
    rates, dt_bias around softplus^-1 of ~0.1 .. 1)."""
    cfg = NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=DIMS.num_heads, mamba_head_dim=DIMS.head_dim,
                          n_groups=DIMS.n_groups, ssm_state_size=DIMS.state_size, conv_kernel=DIMS.conv_kernel,
                          layer_norm_epsilon=DIMS.eps, time_step_limit=LIMIT, chunk_size=8,
                          layer_types=["linear_attention"], num_hidden_layers=1)
    torch.manual_seed(seed)
    m = nh.NemotronHMamba2Mixer(cfg, layer_idx=0).float()
    with torch.no_grad():
        for name, prm in m.named_parameters():
            prm.copy_(torch.randn_like(prm) * (0.3 if name.endswith("weight") else 1.0))
        m.A_log.copy_(torch.linspace(-1.0, 2.0, DIMS.num_heads))
        m.dt_bias.copy_(torch.linspace(-2.0, 0.5, DIMS.num_heads))
    return m


def our_params(m) -> dict:
    """transformers' mixer parameters in the layout `param_shapes` names (in_proj and the conv group-major)."""
    t = lambda a: jnp.asarray(a.detach().numpy())  # noqa: E731

    def gm(a, z_dt):
        return group_major(a, DIMS, 0, jnp.concatenate, with_z_dt=z_dt)
    p = {"in_proj": gm(t(m.in_proj.weight), True).T, "conv": gm(t(m.conv1d.weight)[:, 0, :], False).T,
         "conv_bias": gm(t(m.conv1d.bias), False),
         "dt_bias": t(m.dt_bias), "A_log": t(m.A_log), "D": t(m.D), "norm": t(m.norm.weight),
         "out_proj": t(m.out_proj.weight).T}
    assert {k: v.shape for k, v in p.items()} == param_shapes(HIDDEN, DIMS)
    return p


def zero_states(B, rows=None):
    return (jnp.zeros((B, DIMS.conv_kernel - 1, DIMS.conv_dim), jnp.float32),
            jnp.zeros((rows or B, DIMS.num_heads, DIMS.head_dim, DIMS.state_size), jnp.float32))   # [.., headdim, dstate]


def run(p, x, valid=None, states=None, impl="xla", **kw):
    B, T, _ = x.shape
    valid = jnp.ones((B, T), bool) if valid is None else valid
    conv, ssm = states or zero_states(B)
    return mamba2_mixer(p, jnp.asarray(x), valid, jnp.sum(valid, axis=1).astype(jnp.int32), conv, ssm, dims=DIMS,
                        impl=impl, **kw)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_matches_transformers_mixer(impl):
    """Two rows of 13 tokens from zero states (transformers' forward without a cache)."""
    m = hf_mixer()
    x = np.random.default_rng(1).standard_normal((2, 13, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        want = m(torch.from_numpy(x)).numpy()
    out, _, _ = run(our_params(m), x, impl=impl)
    assert out.shape == want.shape and rel_rms(out, want) <= 1e-5, rel_rms(out, want)


def test_prefill_then_decode_equals_one_prefill():
    """9 tokens chunked, then 4 decode steps (conv and SSM states carried) == 13 tokens at once; a verify
    window run token by token (fused_recurrent) equals it too."""
    p = our_params(hf_mixer(seed=2))
    x = np.random.default_rng(3).standard_normal((2, 13, HIDDEN)).astype(np.float32)
    full, conv_full, ssm_full = run(p, x)
    outs = []
    out, *states = run(p, x[:, :9])
    outs.append(out)
    for t in range(9, 13):
        out, *states = run(p, x[:, t:t + 1], states=tuple(states))
        outs.append(out)
    assert rel_rms(jnp.concatenate(outs, axis=1), full) <= 1e-5
    assert rel_rms(states[0], conv_full) <= 1e-6 and rel_rms(states[1], ssm_full) <= 1e-5
    out, *_ = run(p, x[:, 9:], states=tuple(run(p, x[:, :9])[1:]), fused_recurrent=True)
    assert rel_rms(out, full[:, 9:]) <= 1e-5


def test_padding_leaves_states_alone():
    """Row 1 has 6 real tokens then 4 padding ones: its states equal a 6-token run's."""
    p = our_params(hf_mixer(seed=4))
    x = np.random.default_rng(5).standard_normal((2, 10, HIDDEN)).astype(np.float32)
    valid = jnp.asarray(np.arange(10)[None] < np.array([[10], [6]]))
    out, conv, ssm = run(p, x, valid)
    out6, conv6, ssm6 = run(p, x[1:, :6])
    assert rel_rms(out[1, :6], out6[0]) <= 1e-6
    assert rel_rms(conv[1], conv6[0]) <= 1e-6 and rel_rms(ssm[1], ssm6[0]) <= 1e-6


@pytest.mark.parametrize("T", [1, 5])
def test_pooled_state_rows(T):
    """state_rows: rows [3, 0] of a pool of 5 (decode: in place; T = 5: the rows gathered) == their own run."""
    p = our_params(hf_mixer(seed=6))
    x = np.random.default_rng(7).standard_normal((2, T, HIDDEN)).astype(np.float32)
    conv, _ = zero_states(2)
    pool = jnp.asarray(np.random.default_rng(8).standard_normal((5, 4, 8, 16)), jnp.float32) * 0.1
    rows = jnp.asarray([3, 0], jnp.int32)
    out, _, new_pool = run(p, x, states=(conv, pool), state_rows=rows)
    want, _, want_rows = run(p, x, states=(conv, pool[rows]))
    assert rel_rms(out, want) <= 1e-6 and rel_rms(new_pool[rows], want_rows) <= 1e-6
    np.testing.assert_array_equal(new_pool[jnp.asarray([1, 2, 4])], pool[jnp.asarray([1, 2, 4])])


def test_per_token_states_rebuild_the_states_after_any_position():
    """per_token_states: states_after(parts, idx) equals the states of a run stopped after idx; row 1 is padded
    after 4 tokens, and its SSM state after a padding position is its last real one (a verify step only
    asks for real positions' conv states)."""
    p = our_params(hf_mixer(seed=9))
    x = np.random.default_rng(10).standard_normal((2, 6, HIDDEN)).astype(np.float32)
    valid = jnp.asarray(np.arange(6)[None] < np.array([[6], [4]]))
    conv0 = jnp.asarray(np.random.default_rng(11).standard_normal((2, 3, DIMS.conv_dim)), jnp.float32)
    ssm0 = jnp.asarray(np.random.default_rng(12).standard_normal((2, 4, 8, 16)), jnp.float32) * 0.1
    out, conv, ssm, parts = run(p, x, valid, states=(conv0, ssm0), per_token_states=True)
    assert rel_rms(out, run(p, x, valid, states=(conv0, ssm0))[0]) <= 1e-5

    def stopped_after(b, n):
        return run(p, x[b:b + 1, :n], states=(conv0[b:b + 1], ssm0[b:b + 1]))[1:]
    for idx in ([0, 0], [2, 3], [5, 3]):
        c, s = states_after(parts, jnp.asarray(idx, jnp.int32))
        for b in range(2):
            c_want, s_want = stopped_after(b, idx[b] + 1)
            assert rel_rms(c[b], c_want[0]) <= 1e-6 and rel_rms(s[b], s_want[0]) <= 1e-5, (idx, b)
    _, s = states_after(parts, jnp.asarray([5, 5], jnp.int32))
    assert rel_rms(s[1], stopped_after(1, 4)[1][0]) <= 1e-5


def test_ragged_batch_equals_each_sequence_alone():
    """A ragged batch (sequences of 5, 0 and 7 tokens, then 2 rows of no sequence, each from its own states)
    gives every sequence what the padded mixer gives it alone; the empty one keeps its states."""
    p = our_params(hf_mixer(seed=13))
    rng = np.random.default_rng(14)
    cu = np.array([0, 5, 5, 12])
    x = rng.standard_normal((14, HIDDEN)).astype(np.float32)
    seq = np.clip(np.searchsorted(cu[1:], np.arange(14), side="right"), 0, 2)
    conv0 = jnp.asarray(rng.standard_normal((3, 3, DIMS.conv_dim)), jnp.float32)
    ssm0 = jnp.asarray(rng.standard_normal((3, 4, 8, 16)), jnp.float32) * 0.1
    out, conv, ssm = mamba2_mixer_ragged(p, jnp.asarray(x), jnp.asarray(seq, jnp.int32), jnp.arange(14) < 12,
                                         jnp.asarray(cu, jnp.int32), conv0, ssm0, dims=DIMS)
    for s in (0, 2):
        want, c_want, s_want = run(p, x[None, cu[s]:cu[s + 1]], states=(conv0[s:s + 1], ssm0[s:s + 1]))
        assert rel_rms(out[cu[s]:cu[s + 1]], want[0]) <= 1e-5
        assert rel_rms(conv[s], c_want[0]) <= 1e-6 and rel_rms(ssm[s], s_want[0]) <= 1e-5
    np.testing.assert_array_equal(conv[1], conv0[1])
    np.testing.assert_array_equal(ssm[1], ssm0[1])
