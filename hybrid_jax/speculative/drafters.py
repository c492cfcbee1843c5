"""Drafters: who proposes the K tokens a verify step checks.

* `NgramDrafter` (prompt lookup, host side): finds the most recent earlier occurrence of the
  longest suffix n-gram (prompt_lookup_max .. prompt_lookup_min tokens) of a row's history and
  proposes the tokens that followed it, reading on through its own proposal when the match is
  close to the end (so a loop shorter than K still yields K tokens). Deterministic: q is one-hot.
  The engine also keeps each request's place in the copied text: when a draft was rejected at an
  edit (the model wrote another token where the source had one) and no n-gram matches yet, it
  proposes the source's tokens after the edited one (`read_from`), as code editing continues.
* A draft model (`load_draft_model`): a smaller checkpoint of any family the loader accepts; the
  engine's runner keeps its cache rows in step with the target's and drafts on device
  (`ModelRunner._draft`), returning its distributions q for rejection sampling.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import load_config
from hybrid_jax.weights import open_checkpoint

DRAFT_SALT = 0x5EED
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def load_draft_model(path: str, dtype: str = "auto"):
    """Reads a draft checkpoint the loader accepts. Returns (cfg, params, jnp dtype)."""
    reader = open_checkpoint(path)
    cfg = load_config(path)
    dt = _DTYPES[cfg.dtype if dtype == "auto" else dtype]
    params = get_model(cfg.model_type).convert_hf_weights(cfg, reader.get, reader.has, dt)
    return cfg, params, dt


class NgramDrafter:
    """Prompt-lookup drafting over a row's token history (numpy, no device work)."""

    def __init__(self, lookup_min: int = 1, lookup_max: int = 4):
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"need 1 <= lookup_min <= lookup_max; got {lookup_min}, {lookup_max}")
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, history: np.ndarray, k: int) -> np.ndarray:
        """history [N] int (prompt + generated, the last one pending); k: tokens wanted.
        Returns up to k proposed tokens [<= k] int32 (empty when no n-gram of length >= lookup_min
        recurs)."""
        return self.propose_at(history, k)[0]

    def propose_at(self, history: np.ndarray, k: int) -> tuple[np.ndarray, int]:
        """Like propose; also returns where in history the proposal starts (-1 when empty)."""
        h = np.asarray(history)
        n = h.shape[0]
        none = np.zeros((0,), np.int32), -1
        if k <= 0 or n < self.lookup_min + 1:
            return none
        ends = np.flatnonzero(h[:-1] == h[-1])            # candidate match ends, before the suffix itself
        if ends.size == 0:
            return none
        length = np.ones(ends.shape, np.int64)
        alive = np.ones(ends.shape, bool)
        for m in range(1, min(self.lookup_max, n - 1)):
            ok = alive & (ends - m >= 0)
            ok &= h[np.maximum(ends - m, 0)] == h[n - 1 - m]
            length += ok
            alive = ok
        best = length.max()
        if best < self.lookup_min:
            return none
        start = int(ends[np.flatnonzero(length == best)[-1]]) + 1   # most recent of the longest matches
        return self.read_from(h, start, k), start

    @staticmethod
    def read_from(history: np.ndarray, start: int, k: int) -> np.ndarray:
        """k tokens of history [N] from index start (0 <= start < N), reading on through the
        proposal itself past the end. Returns [k] int32."""
        n = len(history)
        out = np.empty((k,), np.int32)
        for j in range(k):
            idx = start + j
            out[j] = history[idx] if idx < n else out[idx - n]
        return out
