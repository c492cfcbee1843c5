"""Speculative decoding that stays exact for stateful (recurrent) hybrid models: the pieces the
engine core's one verify step is built from (hybrid_jax/engine/speculate.py is its host side).

  config.py       parse_speculative_config: vLLM's dict shape -> SpeculativeConfig
  drafters.py     NgramDrafter (prompt lookup), load_draft_model (a smaller checkpoint)
  acceptance.py   greedy acceptance and rejection sampling (the probability math)
  rollback.py     rollback by selection of per-position states, or snapshot + replay
  verify.py       the verify body (one forward for K drafts + acceptance + rollback), plain decode chunks
  device_loop.py  n-gram drafting, verify and rollback in one on-device loop (a runner mode)
  dynamic_k.py    per-request draft length from the running acceptance rate
  metrics.py      acceptance rate, accepted length, draft / verify time, the step log
"""
from hybrid_jax.speculative.config import SpeculativeConfig, parse_speculative_config
from hybrid_jax.speculative.drafters import load_draft_model

__all__ = ["SpeculativeConfig", "load_draft_model", "parse_speculative_config"]
