"""Several processes (hosts) running one model over all their devices.

`start(coordinator_address, num_processes, process_id)` joins JAX's distributed runtime
(`jax.distributed.initialize`; on CPU with the gloo collectives) before any device is touched; after it
`jax.devices()` lists every process's devices and a layout's mesh spans them all.

Every process runs the same program on its own devices (SPMD): the engine's scheduler is
deterministic, so processes given the same requests schedule the same steps in the same order and
each step's collectives meet. Offline work (`hybrid-jax generate`, `bench`, `LLM.generate` with the
same prompts in every process) runs this way, process 0 printing the results. `serve` refuses
several processes for now: only process 0 would receive the HTTP requests, and sending each step's
requests to the others is not built yet.

Options, or the environment when an option is not given: HYBRID_JAX_COORDINATOR_ADDRESS (host:port
of process 0), HYBRID_JAX_NUM_PROCESSES, HYBRID_JAX_PROCESS_ID.
"""
from __future__ import annotations

import os

from hybrid_jax.errors import ConfigError

ENV_ADDRESS, ENV_COUNT, ENV_ID = "HYBRID_JAX_COORDINATOR_ADDRESS", "HYBRID_JAX_NUM_PROCESSES", "HYBRID_JAX_PROCESS_ID"


def _int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer; got {value!r}") from None


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None) -> tuple[str | None, int, int]:
    """(address, count, id) from the options, else the environment; checked, never started."""
    address = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    count = _int(num_processes if num_processes is not None else os.environ.get(ENV_COUNT, 1), "num_processes")
    pid = _int(process_id if process_id is not None else os.environ.get(ENV_ID, 0), "process_id")
    if count < 1:
        raise ConfigError(f"num_processes must be at least 1; got {count}")
    if not 0 <= pid < count:
        raise ConfigError(f"process_id {pid} is not one of the {count} processes (0 .. {count - 1})")
    if count > 1:
        host, _, port = (address or "").rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{count} processes need coordinator_address HOST:PORT (process 0's, reachable by "
                              f"all); got {address!r}")
    return address, count, pid


def start(coordinator_address: str | None = None, num_processes: int | None = None,
          process_id: int | None = None) -> int:
    """Joins the distributed runtime when there are several processes; returns this process's id.
    Must run before anything touches a device."""
    address, count, pid = resolve(coordinator_address, num_processes, process_id)
    if count == 1:
        return 0
    import jax  # noqa: PLC0415
    if (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(address, num_processes=count, process_id=pid)
    except RuntimeError as e:
        raise ConfigError(f"cannot join {count} processes at {address} as process {pid}: {e}") from None
    return pid


def is_leader() -> bool:
    """Whether this process is the one that reports (process 0; the only one without a runtime)."""
    import jax  # noqa: PLC0415
    return jax.process_index() == 0
