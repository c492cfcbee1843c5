"""The program store: the engine's compiled step programs on disk, read back without tracing.

JAX's persistent compilation cache (also on: engine/compile.enable_persistent_compilation_cache)
saves the XLA compile but not the tracing and lowering that compute its key, about a second per
program of the default model. This store keys each compiled executable by what determines it, so
a restart (or another replica sharing the directory) loads it without tracing anything:

  key = sha256 of
    the store's format version,
    jax and jaxlib versions,
    the backend: platform, platform_version (the PJRT plugin / libtpu build), every device's kind,
      the device count and the process count, XLA_FLAGS and LIBTPU_INIT_ARGS, the jax config
      options that change programs (x64, matmul precision, threefry partitioning),
    a fingerprint of the code that traces the programs (every .py file of hybrid_jax, cache and
      pallas_kernels, by content),
    the step context: the model's config, dtype, kernel implementation, the layout (mesh axes and
      shape) and the drafter,
    the program: its kind, bucket shape, static options, and the shape, dtype and sharding of every
      argument (params, pools, row state, step inputs).

Weights are arguments, not constants, so replicas of one model with other weights (a fine-tune)
share programs; a config or code change misses. Files are written whole under a temporary name and
renamed into place, so replicas may share the directory (a network or object-storage mount), and a
file is read only if its length and sha256 match its header: a torn or corrupt file is deleted, a miss,
never a wrong program. The directory must be trusted like JAX's own cache (entries are pickles).
Only programs XLA compiled in this process are written: one JAX's persistent cache handed back does
not serialize whole on XLA:CPU (engine/compile.compile_fresh).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
from pathlib import Path

import jax

log = logging.getLogger("hybrid_jax.engine")

FORMAT = 1
MAGIC = b"hybrid-jax-program\n"
PACKAGES = ("hybrid_jax", "cache", "pallas_kernels")


@functools.cache
def code_fingerprint() -> str:
    """sha256 over the source of the packages that trace the engine's programs (path and content of
    every .py file)."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        mod = __import__(pkg)
        root = Path(mod.__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root.parent)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def backend_description(devices=None) -> dict:
    """What of the backend and JAX's configuration a compiled program depends on."""
    devices = list(devices if devices is not None else jax.devices())
    d0 = devices[0]
    import jaxlib  # noqa: PLC0415
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "platform": d0.platform, "platform_version": d0.client.platform_version,
        "device_kinds": sorted({d.device_kind for d in devices}), "devices": len(devices),
        "processes": jax.process_count(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
        "x64": bool(jax.config.jax_enable_x64),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
    }


def _aval(leaf):
    """A leaf's signature: (shape, dtype, sharding) of arrays, the value of anything else."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        sharding = getattr(leaf, "sharding", None)
        spec = repr(getattr(sharding, "spec", None)) if sharding is not None else None
        return [list(leaf.shape), str(leaf.dtype), spec]
    return repr(leaf)


def signature(args, kwargs) -> dict:
    """The arguments' tree structure and every leaf's shape, dtype and partition spec."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return {"tree": str(tree), "leaves": [_aval(x) for x in leaves]}


def store_key(context: dict, program: dict) -> str:
    """The hex key of a program: sha256 of the store format, the backend, the code, the step context
    (a JSON-able dict) and the program (kind, shape, statics, signature)."""
    payload = {"format": FORMAT, "backend": backend_description(), "code": code_fingerprint(),
               "context": context, "program": program}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()


class ProgramStore:
    """A directory of compiled programs, one file per key (`store_key`)."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = self.writes = self.rejected = 0

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.xprog"

    def load(self, key: str):
        """The compiled executable stored under key, loaded on the local devices; None when absent or
        unreadable (a torn write, another format, a runtime that refuses it)."""
        from jax.experimental.serialize_executable import deserialize_and_load  # noqa: PLC0415
        f = self._file(key)
        try:
            blob = f.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        try:
            if not blob.startswith(MAGIC):
                raise ValueError("not a program file")
            head, _, body = blob[len(MAGIC):].partition(b"\n")
            length, digest = head.split(b" ")
            if int(length) != len(body) or hashlib.sha256(body).hexdigest().encode() != digest:
                raise ValueError("length or checksum mismatch")
            serialized, in_tree, out_tree = pickle.loads(body)
            compiled = deserialize_and_load(serialized, in_tree, out_tree)
        except Exception as e:     # noqa: BLE001 -- any unreadable entry is a miss, compiled again
            log.warning("program store: %s unreadable (%s: %s); deleted, compiling it instead", f.name,
                        type(e).__name__, e)
            f.unlink(missing_ok=True)      # files are renamed into place whole: this one never reads
            self.rejected += 1
            return None
        self.hits += 1
        return compiled

    def discard(self, key: str):
        """Deletes key's entry (one that loaded but could not run)."""
        self._file(key).unlink(missing_ok=True)
        self.rejected += 1

    def save(self, key: str, compiled):
        """Writes a compiled executable under key (whole, then renamed into place). A backend that
        cannot serialize it leaves the store as it was."""
        from jax.experimental.serialize_executable import serialize  # noqa: PLC0415
        try:
            body = pickle.dumps(serialize(compiled))
        except Exception as e:     # noqa: BLE001 -- not serializable here: the program simply is not stored
            log.warning("program store: cannot serialize a program (%s: %s)", type(e).__name__, e)
            return
        head = MAGIC + f"{len(body)} {hashlib.sha256(body).hexdigest()}\n".encode()
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(head + body)
            os.replace(tmp, self._file(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.writes += 1
