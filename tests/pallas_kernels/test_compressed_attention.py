"""DeepSeek-V4 compressed-attention ops: the compressor and the sparse read, every implementation against the
token-level reference over awkward sizes, step splitting, the masking rules, bad input, and export for TPU and
CUDA."""
from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu  # noqa: F401  registers the Mosaic GPU lowering
import jax.experimental.pallas.tpu  # noqa: F401  registers the Mosaic TPU lowering
import jax.experimental.pallas.triton  # noqa: F401  registers the Triton lowering
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import abi
from pallas_kernels import compressed_attention as ca
from pallas_kernels.compressed_attention import pallas_attention, pallas_compressor

TRITON_CALL = "__gpu$xla.gpu.triton"
CALLS = {"tpu": "tpu_custom_call", "cuda": TRITON_CALL}
S = jax.ShapeDtypeStruct
EPS = 1e-6


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def _compress_inputs(seed, B, T, C, m, overlap, tail_counts, n_new, entry_counts, R=8):
    rng = np.random.default_rng(seed)

    def f(*s):
        return jnp.asarray(rng.standard_normal(s), jnp.float32)
    D = C // 2 if overlap else C
    ov = (f(B, m, D), f(B, m, D)) if overlap else (None, None)
    ints = [jnp.asarray(x, jnp.int32) for x in (tail_counts, n_new, entry_counts)]
    freqs = jnp.asarray(1.0 / 100.0 ** (np.arange(R // 2) / (R // 2)), jnp.float32)
    return (f(B, T, C), f(B, T, C), f(B, m, C), f(B, m, C), *ints, *ov, f(m, C), 1 + 0.1 * f(D), freqs)


def _compress(args, m, overlap, impl):
    return ca.compress_windows(*args, rate=m, overlap=overlap, eps=EPS, rope_scale=1.25, impl=impl)


# B, T, C, rate, overlap, tail_counts, n_new, entry_counts
COMPRESS_CASES = [
    (2, 63, 16, 4, False, [3, 0], [63, 40], [0, 5]),               # HCA prefill, a padded row
    (2, 75, 16, 8, True, [7, 2], [75, 9], [0, 3]),                 # CSA prefill, the first entry of a row
    (1, 1, 16, 4, True, [3], [1], [2]),                            # decode that closes a window
    (3, 5, 32, 8, True, [0, 6, 7], [5, 0, 3], [0, 1, 9]),           # no window / a row with no tokens / one
]


def _check_compress_equal(got, ref, overlap):
    idx = np.asarray(ref[1])
    np.testing.assert_array_equal(np.asarray(got[1]), idx)
    closed = idx >= 0
    assert closed.any()                                            # the case pools at least one window
    assert rel_rms(np.asarray(got[0])[closed], np.asarray(ref[0])[closed]) < 1e-6
    np.testing.assert_array_equal(np.asarray(got[2][2]), np.asarray(ref[2][2]))
    for a, b in zip(got[2][:2], ref[2][:2]):                       # the tail is a copy: exact
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if overlap:
        for a, b in zip(got[3], ref[3]):
            assert rel_rms(a, b) < 1e-6
    else:
        assert got[3] is None


@functools.cache
def _compress_case(i):
    """(inputs, reference outputs) of COMPRESS_CASES[i], computed once for all implementations."""
    B, T, C, m, overlap, tc, nn, ec = COMPRESS_CASES[i]
    args = _compress_inputs(T + m, B, T, C, m, overlap, tc, nn, ec)
    return args, _compress(args, m, overlap, "reference")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("i", range(len(COMPRESS_CASES)),
                         ids=[f"B{c[0]}T{c[1]}m{c[3]}{'csa' if c[4] else 'hca'}" for c in COMPRESS_CASES])
def test_compress_matches_reference(i, impl):
    B, T, C, m, overlap, tc, nn, ec = COMPRESS_CASES[i]
    args, ref = _compress_case(i)
    got = _compress(args, m, overlap, impl)
    NW = (m - 1 + T) // m
    assert got[0].shape == (B, NW, C // 2 if overlap else C) and got[1].shape == (B, NW)
    np.testing.assert_array_equal(np.asarray(ref[2][2]), (np.asarray(tc) + np.asarray(nn)) % m)
    _check_compress_equal(got, ref, overlap)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_compress_in_two_steps_equals_one(impl, overlap):
    """A step of 75 tokens and steps of 30 + 45 with the state carried give the same entries and state."""
    B, T, C, m = 2, 75, 16, 4
    args = list(_compress_inputs(1, B, T, C, m, overlap, [1, 3], [75, 60], [0, 2]))
    one = _compress(args, m, overlap, impl)
    a = list(args)
    a[0], a[1], a[5] = args[0][:, :30], args[1][:, :30], jnp.minimum(args[5], 30)
    first = _compress(a, m, overlap, impl)
    b = list(args)
    b[0], b[1], b[5] = args[0][:, 30:], args[1][:, 30:], args[5] - a[5]
    b[2], b[3], b[4] = first[2]
    b[6] = args[6] + jnp.sum(first[1] >= 0, axis=1).astype(jnp.int32)
    if overlap:
        b[7], b[8] = first[3]
    second = _compress(b, m, overlap, impl)
    for bi in range(B):
        got = {int(i): e for part in (first, second) for i, e in zip(np.asarray(part[1][bi]), np.asarray(part[0][bi]))
               if i >= 0}
        want = {int(i): e for i, e in zip(np.asarray(one[1][bi]), np.asarray(one[0][bi])) if i >= 0}
        assert sorted(got) == sorted(want) and len(want) > 5
        assert rel_rms(np.stack([got[k] for k in sorted(got)]), np.stack([want[k] for k in sorted(want)])) < 1e-6
    np.testing.assert_array_equal(np.asarray(second[2][2]), np.asarray(one[2][2]))
    np.testing.assert_array_equal(np.asarray(second[2][0]), np.asarray(one[2][0]))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_csa_first_entry_ignores_overlap_state(impl):
    """A row's entry 0 has no previous window: the overlap state can't change it; entry 1 reads it."""
    args = list(_compress_inputs(2, 1, 4, 16, 4, True, [0], [4], [0]))
    e0 = _compress(args, 4, True, impl)[0]
    args[7] = args[7] + 5.0
    np.testing.assert_array_equal(np.asarray(_compress(args, 4, True, impl)[0]), np.asarray(e0))
    args[6] = jnp.asarray([1], jnp.int32)
    assert rel_rms(_compress(args, 4, True, impl)[0], e0) > 1e-2


def _attention_inputs(seed, B, T, H, D, W, NE, ps, K, mode, lengths, n_new, rate=4):
    """Ring + this step's tokens as the layer lays them out, a shuffled page pool of entries, and either
    per-query entry ids (csa: random picks incl. -1 / past-count ones) or HCA's rate (every closed window)."""
    rng = np.random.default_rng(seed)

    def f(*s):
        return jnp.asarray(rng.standard_normal(s), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    qpos = lens[:, None] + t[None]
    valid = t[None] < jnp.asarray(n_new)[:, None]
    s = jnp.arange(W, dtype=jnp.int32)[None]
    rpos = lens[:, None] - 1 - jnp.mod(lens[:, None] - 1 - s, W)
    kv = f(B, W + T, D)
    kpos = jnp.concatenate([jnp.where(rpos >= 0, rpos, -1), jnp.where(valid, qpos, -1)], axis=1)
    out = dict(q=f(B, T, H, D), kv=kv, kv_positions=kpos, q_positions=qpos, sinks=f(H),
               entries=None, page_table=None, indices=None, entry_counts=None, rate=None)
    if mode == "swa":
        return out
    NP = -(-NE // ps)
    P = B * NP + 2
    table = jnp.asarray(rng.permutation(P)[:B * NP].reshape(B, NP), jnp.int32)
    count = jnp.minimum(lens // rate, NE).astype(jnp.int32)
    out.update(entries=f(P, ps, D), page_table=table, entry_counts=count)
    if mode == "csa":
        out["indices"] = jnp.asarray(rng.integers(-1, NE, (B, T, K)), jnp.int32)     # some >= count: masked
    else:
        out["rate"] = rate
    return out


# B, T, H, D, W (= window), NE, ps, K, mode, lengths, n_new
ATTN_CASES = [
    (2, 1, 4, 16, 8, 12, 4, 5, "csa", [30, 3], [1, 1]),            # decode, a row younger than the window
    (2, 63, 3, 16, 16, 20, 8, 5, "csa", [40, 0], [63, 17]),        # prefill, K not a multiple of block_k
    (2, 75, 4, 16, 8, 24, 8, None, "hca", [20, 9], [75, 30]),      # HCA: every closed window
    (1, 3, 2, 16, 4, 13, 4, None, "hca", [50], [2]),               # HCA decode-ish, a partly used last page
    (1, 7, 2, 16, 8, 0, 0, None, "swa", [5], [4]),                 # sliding window only
]


@functools.cache
def _attention_case(i):
    """(inputs, reference output) of ATTN_CASES[i], computed once for all implementations."""
    B, T, H, D, W, NE, ps, K, mode, lengths, n_new = ATTN_CASES[i]
    a = _attention_inputs(sum(lengths) + T, B, T, H, D, W, NE, ps, K, mode, lengths, n_new)
    return a, ca.compressed_sparse_read(**a, window=W, scale=D ** -0.5, impl="reference")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("i", range(len(ATTN_CASES)), ids=[f"B{c[0]}T{c[1]}H{c[2]}{c[8]}" for c in ATTN_CASES])
def test_attention_matches_reference(i, impl):
    B, T, H, D, W, NE, ps, K, mode, lengths, n_new = ATTN_CASES[i]
    a, ref = _attention_case(i)
    got = ca.compressed_sparse_read(**a, window=W, scale=D ** -0.5, impl=impl)
    assert got.shape == (B, T, H, D) and got.dtype == jnp.float32
    assert rel_rms(got, ref) < 1e-6


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_sink_is_a_zero_value_logit(impl):
    """A query that sees nothing returns zeros; with a very low sink the result is plain softmax attention
    over the window; with a sink equal to a lone key's logit the output is half of that key."""
    B, T, H, D, W = 1, 3, 2, 16, 4
    a = _attention_inputs(0, B, T, H, D, W, 0, 0, None, "swa", [6], [3])
    a["kv_positions"] = a["kv_positions"].at[:, :].set(-1)
    out = ca.compressed_sparse_read(**a, window=W, scale=0.5, impl=impl)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    a = _attention_inputs(0, B, T, H, D, W, 0, 0, None, "swa", [6], [3])
    a["sinks"] = jnp.full((H,), -1e30)
    out = ca.compressed_sparse_read(**a, window=W, scale=0.5, impl=impl)
    p, kpos = np.asarray(a["q_positions"])[0], np.asarray(a["kv_positions"])[0]
    kv, q = np.asarray(a["kv"], np.float64)[0], np.asarray(a["q"], np.float64)[0]
    for t in range(T):
        ok = (kpos >= 0) & (kpos <= p[t]) & (kpos > p[t] - W)
        s = q[t] @ kv[ok].T * 0.5
        e = np.exp(s - s.max(axis=1, keepdims=True))
        np.testing.assert_allclose(np.asarray(out[0, t]), (e / e.sum(1, keepdims=True)) @ kv[ok], rtol=1e-5, atol=1e-6)
    a["kv_positions"] = jnp.where(jnp.arange(W + T)[None] == W, a["kv_positions"], -1)   # one key, position 6
    a["sinks"] = jnp.einsum("hd,d->h", a["q"][0, 0], a["kv"][0, W]) * 0.5
    out = ca.compressed_sparse_read(**a, window=W, scale=0.5, impl=impl)
    np.testing.assert_allclose(np.asarray(out[0, 0]), 0.5 * np.broadcast_to(np.asarray(a["kv"][0, W]), (H, D)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_unreadable_entries_are_masked_never_read(impl):
    """Entry ids past the row's count or on a page outside the pool read nothing, even when that memory
    holds huge values: the output equals attention with those ids replaced by -1."""
    a = _attention_inputs(4, 2, 2, 2, 16, 8, 12, 4, 4, "csa", [40, 20], [2, 2])
    count = np.asarray(a["entry_counts"])                           # [10, 5]
    good = np.array([[[0, 3, 9, -1]] * 2, [[1, 2, 4, -1]] * 2], np.int32)
    bad = good.copy()
    bad[1, :, 3] = 7                                                # >= count of row 1
    a["entries"] = a["entries"].at[a["page_table"][1, 1]].set(1e4)  # row 1's entries 4..7: poison beyond count
    ref = ca.compressed_sparse_read(**{**a, "indices": jnp.asarray(good)}, window=8, scale=0.25, impl="reference")
    got = ca.compressed_sparse_read(**{**a, "indices": jnp.asarray(bad)}, window=8, scale=0.25, impl=impl)
    assert count[1] == 5
    assert rel_rms(got, ref) < 1e-6 and np.all(np.abs(np.asarray(got)) < 100)
    table = a["page_table"].at[0, 2].set(10_000)                    # row 0's entries 8..11: off the pool
    got = ca.compressed_sparse_read(**{**a, "indices": jnp.asarray(good), "page_table": table}, window=8, scale=0.25,
                                  impl=impl)
    only = good.copy()
    only[0, :, 2] = -1
    ref = ca.compressed_sparse_read(**{**a, "indices": jnp.asarray(only)}, window=8, scale=0.25, impl="reference")
    assert rel_rms(got[0], ref[0]) < 1e-6


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_hca_walks_only_the_entries_in_use_of_a_wide_table(impl):
    """HCA with a page table as wide as a release's max_model_len (32 pages, 2 in use by the longer row):
    every entry slot past a row's count holds NaN and every table entry past its used pages points outside
    the pool; the output is the reference's over a clean pool and a table of only those pages (the read
    stops at the step's furthest readable entry and masks inside the last page it reads)."""
    B, T, H, D, W = 2, 6, 2, 16, 8
    a = _attention_inputs(3, B, T, H, D, W, 16, 8, None, "hca", [44, 9], [6, 3])
    ref = ca.compressed_sparse_read(**a, window=W, scale=D ** -0.5, impl="reference")
    ent, table, count = np.asarray(a["entries"]).copy(), np.asarray(a["page_table"]), np.asarray(a["entry_counts"])
    P, ps = ent.shape[:2]
    live = np.zeros((P, ps), bool)
    for b in range(B):
        for j in range(count[b]):
            live[table[b, j // ps], j % ps] = True
    ent[~live] = np.nan
    wide = np.full((B, 32), P + 5, np.int32)
    wide[:, :table.shape[1]] = table
    got = ca.compressed_sparse_read(**{**a, "entries": jnp.asarray(ent), "page_table": jnp.asarray(wide)}, window=W,
                                    scale=D ** -0.5, impl=impl)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_rms(got, ref) < 1e-6


def test_bad_input_raises_value_errors():
    args = list(_compress_inputs(0, 1, 4, 16, 4, True, [0], [4], [0]))
    with pytest.raises(ValueError, match="overlap_kv"):
        ca.compress_windows(*args[:7], None, None, *args[9:], rate=4, overlap=True, eps=EPS)
    with pytest.raises(ValueError, match="tail_kv"):
        ca.compress_windows(*args, rate=8, overlap=True, eps=EPS)
    with pytest.raises(ValueError, match="norm_w"):
        ca.compress_windows(*args[:10], jnp.ones((16,)), args[11], rate=4, overlap=True, eps=EPS)
    with pytest.raises(ValueError, match="impl"):
        ca.compress_windows(*args, rate=4, overlap=True, eps=EPS, impl="cuda")
    a = _attention_inputs(0, 1, 2, 2, 16, 4, 8, 4, 3, "csa", [10], [2])
    with pytest.raises(ValueError, match="sinks"):
        ca.compressed_sparse_read(**{**a, "sinks": jnp.ones(3)}, window=4, scale=1.0)
    with pytest.raises(ValueError, match="indices"):
        ca.compressed_sparse_read(**{**a, "indices": a["indices"][..., None]}, window=4, scale=1.0)
    with pytest.raises(ValueError, match="exactly one of indices"):
        ca.compressed_sparse_read(**{**a, "indices": None}, window=4, scale=1.0)
    with pytest.raises(ValueError, match="exactly one of indices"):
        ca.compressed_sparse_read(**{**a, "rate": 4}, window=4, scale=1.0)
    with pytest.raises(ValueError, match="without entries"):
        ca.compressed_sparse_read(**{**a, "entries": None}, window=4, scale=1.0)
    with pytest.raises(ValueError, match="kv_positions"):
        ca.compressed_sparse_read(**{**a, "kv_positions": a["kv_positions"][:, 1:]}, window=4, scale=1.0)


def test_kernels_declare_their_abi():
    assert abi.get("v4_compress") is abi.V4_COMPRESSOR is pallas_compressor.ABI
    assert abi.get("v4_sparse_read") is abi.V4_SPARSE_READ is pallas_attention.ABI


def _export(fn, platform, args):
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_compressor_exports(platform, overlap):
    """Through the public op: the kernel follows the platform lowered for, not the host's."""
    call = CALLS[platform]
    B, T, m = 2, 64, 4
    C, D = (256, 128) if overlap else (128, 128)

    def fn(kv, g, tkv, tg, tc, nn, ec, okv, og, bias, nw, fr):
        return ca.compress_windows(kv, g, tkv, tg, tc, nn, ec, okv if overlap else None, og if overlap else None,
                                   bias, nw, fr, rate=m, overlap=overlap, eps=EPS, impl="pallas")
    bf, i32 = jnp.bfloat16, jnp.int32
    args = [S((B, T, C), bf), S((B, T, C), bf), S((B, m, C), bf), S((B, m, C), jnp.float32), S((B,), i32),
            S((B,), i32), S((B,), i32), S((B, m, D), bf), S((B, m, D), jnp.float32), S((m, C), jnp.float32),
            S((D,), jnp.float32), S((32,), jnp.float32)]
    assert call in _export(fn, platform, args)


@pytest.mark.parametrize("mode", ["window", "gather", "dense"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_attention_exports(platform, mode):
    call = CALLS[platform]
    B, T, H, D, W, P, ps, NP, K = 2, 4, 16, 128, 128, 9, 64, 5, 64
    bf, i32 = jnp.bfloat16, jnp.int32

    def fn(q, kv, kpos, qpos, sinks, *e):
        ent, table, count, *idx = e if e else (None,) * 3
        return ca.compressed_sparse_read(q, kv, kpos, qpos, ent, table, idx[0] if idx else None, count, sinks,
                                         window=W, scale=D ** -0.5, rate=8 if mode == "dense" else None, impl="pallas")
    args = [S((B, T, H, D), bf), S((B, W + T, D), bf), S((B, W + T), i32), S((B, T), i32), S((H,), jnp.float32)]
    if mode != "window":
        args += [S((P, ps, D), bf), S((B, NP), i32), S((B,), i32)]
    if mode == "gather":
        args.append(S((B, T, K), i32))
    assert call in _export(fn, platform, args)
