"""Capacity and roofline plans for real model sizes on TPU topologies, built by the TPU compiler.

    from hybrid_jax.plan import plan, format_plan
    p = plan("qwen3_next_80b_a3b_instruct", "v6e:2x4", tensor_parallel_size=8, max_num_seqs=64,
             max_model_len=32768)
    print(format_plan(p))

Weights and cache pools are shapes only (`shapes.py`), the engine's steps are compiled for a TPU device
with libtpu on any host (`compile.py`), and the figures are assembled per chip (`planner.py`) against the
chips' published peaks (`chips.py`). `hybrid-jax plan` prints `format_plan`.
"""
from hybrid_jax.plan.chips import (
           CHIPS,
           Chip,
           PlanError,
           Topology,
           parse_topology,
           topology,
)
from hybrid_jax.plan.format import format_plan
from hybrid_jax.plan.planner import (
           Capacity,
           Memory,
           Plan,
           Roofline,
           plan,
           resolve_model,
)

__all__ = ["CHIPS", "Capacity", "Chip", "Memory", "Plan", "PlanError", "Roofline", "Topology", "format_plan",
           "parse_topology", "plan", "resolve_model", "topology"]
