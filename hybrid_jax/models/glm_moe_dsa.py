"""GLM-5 (`model_type: glm_moe_dsa`): DeepSeek-V3.2's family (models.deepseek_v32) run with GLM-5's config.

Nothing here is GLM's own code: the forward, the ragged forward, the paged latent and indexer-key cache
groups, the conversion of a transformers checkpoint (FP8 block-scaled weights included), the parameter
layout and its sharding axes, and the MTP block (GLM-5 ships one, stored as layer `num_hidden_layers`
like DeepSeek's) are DeepSeek-V3.2's. Where GLM-5's math differs, the config carries it
(models.glm_moe_dsa_config): the indexer's RoPE on interleaved pairs (layers.mla.index_rope) and GLM's
defaults (rms_norm_eps 1e-5, 32 indexer heads, ...); the q / latent norms keep eps 1e-6 in both, as
transformers builds them.
"""
from __future__ import annotations

import dataclasses

from hybrid_jax.models import deepseek_v32

FAMILY = dataclasses.replace(deepseek_v32.FAMILY, name="glm_moe_dsa")
