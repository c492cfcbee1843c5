"""Every Pallas TPU kernel compiled by the TPU compiler (XLA + Mosaic) through the public ops on this host,
which has no TPU: the real models' shapes in bf16 on v5e, v6e and v5p, and awkward shapes on v5e. The cases and their shapes are in tpu_cases.py; f32 is
test_tpu_compile_f32.py. Every test skips, saying why, where the TPU compiler (`tpu-aot` extra) is missing.
"""
from __future__ import annotations

import jax.numpy as jnp
import pytest
from tpu_cases import AWKWARD, CHIPS, REAL, check_real, compiled, gdn_args, need_chip

import pallas_kernels as pk
from pallas_kernels import aot

@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("name", list(REAL))
def test_real_shapes_compile_bf16(name, chip):
    check_real(name, chip, "bf16")


@pytest.mark.parametrize("name", list(AWKWARD))
def test_awkward_shapes_compile(name):
    need_chip("v5e")
    program, _ = compiled(name, "bf16", "v5e")
    assert "tpu_custom_call" in program.as_text()


def test_auto_picks_the_kernel_when_compiled_for_tpu():
    """impl="auto" compiled for a TPU from this CPU host runs the Mosaic kernel, not the XLA path."""
    need_chip("v5e")

    def fn(*a):
        return pk.fused_recurrent_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True, impl="auto")
    program, _ = aot.compile_for(fn, gdn_args(2, 1, 2, 4, 128, 128, jnp.bfloat16), "v5e")
    assert "tpu_custom_call" in program.as_text()
