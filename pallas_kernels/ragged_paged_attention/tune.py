"""The TPU ragged paged attention kernel as `hybrid-jax tune` searches it (pallas_kernels/tuning.py).

A key is "<kv dtype>:hkv<Hkv>:g<Hq / Hkv>:d<head dim>:ps<page size>", e.g. "bfloat16:hkv2:g8:d256:ps16"
(Qwen3-Next-80B's attention). A candidate is {num_kv_pages_per_block, num_queries_per_block}: the pages DMA'd
per key block and the query rows of a prefill tile (decode tiles keep one query each: callers set them to
their verify window). The workloads are the calls a served step makes at the key's shapes:

  prefill   one 2,048-token chunk of a prompt at 8k context    (every prefill tile reads its span)
  prompts   eight 256-token prompts in one 2,048-token chunk   (a tile longer than a prompt is padding)
  decode    64 sequences of one query at 8k context            (the key block alone matters)

Beyond the compiled cost (`overheads`): sequential steps, the grid's tiles and per tile the key blocks it walks
(its table span: the static cost's assumption, the most a tile reads), and half a key block of masked keys
scored per tile.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.tuned_block_sizes import TABLE, rule
from pallas_kernels.tuning import TuningError, Workload

# Qwen3-Next-80B's attention on one chip (Hq 16, Hkv 2, D 256), bf16, at the page sizes the engine and plan use
DEFAULT_KEYS = ("bfloat16:hkv2:g8:d256:ps16", "bfloat16:hkv2:g8:d256:ps32", "bfloat16:hkv2:g8:d256:ps64")
PAGES = (4, 8, 16, 32)
QUERIES = (16, 32, 64, 128, 256)
CONTEXT = 8192
_KEY = re.compile(r"^(\w+):hkv(\d+):g(\d+):d(\d+):ps(\d+)$")


def key_of(kv_dtype, num_kv_heads: int, group: int, head_dim: int, page_size: int) -> str:
    return f"{jnp.dtype(kv_dtype).name}:hkv{num_kv_heads}:g{group}:d{head_dim}:ps{page_size}"


def parse_key(key: str) -> tuple[jnp.dtype, int, int, int, int]:
    m = _KEY.match(key)
    if not m:
        raise TuningError(f"ragged_paged_attention key {key!r} is not <kv dtype>:hkv<H>:g<G>:d<D>:ps<P> "
                          f"(e.g. bfloat16:hkv2:g8:d256:ps16)")
    try:
        dtype = jnp.dtype(m.group(1))
    except TypeError:
        raise TuningError(f"ragged_paged_attention key {key!r}: unknown dtype {m.group(1)!r}") from None
    return (dtype, *(int(m.group(i)) for i in range(2, 6)))


def hand_picked(key: str) -> dict:
    """The hand-picked table's entry (or its rule) for the key."""
    dtype, _, group, head_dim, ps = parse_key(key)
    b = TABLE.get((dtype.name, group, head_dim, ps)) or rule(group, ps)
    return {"num_kv_pages_per_block": b.num_kv_pages_per_block, "num_queries_per_block": b.num_queries_per_block}


def candidates(key: str) -> list[dict]:
    hand = hand_picked(key)
    out = [{"num_kv_pages_per_block": p, "num_queries_per_block": q} for p in PAGES for q in QUERIES]
    return out + ([hand] if hand not in out else [])


def workloads(key: str) -> list[Workload]:
    parse_key(key)
    return [Workload("prefill", dict(N=2048, R=1, context=CONTEXT, decode=False)),
            Workload("prompts", dict(N=2048, R=8, context=256, decode=False)),
            Workload("decode", dict(N=64, R=64, context=CONTEXT, decode=True))]


def relevant(cand: dict, w: Workload) -> dict:
    """The part of a candidate a workload's program depends on (a decode batch has no prefill tiles)."""
    return {"num_kv_pages_per_block": cand["num_kv_pages_per_block"]} if w.shape["decode"] else cand


def _shapes(key: str, w: Workload):
    dtype, Hkv, group, D, ps = parse_key(key)
    N, R = w.shape["N"], w.shape["R"]
    NP = -(-w.shape["context"] // ps)
    P = R * NP
    S = jax.ShapeDtypeStruct
    return (S((N, Hkv * group, D), dtype), S((P, ps, Hkv, D), dtype), S((P, ps, Hkv, D), dtype),
            S((R,), jnp.int32), S((R, NP), jnp.int32), S((R + 1,), jnp.int32), S((1,), jnp.int32)), NP


def program(key: str, cand: dict, w: Workload):
    from pallas_kernels.ragged_paged_attention import pallas_tpu  # noqa: PLC0415
    args, _ = _shapes(key, w)
    D = parse_key(key)[3]
    decode = w.shape["decode"]

    def fn(*a):
        return pallas_tpu.ragged_paged_attention_tpu(
            *a, sm_scale=D ** -0.5, max_q_len=1 if decode else None, decode_only=decode,
            decode_queries_per_block=1, **cand)
    return fn, args


def overheads(key: str, cand: dict, w: Workload, grids: list[tuple[int, ...]]) -> tuple[int, float]:
    """(sequential steps, FLOPs the static cost leaves out). Steps: the grid's tiles (`grids`, read from the
    traced program) and, per tile, the key blocks of its table span. FLOPs: a tile's last key block is scored
    whole while its keys end anywhere in it, half a block of masked keys per tile on average."""
    dtype, Hkv, group, D, ps = parse_key(key)
    _, NP = _shapes(key, w)
    bp = min(cand["num_kv_pages_per_block"], NP)
    tiles = sum(g[0] for g in grids)
    rows = 1 if w.shape["decode"] else cand["num_queries_per_block"]
    return tiles * (1 + -(-NP // bp)), tiles * Hkv * rows * group * (bp * ps / 2) * 4 * D
