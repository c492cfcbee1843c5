"""Speculative decoding configuration in vLLM's shape, parsed and checked once.

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
  {"method": "draft_model", "model": "/path/to/small/checkpoint", "num_speculative_tokens": 4}
  {"method": "mtp", "num_speculative_tokens": 2}     # the checkpoint's own MTP block drafts (engine only)

plus this project's options:
  "rollback":  "selection" (default: the verify step emits the recurrent state after every draft
               position and keeps the accepted one) or "replay" (the pre-verify cache is kept by
               reference, restored on rejection, and the accepted tokens are run through again);
               a family whose cache selection cannot restore (DeepSeek-V4: `ROLLBACK_BY_SELECTION`
               False in its module) always rolls back by replay;
  "dynamic_k": true (default) picks each request's draft length in [0, K] from its running
               acceptance rate; K = 0 for every row falls back to plain on-device decode chunks.
  "fallback_steps": tokens per plain decode chunk when no row speculates (default 4; with dynamic K
               grown 4x, up to 32x, while the n-gram drafts checked against those chunks keep failing,
               and 32x from the start when prompt lookup never once predicted a prompt's tail).
  "draft_cost": the cost of one more verified draft token relative to a decode step, used by the
               dynamic-K choice (default 0.25).
  "ewma_decay": weight of the past in the running acceptance rate (default 0.8).
  "device_loop": true (default) runs n-gram drafting with rollback by selection entirely on device
               (`device_loop.py`: one while loop, no host round trip per step); false keeps the host
               loop. Draft models and rollback by replay always use the host loop.
Every problem raises hybrid_jax.errors.InputError naming the key and the value.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from hybrid_jax.errors import InputError

METHODS = ("ngram", "draft_model", "mtp")
ROLLBACKS = ("selection", "replay")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "rollback",
         "dynamic_k", "fallback_steps", "draft_cost", "ewma_decay", "draft_dtype", "device_loop"}
MAX_SPECULATIVE_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative config (see the module docstring for each field)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    rollback: str = "selection"
    dynamic_k: bool = True
    fallback_steps: int = 4
    draft_cost: float = 0.25
    ewma_decay: float = 0.8
    draft_dtype: str = "auto"
    device_loop: bool = True

    def k_buckets(self) -> tuple[int, ...]:
        """Draft lengths a verify step is compiled for: powers of two below K and K itself with
        dynamic K; K alone without (shorter drafts are padded)."""
        if not self.dynamic_k:
            return (self.num_speculative_tokens,)
        out, k = [], 1
        while k < self.num_speculative_tokens:
            out.append(k)
            k *= 2
        return tuple(out + [self.num_speculative_tokens])

    def k_bucket(self, k: int) -> int:
        """The smallest compiled draft length >= k (k >= 1)."""
        return next(b for b in self.k_buckets() if b >= k)


def _int(d: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InputError(f"speculative_config[{key!r}] must be an integer in [{lo}, {hi}]; got {v!r}")
    return v


def _float(d: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = d.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise InputError(f"speculative_config[{key!r}] must be a number in [{lo}, {hi}]; got {v!r}")
    return float(v)


def parse_speculative_config(d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """vLLM-shaped dict -> SpeculativeConfig (None -> None). Raises InputError naming the problem."""
    if d is None or isinstance(d, SpeculativeConfig):
        return d
    if not isinstance(d, dict):
        raise InputError(f"speculative_config must be a dict; got {type(d).__name__}")
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise InputError(f"speculative_config has unknown keys {unknown}; known: {sorted(_KEYS)}")
    method = d.get("method")
    if method not in METHODS:
        raise InputError(f"speculative_config['method'] must be one of {list(METHODS)}; got {method!r}")
    if "num_speculative_tokens" not in d:
        raise InputError("speculative_config needs 'num_speculative_tokens' (the draft length K)")
    k = _int(d, "num_speculative_tokens", 0, 1, MAX_SPECULATIVE_TOKENS)
    lmax = _int(d, "prompt_lookup_max", 4, 1, 64)
    lmin = _int(d, "prompt_lookup_min", 1, 1, 64)
    if lmin > lmax:
        raise InputError(f"speculative_config: prompt_lookup_min ({lmin}) exceeds prompt_lookup_max ({lmax})")
    model = d.get("model")
    if method == "draft_model":
        if not isinstance(model, (str, os.PathLike)) or not os.fspath(model):
            raise InputError("speculative_config: method 'draft_model' needs 'model', the draft checkpoint's path")
        model = os.fspath(model)
        if not os.path.isdir(model):
            raise InputError(f"speculative_config['model']: no checkpoint directory at {model!r}")
    elif model is not None:
        raise InputError("speculative_config['model'] is only used with method 'draft_model'")
    rollback = d.get("rollback", "selection")
    if rollback not in ROLLBACKS:
        raise InputError(f"speculative_config['rollback'] must be one of {list(ROLLBACKS)}; got {rollback!r}")
    dyn = d.get("dynamic_k", True)
    if not isinstance(dyn, bool):
        raise InputError(f"speculative_config['dynamic_k'] must be true or false; got {dyn!r}")
    device_loop = d.get("device_loop", True)
    if not isinstance(device_loop, bool):
        raise InputError(f"speculative_config['device_loop'] must be true or false; got {device_loop!r}")
    draft_dtype = d.get("draft_dtype", "auto")
    if draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise InputError(f"speculative_config['draft_dtype'] must be auto, float32, bfloat16 or float16; "
                         f"got {draft_dtype!r}")
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, prompt_lookup_max=lmax, prompt_lookup_min=lmin, model=model,
        rollback=rollback, dynamic_k=dyn, fallback_steps=_int(d, "fallback_steps", 4, 1, 256),
        draft_cost=_float(d, "draft_cost", 0.25, 0.0, 10.0), ewma_decay=_float(d, "ewma_decay", 0.8, 0.0, 0.999),
        draft_dtype=draft_dtype, device_loop=device_loop)
