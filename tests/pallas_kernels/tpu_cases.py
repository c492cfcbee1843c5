"""The cases of the TPU compile tests (test_tpu_compile.py, test_tpu_compile_f32.py): every Pallas TPU kernel
compiled by the TPU compiler (XLA + Mosaic) through the public ops, on a host without a TPU
(pallas_kernels.aot; needs the `tpu-aot` extra, else every test skips saying so).

Lowering (test_export.py) proves the kernels have a TPU lowering; this proves Mosaic accepts them:
block shapes, layouts, alignment, VMEM. Real models' shapes, on v5e, v6e and v5p, in bf16 and f32:
  * Qwen3-Next-80B-A3B / Qwen3.5 Gated DeltaNet: 16 QK heads, 32 V heads, K = V = 128;
  * Kimi-Linear-48B-A3B Kimi Delta Attention (the decay per key channel, g [B, T, HV, K] f32): 32 heads,
    K = V = 128;
  * DeepSeek-V3.2 DSA: indexer 64 heads of 128 over 128-token pages, Top-K 2048; MLA with 128 query
    heads over a latent of 512 + rope 64 (64-token pages; the engine's rope pool is 128 lanes wide,
    cache.mla.rope_width, so the decode case reads that);
  * DeepSeek-V3.2 FP8 routed experts (grouped matmul): 256 experts 7168 -> 2 x 2048, 64 rows x Top-8;
  * DeepSeek-V4 (-Flash, transformers' DeepseekV4Config defaults): 64 query heads of 512, a 128-token
    window, CSA rate 4 (compressor width 2 x 512, indexer 64 x 128, Top-K 512), HCA rate 128;
decode steps at a 32k context with 8 rows, a prefill chunk and a verify window; then awkward shapes on
v5e. Every real case also checks that the compiler's cost analysis sees the kernel's work (the kernels
pass a pl.CostEstimate: a Pallas call without one reports almost nothing), and the decode steps' FLOPs
and HBM bytes are held to the recorded baselines (tpu_baselines.json, see test_decode_baselines).
Compiled programs are shared between the tests of a module (one compile per case, dtype and chip); bf16
and f32 live in two modules so that pytest-xdist compiles them in parallel.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest

from cache.mla import rope_width
import pallas_kernels as pk
from pallas_kernels import aot
from pallas_kernels import compressed_attention as ca
from pallas_kernels import sparse_attention as sa
from pallas_kernels.grouped_matmul import fp8_grouped_matmul

CHIPS = ("v5e", "v6e", "v5p")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
S = jax.ShapeDtypeStruct
F32, I32 = jnp.float32, jnp.int32


@functools.lru_cache(maxsize=None)
def _device_or_reason(chip: str):
    try:
        return aot.tpu_device(chip), None
    except aot.AotUnavailable as e:
        return None, str(e)


def need_chip(chip: str):
    _, reason = _device_or_reason(chip)
    if reason:
        pytest.skip(reason)


@dataclasses.dataclass(frozen=True)
class Case:
    """fn(*args) calls a public op with impl="pallas"; args(dtype) are its abstract inputs.
    min_flops / min_bytes: the work and HBM traffic the op cannot avoid (a lower bound the compiler's
    cost analysis must reach when the kernel reports its cost)."""
    fn: Callable
    args: Callable
    min_flops: float = 0.0
    min_bytes: Callable = lambda dt: 0.0
    donate: tuple[int, ...] = ()
    decode: bool = False        # recorded in the baselines


def gdn_args(B, T, H, HV, K, V, dt, N=None):
    return (S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, V), dt), S((B, T, HV), F32), S((B, T, HV), F32),
            S((N or B, HV, K, V), F32))


def kda_args(B, T, H, HV, K, V, dt, N=None):
    """gdn_args with KDA's per-channel log decay g [B, T, HV, K] f32."""
    a = gdn_args(B, T, H, HV, K, V, dt, N)
    return a[:3] + (S((B, T, HV, K), F32),) + a[4:]


