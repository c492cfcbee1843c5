"""The alignment tool finds the first layer that diverges."""
from __future__ import annotations

import jax.numpy as jnp

from hybrid_jax import LLM
from hybrid_jax.align import align


def test_align_agrees_on_a_faithful_model(tiny_checkpoint):
    report = align(LLM(model=tiny_checkpoint), [3, 1, 4, 1, 5, 9, 2, 6])
    assert report.first_divergent is None
    assert len(report.rows) == 4 + 2       # embedding, layers 0..2, last layer + norm, logits


def test_align_names_the_first_broken_layer(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint)
    # break layer 2's Gated DeltaNet output projection: layers 0-1 must agree, layer 2 must not
    lp = llm.params["layers"][2]["gdn"]
    lp["out_proj"] = lp["out_proj"] * jnp.float32(2.0)
    report = align(llm, [3, 1, 4, 1, 5, 9, 2, 6])
    assert report.first_divergent == "layer 2 (linear_attention)"
    assert report.rows[1].ok(report.atol) and report.rows[2].ok(report.atol)
