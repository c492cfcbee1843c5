"""On a CPU backend, keeps XLA's compute threads (the "device") apart from Python's threads (the host).

XLA:CPU runs a program on threads of its own (PJRT's execution threads and Eigen's intra-op pool);
the Python thread that steps the engine only dispatches to them and reads results back. Left to
the scheduler, both kinds share every core, so each millisecond of scheduling, detokenizing or HTTP
work is one the computation loses, which an accelerator never sees. `HYBRID_JAX_ENGINE_CPUS=0-3`
gives the runtime CPUs 0-3 and moves every Python thread to the other CPUs: the engine's step loop
then keeps the "device" fed the way it would feed an accelerator, and the compute threads are never
descheduled for host work.

  keep_to(cpus)       before JAX starts: every thread so far (and so every runtime thread started
                      from them) keeps to `cpus`
  split_threads(cpus) once the runtime runs: its threads keep to `cpus`, Python's to the others

The runtime starts some threads lazily (PJRT's execution threads at the first program), so
`split_threads` runs a small program first; callers split once warm-up has run.
"""
from __future__ import annotations

import os
import threading

from hybrid_jax.errors import HybridJaxError

CPUS_ENV = "HYBRID_JAX_ENGINE_CPUS"     # e.g. "0" or "0-3,8": the CPUs XLA's compute threads run on


def parse_cpus(text: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}; raises HybridJaxError naming a bad list."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus |= set(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise HybridJaxError(f"{CPUS_ENV}={text!r} is not a CPU list such as '0-3,8'") from None
    if not cpus:
        raise HybridJaxError(f"{CPUS_ENV}={text!r} names no CPU")
    return cpus


def from_env() -> set[int] | None:
    """The CPU list HYBRID_JAX_ENGINE_CPUS names, or None when it is unset or empty."""
    text = os.environ.get(CPUS_ENV, "").strip()
    return parse_cpus(text) if text else None


def host_cpus(device: set[int]) -> set[int]:
    """The CPUs Python's threads get: every online CPU outside `device` (all of them when `device`
    leaves none, e.g. on a one-CPU machine)."""
    rest = set(range(os.cpu_count() or 1)) - device
    return rest or set(device)


def keep_to(cpus: set[int]):
    """Every thread of this process so far keeps to `cpus` (threads they start inherit them). Call
    before JAX starts its runtime, so the runtime's threads start on the device CPUs."""
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), cpus)
        except ProcessLookupError:          # a thread that ended meanwhile
            pass


def python_threads() -> set[int]:
    """Native ids of the threads Python started (the main thread included)."""
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def split_threads(device: set[int]) -> dict[str, list[int]]:
    """Every thread of this process that Python did not start (XLA's) keeps to `device`; Python's
    threads keep to `host_cpus(device)`. Returns {"device": tids, "host": tids}."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.zeros(8)))      # PJRT starts its execution threads
    host, mine = host_cpus(device), python_threads()
    out: dict[str, list[int]] = {"device": [], "host": []}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setaffinity(tid, host if tid in mine else device)
        except ProcessLookupError:          # a thread that ended meanwhile
            continue
        out["host" if tid in mine else "device"].append(tid)
    return out
