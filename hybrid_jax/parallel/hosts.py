"""Several processes (hosts) running one model over all their devices.

`start(coordinator_address, num_processes, process_id)` joins JAX's distributed runtime
(`jax.distributed.initialize`; on CPU with the gloo collectives) before any device is touched; after it
`jax.devices()` lists every process's devices and a layout's mesh spans them all.

Every process runs the same program on its own devices (SPMD): the engine's scheduler is
deterministic, so processes given the same requests schedule the same steps in the same order and
each step's collectives meet. Offline work (`hybrid-jax generate`, `bench`, `LLM.generate` with the
same prompts in every process) runs this way, process 0 printing the results. Serving: process 0
runs the HTTP server and the engine loop, and before each iteration sends what it applied to its
engine (requests added and aborted) and whether it steps (`Mirror`); every other process runs
`follow`, applying the same to its own engine and stepping with it. Nothing time-dependent may
decide a step (the disk tier's prefetch policy would): `kv_cache_dir` is refused with several
processes.

Options, or the environment when an option is not given: HYBRID_JAX_COORDINATOR_ADDRESS (host:port
of process 0), HYBRID_JAX_NUM_PROCESSES, HYBRID_JAX_PROCESS_ID.
"""
from __future__ import annotations

import dataclasses
import json
import logging
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


class Mirror:
    """Process 0's engine inputs, sent to every process once per engine-loop iteration: a JSON message
    {"events": [["add", id, prompt, sampling params, arrival] | ["abort", id]], "step": bool,
    "stop": bool}, broadcast as its length and then its bytes (padded to a power of two: few shapes
    to compile)."""

    def exchange(self, message: dict | None = None) -> dict:
        """On process 0: sends `message` and returns it; elsewhere: returns process 0's message."""
        import jax  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415
        from jax.experimental import multihost_utils  # noqa: PLC0415
        data = json.dumps(message).encode() if jax.process_index() == 0 else b""
        n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int32)))[0])
        buf = np.zeros(max(256, 1 << (n - 1).bit_length()), np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        return json.loads(out[:n].tobytes())

    @staticmethod
    def add_event(request_id: str, prompt, params, arrival) -> list:
        return ["add", request_id, prompt, dataclasses.asdict(params), arrival]


def apply_events(engine, events: list):
    """Applies process 0's engine inputs to this process's engine, as process 0 did (an add it refused
    is refused here alike)."""
    from hybrid_jax.sampling import SamplingParams  # noqa: PLC0415
    for ev in events:
        if ev[0] == "add":
            _, rid, prompt, params, arrival = ev
            try:
                engine.add_request(rid, prompt, SamplingParams(**params), arrival=arrival)
            except Exception:  # noqa: BLE001,S110  (process 0 answered it)
                pass
        elif ev[0] == "abort":
            engine.abort_request(ev[1])


def follow(engine, mirror: Mirror | None = None):
    """A process other than 0 while serving: applies process 0's engine inputs and steps with it
    until process 0 stops. Outputs are dropped (process 0 answers)."""
    log = logging.getLogger("hybrid_jax.hosts")
    mirror = mirror or Mirror()
    while True:
        msg = mirror.exchange()
        apply_events(engine, msg["events"])
        if msg.get("stop"):
            return
        if msg["step"]:
            try:
                engine.step()
            except Exception as e:  # noqa: BLE001  (process 0 failed the same step and aborts the same)
                log.error("engine step raised (%s); aborting every request, as process 0 does", e)
                engine.abort_all()
                continue
            engine.flush_publishes()
