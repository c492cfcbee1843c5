"""The TPU compile tests in f32 (test_tpu_compile.py has bf16; the cases are in tpu_cases.py): the real
models' shapes on v5e, v6e and v5p, and the every-token states of a 200-token window, which ran out of
VMEM on v5e before the recurrent kernel walked T in blocks (GDN's per-head decay and KDA's per-channel one,
whose g is one more [block_t, K] f32 block a step)."""
from __future__ import annotations

import pytest
from tpu_cases import CHIPS, REAL, check_real, compiled, need_chip


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("name", list(REAL))
def test_real_shapes_compile_f32(name, chip):
    check_real(name, chip, "f32")


@pytest.mark.parametrize("name", ["gdn_all_states_T200", "kda_all_states_T200"])
def test_all_states_T200_fits_vmem_f32(name):
    need_chip("v5e")
    program, _ = compiled(name, "f32", "v5e")
    assert "tpu_custom_call" in program.as_text()
