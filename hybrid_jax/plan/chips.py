"""TPU chips' published peak figures, and topology names resolved to devices the TPU compiler targets.

The figures are Google's per-chip specifications (Cloud TPU documentation, "System architecture" table
of each generation's page), used only for roofline estimates and capacity; they are not measured here:

  v4   https://cloud.google.com/tpu/docs/v4    275 TFLOP/s bf16, HBM2 32 GiB, 1200 GB/s
  v5e  https://cloud.google.com/tpu/docs/v5e   197 TFLOP/s bf16, HBM2 16 GB, 819 GB/s
  v5p  https://cloud.google.com/tpu/docs/v5p   459 TFLOP/s bf16, HBM2e 95 GB, 2765 GB/s
  v6e  https://cloud.google.com/tpu/docs/v6e   918 TFLOP/s bf16, HBM 32 GB, 1638 GB/s

A topology is named as libtpu names it, `<chip>:<AxB>` or `<chip>:<AxBxC>` (v6e:2x4, v5p:2x2x2); a
single chip is not a name libtpu's default host bounds accept (v6e:1x1 is refused), so one-chip plans
use a 2x2 slice and one of its devices.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax

from hybrid_jax.errors import HybridJaxError

GB, GiB = 10**9, 2**30


class PlanError(HybridJaxError):
    """A plan that cannot be made: unknown topology, TPU compiler missing, a model that does not fit."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's published peak figures (see the module docstring for the sources)."""
    name: str
    peak_bf16_flops: float        # FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float          # bytes/s
    source: str


CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GiB, 1200 * GB, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", 197e12, 16 * GB, 819 * GB, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", 459e12, 95 * GB, 2765 * GB, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", 918e12, 32 * GB, 1638 * GB, "https://cloud.google.com/tpu/docs/v6e"),
}

_NAME = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+){1,2})$")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice: its name, chip, number of chips, and its devices to compile for."""
    name: str
    chip: Chip
    num_chips: int
    devices: tuple                # libtpu's devices of the slice (v4 lists each of a chip's two cores)

    @property
    def device(self) -> jax.Device:
        """The device a one-chip program is compiled for."""
        return self.devices[0]

    @property
    def num_devices(self) -> int:
        return len(self.devices)


def parse_topology(name: str) -> tuple[Chip, int]:
    """'v6e:2x4' -> (CHIPS['v6e'], 8). Raises PlanError for a malformed name or an unknown chip."""
    m = _NAME.match(name or "")
    if not m:
        raise PlanError(f"topology {name!r} is not of the form CHIP:AxB or CHIP:AxBxC (e.g. v6e:2x4, v5p:2x2x2)")
    if m.group(1) not in CHIPS:
        raise PlanError(f"unknown TPU chip {m.group(1)!r} in topology {name!r}; known: {sorted(CHIPS)}")
    return CHIPS[m.group(1)], math.prod(int(x) for x in m.group(2).split("x"))


@functools.lru_cache(maxsize=None)
def topology(name: str) -> Topology:
    """The slice `name` as libtpu describes it (no TPU needed). Raises PlanError when the name is bad, libtpu
    is not installed, or libtpu refuses the name (its message is kept)."""
    chip, n = parse_topology(name)
    try:
        import libtpu  # noqa: F401, PLC0415
    except ImportError as e:
        raise PlanError(f"the TPU compiler is not installed (pip install -e '.[tpu-aot]'): {e}") from None
    from jax.experimental import topologies  # noqa: PLC0415
    try:
        devices = topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as e:  # noqa: BLE001  (libtpu reports refusals as assorted runtime errors)
        raise PlanError(f"libtpu refused the topology {name!r}: {str(e).splitlines()[0]}") from None
    return Topology(name=name, chip=chip, num_chips=n, devices=tuple(devices))
