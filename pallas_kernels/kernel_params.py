"""What every Pallas kernel hands its `pallas_call` besides the body: compiler parameters per backend,
small integer vectors in scalar memory, and the cost estimate XLA's cost analysis reports.

Backends are the kernel variants of `dispatch.KERNEL_BACKENDS`: "tpu" (Mosaic TPU) and "gpu" (Triton).
"""
from __future__ import annotations

from jax.experimental import pallas as pl

BACKENDS = ("tpu", "gpu")
# Scoped VMEM a TPU kernel may ask for. Mosaic's default (16 MiB on v5e) is a fraction of the chip's
# VMEM; kernels whose double-buffered blocks need more ask for this much and size their blocks to stay
# under it. tests/pallas_kernels/test_tpu_compile.py compiles them for v5e, v6e and v5p.
TPU_VMEM_LIMIT = 48 << 20


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    return backend


def compiler_params(backend: str, semantics: tuple[str, ...], num_warps: int = 4, num_stages: int | None = None,
                    vmem_limit_bytes: int | None = None):
    """Mosaic TPU params (grid axis semantics, VMEM limit) or Triton params (warps, stages)."""
    if check_backend(backend) == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)
    from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def smem_spec(backend: str, n: int):
    """A whole small int32 vector [n]: SMEM on TPU, an ordinary block on GPU."""
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((n,), lambda *_: (0,))


def cost(flops: float, transcendentals: float, *arrays, extra_bytes: float = 0) -> pl.CostEstimate:
    """A kernel's cost for XLA's cost analysis: its FLOPs and transcendentals, and its HBM bytes: those
    of `arrays` (anything with .shape and .dtype) read or written once each, plus `extra_bytes` (what
    the kernel reads more than once, or reads only in part: gathered rows, re-fetched pages)."""
    nbytes = sum(nbytes_of(a) for a in arrays if a is not None)
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                           bytes_accessed=int(nbytes + extra_bytes))


def nbytes_of(a) -> int:
    """Bytes of an array or ShapeDtypeStruct."""
    return int(a.dtype.itemsize) * _size(a.shape)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n

