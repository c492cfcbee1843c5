"""DeepSeek sparse attention ops: every implementation against the token-level reference over awkward
sizes, the dense-equivalence rule, fp8 keys, bad input, the hit rate, and export for TPU and CUDA."""
from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu  # noqa: F401  registers the Mosaic GPU lowering
import jax.experimental.pallas.tpu  # noqa: F401  registers the Mosaic TPU lowering
import jax.experimental.pallas.triton  # noqa: F401  registers the Triton lowering
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sparse_attention as sa
from pallas_kernels.sparse_attention import naive
from pallas_kernels.sparse_attention import ops as sa_ops
from pallas_kernels.sparse_attention.common import physical_rows

TRITON_CALL = "__gpu$xla.gpu.triton"


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def _paged(rng, B, NP, ps, extra_pages=1):
    """A shuffled page assignment: row b owns NP distinct pages of a pool of B * NP + extra pages."""
    P = B * NP + extra_pages
    perm = rng.permutation(P)[:B * NP].reshape(B, NP)
    return P, jnp.asarray(perm, jnp.int32)


def _indexer_inputs(seed, B, T, H, D, ps, NP, lengths, start=None):
    rng = np.random.default_rng(seed)
    P, pt = _paged(rng, B, NP, ps)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((P, ps, D)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    start = lens - T if start is None else jnp.asarray(start, jnp.int32)
    qpos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    return q, w, k, pt, qpos, lens


def _sets(idx):
    return [[sorted(int(x) for x in r if x >= 0) for r in row] for row in np.asarray(idx)]


# B, T, H, D, ps, NP, lengths, topk
INDEXER_CASES = [
    (1, 1, 4, 16, 16, 5, [75], 8),             # decode, topk < context
    (2, 7, 3, 8, 8, 4, [30, 9], 5),            # prefill rows of different lengths, odd heads
    (1, 63, 2, 16, 32, 2, [63], 63),           # topk == context
    (2, 1, 5, 16, 16, 3, [40, 1], 7),          # a row with fewer keys than topk
]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}K{c[7]}")
def test_indexer_topk_matches_reference(case, impl):
    B, T, H, D, ps, NP, lengths, topk = case
    q, w, k, pt, qpos, lens = _indexer_inputs(sum(lengths) + T, B, T, H, D, ps, NP, lengths)
    ref = sa.indexer_topk(q, w, k, pt, qpos, lens, topk=topk, impl="reference")
    got = sa.indexer_topk(q, w, k, pt, qpos, lens, topk=topk, impl=impl)
    assert got.shape == (B, T, topk) and got.dtype == jnp.int32
    assert _sets(got) == _sets(ref)
    # causality and readability: every selected key is <= the query's position and < the row length
    g = np.asarray(got)
    sel = g >= 0
    assert np.all(g[sel] <= np.broadcast_to(np.asarray(qpos)[..., None], g.shape)[sel])


def test_indexer_threshold_ties_resolved_by_position():
    """Equal scores at the K-th place: the lowest positions win, like lax.top_k."""
    B, T, H, D, ps, NP = 1, 1, 2, 8, 8, 2
    q = jnp.ones((B, T, H, D))
    w = jnp.ones((B, T, H))
    k = jnp.ones((NP, ps, D))                   # every key scores the same
    pt = jnp.arange(NP, dtype=jnp.int32)[None]
    lens, qpos = jnp.asarray([16]), jnp.asarray([[15]])
    got = sa.indexer_topk(q, w, k, pt, qpos, lens, topk=5, impl="pallas")
    assert np.asarray(got).tolist() == [[[0, 1, 2, 3, 4]]]


