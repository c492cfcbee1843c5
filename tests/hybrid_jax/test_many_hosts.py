"""Several processes, one mesh (hybrid_jax.parallel.hosts): two processes with four CPU devices each
join JAX's distributed runtime on 127.0.0.1 (gloo collectives) and run `hybrid-jax generate` split
over all eight devices, in lockstep; the options are checked before anything starts."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from conftest import make_checkpoint

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
    pre = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pre,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {})))


def _token_ids(stderr: str) -> list[int]:
    m = re.search(r"token_ids=\[([\d, ]*)\]", stderr)
    assert m, stderr[-3000:]
    return [int(x) for x in m.group(1).split(",") if x.strip()]


def _two_processes(ckpt, *extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
           "HYBRID_JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "HYBRID_JAX_NUM_PROCESSES": "2"}
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
    printed = [[x for x in o.splitlines() if not x.startswith("[Gloo]")] for o in (out0, out1)]   # gloo's own
    assert printed == [out.splitlines(), []]       # process 0 prints the text; the others print nothing


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