def _chunk(q, k, v, g, b, h, *cu):
    return pk.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu[0] if cu else None, impl="pallas")


def _recurrent(**kw):
    def fn(q, k, v, g, b, h, *cu):
        return pk.fused_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=h, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu[0] if cu else None,
                                                   impl="pallas", **kw)
    return fn


def _pooled_recurrent(q, k, v, g, b, pool, rows):
    """The decode step's recurrent op over a state pool [P, HV, K, V]: batch row b's state is pool[rows[b]]."""
    return pk.fused_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=pool, state_indices=rows,
                                               output_final_state=True, use_qk_l2norm_in_kernel=True, impl="pallas")


def pooled_gdn_args(B, H, HV, K, V, dt, P):
    """gdn_args of a decode step (T = 1) whose states are rows [B] of a pool of P rows."""
    return gdn_args(B, 1, H, HV, K, V, dt)[:5] + (S((P, HV, K, V), F32), S((B,), I32))


def _kda_chunk(q, k, v, g, b, h, *cu):
    return pk.chunk_kda(q, k, v, g, b, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True,
                        cu_seqlens=cu[0] if cu else None, impl="pallas")


def _kda_recurrent(**kw):
    def fn(q, k, v, g, b, h, *cu):
        return pk.fused_recurrent_kda(q, k, v, g, b, initial_state=h, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu[0] if cu else None,
                                      impl="pallas", **kw)
    return fn


def _indexer(topk):
    def fn(q, w, keys, table, qpos, lens, *scale):
        return sa.indexer_topk(q, w, keys, table, qpos, lens, topk=topk, k_scale=scale[0] if scale else None,
                               impl="pallas")
    return fn


def _indexer_args(B, T, H, D, ps, NP, kdt, dt, scale=False):
    a = (S((B, T, H, D), dt), S((B, T, H), F32), S((B * NP + 1, ps, D), kdt), S((B, NP), I32), S((B, T), I32),
         S((B,), I32))
    return a + ((S((B * NP + 1, ps), F32),) if scale else ())


def _mla(ql, qr, lat, rp, table, idx, lens):
    return sa.sparse_mla_attention(ql, qr, lat, rp, table, idx, lens, scale=0.07, impl="pallas")


def _mla_args(B, T, H, R, Dr, ps, NP, K, dt):
    P = B * NP + 1
    return (S((B, T, H, R), dt), S((B, T, H, Dr), dt), S((P, ps, R), dt), S((P, ps, Dr), dt), S((B, NP), I32),
            S((B, T, K), I32), S((B,), I32))


def _fp8_experts(xs, w, scale, sizes):
    return fp8_grouped_matmul(xs, w, scale, sizes, impl="pallas")


