"""Context-parallel prefill of the chunked linear-attention rules (pallas_kernels/context_parallel.py):
one sequence's tokens split by position over 8 CPU devices give one device's outputs and final states
(context_parallel_worker.py, in a subprocess: the device count is fixed before jax is imported)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybrid_jax"))
from multi_device import run_worker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def errors():
    return run_worker(os.path.join(HERE, "context_parallel_worker.py"))


def test_every_rule_split_over_eight_devices_gives_one_devices_outputs_and_states(errors):
    # rows, a packed batch through four spans with an empty sequence and a padded tail, boundaries on
    # the spans' edges; GDN's Pallas kernel (interpreted) beside the XLA paths
    assert {"gdn/packed/pallas", "kda/edges/xla", "mamba2/packed/xla", "mamba2/rows/xla"} <= set(errors)
    for case, e in errors.items():
        if case == "split_over":
            continue
        tol = 2e-2 if "bf16" in case else 2e-6
        assert e["split"]["o"] < tol and e["split"]["final"] < tol, (case, e)
        # the control: spans scanned alone from the initial state are far off, so the carried state is tested
        assert e["unjoined"]["o"] > 1e-2, (case, e)


def test_split_over_runs_a_rule_on_whole_arrays_and_names_a_length_the_axis_does_not_divide(errors):
    assert errors["split_over"]["o"] < 2e-6 and errors["split_over"]["final"] < 2e-6, errors["split_over"]
    assert "multiple of 8" in errors["split_over"]["indivisible"]
