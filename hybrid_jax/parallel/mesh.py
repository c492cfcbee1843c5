"""The device mesh of a parallel layout: axes ("data", "model") over jax.devices()."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from hybrid_jax.parallel.config import ParallelConfig

AXES = ("data", "model")


def build_mesh(pc: ParallelConfig, devices=None) -> Mesh:
    """A [data_parallel_size, tensor_parallel_size] mesh over `devices` (default: jax.devices()); a
    tensor group is adjacent devices (on a TPU slice, the chips nearest each other)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != pc.world_size:
        from hybrid_jax.errors import ConfigError  # noqa: PLC0415
        raise ConfigError(f"the layout needs {pc.world_size} devices; got {len(devices)}")
    grid = np.array(devices, dtype=object).reshape(pc.data_parallel_size, pc.tensor_parallel_size)
    return Mesh(grid, AXES)