def _mla_inputs(seed, B, T, H, R, Dr, ps, NP, lengths, K):
    rng = np.random.default_rng(seed)
    P, pt = _paged(rng, B, NP, ps)
    ql = jnp.asarray(rng.standard_normal((B, T, H, R)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((B, T, H, Dr)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((P, ps, R)), jnp.float32)
    rp = jnp.asarray(rng.standard_normal((P, ps, Dr)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    idx = np.stack([np.stack([rng.choice(max(int(n), 1), K, replace=K > int(n)) for _ in range(T)])
                    for n in lengths]).astype(np.int32)
    idx[..., -1] = -1                                          # a padding slot in every query
    return ql, qr, lat, rp, pt, jnp.asarray(idx), lens


MLA_CASES = [(1, 1, 4, 16, 8, 8, 4, [30], 8), (2, 3, 3, 32, 16, 16, 3, [40, 7], 16),
             (1, 5, 2, 8, 8, 4, 7, [25], 4)]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}R{c[3]}K{c[8]}")
def test_sparse_mla_matches_reference(case, impl):
    B, T, H, R, Dr, ps, NP, lengths, K = case
    ql, qr, lat, rp, pt, idx, lens = _mla_inputs(K + T, B, T, H, R, Dr, ps, NP, lengths, K)
    ref = sa.sparse_mla_attention(ql, qr, lat, rp, pt, idx, lens, scale=0.3, impl="reference")
    got = sa.sparse_mla_attention(ql, qr, lat, rp, pt, idx, lens, scale=0.3, impl=impl)
    assert got.shape == (B, T, H, R)
    assert rel_rms(got, ref) < 1e-5


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_sparse_equals_dense_when_topk_covers_context(impl):
    B, T, H, D, ps, NP = 2, 4, 3, 16, 8, 3
    lengths = [20, 13]
    q, w, k, pt, qpos, lens = _indexer_inputs(5, B, T, H, D, ps, NP, lengths)
    idx = sa.indexer_topk(q, w, k, pt, qpos, lens, topk=NP * ps, impl=impl)
    ql, qr, lat, rp, _, _, _ = _mla_inputs(6, B, T, H, 16, 8, ps, NP, lengths, 4)
    P = lat.shape[0]
    lat, rp = lat[:P], rp[:P]
    sparse = sa.sparse_mla_attention(ql, qr, lat, rp, pt, idx, lens, scale=0.25, impl=impl)
    dense = sa.dense_mla_attention(ql, qr, lat, rp, pt, qpos, lens, scale=0.25)
    assert rel_rms(sparse, dense) < 1e-5


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_bad_indices_are_masked_never_read(impl):
    """Indices past a row's length, negative, or whose page lies outside the pool read nothing: the
    output equals attention over the good indices only, even when the bad rows hold huge values."""
    B, T, H, R, Dr, ps, NP = 2, 1, 2, 8, 8, 4, 3
    ql, qr, lat, rp, pt, _, lens = _mla_inputs(1, B, T, H, R, Dr, ps, NP, [10, 12], 4)
    lat = lat.at[pt[1]].set(1e4)                                         # row 1's pages: poison
    good = jnp.asarray([[[0, 3, 9, -1]], [[1, 2, 5, 11]]], jnp.int32)
    bad = jnp.asarray([[[0, 3, 9, 10]], [[1, 2, 5, 11]]], jnp.int32)    # 10 >= length of row 0
    pt_bad = pt.at[0, 2].set(10_000)                                     # a page outside the pool
    bad2 = jnp.asarray([[[0, 3, 9, -7]], [[1, 2, 5, 11]]], jnp.int32)
    ref = sa.sparse_mla_attention(ql, qr, lat, rp, pt, good, lens, scale=0.5, impl="reference")
    for idx, table in ((bad, pt), (bad2, pt)):
        got = sa.sparse_mla_attention(ql, qr, lat, rp, table, idx, lens, scale=0.5, impl=impl)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
    got = sa.sparse_mla_attention(ql, qr, lat, rp, pt_bad, good, lens, scale=0.5, impl=impl)
    only = sa.sparse_mla_attention(ql, qr, lat, rp, pt, jnp.asarray([[[0, 3, -1, -1]], [[1, 2, 5, 11]]]),
                                   lens, scale=0.5, impl="reference")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(only[0]), rtol=1e-5, atol=1e-5)
    assert np.all(np.abs(np.asarray(got[0])) < 100)


def test_bad_input_raises_value_errors():
    q, w, k, pt, qpos, lens = _indexer_inputs(0, 1, 2, 2, 8, 8, 2, [10])
    with pytest.raises(ValueError, match="topk"):
        sa.indexer_topk(q, w, k, pt, qpos, lens, topk=17)
    with pytest.raises(ValueError, match="page_table"):
        sa.indexer_topk(q, w, k, jnp.zeros((3, 2), jnp.int32), qpos, lens, topk=4)
    with pytest.raises(ValueError, match="w must be"):
        sa.indexer_topk(q, w[..., :1], k, pt, qpos, lens, topk=4)
    with pytest.raises(ValueError, match="impl"):
        sa.indexer_topk(q, w, k, pt, qpos, lens, topk=4, impl="cuda")
    with pytest.raises(ValueError, match="k_scale"):
        sa.indexer_topk(q, w, k.astype(jnp.float8_e4m3fn), pt, qpos, lens, topk=4)
    ql, qr, lat, rp, pt2, idx, lens2 = _mla_inputs(0, 1, 1, 2, 8, 8, 4, 2, [6], 4)
    with pytest.raises(ValueError, match="indices"):
        sa.sparse_mla_attention(ql, qr, lat, rp, pt2, idx[:, :, :, None], lens2, scale=1.0)
    with pytest.raises(ValueError, match="pools"):
        sa.sparse_mla_attention(ql, qr, lat, rp[:, :2], pt2, idx, lens2, scale=1.0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fp8_keys_recall_against_bf16(impl):
    B, T, H, D, ps, NP, topk = 1, 4, 8, 32, 16, 8, 32
    q, w, k, pt, qpos, lens = _indexer_inputs(3, B, T, H, D, ps, NP, [128])
    kb = k.astype(jnp.bfloat16)
    k8, sc = sa.quantize_fp8(kb)
    assert k8.dtype == jnp.float8_e4m3fn and sc.shape == k.shape[:2]
    ref = _sets(sa.indexer_topk(q, w, kb, pt, qpos, lens, topk=topk, impl="reference"))
    got = _sets(sa.indexer_topk(q, w, k8, pt, qpos, lens, topk=topk, k_scale=sc, impl=impl))
    recall = np.mean([len(set(a) & set(b)) / len(b) for ra, rb in zip(got, ref) for a, b in zip(ra, rb)])
    assert recall > 0.85


def test_sparse_hit_rate():
    pt = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    resident = jnp.asarray([True, False, True, True])
    idx = jnp.asarray([[[0, 1, 5, -1]], [[0, 7, 6, 3]]], jnp.int32)      # row 0: pages 0, 0, 1
    hr = sa.sparse_hit_rate(idx, pt, resident, 4, jnp.asarray([8, 8]))
    np.testing.assert_allclose(np.asarray(hr), [2 / 3, 1.0])


def test_sparse_hit_rate_counts_alike_with_and_without_a_gather(monkeypatch):
    """The decode form (selections counted per page-table slot by comparison) and the gathering form
    (physical rows, for large problems) give the same rates, with padding, positions past a row's
    length or its table, pages outside the pool and non-resident pages among the selections."""
    rng = np.random.default_rng(3)
    B, T, K, ps, NP, P = 3, 2, 16, 4, 6, 20
    pt = jnp.asarray(rng.permutation(P)[:B * NP].reshape(B, NP), jnp.int32).at[1, 2].set(P + 3).at[2, 0].set(-1)
    resident = jnp.asarray(rng.random(P) < 0.6)
    idx = jnp.asarray(rng.integers(-2, NP * ps + 3, (B, T, K)), jnp.int32)
    lens = jnp.asarray([NP * ps, 9, 17], jnp.int32)
    compared = sa.sparse_hit_rate(idx, pt, resident, ps, lens)
    monkeypatch.setattr(sa_ops, "COMPARE_PAIRS", 0)
    gathered = sa.sparse_hit_rate(idx, pt, resident, ps, lens)
    np.testing.assert_array_equal(np.asarray(compared), np.asarray(gathered))
    rows, ok = physical_rows(idx, pt, ps, P, lens)                       # by hand, row by row
    for b in range(B):
        n = int(np.sum(ok[b]))
        want = float(np.sum(np.asarray(ok[b]) & np.asarray(resident)[np.asarray(rows[b]) // ps])) / n if n else 1.0
        assert abs(float(compared[b]) - want) < 1e-6
    assert 0 < float(np.min(compared)) < 1


def _export(fn, platform, args):
    return jax.export.export(jax.jit(fn), platforms=[platform],
                             disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args).mlir_module()


S = jax.ShapeDtypeStruct
CALLS = {"tpu": "tpu_custom_call", "cuda": TRITON_CALL}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_indexer_exports(platform, fp8):
    """Through the public op: the kernel follows the platform lowered for, not the host's."""
    call = CALLS[platform]
    B, T, H, D, ps, NP, P = 2, 3, 4, 128, 128, 4, 9
    kdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16

    def fn(q, w, k, pt, qpos, lens, *sc):
        return sa.indexer_topk(q, w, k, pt, qpos, lens, topk=64, k_scale=sc[0] if sc else None, impl="pallas")
    args = [S((B, T, H, D), jnp.bfloat16), S((B, T, H), jnp.float32), S((P, ps, D), kdt),
            S((B, NP), jnp.int32), S((B, T), jnp.int32), S((B,), jnp.int32)]
    if fp8:
        args.append(S((P, ps), jnp.float32))
    assert call in _export(fn, platform, args)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sparse_mla_exports(platform):
    call = CALLS[platform]
    B, T, H, R, Dr, ps, NP, P, K = 2, 1, 16, 512, 64, 64, 4, 9, 64

    def fn(ql, qr, lat, rp, pt, idx, lens):
        return sa.sparse_mla_attention(ql, qr, lat, rp, pt, idx, lens, scale=0.1, impl="pallas")
    args = [S((B, T, H, R), jnp.bfloat16), S((B, T, H, Dr), jnp.bfloat16), S((P, ps, R), jnp.bfloat16),
            S((P, ps, Dr), jnp.bfloat16), S((B, NP), jnp.int32), S((B, T, K), jnp.int32), S((B,), jnp.int32)]
    assert call in _export(fn, platform, args)


def test_reference_scores_have_no_selectable_future():
    q, w, k, pt, qpos, lens = _indexer_inputs(2, 1, 3, 2, 8, 8, 2, [12])
    s = naive.index_scores_reference(q, w, k, pt, qpos, lens)
    j = np.arange(16)
    assert np.all(np.isinf(np.asarray(s[0]))[np.broadcast_to(j[None] > np.asarray(qpos[0])[:, None], (3, 16))])


@pytest.mark.parametrize("impl", ["pallas", "xla", "reference"])
def test_layer_of_a_stack_reads_that_layer(impl):
    """With `layer`, the ops take the layers' stacks [L, P, ps, X] and read layer `layer` (the TPU kernels in
    place): the same result as handing them that layer's pools."""
    rng = np.random.default_rng(5)
    B, T, H, R, Dr, ps, NP, K, Hi, Di = 2, 3, 4, 128, 64, 8, 4, 6, 2, 128
    L, P = 3, B * NP + 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    lat, rope, keys = f(L, P, ps, R), f(L, P, ps, Dr), f(L, P, 128, Di)
    table = jnp.asarray(rng.permutation(P)[:B * NP].reshape(B, NP), jnp.int32)
    itable = jnp.asarray(rng.permutation(P)[:B].reshape(B, 1), jnp.int32)
    lens = jnp.asarray([20, 31], jnp.int32)
    qpos = lens[:, None] - T + jnp.arange(T)[None]
    q = rng.standard_normal((B, T, Hi, Di))
    w = np.abs(rng.standard_normal((B, T, Hi)))
    a = sa.indexer_topk(jnp.asarray(q, jnp.float32), jnp.asarray(w, jnp.float32), keys, itable, qpos, lens, topk=K,
                        impl=impl, layer=2)
    b = sa.indexer_topk(jnp.asarray(q, jnp.float32), jnp.asarray(w, jnp.float32), keys[2], itable, qpos, lens, topk=K,
                        impl=impl)
    np.testing.assert_array_equal(np.sort(np.asarray(a), -1), np.sort(np.asarray(b), -1))
    ql, qr = f(B, T, H, R), f(B, T, H, Dr)
    sel = jnp.asarray(rng.integers(0, 20, (B, T, K)), jnp.int32)
    got = sa.sparse_mla_attention(ql, qr, lat, rope, table, sel, lens, scale=0.1, impl=impl, layer=2)
    ref = sa.sparse_mla_attention(ql, qr, lat[2], rope[2], table, sel, lens, scale=0.1, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_ragged_ops_equal_the_padded_ops_per_sequence(impl):
    """A flat batch of a 70-token chunk on a cached prefix, a decode, a 3-token verify window, a fresh
    10-token prompt and an empty sequence (tiles of 16 rows, groups of 2: several tiles per sequence and
    more tiles than one group): the ragged indexer and sparse MLA give each token what the padded ops give
    its sequence's row, and padding tokens get -1 / 0."""
    from pallas_kernels.sparse_attention import ragged  # noqa: PLC0415
    rng = np.random.default_rng(3)
    S, NP, ps, H, D, Hm, R, Dr, K = 5, 8, 16, 2, 16, 2, 32, 8, 24
    new = [70, 1, 3, 10, 0]
    held = [40, 100, 7, 0, 5]
    N = 96
    P, pt = _paged(rng, S, NP, ps)
    keys = jnp.asarray(rng.standard_normal((P, ps, D)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((P, ps, R)), jnp.float32)
    rp = jnp.asarray(rng.standard_normal((P, ps, Dr)), jnp.float32)
    kv = jnp.asarray([h + n for h, n in zip(held, new)], jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((N, H, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    ql = jnp.asarray(rng.standard_normal((N, Hm, R)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((N, Hm, Dr)), jnp.float32)
    kw = dict(max_q_len=3, prefill_tile=16, group=2)
    idx = jax.jit(lambda *a: ragged.indexer_topk_ragged(*a, topk=K, impl=impl, **kw))(q, w, keys, pt, cu, kv)
    o = jax.jit(lambda *a: ragged.sparse_mla_attention_ragged(*a, scale=0.2, impl=impl, **kw))(
        ql, qr, lat, rp, pt, cu, idx, kv)
    total = int(cu[-1])
    assert (np.asarray(idx[total:]) == -1).all() and not np.asarray(o[total:]).any()
    for s in range(S):
        a, b = int(cu[s]), int(cu[s + 1])
        if a == b:
            continue
        qpos = (int(kv[s]) - (b - a) + jnp.arange(b - a, dtype=jnp.int32))[None]
        ref_idx = sa.indexer_topk(q[None, a:b], w[None, a:b], keys, pt[s:s + 1], qpos, kv[s:s + 1], topk=K,
                                  impl=impl)
        np.testing.assert_array_equal(np.sort(np.asarray(idx[a:b]), -1), np.sort(np.asarray(ref_idx[0]), -1))
        ref_o = sa.sparse_mla_attention(ql[None, a:b], qr[None, a:b], lat, rp, pt[s:s + 1], ref_idx, kv[s:s + 1],
                                        scale=0.2, impl=impl)
        assert rel_rms(o[a:b], ref_o[0]) < 1e-6, s
    seq = jnp.asarray(np.repeat(np.arange(S), new).tolist() + [S - 1] * (N - total), jnp.int32)
    resident = jnp.asarray(rng.random(P) < 0.5)
    rate = ragged.sparse_hit_rate_ragged(idx, pt, seq, jnp.arange(N) < total, resident, ps, kv)
    for s in range(S):
        a, b = int(cu[s]), int(cu[s + 1])
        want = sa.sparse_hit_rate(idx[None, a:b], pt[s:s + 1], resident, ps, kv[s:s + 1])[0] if a < b else 1.0
        assert abs(float(rate[s]) - float(want)) < 1e-6, s


@pytest.mark.parametrize("block_keys", [32, 512])
def test_dense_mla_reads_only_the_pages_in_use_and_its_ragged_form_equals_it(block_keys):
    """Kimi-Linear's dense MLA over the batch of the test above: every page a row does not use (past its
    length, or another row's) holds NaN and every table entry past a row's used pages points outside the
    pool, and the output is still the reference's (every causal position gathered from a clean pool),
    whether the keys come in blocks of 2 pages or 1 block; the layer stack is read in place at `layer`;
    the ragged form gives each token what the padded op gives its row."""
    from pallas_kernels.sparse_attention import naive, ragged  # noqa: PLC0415
    rng = np.random.default_rng(4)
    S, NP, ps, Hm, R, Dr = 5, 8, 16, 2, 32, 8
    new, held = [70, 1, 3, 10, 0], [40, 100, 7, 0, 5]
    N = 96
    P, pt = _paged(rng, S, NP, ps)
    kv = np.asarray([h + n for h, n in zip(held, new)], np.int32)
    used = -(-kv // ps)                                                   # pages each row reads
    clean_lat = rng.standard_normal((P, ps, R)).astype(np.float32)
    clean_rp = rng.standard_normal((P, ps, Dr)).astype(np.float32)
    lat, rp = clean_lat.copy(), clean_rp.copy()
    live = np.zeros((P, ps), bool)
    for s in range(S):
        for j in range(kv[s]):
            live[int(pt[s, j // ps]), j % ps] = True
    lat[~live], rp[~live] = np.nan, np.nan
    table = np.asarray(pt).copy()
    for s in range(S):
        table[s, used[s]:] = P + 3 if s % 2 else -5
    stack = lambda a: jnp.asarray(np.stack([np.zeros_like(a), a]))        # noqa: E731  layer 1 is the pool
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    ql = jnp.asarray(rng.standard_normal((N, Hm, R)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((N, Hm, Dr)), jnp.float32)
    step = jax.jit(lambda *a: ragged.dense_mla_attention_ragged(*a, scale=0.2, layer=1, max_q_len=3,
                                                                prefill_tile=16, group=2))
    o = step(ql, qr, stack(lat), stack(rp), jnp.asarray(table), cu, jnp.asarray(kv))
    total = int(cu[-1])
    assert not np.asarray(o[total:]).any()
    for s in range(S):
        a, b = int(cu[s]), int(cu[s + 1])
        if a == b:
            continue
        qpos = (int(kv[s]) - (b - a) + jnp.arange(b - a, dtype=jnp.int32))[None]
        want = naive.dense_mla_reference(ql[None, a:b], qr[None, a:b], jnp.asarray(clean_lat), jnp.asarray(clean_rp),
                                         pt[s:s + 1], qpos, jnp.asarray(kv[s:s + 1]), scale=0.2)
        got = sa.dense_mla_attention(ql[None, a:b], qr[None, a:b], stack(lat), stack(rp), jnp.asarray(table[s:s + 1]),
                                     qpos, jnp.asarray(kv[s:s + 1]), scale=0.2, layer=1, block_keys=block_keys)
        assert np.isfinite(np.asarray(got)).all(), s
        assert rel_rms(got[0], want[0]) < 1e-5, s
        assert rel_rms(o[a:b], got[0]) < 1e-6, s


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_ragged_ops_export_with_the_kernels(platform):
    """The ragged forms keep the platform's kernels (inside the loop over tiles)."""
    from pallas_kernels.sparse_attention import ragged  # noqa: PLC0415
    call = CALLS[platform]
    N, NS, H, D, Hm, R, Dr, ps, NP, P, K = 48, 4, 4, 128, 16, 512, 64, 128, 4, 9, 64

    def fn(q, w, k, ql, qr, lat, rp, pt, cu, lens):
        idx = ragged.indexer_topk_ragged(q, w, k, pt, cu, lens, topk=K, impl="pallas", prefill_tile=16)
        return ragged.sparse_mla_attention_ragged(ql, qr, lat, rp, pt, cu, idx, lens, scale=0.1, impl="pallas",
                                                  prefill_tile=16)
    args = [S((N, H, D), jnp.bfloat16), S((N, H), jnp.float32), S((P, ps, D), jnp.bfloat16),
            S((N, Hm, R), jnp.bfloat16), S((N, Hm, Dr), jnp.bfloat16), S((P, ps, R), jnp.bfloat16),
            S((P, ps, Dr), jnp.bfloat16), S((NS, NP), jnp.int32), S((NS + 1,), jnp.int32), S((NS,), jnp.int32)]
    text = _export(fn, platform, args)
    assert text.count(call) >= 2, "both the indexer and the MLA kernel"


def test_in_order_selection_is_every_causal_position():
    got = sa.in_order_selection(jnp.asarray([[2, 4], [-1, 0]], jnp.int32), 5)
    want = [[[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]], [[-1, -1, -1, -1, -1], [0, -1, -1, -1, -1]]]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_in_order_read_equals_the_gathered_read_and_dense_attention(dtype):
    """in_order=True (every position of the table selected in order) makes the TPU kernel read runs of
    rows, one DMA per block of positions, instead of one row group per selection: the same output as
    the gathered read of the same selection and as dense attention, with rows past a length poisoned,
    an unmapped page past a row's length, and the layers' stacks read in place."""
    rng = np.random.default_rng(11)
    B, T, H, R, Dr, ps, NP, L = 2, 3, 2, 128, 128, 16, 3, 2
    P = B * NP + 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    lat, rope = f(L, P, ps, R), f(L, P, ps, Dr)
    table = jnp.asarray(rng.permutation(P)[:B * NP].reshape(B, NP), jnp.int32).at[1, 2].set(-1)
    lens = jnp.asarray([41, 29], jnp.int32)                    # row 1 ends in its second page
    lat = lat.at[1, table[0, 2], 41 % ps:].set(1e4)             # past row 0's length: poison
    qpos = lens[:, None] - T + jnp.arange(T)[None]
    qpos = qpos.at[1, 0].set(-1)                                # a padding query
    ql, qr = f(B, T, H, R), f(B, T, H, Dr)
    idx = sa.in_order_selection(qpos, NP * ps)
    runs = sa.sparse_mla_attention(ql, qr, lat, rope, table, idx, lens, scale=0.1, impl="pallas", layer=1,
                                   in_order=True)
    gathered = sa.sparse_mla_attention(ql, qr, lat, rope, table, idx, lens, scale=0.1, impl="pallas", layer=1)
    dense = sa.dense_mla_attention(ql, qr, lat, rope, table, qpos, lens, scale=0.1, layer=1)
    np.testing.assert_allclose(np.asarray(runs), np.asarray(gathered), rtol=1e-5, atol=1e-5)
    assert rel_rms(runs, dense) < 1e-5
    assert np.all(np.asarray(runs[1, 0]) == 0)                 # the padding query reads nothing


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_indexer_walks_only_the_keys_in_use_of_a_wide_table(impl):
    """A page table as wide as a release's max_model_len (64 pages here, 3 in use): every key no query may
    read holds NaN, every table entry past the used pages points outside the pool, the keys are layer 1 of a
    stack; the selections are the reference's over the clean keys and a table of only the used pages."""
    B, T, H, D, ps, NP, lengths, topk = 2, 5, 3, 16, 8, 3, [21, 9], 6
    q, w, k, pt, qpos, lens = _indexer_inputs(11, B, T, H, D, ps, NP, lengths)
    ref = sa.indexer_topk(q, w, k, pt, qpos, lens, topk=topk, impl="reference")
    P = k.shape[0]
    live = np.zeros((P, ps), bool)
    for b, n in enumerate(lengths):
        for j in range(n):
            live[int(pt[b, j // ps]), j % ps] = True
    poisoned = np.where(live[..., None], np.asarray(k), np.nan).astype(np.float32)
    wide = np.full((B, 64), P + 7, np.int32)
    wide[:, :NP] = np.asarray(pt)
    stack = jnp.asarray(np.stack([np.zeros_like(poisoned), poisoned]))
    got = sa.indexer_topk(q, w, stack, jnp.asarray(wide), qpos, lens, topk=topk, impl=impl, layer=1)
    assert _sets(got) == _sets(ref)
