"""`hybrid-jax plan` of a tiny Qwen4-Exp split over 2 TPU devices (libtpu compiles; skipped without it): the
PLE layer is planned as a layer kind of its own, the n-gram table is split by rows, and the table is neither
read whole by the compiled decode step nor counted in its minimum bytes (a step gathers a few rows of it)."""
from __future__ import annotations

import pytest
from test_plan import needs_libtpu
from test_qwen4_exp import BASE

from hybrid_jax.models.config_common import config_from_hf_dict
from hybrid_jax.plan import plan
from hybrid_jax.plan.shapes import layer_counts

LIN, IDX = "linear_attention", "full_attention"        # a release names its indexed layers full_attention
SHAPES = dict(max_num_seqs=4, max_model_len=256, chunk=64, layers="full", tensor_parallel_size=2)


def _config(ngram_base: int):
    return config_from_hf_dict(dict(BASE, model_type="qwen4_exp_text", num_hidden_layers=4,
                                    layer_types=[LIN, IDX, LIN, IDX], ple_layer_ids=[3],      # one-indexed: layer 2
                                    ngram_vocab_size_base=ngram_base))


def test_a_ple_layer_is_a_layer_kind_of_its_own():
    """The planner's reduced stacks compile one layer of each kind: the PLE layer (a DeltaNet layer that
    also gathers n-gram embeddings) must not be scaled from a plain DeltaNet layer's cost."""
    cfg = _config(50)
    assert layer_counts(cfg) == {("linear_attention", "moe"): 1, ("indexed_attention", "moe"): 2,
                                 ("linear_attention", "ple+moe"): 1}
    # a reduced stack without the PLE layer, or with it moved, keeps its layers' kinds (the PLE ids follow)
    assert cfg.with_layers([0, 1]).ple_layers == () and cfg.with_layers([1, 2]).ple_layers == (1,)
    assert layer_counts(cfg.with_layers([2, 1, 2])) == {("linear_attention", "ple+moe"): 2,
                                                        ("indexed_attention", "moe"): 1}


@needs_libtpu
def test_the_ngram_table_is_gathered_by_rows_and_left_out_of_the_minimum():
    """A table 100x larger (every head's prime 100x larger) adds its rows to the per-chip weights (split over
    the 2 chips) but not to the minimum decode bytes, which leave it out (a step gathers a few rows)."""
    small, big = (plan("tiny", "v6e:2x2", config=_config(b), **SHAPES) for b in (50, 5000))
    assert small.sharded and big.sharded
    rows = big.memory.weights - small.memory.weights              # per chip: half of the table's extra rows
    whole = 4 * (5000 - 50) * (BASE["ple_embed_dim"] // 4) * 2      # 4 heads' primes, (E / 4) wide, bf16
    assert 0.45 * whole < rows < 0.55 * whole
    assert big.roofline.min_decode_bytes == pytest.approx(small.roofline.min_decode_bytes, rel=1e-3)
    assert any("ple/table" in n for n in big.notes)


@needs_libtpu
@pytest.mark.parametrize("packed", [True, False])
def test_a_release_sized_table_is_read_by_rows_only_when_packed(packed):
    """One chip's share of the release's table (tp 8: ~40M rows x 160) gathered at 64 tokens x 16 heads. Stored
    [rows, 160], the TPU compiler lays it out rows-minor (its compact layout for a narrow array) and copies all
    12 GiB to gather (the negative control); packed 4 rows to a 640-lane row, the gather reads its rows."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from hybrid_jax.layers.ple import gather_rows, packed_rows, rows_per_lane_row  # noqa: PLC0415
    from pallas_kernels.aot import cost_of, on_device, tpu_device  # noqa: PLC0415
    rows, width = 320001536 // 8, 160
    table = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
    if packed:
        table = jax.ShapeDtypeStruct((packed_rows(rows, width), rows_per_lane_row(width) * width), jnp.bfloat16)
        fn = lambda t, ids: gather_rows(t, ids, width)                      # noqa: E731
    else:
        fn = lambda t, ids: t[ids]                                          # noqa: E731
    args = on_device((table, jax.ShapeDtypeStruct((64, 1, 16), jnp.int32)), tpu_device("v5p"))
    read = cost_of(jax.jit(fn).lower(*args).compile()).bytes_accessed
    table_bytes = rows * width * 2
    assert (read < 0.01 * table_bytes) if packed else (read > table_bytes)     # 0.02 GiB packed, 31 GiB not


@needs_libtpu
def test_the_indexed_layers_pools_are_neither_copied_nor_gathered_whole(monkeypatch):
    """Lowered for a TPU, QSA's sparse read gathers its bf16 K / V rows as they are: `gather_any` bitcasts a
    16-bit pool to uint16 for the CPU only (on a TPU the bitcast copied the whole pool, 4 GiB a layer and decode
    step at the release's shapes). No collective of the step moves the indexer key pool. (At the release's
    shapes, 4 indexer heads over 8 chips, the partitioner had split the pool after its write and all-gathered
    it for the walk; `whole_pool` now holds it whole. This miniature did not reproduce that split.)"""
    import hybrid_jax.plan.compile as plan_compile  # noqa: PLC0415
    texts = []
    cost = plan_compile._cost
    monkeypatch.setattr(plan_compile, "_COMPILED", {})
    monkeypatch.setattr(plan_compile, "_cost", lambda c: texts.append(c.as_text()) or cost(c))
    p = plan("tiny", "v6e:2x2", config=_config(50), **SHAPES)
    decode = texts[0]
    assert "u16[" not in decode
    keys = p.memory.cache_by_kind["indexer_keys"]
    assert 0 < p.roofline.decode_collective_bytes < keys / 4, (p.roofline.decode_collective_bytes, keys)
