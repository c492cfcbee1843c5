"""Every Pallas TPU kernel compiled by the TPU compiler (XLA + Mosaic) through the public ops on this host,
which has no TPU: the real models' shapes in bf16 on v5e, v6e and v5p, awkward shapes on v5e, and the
decode steps' cost baselines. The cases and their shapes are in tpu_cases.py; f32 is
test_tpu_compile_f32.py. Every test skips, saying why, where the TPU compiler (`tpu-aot` extra) is missing.
"""
from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest
from conftest import check_cost_baselines
from tpu_cases import AWKWARD, CHIPS, REAL, check_real, compiled, gdn_args, need_chip

import pallas_kernels as pk
from pallas_kernels import aot

BASELINES = pathlib.Path(__file__).with_name("tpu_baselines.json")
BASELINE_CHIPS = ("v5e", "v6e")
TOLERANCE = 1.05


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


@pytest.mark.parametrize("chip", ("v5e", "v6e"))
def test_pooled_decode_moves_only_the_batchs_states(chip):
    """The decode step's recurrent kernel over a pool of 3 x 65 rows (every layer's states; batch rows reach
    theirs through a scalar-prefetched index, the pool aliased to the output) costs what the kernel over the
    batch's own 8 states costs: the pool is neither copied, gathered, scattered nor counted whole
    (a gather before and a scatter after would add 4 x the states' bytes; a copy of the pool, 48 x)."""
    need_chip(chip)
    pooled, own = compiled("gdn_decode_pooled", "bf16", chip), compiled("gdn_decode", "bf16", chip)
    text = pooled[0].as_text()
    assert "tpu_custom_call" in text and " gather(" not in text and " scatter(" not in text
    assert pooled[1].bytes_accessed <= 1.02 * own[1].bytes_accessed, (pooled[1], own[1])


def _measured():
    return {f"{chip}/{name}/bf16": dataclasses.asdict(compiled(name, "bf16", chip)[1])
            for chip in BASELINE_CHIPS for name, case in REAL.items() if case.decode}


def test_decode_baselines():
    """The decode steps' compiled FLOPs and HBM bytes (bf16, v5e and v6e) may not rise more than 5% over
    tpu_baselines.json. After a deliberate change, regenerate the file and commit it with the change:
        UPDATE_TPU_BASELINES=1 python -m pytest tests/pallas_kernels/test_tpu_compile.py -k baselines
    """
    for chip in BASELINE_CHIPS:
        need_chip(chip)
    check_cost_baselines(
        BASELINES, _measured(),
        "Compiled cost per decode step of each kernel at the real models' shapes (B = 8 rows, 32k context, bf16; "
        "shapes in tests/pallas_kernels/tpu_cases.py), from the TPU compiler's cost analysis. Regenerate: "
        "UPDATE_TPU_BASELINES=1 python -m pytest tests/pallas_kernels/test_tpu_compile.py -k baselines",
        TOLERANCE)


@pytest.mark.parametrize("T", [1, 16])
def test_indexer_split_by_heads_compiles_for_a_slice(T):
    """DeepSeek-V3.2's indexer (64 heads of 128, 128-token pages, 32k context, Top-K 2048) with its heads
    split over the 4 chips of a v5e 2x2 slice: each chip's scoring kernel, one all-reduce of the scores,
    then the threshold kernel on the summed rows."""
    need_chip("v5e")
    import numpy as np  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415
    from tpu_cases import _indexer_args  # noqa: PLC0415

    import pallas_kernels.sparse_attention as sa  # noqa: PLC0415
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    mesh = Mesh(np.array(devices), ("model",))
    heads = PartitionSpec(None, None, "model")
    specs = (heads, heads) + (PartitionSpec(),) * 4

    def split(q, w, keys, table, qpos, lens):
        return jax.shard_map(lambda *a: sa.indexer_topk(*a, topk=2048, impl="pallas", head_axis="model"),
                             mesh=mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False)(
            q, w, keys, table, qpos, lens)
    args = _indexer_args(8, T, 64, 128, 128, 256, jnp.bfloat16, jnp.bfloat16)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    text = jax.jit(split).lower(*placed).compile().as_text()
    assert text.count("tpu_custom_call") >= 2 and "all-reduce" in text
