"""Pallas compressor: DeepSeek-V4's gated-softmax pooling of closed windows into compressed entries.

  HCA  e_w = RMSNorm(sum_s softmax_s(Z_s + B_s) * C_s)          s over the window's m slots, per channel
  CSA  the same over 2m slots: window w-1's a-half (channels :D, gates biased) then window w's b-half
       (channels D:); window 0 of a step takes the stored overlap state, and the very first entry of a
       row (no previous window at all) has its a-half masked out.

One program per (row, window) reads the window's [m, C] kv and gate rows (CSA: also the previous
window's, the same arrays through a second BlockSpec), adds the bias, pools with one max, one exp and
two slot reductions per channel, RMS-normalises and writes one [1, D] f32 row. This is the part that
reads every token's 2C compressor values; it needs no matmul and no transpose, so one body lowers for
both targets.

Left to XLA, with why:
  * the stream shift (tail + new tokens, shifted by the row's dynamic tail_count) is one gather before
    the kernel: window blocks then start at static, aligned offsets, which BlockSpecs need;
  * RoPE on the NW entries (interleaved pairs need lane shuffles that Mosaic lowers poorly; they are
    1/m of the kernel's bytes), the tail and the overlap bookkeeping (common.finish), after it.
Reuse: the DSA kernels (pallas_kernels.sparse_attention) score and gather keys; none pools a window,
so this kernel is new.

Backends (both proven by `jax.export` tests):
  * TPU (Mosaic): grid (B, NW), both axes parallel; blocks are whole [m, C] windows (full trailing dims).
  * GPU (Triton): the same grid and body; m, C (and C/2 with overlap) must be powers of two.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import abi
from pallas_kernels.compressed_attention.common import finish, stream
from pallas_kernels.dispatch import KernelUnsupported
from pallas_kernels.kernel_params import compiler_params, cost

ABI = abi.V4_COMPRESSOR   # the entries / tail / overlap layout, the same for every implementation


@dataclasses.dataclass(frozen=True)
class CompressorConfig:
    num_warps: int = 4        # Triton only


def _pool(kv, g):
    """kv, g [n, X] f32 -> (sum_s e_s kv_s [1, X], sum_s e_s [1, X], max [1, X]) with e = exp(g - max)."""
    mx = jnp.max(g, axis=0, keepdims=True)
    e = jnp.exp(g - mx)
    return jnp.sum(e * kv, axis=0, keepdims=True), jnp.sum(e, axis=0, keepdims=True), mx


def _kernel(flag_ref,                   # [1, 1] int32: this window has a previous one (CSA)
            kv_ref, g_ref,              # [m, C] this window (raw gates)
            *refs, overlap, D, eps):
    if overlap:
        pkv_ref, pg_ref, okv_ref, og_ref, bias_ref, w_ref, o_ref = refs   # [m, C] x2, [m, D] x2, [m, C], [1, D]
        w = pl.program_id(1)
        first = w == 0
        # window 0 of the step reads the stored overlap (gates already biased), later ones the previous window
        p_kv = jnp.where(first, okv_ref[...].astype(jnp.float32), pkv_ref[:, :D].astype(jnp.float32))
        p_g = jnp.where(first, og_ref[...].astype(jnp.float32),
                        pg_ref[:, :D].astype(jnp.float32) + bias_ref[:, :D].astype(jnp.float32))
        p_g = jnp.where(flag_ref[...] > 0, p_g, -jnp.inf)
        c_kv = kv_ref[:, D:].astype(jnp.float32)
        c_g = g_ref[:, D:].astype(jnp.float32) + bias_ref[:, D:].astype(jnp.float32)
        num_c, den_c, mx_c = _pool(c_kv, c_g)
        mx_p = jnp.max(p_g, axis=0, keepdims=True)
        mx = jnp.maximum(mx_c, mx_p)                                  # finite: the b-half always counts
        e_p = jnp.exp(p_g - mx)
        scale_c = jnp.exp(mx_c - mx)
        num = num_c * scale_c + jnp.sum(e_p * p_kv, axis=0, keepdims=True)
        den = den_c * scale_c + jnp.sum(e_p, axis=0, keepdims=True)
    else:
        bias_ref, w_ref, o_ref = refs                                 # [m, C], [1, D]
        num, den, _ = _pool(kv_ref[...].astype(jnp.float32),
                            g_ref[...].astype(jnp.float32) + bias_ref[...].astype(jnp.float32))
    x = num / den                                                     # [1, D]
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    o_ref[...] = x * w_ref[...].astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("rate", "overlap", "eps", "config", "backend", "interpret"))
def pool_windows_pallas(s_kv, s_gate, overlap_kv, overlap_gate, entry_count, bias, norm_w, *, rate: int,
                        overlap: bool, eps: float, config: CompressorConfig = CompressorConfig(),
                        backend: str = "tpu", interpret: bool = False):
    """s_kv, s_gate [B, (NW + 1) m, C] (the stream, raw gates); overlap_* [B, m, C/2] | None; entry_count [B];
    bias [m, C]; norm_w [D] -> normed entries [B, NW, D] f32 (no RoPE yet)."""
    B, Ls, C = s_kv.shape
    m = rate
    NW = Ls // m - 1
    D = C // 2 if overlap else C
    if backend == "gpu":
        for name, x in (("rate", m), ("C", C), ("D", D)):
            if x & (x - 1):
                raise KernelUnsupported(f"the Triton compressor kernel needs {name} a power of two; got {x}")
    win_kv = s_kv[:, :NW * m].reshape(B, NW, m, C)
    win_g = s_gate[:, :NW * m].reshape(B, NW, m, C)
    k = jnp.arange(NW, dtype=jnp.int32)[None, :]
    flag = (entry_count.astype(jnp.int32)[:, None] + k > 0).astype(jnp.int32).reshape(B, NW, 1, 1)
    cur = pl.BlockSpec((None, None, m, C), lambda b, w: (b, w, 0, 0))
    in_specs = [pl.BlockSpec((None, None, 1, 1), lambda b, w: (b, w, 0, 0)), cur, cur]
    args = [flag, win_kv, win_g]
    if overlap:
        prev = pl.BlockSpec((None, None, m, C), lambda b, w: (b, jnp.maximum(w - 1, 0), 0, 0))
        ov = pl.BlockSpec((None, m, D), lambda b, w: (b, 0, 0))
        in_specs += [prev, prev, ov, ov]
        args += [win_kv, win_g, overlap_kv, overlap_gate]
    in_specs += [pl.BlockSpec((m, C), lambda b, w: (0, 0)), pl.BlockSpec((1, D), lambda b, w: (0, 0))]
    args += [bias, norm_w.reshape(1, D)]
    sem = ("parallel", "parallel") if backend == "tpu" else ()
    out = pl.pallas_call(
        functools.partial(_kernel, overlap=overlap, D=D, eps=eps), grid=(B, NW), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, 1, D), lambda b, w: (b, w, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, NW, 1, D), jnp.float32),
        compiler_params=compiler_params(backend, sem, config.num_warps), interpret=interpret,
        name="v4_compressor", cost_estimate=_cost(B, NW, m, C, D, s_kv, s_gate, overlap),
    )(*args)
    return out[:, :, 0]


def _cost(B, NW, m, C, D, s_kv, s_gate, overlap):
    """Per window: bias add, max, exp, two products and sums over its m x C (CSA: 2 m x D) slots, then the
    RMSNorm of one D row (~6 m C + 4 D flops, m C exp). Bytes: each window's kv and gate rows (CSA reads
    the previous window's a-half too), the f32 entries written."""
    slots = m * C
    per_window = slots * (s_kv.dtype.itemsize + s_gate.dtype.itemsize) * (2 if overlap else 1)
    return cost(B * NW * (6 * slots + 4 * D), B * NW * (slots + 1), extra_bytes=B * NW * (per_window + 4 * D))


@functools.partial(jax.jit, static_argnames=("rate", "overlap", "eps", "rope_scale", "config", "backend",
                                             "interpret"))
def compress_pallas(kv_new, gate_new, tail_kv, tail_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate,
                    bias, norm_w, freqs, *, rate: int, overlap: bool, eps: float, rope_scale: float = 1.0,
                    config: CompressorConfig = CompressorConfig(), backend: str = "tpu",
                    interpret: bool = False):
    """Shapes as ops.compress_windows: stream gather (XLA) -> pooling + norm (kernel) -> RoPE, tail, overlap (XLA)."""
    s_kv = stream(tail_kv, kv_new, tail_count, n_new, rate)
    s_gate = stream(tail_gate, gate_new, tail_count, n_new, rate)
    pooled = pool_windows_pallas(s_kv, s_gate, overlap_kv, overlap_gate, entry_count, bias, norm_w, rate=rate,
                                 overlap=overlap, eps=eps, config=config, backend=backend, interpret=interpret)
    return finish(pooled, s_kv, s_gate, tail_count, n_new, entry_count, overlap_kv, overlap_gate, bias, None,
                  freqs, rate=rate, overlap=overlap, eps=eps, rope_scale=rope_scale, out_dtype=kv_new.dtype)
