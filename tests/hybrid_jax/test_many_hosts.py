"""Several processes, one mesh (hybrid_jax.parallel.hosts): two processes with four CPU devices each
join JAX's distributed runtime on 127.0.0.1 (gloo collectives) and run `hybrid-jax generate` split
over all eight devices in lockstep, or `hybrid-jax serve` with process 0 answering HTTP and process 1
following its engine; the options are checked before anything starts."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from conftest import make_checkpoint
from test_server import _wait_ready   # noqa: PLC2701  (sibling test module's helper)

from hybrid_jax.errors import ConfigError
from hybrid_jax.parallel import hosts

# Heads, KV copies, experts and MLP columns that 8 devices split.
EIGHT = dict(vocab_size=320, num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=8,
             linear_num_value_heads=8, num_experts=8, layer_types=["linear_attention", "linear_attention",
                                                                  "linear_attention", "full_attention"],
             mlp_only_layers=[1])
TOKENS = "5,9,13,200,7,41,5,9,13,200,7,41,3,4,5"


def _generate(ckpt, *extra, env=None, core=None):
    """Starts `hybrid-jax generate` (greedy, 8 tokens of TOKENS) on `core`; returns the Popen."""
    cmd = [sys.executable, "-m", "hybrid_jax.cli", "generate", "--model", ckpt, "--tokens", TOKENS, "--max-tokens",
           "8", "--temperature", "0", "--ignore-eos", "--dtype", "float32", *extra]
    return subprocess.Popen(_on_core(cmd, core), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {})))


def _on_core(cmd: list, core) -> list:
    """cmd run on one core (taskset; a preexec_fn would fork this multithreaded process unsafely), so
    the two processes of a test do not take the other pytest worker's core as well."""
    return ["taskset", "-c", str(core), *cmd] if core is not None and shutil.which("taskset") else cmd


def _token_ids(stderr: str) -> list[int]:
    m = re.search(r"token_ids=\[([\d, ]*)\]", stderr)
    assert m, stderr[-3000:]
    return [int(x) for x in m.group(1).split(",") if x.strip()]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosts_env() -> dict:
    """Two processes of four CPU devices on 127.0.0.1."""
    return {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
            "HYBRID_JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_port()}", "HYBRID_JAX_NUM_PROCESSES": "2"}


def _two_processes(ckpt, *extra):
    env = _hosts_env()
    cores = sorted(os.sched_getaffinity(0))
    procs = [_generate(ckpt, "--process-id", str(i), *extra, env=env, core=cores[i % len(cores)]) for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        results.append((p.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hosts") / "m", seed=11, **EIGHT)


def test_two_processes_of_four_devices_generate_what_one_device_does(eight):
    one = _generate(eight)
    out, err = one.communicate(timeout=900)
    assert one.returncode == 0, err[-3000:]
    want = _token_ids(err)
    (rc0, out0, err0), (rc1, out1, err1) = _two_processes(eight, "--tensor-parallel-size", "8",
                                                           "--enable-expert-parallel")
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    assert _token_ids(err0) == _token_ids(err1) == want and len(want) == 8
    # each process read its devices' slices of the file: about half of it (norms, router, conv taps whole)
    read = [re.search(r"read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB", e).groups() for e in (err0, err1)]
    assert all(0.4 < float(r) / float(total) < 0.65 for r, total in read), read
    # process 0 prints the text; the others print nothing. The runtime's own lines (gloo's, written by its
    # C++ threads a piece at a time) go to stderr: stdout is exactly one device's
    assert [out0, out1] == [out, ""]
    assert "[Gloo]" not in out0 + out1


def test_two_processes_serve_what_one_device_generates(eight):
    """Process 0 serves HTTP and sends each engine iteration's requests to process 1, which steps with
    it: a completion (token ids in, greedy) equals one device's; SIGTERM stops both, exiting 0."""
    one = _generate(eight)
    _, err = one.communicate(timeout=900)
    want = _token_ids(err)
    env, port = _hosts_env(), _port()
    cores = sorted(os.sched_getaffinity(0))
    procs = [subprocess.Popen(_on_core([sys.executable, "-m", "hybrid_jax.cli", "serve", "--model", eight, "--port",
                                        str(port), "--dtype", "float32", "-tp", "8", "--enable-expert-parallel",
                                        "--max-num-seqs", "2", "--max-model-len", "256", "--warmup", "none",
                                        "--process-id", str(i)], cores[i % len(cores)]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env)) for i in range(2)]
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(procs[0], url, 600)
        body = {"model": eight, "prompt": [int(t) for t in TOKENS.split(",")], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        got = [httpx.post(url + "/v1/completions", json=body, timeout=600).json() for _ in range(2)]
        assert [g["choices"][0]["logprobs"]["token_ids"] for g in got] == [want, want]
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(300) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_layout_that_leaves_devices_out_fails_in_every_process(eight):
    """Two processes own 8 devices: tensor size 4 would leave a process without work; both say so."""
    results = _two_processes(eight, "--tensor-parallel-size", "4")
    for rc, _, err in results:
        assert rc == 2 and "2 processes share 8 devices" in err, err[-3000:]


@pytest.mark.parametrize("kw, words", [
    (dict(num_processes=2, process_id=2, coordinator_address="127.0.0.1:1"), "process_id 2 is not one of the 2"),
    (dict(num_processes=2, process_id=0), "coordinator_address HOST:PORT"),
    (dict(num_processes=0), "num_processes must be at least 1"),
    (dict(num_processes="two"), "num_processes must be an integer"),
])
def test_bad_process_options_are_named(kw, words, monkeypatch):
    for v in (hosts.ENV_ADDRESS, hosts.ENV_COUNT, hosts.ENV_ID):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ConfigError, match=words):
        hosts.resolve(**kw)


def test_one_process_needs_no_runtime(monkeypatch):
    monkeypatch.setenv(hosts.ENV_COUNT, "1")
    assert hosts.start() == 0
