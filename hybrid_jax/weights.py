"""Checkpoint reading: safetensors files (single or sharded with an index), never the network.

`open_checkpoint(path)` checks the directory and returns a reader with `get(name)` / `has(name)`;
every problem (missing directory, no weights, an index naming a missing shard, a corrupt file)
raises CheckpointError naming the file.
"""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open

from hybrid_jax.errors import CheckpointError

LARGE_CHECKPOINT_BYTES = 64 << 20    # above this, loading shows a progress bar


class CheckpointReader:
    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint directory {path!r} does not exist (models are only read from "
                                  f"local directories; nothing is downloaded)")
        single = os.path.join(path, "model.safetensors")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            files, weight_map = ["model.safetensors"], None
        else:
            raise CheckpointError(f"no weights in {path!r}: expected model.safetensors or "
                                  f"model.safetensors.index.json")
        self._handles = {}
        self._where: dict[str, str] = {}
        for fname in files:
            fp = os.path.join(path, fname)
            if os.path.basename(fname) != fname or not os.path.exists(fp):
                raise CheckpointError(f"weight shard {fname!r} named by the index is missing from {path!r}")
            try:
                h = safe_open(fp, framework="numpy")
                keys = list(h.keys())
            except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
                raise CheckpointError(f"weight file {fp} is corrupt or not safetensors: {e}") from None
            self._handles[fname] = h
            for k in keys:
                self._where[k] = fname
        if weight_map is not None:
            missing = [k for k, f in weight_map.items() if self._where.get(k) != f]
            if missing:
                raise CheckpointError(f"the index names tensors its shards do not hold, e.g. {missing[:3]}")
        self.total_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        self.path = path

    def keys(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except KeyError:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}") from None
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read tensor {name!r} from {self._where[name]}: {e}") from None


def open_checkpoint(path: str) -> CheckpointReader:
    return CheckpointReader(path)


def checked_getter(get, has, progress=lambda: None):
    """t(name, shape=None) -> numpy array, for a model's weight conversion: raises CheckpointError
    naming a missing tensor, or one whose shape disagrees with config.json; ticks `progress`."""
    def t(name: str, shape=None) -> np.ndarray:
        if not has(name):
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        a = np.asarray(get(name))
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)} "
                                  f"from config.json")
        progress()
        return a
    return t


def to_device(a: np.ndarray, dtype):
    """A checkpoint array as a jax array of `dtype` (integer-typed tensors go through fp32)."""
    import jax.numpy as jnp  # noqa: PLC0415
    return jnp.asarray(np.asarray(a, dtype=np.float32) if a.dtype.kind != "f" else a, dtype=dtype)


def fingerprint(config, params, sample: int = 4096) -> str:
    """A short hash identifying a model's weights: its config, every tensor's path, shape and dtype,
    and up to `sample` evenly strided values of each tensor. Cached prefixes are keyed by it, so a
    cache built with other weights (or the same weights in another dtype) can never hit."""
    import hashlib  # noqa: PLC0415

    import jax  # noqa: PLC0415
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(config).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(jax.tree_util.keystr(path).encode())
        h.update(repr((tuple(leaf.shape), str(leaf.dtype))).encode())
        flat = leaf.reshape(-1)
        step = max(1, flat.shape[0] // sample)
        h.update(np.asarray(flat[::step][:sample]).tobytes())
    return h.hexdigest()
