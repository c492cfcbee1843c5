"""The on-disk format of one disk-tier entry: how it is written into a directory and read back, fail-closed.

An entry directory (entries/<key>/ once published, see cache.disk_tier) holds

    arrays/...    the entry's arrays, one Orbax PyTree checkpoint (any dtype numpy + ml_dtypes know:
                  float32, bfloat16, int32, float8_e4m3fn, ...); zero-size arrays are not written
                  (the meta alone rebuilds them). Or, format "raw" (an entry read once, on the critical
                  path of a request's first token: a prefill/decode handoff), each array's bytes in C
                  order in arrays/<name>.bin, rebuilt from the meta's dtype and shape: no Orbax restore
    meta.json     sealed JSON (cache.tier_entry.sealed_json): the entry's own key, its EntryMeta, a
                  blake2b checksum per array, the size of every file under arrays/

`write_entry` writes both and fsyncs every file (when durable). `read_entry` checks, in order:
meta.json reads and its seal matches ("disk_corrupt", or "disk_truncated" when it is missing); the
key sealed in it is the key it was read under ("disk_key_mismatch": an entry moved or copied into
another's place); every listed file is there with its size (shorter or missing: "disk_truncated",
longer: "disk_corrupt"); the weights fingerprint is the reader's ("disk_foreign_model"); the
reader's expected EntryMeta matches ("disk_abi_mismatch", "disk_dtype_mismatch",
"disk_shape_mismatch", "disk_range_mismatch"); Orbax restores it and every array has the recorded
dtype, shape and checksum ("disk_corrupt"). A failed check raises `Reject` with its reason.
"""
from __future__ import annotations

import math
import os

import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 dtype names with numpy (zero-size arrays)
import numpy as np

from cache.tier_entry import Arrays, EntryMeta, checksum, open_sealed_json, sealed_json

META = "meta.json"
ARRAYS = "arrays"


class Reject(Exception):
    """An entry failed a check; args[0] is the reason (one of cache.disk_tier.DISK_REASONS)."""


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files(root: str) -> dict[str, int]:
    """relative path -> size of every file under root."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


def dir_bytes(path: str) -> int:
    try:
        return sum(files(path).values())
    except OSError:
        return 0


def write_entry(tmp: str, key: str, arrays: Arrays, meta: EntryMeta, durable: bool, raw: bool = False) -> int:
    """Write the entry into `tmp` (Orbax checkpoint, or with `raw` one file of bytes per array, + sealed
    meta naming `key`), fsync it (durable); its size in bytes."""
    arrays_dir = os.path.join(tmp, ARRAYS)
    stored = {n: a for n, a in arrays.items() if a.size}   # Orbax cannot write zero-size arrays; the
    if stored and raw:                                     # meta alone rebuilds them
        os.mkdir(arrays_dir)
        for n, a in stored.items():
            with open(os.path.join(arrays_dir, n + ".bin"), "wb") as f:
                f.write(np.ascontiguousarray(a).tobytes())
    elif stored:
        import orbax.checkpoint as ocp  # noqa: PLC0415 - keeps `import cache` light
        ocp.PyTreeCheckpointer().save(arrays_dir, args=ocp.args.PyTreeSave(stored))
    written = files(arrays_dir) if stored else {}
    body = {"key": key, "meta": meta.to_json(), "checksums": {n: checksum(a) for n, a in arrays.items()},
            "files": written, "format": "raw" if raw else "orbax"}
    raw = sealed_json(body)
    with open(os.path.join(tmp, META), "wb") as f:
        f.write(raw)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    if durable:
        for d, _, names in os.walk(tmp):
            for n in names:
                fsync_path(os.path.join(d, n))
            fsync_path(d, directory=True)
    return sum(written.values()) + len(raw)


def _sealed_meta(path: str, key: str) -> tuple[EntryMeta, dict, dict, str]:
    """(meta, checksums, files, format) of the entry at `path`, its seal and key checked."""
    try:
        with open(os.path.join(path, META), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise Reject("disk_truncated") from None
    try:
        body = open_sealed_json(raw)
        meta = EntryMeta.from_json(body["meta"])
        sums, listed, fmt = dict(body["checksums"]), dict(body["files"]), body.get("format", "orbax")
    except (ValueError, KeyError, TypeError):
        raise Reject("disk_corrupt") from None
    if body.get("key") != key:
        raise Reject("disk_key_mismatch")
    if fmt not in ("orbax", "raw"):
        raise Reject("disk_corrupt")
    return meta, sums, listed, fmt


def read_entry(path: str, key: str, expect: EntryMeta | None, fingerprint: str) -> Arrays:
    """The arrays of the entry at `path` stored under `key`, after every check of the module docstring
    (`Reject` with the reason of the first that fails)."""
    meta, sums, listed, fmt = _sealed_meta(path, key)
    arrays_dir = os.path.join(path, ARRAYS)
    for rel, size in listed.items():
        try:
            actual = os.path.getsize(os.path.join(arrays_dir, rel))
        except FileNotFoundError:
            raise Reject("disk_truncated") from None
        if actual != size:
            raise Reject("disk_truncated" if actual < size else "disk_corrupt")
    if meta.fingerprint != fingerprint:
        raise Reject("disk_foreign_model")
    if expect is not None:
        reason = meta.mismatch(expect, "disk")
        if reason is not None:
            raise Reject(reason)
    names = [n for n, s in meta.shapes.items() if math.prod(s)]
    out = {}
    if names and fmt == "raw":
        out = _read_raw(arrays_dir, meta, names)
    elif names:
        import orbax.checkpoint as ocp  # noqa: PLC0415
        restore = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
        out = ocp.PyTreeCheckpointer().restore(arrays_dir, args=ocp.args.PyTreeRestore(restore_args=restore))
    if not isinstance(out, dict) or set(out) != set(names) or set(sums) != set(meta.dtypes):
        raise Reject("disk_corrupt")
    arrays = {n: np.asarray(out[n]) if n in out else np.empty(meta.shapes[n], np.dtype(meta.dtypes[n]))
              for n in meta.dtypes}
    for n, a in arrays.items():
        if a.dtype.name != meta.dtypes[n] or a.shape != meta.shapes[n] or checksum(a) != sums[n]:
            raise Reject("disk_corrupt")
    return arrays


def _read_raw(arrays_dir: str, meta: EntryMeta, names: list[str]) -> Arrays:
    """A raw entry's arrays, from their bytes and the meta's dtype and shape (sizes were checked)."""
    out = {}
    for n in names:
        try:
            with open(os.path.join(arrays_dir, n + ".bin"), "rb") as f:
                data = f.read()
            out[n] = np.frombuffer(data, np.dtype(meta.dtypes[n])).reshape(meta.shapes[n])
        except (OSError, ValueError, TypeError):
            raise Reject("disk_corrupt") from None
    return out
