"""On-device sampling: filters keep exactly the right support, frequencies follow the distribution."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.sampling import SamplerFlags, sample

PROBS = np.array([0.4, 0.3, 0.2, 0.1, 0.0], np.float32)


def _draw(n, temperature=1.0, top_k=-1, top_p=1.0, probs=PROBS):
    logits = jnp.log(jnp.asarray(np.tile(probs, (n, 1))) + 1e-30)
    keys = jax.vmap(jax.random.key)(jnp.arange(n, dtype=jnp.uint32))
    flags = SamplerFlags(any_random=temperature > 0, use_top_k=top_k > 0, use_top_p=top_p < 1)
    f = jax.jit(sample, static_argnames="flags")
    return np.asarray(f(logits, keys, jnp.int32(0), jnp.full((n,), temperature, jnp.float32),
                        jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32), flags=flags))


def _check_freq(draws, expected):
    n = len(draws)
    for tok, p in enumerate(expected):
        f = np.mean(draws == tok)
        sd = np.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(f - p) <= 5 * sd + 1e-9, f"token {tok}: frequency {f:.4f}, expected {p:.4f}"


def test_greedy():
    assert set(_draw(64, temperature=0.0)) == {0}


def test_plain_sampling_follows_probabilities():
    _check_freq(_draw(20000), PROBS)


def test_top_k_keeps_k_most_likely_renormalised():
    d = _draw(20000, top_k=2)
    assert set(d) <= {0, 1}
    _check_freq(d, np.array([0.4, 0.3, 0, 0, 0]) / 0.7)


def test_top_p_keeps_smallest_set_reaching_p():
    d = _draw(20000, top_p=0.5)          # 0.4 alone < 0.5, so {0, 1} is the nucleus
    assert set(d) <= {0, 1}
    _check_freq(d, np.array([0.4, 0.3, 0, 0, 0]) / 0.7)


def test_temperature_sharpens():
    d = _draw(20000, temperature=0.5)    # p^2 renormalised
    p2 = PROBS ** 2 / np.sum(PROBS ** 2)
    _check_freq(d, p2)


def test_rows_mix_greedy_and_random():
    logits = jnp.log(jnp.asarray(np.tile(PROBS, (4, 1))) + 1e-30)
    keys = jax.vmap(jax.random.key)(jnp.arange(4, dtype=jnp.uint32))
    outs = set()
    for step in range(50):
        t = sample(logits, keys, jnp.int32(step), jnp.asarray([0.0, 1.0, 0.0, 1.0]), jnp.full((4,), -1),
                   jnp.ones((4,)), SamplerFlags(True, False, False))
        assert int(t[0]) == 0 and int(t[2]) == 0
        outs.add(int(t[1]))
    assert len(outs) > 1


def test_greedy_tokens_equal_argmax_with_ties_and_nans():
    """The two-reduction argmax picks what jnp.argmax picks: the first maximum, the first NaN."""
    from hybrid_jax.sampling import greedy_tokens  # noqa: PLC0415
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(4, 5, 97)).astype(np.float32)     # small integers: many ties
    x[0, 1, [7, 50]] = np.nan
    x[1, 2, 3] = np.inf
    x[2, 0] = -np.inf
    x[3, 4] = np.nan
    got = np.asarray(jax.jit(greedy_tokens)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.dtype == np.int32 and got[0, 1] == 7 and got[1, 2] == 3 and got[2, 0] == 0 and got[3, 4] == 0
