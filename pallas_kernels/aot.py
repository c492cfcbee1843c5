"""Ahead-of-time compilation for TPU topologies on any host, no TPU attached.

The TPU compiler ships in libtpu (`pip install -e ".[tpu-aot]"`); `jax.experimental.topologies` describes
a slice's devices from its name, and `jax.jit(f).lower(args on such a device).compile()` runs the whole
TPU pipeline (XLA and Mosaic for the Pallas kernels), so a kernel that Mosaic rejects (layout, VMEM)
fails here exactly as it would on the chip, and `cost_analysis()` / `memory_analysis()` report the
compiler's figures.

Single chips are named by a 2x2 slice (v5e, v6e) or 2x2x1 (v5p) and programs use one of its devices:
a lone `v5e:1x1` is refused by libtpu's default host bounds.

libtpu takes a lock file per process unless ALLOW_MULTIPLE_LIBTPU_LOAD=1; with no TPU attached nothing
is shared, so tools that compile from several processes set it (tests/conftest.py does).
"""
from __future__ import annotations

import dataclasses
import functools

import jax

# chip -> the smallest slice name libtpu's topology description accepts by default
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


class AotUnavailable(RuntimeError):
    """The TPU compiler cannot be had on this host (libtpu missing or refusing to start); says why."""


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """What the compiler reports for one program."""
    flops: float
    transcendentals: float
    bytes_accessed: float        # HBM bytes, by XLA's cost model (kernels: their pl.CostEstimate)
    argument_bytes: int
    output_bytes: int
    alias_bytes: int             # outputs that reuse an argument's buffer (donated state)
    temp_bytes: int              # compiler temporaries


@functools.lru_cache(maxsize=None)
def tpu_device(chip: str) -> jax.Device:
    """One TPU device of `chip` ("v5e", "v6e", "v5p", "v4") to compile for. Raises AotUnavailable."""
    if chip not in TOPOLOGIES:
        raise ValueError(f"unknown TPU chip {chip!r}; known: {sorted(TOPOLOGIES)}")
    try:
        import libtpu  # noqa: F401, PLC0415
    except ImportError as e:
        raise AotUnavailable(f"the TPU compiler is not installed (pip install -e '.[tpu-aot]'): {e}") from e
    from jax.experimental import topologies  # noqa: PLC0415
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[chip]).devices[0]
    except Exception as e:  # noqa: BLE001  (libtpu reports its refusals as assorted runtime errors)
        raise AotUnavailable(f"libtpu would not describe {TOPOLOGIES[chip]}: {e}") from e


def on_device(tree, device: jax.Device):
    """ShapeDtypeStructs (any pytree of objects with .shape / .dtype, None kept) placed on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def compile_for(fn, args: tuple, chip: str, **jit_kw):
    """jax.jit(fn, **jit_kw) lowered and compiled for one `chip` device with abstract `args`.
    Returns (compiled, CompiledCost). Raises what the compiler raises (e.g. a Mosaic error)."""
    compiled = jax.jit(fn, **jit_kw).lower(*on_device(args, tpu_device(chip))).compile()
    return compiled, cost_of(compiled)


def cost_of(compiled) -> CompiledCost:
    ca = compiled.cost_analysis() or {}
    if isinstance(ca, list):       # older jax: one dict per program
        ca = ca[0] if ca else {}
    ma = compiled.memory_analysis()
    return CompiledCost(flops=float(ca.get("flops", 0.0)), transcendentals=float(ca.get("transcendentals", 0.0)),
                        bytes_accessed=float(ca.get("bytes accessed", 0.0)),
                        argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
                        alias_bytes=int(ma.alias_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes))
