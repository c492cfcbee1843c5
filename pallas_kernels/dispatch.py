"""Which implementation of an op runs: `impl` and the platform the program is lowered for.

Every public op takes `impl="auto"|"pallas"|"xla"|"reference"` and hands its arguments to `run`:

  impl          lowered for CPU             for TPU                 for CUDA / ROCm
  "reference"   token-level reference       (same)                  (same)
  "xla"         the op's XLA path           (same)                  (same)
  "pallas"      Mosaic TPU kernel,          Mosaic TPU kernel       Triton kernel
                interpreted
  "auto"        the op's XLA path           Mosaic TPU kernel       Triton kernel

The platform is the one the program is *lowered* for, not `jax.default_backend()`: the choice is
staged out with `jax.lax.platform_dependent`, so `jax.export` / `jit(...).lower(...).compile()` for a
TPU from a CPU host carries the TPU kernel (a `tpu_custom_call`), and the same traced program lowered
for the CPU runs the interpreter. All branches are traced; only the lowering platform's is lowered.
Called outside `jit`, the default device's branch runs directly.

A Pallas request that cannot be honoured is an error, never a quiet XLA run:
  * the op's kernel module fails to import: `impl="pallas"` raises at once (KernelUnavailable);
    `impl="auto"` raises when lowered for a TPU or GPU (on the CPU it needs no kernel);
  * a kernel variant that cannot take these shapes (it raises `KernelUnsupported` while being traced,
    e.g. the Triton variants need power-of-two tiles): with `impl="pallas"` lowering for that platform
    fails with the kernel's message; `impl="auto"` takes the XLA path on that platform instead (auto
    means the best implementation that exists for the input).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import mlir

IMPLS = ("auto", "pallas", "xla", "reference")
# Lowering platform -> the Pallas kernel variant built for it. The CPU interprets the TPU variant.
KERNEL_BACKENDS = {"tpu": "tpu", "cuda": "gpu", "rocm": "gpu"}
INTERPRET_BACKEND = "tpu"

class KernelUnsupported(ValueError):
    """A kernel variant cannot be built for these shapes (raised while tracing it)."""


class KernelUnavailable(RuntimeError):
    """`impl="pallas"` was asked for an op whose Pallas kernel cannot be had here."""


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    return impl


def run(op: str, impl: str, args: tuple, *, reference: Callable[..., Any], xla: Callable[..., Any],
        pallas: Callable[[], Callable[..., Any]]) -> Any:
    """Runs op `op` on `args` (a tuple of arrays / None) with the implementation `impl` picks.

    reference, xla: functions of *args. pallas: imports the kernel module and returns the kernel, a
    function of *args and the keywords backend (a KERNEL_BACKENDS value) and interpret; an ImportError
    there makes the kernel unavailable (see the module docstring)."""
    check_impl(impl)
    if impl == "reference":
        return reference(*args)
    if impl == "xla":
        return xla(*args)
    try:
        kernel = pallas()
    except ImportError as e:
        if impl == "pallas":
            raise KernelUnavailable(f"{op}: impl='pallas' needs its Pallas kernel, whose module failed to import: "
                                    f"{e}") from e
        reason = f"{op}: impl='auto' on an accelerator needs the Pallas kernel, whose module failed to import: {e}"
        return jax.lax.platform_dependent(*args, cpu=xla, default=_unbuildable_branch(reason, xla))

    def kernel_branch(backend: str, interpret: bool, where: str):
        def branch(*a):
            try:
                return kernel(*a, backend=backend, interpret=interpret)
            except KernelUnsupported as e:
                if impl == "auto":
                    return xla(*a)
                return _unbuildable_branch(f"{op}: impl='pallas' has no kernel for {where}: {e}", xla)(*a)
        return branch

    # one branch per kernel variant: platforms sharing a variant share the function, so it is traced once
    variants = {b: kernel_branch(b, False, "/".join(p for p, v in KERNEL_BACKENDS.items() if v == b) + f" ({b} variant)")
                for b in set(KERNEL_BACKENDS.values())}
    accel = {p: variants[b] for p, b in KERNEL_BACKENDS.items()}
    cpu = xla if impl == "auto" else kernel_branch(INTERPRET_BACKEND, True, "cpu (interpret mode)")
    other = _unbuildable_branch(f"{op}: no Pallas kernel for this platform (there are: cpu, "
                                f"{', '.join(KERNEL_BACKENDS)})", xla)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=other, **accel)


# ------------------------------------------------------------------ a branch that fails when lowered

_unbuildable_p = jex_core.Primitive("pallas_kernels_unbuildable")
_unbuildable_p.multiple_results = True


@_unbuildable_p.def_abstract_eval
def _unbuildable_abstract_eval(*_, out_avals, message):
    return out_avals


def _unbuildable_impl(*_, out_avals, message):
    raise KernelUnavailable(message)


def _unbuildable_lowering(ctx, *_, out_avals, message):
    raise KernelUnavailable(message)


_unbuildable_p.def_impl(_unbuildable_impl)
mlir.register_lowering(_unbuildable_p, _unbuildable_lowering)


def _unbuildable_branch(message: str, like: Callable[..., Any]):
    """A branch with `like`'s outputs whose lowering (or eager run) raises KernelUnavailable(message)."""
    def branch(*a):
        out = jax.eval_shape(like, *a)
        leaves, tree = jax.tree.flatten(out)
        avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
        flat_args = [x for x in jax.tree.leaves(a)]
        return jax.tree.unflatten(tree, _unbuildable_p.bind(*flat_args, out_avals=avals, message=message))
    return branch
