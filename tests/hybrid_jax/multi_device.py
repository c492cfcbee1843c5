"""Running a check on 8 CPU devices from a test: the worker scripts (parallel_worker.py,
per_device_worker.py) call `eight_devices()` before importing jax, and the tests start them with
`run_worker`, which returns the worker's one "RESULT {json}" line as a dict.

A worker runs on one core. XLA:CPU drives each of the 8 devices from its own threads; left on every
core, those threads outnumber the other pytest worker's and the scheduler gives them most of the
machine, so every test beside them ran half again slower. The test that started the worker only
waits for it, so one core is its fair share.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def eight_devices():
    """In a worker, before jax is imported: 8 CPU devices, on one core."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[os.getpid() % len(cores)]})


def run_worker(script: str, *args, timeout: int = 1500) -> dict:
    """Runs tests/hybrid_jax/<script> with `args` in a subprocess; its RESULT line as a dict."""
    r = subprocess.run([sys.executable, os.path.join(HERE, script), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])
