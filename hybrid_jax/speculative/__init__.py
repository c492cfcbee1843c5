"""Speculative decoding that stays exact for stateful (recurrent) hybrid models.

  config.py      parse_speculative_config: vLLM's dict shape -> SpeculativeConfig
  drafters.py    NgramDrafter (prompt lookup), DraftModelDrafter (a smaller checkpoint)
  acceptance.py  greedy acceptance and rejection sampling (the probability math)
  rollback.py    rollback by selection of per-position states, or snapshot + replay
  verify.py      the target's jitted steps: prefill, verify (one forward for K drafts), replay, decode chunk
  dynamic_k.py   per-request draft length from the running acceptance rate
  metrics.py     acceptance rate, accepted length, draft / verify time
  decoder.py     SpeculativeDecoder: the offline generator LLM.generate can delegate to
"""
from hybrid_jax.speculative.config import SpeculativeConfig, parse_speculative_config
from hybrid_jax.speculative.decoder import SpeculativeDecoder, load_draft_model

__all__ = ["SpeculativeConfig", "SpeculativeDecoder", "load_draft_model", "parse_speculative_config"]
