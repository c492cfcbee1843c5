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
    the 2 chips), but not to the decode step's bytes or to its minimum: neither reads it whole."""
    small, big = (plan("tiny", "v6e:2x2", config=_config(b), **SHAPES) for b in (50, 5000))
    assert small.sharded and big.sharded
    rows = big.memory.weights - small.memory.weights              # per chip: half of the table's extra rows
    whole = 4 * (5000 - 50) * (BASE["ple_embed_dim"] // 4) * 2      # 4 heads' primes, (E / 4) wide, bf16
    assert 0.45 * whole < rows < 0.55 * whole
    assert big.roofline.min_decode_bytes == pytest.approx(small.roofline.min_decode_bytes, rel=1e-3)
    assert big.roofline.decode_bytes < small.roofline.decode_bytes + 0.05 * rows
    assert any("ple/table" in n for n in big.notes)
