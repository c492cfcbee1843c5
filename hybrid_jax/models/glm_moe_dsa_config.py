"""GLM-5 (`model_type: glm_moe_dsa`) configuration: DeepSeek-V3.2's (deepseek_v32_config), read with GLM's
defaults and its one difference in the math, the indexer's interleaved RoPE.

transformers' GlmMoeDsa is DeepseekV32 with (a) the indexer's RoPE on interleaved pairs, as the MLA's
(the release's `indexer_rope_interleave: true`; false reads as V3.2's half-split layout), and (b) an
optional cross-layer sharing of the indexer's Top-K (`indexer_types`, or the `index_topk_freq` /
`index_skip_topk_offset` / `index_topk_pattern` schedule): a "shared" layer runs no indexer and reuses
the previous full layer's selection: here a "shared_sparse_attention" layer (models.deepseek_v32), which
keeps its latent but no indexer keys. The release's schedule has every layer "full". Everything else (MLA, group-limited sigmoid
MoE with correction bias, shared experts, first dense layers, MTP layer stored after the last layer) is
DeepSeek-V3.2's. Keys some GLM/DeepSeek configs carry that would change the math if they held another
value than the one implemented (scoring_func, topk_method, rope_interleave, moe_layer_freq,
use_sliding_window) are checked and refused when they differ.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_jax.errors import ConfigError
from hybrid_jax.models.deepseek_v32_config import V32_DEFAULTS, DeepseekV32Config, dsa_fields

# transformers' GlmMoeDsaConfig defaults of the fields a config.json may leave out.
GLM_DEFAULTS = {**V32_DEFAULTS, "index_n_heads": 32, "routed_scaling_factor": 2.5,
                "max_position_embeddings": 202752, "moe_intermediate_size": 2048}
GLM_RMS_NORM_EPS = 1e-5

# key -> the values implemented; another value changes the math and is refused
_FIXED = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "rope_interleave": (True,),
          "moe_layer_freq": (1,), "use_sliding_window": (False,)}


@dataclasses.dataclass(frozen=True)
class GlmMoeDsaConfig(DeepseekV32Config):
    """DeepseekV32Config with GLM-5's indexer RoPE (interleaved unless the config says otherwise)."""
    index_rope_interleaved: bool = True


def indexer_types(d: dict[str, Any], n: int) -> list[str]:
    """Per layer "full" (runs the indexer) or "shared" (reuses the previous full layer's Top-K), as
    transformers derives them: `indexer_types`, else `index_topk_pattern` ("F"/"S" letters or a list),
    else layer i is full when max(i - offset + 1, 0) % freq == 0 (index_topk_freq, default 1;
    index_skip_topk_offset, default 2)."""
    if d.get("indexer_types") is not None:
        types = list(d["indexer_types"])
    elif d.get("index_topk_pattern") is not None:
        pat = d["index_topk_pattern"]
        names = {"F": "full", "S": "shared"}
        if isinstance(pat, str) and not set(pat) <= set(names):
            raise ConfigError(f"index_topk_pattern {pat!r} may hold only 'F' and 'S'")
        types = [names[c] for c in pat] if isinstance(pat, str) else list(pat)
    else:
        freq = max(int(d.get("index_topk_freq") or 1), 1)
        offset = int(d.get("index_skip_topk_offset", 2) if d.get("index_skip_topk_offset") is not None else 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n or not set(types) <= {"full", "shared"}:
        raise ConfigError(f"indexer types must be {n} entries of 'full' / 'shared'; got {types}")
    return types


def _check_fixed(d: dict[str, Any]) -> None:
    for key, ok in _FIXED.items():
        if d.get(key) is not None and d[key] not in ok:
            raise ConfigError(f"glm_moe_dsa: {key}={d[key]!r} is not supported (implemented: {list(ok)})")


def glm_moe_dsa_config(d: dict[str, Any]) -> GlmMoeDsaConfig:
    """config.json -> GlmMoeDsaConfig (KeyError / ValueError / ConfigError on bad fields). A layer whose
    indexer type is "shared" becomes a "shared_sparse_attention" layer."""
    _check_fixed(d)
    fields = dsa_fields(d, "glm_moe_dsa", GLM_DEFAULTS)
    kinds = indexer_types(d, fields["num_hidden_layers"])
    fields["layer_types"] = tuple("shared_sparse_attention" if k == "shared" else t
                                  for t, k in zip(fields["layer_types"], kinds))
    if d.get("rms_norm_eps") is None:
        fields["rms_norm_eps"] = GLM_RMS_NORM_EPS
    if fields["rope"].partial_rotary_factor != 1.0:
        raise ConfigError(f"glm_moe_dsa: partial_rotary_factor={fields['rope'].partial_rotary_factor} is not "
                          f"supported (RoPE covers the qk_rope_head_dim channels)")
    interleave = d.get("indexer_rope_interleave")
    return GlmMoeDsaConfig(**fields, index_rope_interleaved=True if interleave is None else bool(interleave))