def _fp8_experts_args(R, E, K, N, dt):
    return S((R, K), dt), S((E, K, N), jnp.float8_e4m3fn), S((E, K // 128, N // 128), F32), S((E,), I32)


def _compressor(rate, overlap):
    def fn(*a):
        return ca.compress_windows(*a, rate=rate, overlap=overlap, eps=1e-6, impl="pallas")
    return fn


def _compressor_args(B, T, m, C, dt, overlap, rope=64):
    D = C // 2 if overlap else C
    ov = (S((B, m, D), dt), S((B, m, D), F32)) if overlap else (None, None)
    return (S((B, T, C), dt), S((B, T, C), dt), S((B, m, C), dt), S((B, m, C), F32), S((B,), I32), S((B,), I32),
            S((B,), I32), *ov, S((m, C), F32), S((D,), F32), S((rope // 2,), F32))


def _v4_attention(window, rate=None):
    def fn(q, kv, kpos, qpos, sinks, *e):
        ent, table, count, *idx = e if e else (None,) * 3
        return ca.compressed_sparse_read(q, kv, kpos, qpos, ent, table, idx[0] if idx else None, count, sinks,
                                         window=window, scale=0.044, rate=rate, impl="pallas")
    return fn


def _v4_attention_args(B, T, H, D, W, dt, ps=0, NP=0, K=0):
    a = (S((B, T, H, D), dt), S((B, W + T, D), dt), S((B, W + T), I32), S((B, T), I32), S((H,), F32))
    if NP:
        a += (S((B * NP + 1, ps, D), dt), S((B, NP), I32), S((B,), I32))
    if K:
        a += (S((B, T, K), I32),)
    return a


def _nbytes(dt):
    return jnp.dtype(dt).itemsize


# Decode steps: B = 8 rows at a 32k context. GDN: Qwen3-Next-80B / Qwen3.5 heads.
B8, CTX = 8, 32768
GH, GHV, GK = 16, 32, 128
STATE = B8 * GHV * GK * GK * 4
KH, KK = 32, 128                        # Kimi-Linear's KDA: 32 heads (q / k and v alike), K = V = 128
KDA_STATE = B8 * KH * KK * KK * 4
REAL = {
    "gdn_decode": Case(_recurrent(), lambda dt: gdn_args(B8, 1, GH, GHV, GK, GK, dt),
                       min_flops=B8 * GHV * 4 * GK * GK, min_bytes=lambda dt: 2 * STATE, donate=(5,), decode=True),
    # the engine's decode: the batch's rows of a pool of every layer's states (3 layers x 65 rows here),
    # read and written in place by the kernel
    "gdn_decode_pooled": Case(_pooled_recurrent, lambda dt: pooled_gdn_args(B8, GH, GHV, GK, GK, dt, 3 * 65),
                              min_flops=B8 * GHV * 4 * GK * GK, min_bytes=lambda dt: 2 * STATE, donate=(5,),
                              decode=True),
    "gdn_verify_deltas": Case(_recurrent(output_deltas=True), lambda dt: gdn_args(B8, 4, GH, GHV, GK, GK, dt),
                              min_flops=4 * B8 * GHV * 4 * GK * GK, min_bytes=lambda dt: 2 * STATE, donate=(5,)),
    "gdn_chunk_prefill": Case(_chunk, lambda dt: gdn_args(2, 2048, GH, GHV, GK, GK, dt),
                              min_flops=2 * 2048 * GHV * 4 * GK * GK,
                              min_bytes=lambda dt: 2 * 2048 * (2 * GH * GK + 2 * GHV * GK) * _nbytes(dt),
                              donate=(5,)),
    # Kimi-Linear KDA: the recurrent kernel (GDN's, per-channel g) and the chunked one
    "kda_decode": Case(_kda_recurrent(), lambda dt: kda_args(B8, 1, KH, KH, KK, KK, dt),
                       min_flops=B8 * KH * 4 * KK * KK, min_bytes=lambda dt: 2 * KDA_STATE, donate=(5,), decode=True),
    "kda_verify_deltas": Case(_kda_recurrent(output_deltas=True), lambda dt: kda_args(B8, 4, KH, KH, KK, KK, dt),
                              min_flops=4 * B8 * KH * 4 * KK * KK, min_bytes=lambda dt: 2 * KDA_STATE, donate=(5,)),
    "kda_chunk_prefill": Case(_kda_chunk, lambda dt: kda_args(2, 2048, KH, KH, KK, KK, dt),
                              min_flops=2 * 2048 * KH * 4 * KK * KK,
                              min_bytes=lambda dt: 2 * 2048 * KH * (3 * KK * _nbytes(dt) + KK * 4), donate=(5,)),
    # DeepSeek-V3.2: indexer over 128-token pages, MLA over 64-token pages.
    "dsa_indexer_decode": Case(_indexer(2048), lambda dt: _indexer_args(B8, 1, 64, 128, 128, CTX // 128, dt, dt),
                               min_flops=B8 * CTX * 2 * 64 * 128, min_bytes=lambda dt: B8 * CTX * 128 * _nbytes(dt),
                               decode=True),
    "dsa_mla_decode": Case(_mla, lambda dt: _mla_args(B8, 1, 128, 512, rope_width(64), 64, CTX // 64, 2048, dt),
                           min_flops=B8 * 2048 * 2 * 128 * (512 + 64),
                           min_bytes=lambda dt: B8 * 2048 * (512 + 64) * _nbytes(dt), decode=True),
    # DeepSeek-V3.2's FP8 routed experts at a 64-row decode step (64 x 8 routed rows, 256 experts): the up
    # projection 7168 -> 2 x 2048; the weights are read once, as FP8
    "moe_fp8_experts_decode": Case(_fp8_experts, lambda dt: _fp8_experts_args(512, 256, 7168, 4096, dt),
                                   min_flops=2 * 512 * 7168 * 4096, min_bytes=lambda dt: 256 * 7168 * 4096),
    # DeepSeek-V4: CSA compressor (m = 4, width 2 x 512), HCA compressor (m = 128, width 512), the CSA
    # indexer (64 x 128, Top-K 512, 128-entry pages), the sparse read (CSA: Top-K 512 entries in 16-entry
    # pages; HCA: every entry, one per page) over a 128-token window.
    "v4_csa_compressor_decode": Case(_compressor(4, True), lambda dt: _compressor_args(B8, 1, 4, 1024, dt, True),
                                     min_flops=B8 * 4 * 1024, decode=True),
    "v4_hca_compressor_decode": Case(_compressor(128, False), lambda dt: _compressor_args(B8, 1, 128, 512, dt, False),
                                     min_flops=B8 * 128 * 512, decode=True),
    "v4_indexer_decode": Case(_indexer(512), lambda dt: _indexer_args(B8, 1, 64, 128, 128, CTX // 4 // 128, dt, dt),
                              min_flops=B8 * (CTX // 4) * 2 * 64 * 128,
                              min_bytes=lambda dt: B8 * (CTX // 4) * 128 * _nbytes(dt), decode=True),
    "v4_csa_attention_decode": Case(_v4_attention(128), lambda dt: _v4_attention_args(
        B8, 1, 64, 512, 128, dt, ps=16, NP=CTX // 4 // 16, K=512),
        min_flops=B8 * (129 + 512) * 4 * 64 * 512, min_bytes=lambda dt: B8 * 512 * 512 * _nbytes(dt), decode=True),
    "v4_hca_attention_decode": Case(_v4_attention(128, rate=128), lambda dt: _v4_attention_args(
        B8, 1, 64, 512, 128, dt, ps=1, NP=CTX // 128),
        min_flops=B8 * (129 + CTX // 128) * 4 * 64 * 512,
        min_bytes=lambda dt: B8 * (CTX // 128) * 512 * _nbytes(dt), decode=True),
}

# Awkward shapes (v5e): odd T, HV != H with K = V = 64, packed batches, partial blocks, fp8 keys, Top-K not a
# multiple of the row block, a V4 window-only layer; and the failures at full size (recurrent bf16
# T > 1, every-token states at T = 200 in f32).
AWKWARD = {
    "gdn_chunk_T75_hv3h": Case(_chunk, lambda dt: gdn_args(3, 75, 2, 6, 64, 64, dt)),
    "gdn_chunk_varlen": Case(_chunk, lambda dt: gdn_args(1, 140, 2, 4, 128, 128, dt, N=3) + (S((4,), I32),)),
    "gdn_recurrent_T63_hv3h": Case(_recurrent(), lambda dt: gdn_args(3, 63, 2, 6, 64, 64, dt)),
    "gdn_recurrent_varlen_deltas": Case(_recurrent(output_deltas=True),
                                        lambda dt: gdn_args(1, 33, 2, 4, 128, 128, dt, N=3) + (S((4,), I32),)),
    "gdn_pooled_hv3h": Case(_pooled_recurrent, lambda dt: pooled_gdn_args(3, 2, 6, 64, 64, dt, 5), donate=(5,)),
    "gdn_all_states_T200": Case(_recurrent(output_all_states=True), lambda dt: gdn_args(B8, 200, GH, GHV, GK, GK, dt)),
    # KDA: odd T with HV = 2 H and K != V, packed batches, C = 24 (sub-blocks of 8), every-token states at T = 200
    "kda_chunk_T75_hv2h": Case(_kda_chunk, lambda dt: kda_args(3, 75, 2, 4, 64, 96, dt)),
    "kda_chunk_varlen": Case(_kda_chunk, lambda dt: kda_args(1, 140, 2, 4, 128, 128, dt, N=3) + (S((4,), I32),)),
    "kda_chunk_C24": Case(lambda q, k, v, g, b, h: pk.chunk_kda(q, k, v, g, b, initial_state=h, chunk_size=24,
                                                                impl="pallas"),
                          lambda dt: kda_args(2, 75, 2, 2, 128, 128, dt)),
    "kda_recurrent_T63_hv2h": Case(_kda_recurrent(), lambda dt: kda_args(3, 63, 2, 4, 64, 96, dt)),
    "kda_recurrent_varlen_deltas": Case(_kda_recurrent(output_deltas=True),
                                        lambda dt: kda_args(1, 33, 2, 4, 128, 128, dt, N=3) + (S((4,), I32),)),
    "kda_all_states_T200": Case(_kda_recurrent(output_all_states=True),
                                lambda dt: kda_args(B8, 200, KH, KH, KK, KK, dt)),
    "dsa_indexer_prefill_fp8": Case(_indexer(100), lambda dt: _indexer_args(
        2, 75, 64, 128, 128, 3, jnp.float8_e4m3fn, dt, scale=True)),
    "dsa_mla_K100": Case(_mla, lambda dt: _mla_args(2, 3, 16, 512, 64, 64, 5, 100, dt)),
    # more selections than SMEM holds (1 MiB): 512 queries x Top-K 2048 rows + flags are 8 MiB, as are 64 rows
    # x 2048 of a decode step (with 128 heads) and a 2048-token prefill chunk of DeepSeek-V3.2
    "dsa_mla_selections_over_smem": Case(_mla, lambda dt: _mla_args(1, 512, 16, 512, 64, 64, 32, 2048, dt)),
    "v4_window_only_T3": Case(_v4_attention(128), lambda dt: _v4_attention_args(2, 3, 64, 512, 128, dt)),
    "v4_csa_attention_K37": Case(_v4_attention(128), lambda dt: _v4_attention_args(
        2, 3, 64, 512, 128, dt, ps=16, NP=4, K=37)),
    "v4_index_compressor_T75": Case(_compressor(4, True), lambda dt: _compressor_args(2, 75, 4, 256, dt, True)),
}
CASES = {**REAL, **AWKWARD}




@functools.lru_cache(maxsize=None)
def compiled(name: str, dtype: str, chip: str):
    """(compiled program, aot.CompiledCost) of case `name`, compiled once per dtype and chip."""
    case = CASES[name]
    return aot.compile_for(case.fn, case.args(DTYPES[dtype]), chip, donate_argnums=case.donate)


def check_real(name: str, chip: str, dtype: str):
    """Mosaic accepts the kernel at the real model's shapes, and the compiler's cost analysis carries at
    least the op's unavoidable FLOPs and HBM bytes (the kernel's pl.CostEstimate reached XLA)."""
    need_chip(chip)
    program, cost = compiled(name, dtype, chip)
    assert "tpu_custom_call" in program.as_text()
    case = REAL[name]
    dt = DTYPES[dtype]
    assert cost.flops >= case.min_flops, (cost.flops, case.min_flops)
    assert cost.bytes_accessed >= case.min_bytes(dt), (cost.bytes_accessed, case.min_bytes(dt))
