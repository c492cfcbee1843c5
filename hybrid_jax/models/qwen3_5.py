"""Qwen3.5 (dense and MoE): Qwen3-Next's model with Qwen3.5's weight map.

The layers are Qwen3-Next's (Gated DeltaNet, gated full attention, sparse MoE with a shared expert),
so forward, the cache and the parameter layout are `qwen3_next`'s; what is Qwen3.5's own is the
checkpoint (`convert_hf_weights`):
  - the text model of the multimodal checkpoint, under `model.language_model.*` (`model.*` in a
    text-only one); `model.visual.*` is not read (logged once);
  - the Gated DeltaNet input projection split in four, not grouped per key head:
    in_proj_qkv [2*H*K + HV*V, Hd] (q | k | v), in_proj_z [HV*V, Hd], in_proj_b, in_proj_a [HV, Hd];
  - MoE experts as fused 3-D tensors (experts.gate_up_proj [E, 2I, Hd], experts.down_proj [E, Hd, I])
    or per expert;
  - the MTP block (`mtp_num_hidden_layers`) at the top level, `mtp.*`, in Qwen3-Next's layout.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from hybrid_jax.models import qwen3_next
from hybrid_jax.models.qwen3_next import (
    DEFERRED_GROUPS,
    LAYER_TYPES,
    final_norm,
    forward,
    init_params,
    mtp_config,
    mtp_logits,
    mtp_new_cache,
    mtp_prefixes,
    mtp_step,
    new_cache,
    target_hidden,
    write_deferred_kv,
)
from hybrid_jax.models.qwen3_next_config import ModelConfig
from hybrid_jax.weights import concat

__all__ = ["DEFERRED_GROUPS", "FAMILY", "LAYER_TYPES", "convert_hf_weights", "final_norm", "forward", "init_params", "mtp_config", "mtp_logits",
           "mtp_new_cache", "mtp_prefixes", "mtp_step", "new_cache", "target_hidden",
           "write_deferred_kv"]           # all but the weight map are Qwen3-Next's
log = logging.getLogger(__name__)
TEXT_PREFIXES = ("model.language_model.", "model.")


def _text_prefix(has) -> str:
    for prefix in TEXT_PREFIXES:
        if has(prefix + "embed_tokens.weight"):
            return prefix
    return TEXT_PREFIXES[0]           # the loader then names the missing embedding


def convert_hf_weights(cfg: ModelConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                       dtype, progress: Callable[[], None] = lambda: None) -> dict:
    """Re-lays a Qwen3.5 checkpoint into Qwen3-Next's parameter layout, once, at load. The attention,
    MLP / MoE and norm tensors are named as in Qwen3-Next under the text prefix; only the Gated
    DeltaNet input projections differ (`split_in_proj`). Raises CheckpointError naming a missing or
    misshapen tensor."""
    prefix = _text_prefix(has)
    if prefix == "model.language_model." and has("model.visual.patch_embed.proj.weight"):
        log.info("Qwen3.5: loading the text model (model.language_model.*); the vision tower (model.visual.*) "
                 "is not loaded")
    return qwen3_next.convert_hf_weights(cfg, get, has, dtype, progress, prefix=prefix, gdn_in_proj=split_in_proj)


def split_in_proj(cfg: ModelConfig, t, a: str) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3.5's four Gated DeltaNet input projections (torch layout [out, Hd], heads in order) -> the
    rows of Qwen3-Next's qkvz [H * (K | K | r*V | r*V), Hd] and ba [H * (r | r), Hd], grouped per key head."""
    Hd, H, HV, K, V = (cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim)
    r = HV // H
    q, k, v = np.split(t(a + "in_proj_qkv.weight", (2 * H * K + HV * V, Hd)), [H * K, 2 * H * K])
    z = t(a + "in_proj_z.weight", (HV * V, Hd))
    qkvz = concat([q.reshape(H, K, Hd), k.reshape(H, K, Hd), v.reshape(H, r * V, Hd), z.reshape(H, r * V, Hd)], axis=1)
    ba = concat([t(a + "in_proj_b.weight", (HV, Hd)).reshape(H, r, Hd), t(a + "in_proj_a.weight", (HV, Hd)).reshape(H, r, Hd)],
                axis=1)
    return qkvz.reshape(-1, Hd), ba.reshape(-1, Hd)


FAMILY = dataclasses.replace(qwen3_next.FAMILY, name="qwen3_5", convert_hf_weights=convert_hf_weights)
