"""Gated delta rule (Gated DeltaNet's recurrence): reference, chunked XLA and Pallas implementations."""
from pallas_kernels.gated_delta_rule.common import l2norm
from pallas_kernels.gated_delta_rule.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from pallas_kernels.gated_delta_rule.rebuild import state_after

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "l2norm", "state_after"]
