"""Perf baselines of whole models: the compiled FLOPs and HBM bytes per decode token of the tiny test models
and of real published configs, held to model_baselines.json (a change may not raise either by more than 5%
without updating the file). The decode step is the plan's (take_view in place -> forward -> put_view, pools
donated; hybrid_jax.plan.decode_cost_per_token), compiled by libtpu for one chip at 8 rows (DeepSeek-V3.2 and
GLM-5 64) x 4k context, real configs with one layer of each kind and scaled by layer (the kernels' own baselines are in
tests/pallas_kernels/tpu_baselines.json). After a deliberate change:

    UPDATE_TPU_BASELINES=1 python -m pytest tests/hybrid_jax/test_model_baselines.py -k decode_baselines
"""
from __future__ import annotations

import pathlib

import pytest
from conftest import check_cost_baselines
from test_plan import TINY, V32_TINY, needs_libtpu

from hybrid_jax.models.config_common import config_from_hf_dict
from hybrid_jax.plan.planner import decode_cost_per_token

BASELINES = pathlib.Path(__file__).with_name("model_baselines.json")

# name -> (published config or tiny test config, chip, quantization, rows). One chip must hold the compiled
# programs: DeepSeek-V3.2 (one layer of each kind, FP8 experts) needs a v5p's 95 GB. It decodes 64 rows, a
# serving batch: at 8 rows x 8 experts of 256 its MoE takes the per-row gather form, whose FP8 weight gathers
# take the TPU compiler 4 minutes (and cost 592 GB a token; recorded nowhere as a goal).
MODELS = {
    "tiny_qwen3_next": (TINY, "v6e", None, 8),
    "tiny_deepseek_v32": (V32_TINY, "v6e", None, 8),
    "qwen3_next_80b_a3b_instruct": ("qwen3_next_80b_a3b_instruct", "v6e", None, 8),
    "deepseek_v32": ("deepseek_v32", "v5p", "fp8", 64),
    "nemotron_3_nano_30b_a3b": ("nemotron_3_nano_30b_a3b", "v6e", None, 8),
    "glm_5": ("glm_5", "v5p", "fp8", 64),        # DeepSeek-V3.2's family at GLM-5's shapes, held the same way
}


def _measure(name: str) -> dict[str, float]:
    spec, chip, q, rows = MODELS[name]
    tiny = isinstance(spec, dict)
    return decode_cost_per_token(name if tiny else spec, chip, quantization=q,
                                 config=config_from_hf_dict(spec) if tiny else None,
                                 layers="full" if tiny else "reduced", max_num_seqs=rows,
                                 max_model_len=256 if tiny else 4096)


@needs_libtpu
def test_decode_baselines_per_token():
    measured = {f"{MODELS[n][1]}/{n}": _measure(n) for n in MODELS}
    for v in measured.values():            # each figure is a compiled program's, never a blank
        assert v["flops"] > 0 and v["bytes_accessed"] > 0
    check_cost_baselines(
        BASELINES, measured,
        "Compiled FLOPs and HBM bytes per decode token of whole models (tests/hybrid_jax/test_model_baselines.py: "
        "the plan's decode step, one chip, 8 rows (DeepSeek-V3.2 and GLM-5 64), 4k context (tiny models 256), bf16 "
        "(DeepSeek-V3.2 and GLM-5 FP8)). "
        "Regenerate: UPDATE_TPU_BASELINES=1 python -m pytest tests/hybrid_jax/test_model_baselines.py")


@needs_libtpu
def test_baselines_refuse_a_costlier_decode_step(tmp_path, monkeypatch):
    """The check reads the record: a step 10% costlier than recorded is refused, naming the case."""
    import json  # noqa: PLC0415
    name = "tiny_qwen3_next"
    now = _measure(name)
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"cases": {f"v6e/{name}": {k: v / 1.1 for k, v in now.items()}}}))
    monkeypatch.delenv("UPDATE_TPU_BASELINES", raising=False)
    with pytest.raises(AssertionError, match=name):
        check_cost_baselines(path, {f"v6e/{name}": now}, "")
    check_cost_baselines(path, {f"v6e/{name}": {k: v / 1.1 for k, v in now.items()}}, "")   # equal: passes
