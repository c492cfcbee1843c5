"""Checkpoint reading: safetensors files (single or sharded with an index), never the network.

`open_checkpoint(path, quantization=None)` checks the directory and returns a reader with
`get(name)` / `has(name)`; every problem (missing directory, no weights, an index naming a missing
shard, a corrupt file, a file shorter than its header says or cut while it is read) raises
CheckpointError naming the file.

The reader parses safetensors itself and memory-maps each file: a tensor is read when a model's
weight conversion asks for it, in any dtype the format has (float8_e4m3fn, float8_e8m0fnu and packed
FP4 included, through ml_dtypes), and the model is never held twice in host memory. A checkpoint
with a `quantization_config` (see `quantization.py`) is decoded here:
  quantization=None    quantized tensors come back dequantized to float32 (the run dtype is applied
                       by `to_device`), so a model family needs no code for them;
  quantization="fp8"   they come back as `QUANTIZED` records (value and per-element scale); a
                       model's conversion re-lays them like any array, and `to_device_linear` keeps
                       the weights that layers multiply through `layers.linear` in FP8 on the device
                       with their block scales (~1 byte per weight).
Inside `on_host()` (a model split over a mesh) tensors are read by parts: see `lazy_weights`.
A tensor stored quantized without its scale, with a scale of the wrong shape, or quantized where
`modules_to_not_convert` says it is not, is a CheckpointError naming the tensor.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os

import ml_dtypes
import numpy as np

from hybrid_jax import quantization as qz
from hybrid_jax.errors import CheckpointError, ConfigError
from hybrid_jax.lazy_quantized import (RECORDS, BlockScaled, Fp4Codes, Unquantized, as_values, column_pieces,
                                       constant, fp8_parts, kept_blocks)
from hybrid_jax.lazy_weights import Lazy, Stored
from hybrid_jax.lazy_weights import concat as lazy_concat
from hybrid_jax.lazy_weights import stack as lazy_stack

LARGE_CHECKPOINT_BYTES = 64 << 20    # above this, loading shows a progress bar
QUANTIZATION_MODES = (None, "fp8")
# A quantized tensor in the kept-on-device mode: its float32 value and the scale of its block
# (0 marks an element that was not quantized). Numpy re-lays records like any array.
QUANTIZED = RECORDS
KEPT_BLOCKS = (128, 64, 32, 16)      # block sizes an FP8 weight on the device may use, per axis

_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32,
           "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F32": np.float32, "F64": np.float64, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "F8_E8M0": ml_dtypes.float8_e8m0fnu, "F4": np.uint8}    # F4: two e2m1 codes per byte


class _SafetensorsFile:
    """One memory-mapped safetensors file: an 8-byte header length, a JSON header
    {name: {dtype, shape, data_offsets}}, then the data. A file shorter than its header says (a copy
    or download cut short) is a CheckpointError saying it is truncated, by how much, and which tensor
    is cut off; so is a file that shrinks after it was opened (reading a page of a mapping past the
    end of its file would kill the process with SIGBUS)."""

    def __init__(self, path: str):
        self.path = path
        self.size = size = os.path.getsize(path)
        try:
            if size < 8:
                raise _Truncated(f"the file has {size} bytes, fewer than the 8 of the header length every "
                                 f"safetensors file starts with")
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n < 2:
                    raise ValueError(f"header length {n} is too small for a JSON header")
                if n > size - 8:
                    if n > 100 << 20:          # no real header is this long: not a safetensors file at all
                        raise ValueError(f"header length {n} does not fit a file of {size} bytes")
                    raise _Truncated(f"its {n}-byte header ends at byte {8 + n}, but the file has {size} bytes")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            header.pop("__metadata__", None)
            self.entries: dict[str, tuple[np.dtype, tuple[int, ...], bool, int, int]] = {}
            data = size - 8 - n
            cut: list[tuple[int, str]] = []              # (begin, name) of the tensors that end past the file
            need = 0
            for name, e in header.items():
                code, shape, (begin, end) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
                if code not in _DTYPES:
                    raise ValueError(f"tensor {name!r} has dtype {code!r}, which this reader does not know")
                dt = np.dtype(_DTYPES[code])
                packed = code == "F4"
                count = math.prod(shape) // 2 if packed else math.prod(shape)
                if packed and shape and shape[-1] % 2:
                    raise ValueError(f"F4 tensor {name!r} has an odd last dimension {shape[-1]}")
                if any(d < 0 for d in shape) or not 0 <= begin <= end or end - begin != count * dt.itemsize:
                    raise ValueError(f"tensor {name!r} ({code} {list(shape)}) has data offsets {[begin, end]} that "
                                     f"do not fit its size")
                if end > data:
                    cut.append((begin, name))
                    need = max(need, 8 + n + end)
                self.entries[name] = (dt, shape, packed, 8 + n + begin, count)
            if cut:
                first = min(cut)[1]
                raise _Truncated(f"its header places tensor data up to byte {need}, but the file has {size} bytes "
                                 f"({need - size} bytes missing; {len(cut)} of its {len(header)} tensors cut off, the "
                                 f"first {first!r})")
        except _Truncated as e:
            raise CheckpointError(f"weight file {path} is truncated: {e}") from None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"weight file {path} is corrupt or not safetensors: {e}") from None
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if size else None

    def get(self, name: str) -> np.ndarray:
        """The stored array (a read-only view of the mapped file); F4 as bytes [..., last / 2]."""
        try:
            now = os.path.getsize(self.path)
        except OSError as e:
            raise CheckpointError(f"weight file {self.path} cannot be read any more: {e}") from None
        if now < self.size:
            raise CheckpointError(f"weight file {self.path} was truncated while loading: it had {self.size} bytes "
                                  f"when opened, it has {now} now")
        dt, shape, packed, offset, count = self.entries[name]
        shape = shape[:-1] + (shape[-1] // 2,) if packed else shape
        return np.frombuffer(self._map, dtype=dt, count=count, offset=offset).reshape(shape)


class _Truncated(Exception):
    """Internal: a safetensors file shorter than its own header says."""


class CheckpointReader:
    def __init__(self, path: str, quantization: str | None = None):
        if quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization {quantization!r} is not supported; choose one of "
                              f"{list(QUANTIZATION_MODES)}")
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
        self._files: dict[str, _SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        for fname in files:
            fp = os.path.join(path, fname)
            if os.path.basename(fname) != fname or not os.path.exists(fp):
                raise CheckpointError(f"weight shard {fname!r} named by the index is missing from {path!r}")
            self._files[fname] = _SafetensorsFile(fp)
            for k in self._files[fname].entries:
                self._where[k] = fname
        if weight_map is not None:
            missing = [k for k, f in weight_map.items() if self._where.get(k) != f]
            if missing:
                raise CheckpointError(f"the index names tensors its shards do not hold, e.g. {missing[:3]}")
        self.total_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        self.counter = [0]          # bytes read inside `on_host()` (where tensors are read by parts)
        self.path = path
        self.quant = _read_quant_config(path)
        self.keep_quantized = quantization == "fp8"
        if self.keep_quantized and self.quant is None:
            raise ConfigError(f"quantization='fp8' keeps a pre-quantized checkpoint's FP8 weights on the device, but "
                              f"{os.path.join(path, 'config.json')} has no quantization_config (this loader does not "
                              f"quantize weights itself)")

    def keys(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (float8 codes, packed FP4 bytes, ...)."""
        try:
            return self._files[self._where[name]].get(name)
        except KeyError:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}") from None
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001  (a read from a damaged mapping)
            raise CheckpointError(f"cannot read tensor {name!r} from {self._where[name]}: {e}") from None

    def get(self, name: str) -> np.ndarray:
        """The tensor's values: quantized ones dequantized to float32, or, with quantization='fp8', as
        QUANTIZED records; every other tensor as stored."""
        a = self.raw(name)
        scale_name = next((s for s in qz.scale_names(name) if s in self._where), None)
        fp8 = a.dtype in qz.FP8_DTYPES
        if not fp8 and (scale_name is None or a.dtype not in qz.PACKED_FP4_DTYPES):
            if scale_name is not None and a.dtype.kind == "f" and self.quant is not None:
                raise CheckpointError(f"tensor {name!r} is stored as {a.dtype} but has a scale {scale_name!r}: "
                                      f"only FP8 / FP4 tensors carry one")
            return Stored(a, self.counter) if _ON_HOST.get() else a
        q = self.quant
        if q is None:
            raise CheckpointError(f"tensor {name!r} is stored quantized ({'float8' if fp8 else 'packed int8'}) but "
                                  f"config.json has no quantization_config")
        if not q.converted(name):
            raise CheckpointError(f"tensor {name!r} is stored quantized, but quantization_config."
                                  f"modules_to_not_convert names its module")
        if scale_name is None:
            raise CheckpointError(f"checkpoint lacks the scale of quantized tensor {name!r} (expected "
                                  f"{' or '.join(repr(s) for s in qz.scale_names(name))})")
        scale = self.raw(scale_name)
        if scale.dtype not in qz.SCALE_DTYPES:
            raise CheckpointError(f"scale {scale_name!r} has dtype {scale.dtype}; expected float32, bfloat16 or "
                                  f"float8_e8m0fnu")
        if fp8:
            shape, block = a.shape, q.block
            want = qz.fp8_scale_shape(shape, block)
            ok = scale.shape == want or (block is None and scale.size == 1)
        else:
            if q.expert_dtype != "fp4":
                raise CheckpointError(f"tensor {name!r} is stored as packed {a.dtype} with a scale, but "
                                      f"quantization_config.expert_dtype is {q.expert_dtype!r}, not 'fp4'")
            shape, want = qz.fp4_shapes(a.shape)
            block, ok = (1, qz.FP4_BLOCK), scale.shape == want
        if not ok:
            raise CheckpointError(f"scale {scale_name!r} has shape {tuple(scale.shape)}; tensor {name!r} "
                                  f"{'FP8' if fp8 else 'FP4'} {tuple(shape)} with blocks {block} needs {want}")
        if _ON_HOST.get():                  # read by parts: codes from the file, the block scales whole
            codes = Stored(a, self.counter) if fp8 else Fp4Codes(Stored(a, self.counter))
            full = (1,) * (len(shape) - 2) + tuple(block) if block is not None else shape
            coarse = np.asarray(scale, np.float32).reshape(tuple(-(-n // b) for n, b in zip(shape, full)))
            return BlockScaled(codes, coarse, full, records=self.keep_quantized)
        values = qz.unpack_fp4(a) if not fp8 else a.astype(np.float32)
        smap = qz.scale_map(scale, shape, block)
        if not self.keep_quantized:
            return values * smap
        out = np.empty(shape, QUANTIZED)
        out["v"] = values * smap
        out["s"] = np.where(smap == 0, 1.0, smap)          # an all-zero block decodes the same with scale 1
        return out


def _read_quant_config(path: str) -> qz.QuantConfig | None:
    f = os.path.join(path, "config.json")
    if not os.path.exists(f):
        return None                    # load_config names the missing file
    try:
        with open(f, encoding="utf-8") as fh:
            d = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None                    # load_config reports it
    if not isinstance(d, dict):
        return None
    q = d.get("quantization_config")
    if q is None and isinstance(d.get("text_config"), dict):
        q = d["text_config"].get("quantization_config")
    return None if q is None else qz.QuantConfig.parse(q, d.get("expert_dtype"))


def open_checkpoint(path: str, quantization: str | None = None) -> CheckpointReader:
    return CheckpointReader(path, quantization)


def checked_getter(get, has, progress=lambda: None):
    """t(name, shape=None) -> numpy array, for a model's weight conversion: raises CheckpointError
    naming a missing tensor, or one whose shape disagrees with config.json; ticks `progress`."""
    def t(name: str, shape=None) -> np.ndarray:
        if not has(name):
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        a = get(name)
        a = a if isinstance(a, Lazy) else np.asarray(a)
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)} "
                                  f"from config.json")
        progress()
        return a
    return t


def concat(parts, axis: int = 0) -> np.ndarray:
    """np.concatenate for weight pieces of which some may be QUANTIZED records (the others become
    records marked as not quantized), for the fused projections of a model's conversion. Host weights
    read by parts (`on_host`) give one too (`lazy_weights.Concat`)."""
    if all(isinstance(p, Lazy) for p in parts) and any(p.dtype == QUANTIZED for p in parts):
        return lazy_concat([p if p.dtype == QUANTIZED else Unquantized(p) for p in parts], axis)   # `on_host`
    if any(p.dtype == QUANTIZED for p in parts):
        parts = [np.asarray(p) for p in parts]
        def rec(p):
            if p.dtype == QUANTIZED:
                return p
            r = np.empty(p.shape, QUANTIZED)
            r["v"], r["s"] = p, 0.0
            return r
        parts = [rec(p) for p in parts]
    if any(isinstance(p, Lazy) for p in parts):
        return lazy_concat(parts, axis)
    return np.concatenate(parts, axis=axis)


def stack(parts, axis: int = 0):
    """np.stack, or a `lazy_weights.Stack` of host weights read by parts."""
    quantized = [p.dtype == QUANTIZED for p in parts]
    if any(isinstance(p, Lazy) for p in parts) and (not any(quantized) or
                                                    all(isinstance(p, Lazy) for p in parts) and all(quantized)):
        return lazy_stack(parts, axis)
    return np.stack([np.asarray(p) for p in parts], axis=axis)


def expert_weights(t, has, prefix: str, E: int, I: int, Hd: int, names=("gate_proj", "up_proj", "down_proj")):
    """A MoE layer's routed experts, from the fused 3-D tensors (`<prefix>experts.gate_up_proj`
    [E, 2I, Hd], `experts.down_proj` [E, Hd, I]) or the per-expert ones (`<prefix>experts.<e>.<gate>.weight`
    [I, Hd], `<up>` [I, Hd], `<down>` [Hd, I]; `names` spells gate, up, down). t: `checked_getter`.
    Returns (gate_up [E, Hd, 2I], down [E, I, Hd]) host arrays (QUANTIZED records where stored so)."""
    if has(prefix + "experts.gate_up_proj"):
        return (np.swapaxes(t(prefix + "experts.gate_up_proj", (E, 2 * I, Hd)), 1, 2),
                np.swapaxes(t(prefix + "experts.down_proj", (E, Hd, I)), 1, 2))
    g, u, d = (f"{prefix}experts.{{}}.{n}.weight" for n in names)
    gate_up = stack([concat([t(g.format(e), (I, Hd)), t(u.format(e), (I, Hd))], 0).T for e in range(E)])
    return gate_up, stack([t(d.format(e), (Hd, I)).T for e in range(E)])


def dense_mlp_weights(t, prefix: str, I: int, Hd: int):
    """A dense SwiGLU MLP's weights (`<prefix>gate_proj.weight` [I, Hd], `up_proj` [I, Hd],
    `down_proj` [Hd, I]). t: `checked_getter`. Returns (gate_up [Hd, 2I], down [I, Hd]) host arrays."""
    return (concat([t(prefix + "gate_proj.weight", (I, Hd)), t(prefix + "up_proj.weight", (I, Hd))], 0).T,
            t(prefix + "down_proj.weight", (Hd, I)).T)


_ON_HOST = contextvars.ContextVar("weights_on_host", default=False)


@contextlib.contextmanager
def on_host():
    """Within it, the reader gives stored tensors as `lazy_weights.Stored` (nothing read), `concat` /
    `stack` and the re-layouts keep them lazy, and `to_device` / `to_device_linear` give host weights in
    the run dtype instead of arrays on the default device: a model split over a mesh is converted
    without reading it, and `parallel.Layout.put` reads each device's slice alone, so neither a device
    nor the host holds the model and each process reads only its devices' part. FP8 / FP4 tensors come
    as `lazy_quantized.BlockScaled` (codes read by parts, block scales whole). What a conversion does
    beyond the lazy re-layouts reads that weight whole."""
    token = _ON_HOST.set(True)
    try:
        yield
    finally:
        _ON_HOST.reset(token)


def _array(a: np.ndarray, dtype):
    """`a` as a device array of `dtype`, or a host one inside `on_host()` (a view when no cast is needed;
    a weight read by parts stays one, cast as each part is read)."""
    import jax.numpy as jnp  # noqa: PLC0415
    if not _ON_HOST.get():
        return jnp.asarray(a, dtype=dtype)
    return a.astype(jnp.dtype(dtype)) if isinstance(a, Lazy) else np.asarray(a, dtype=jnp.dtype(dtype))


def to_device(a: np.ndarray, dtype):
    """A checkpoint array as a jax array of `dtype` (integer-typed tensors go through fp32; QUANTIZED
    records are dequantized); a host array inside `on_host()`."""
    if a.dtype == QUANTIZED:
        v = as_values(a) if isinstance(a, Lazy) else None
        a = v if v is not None else np.asarray(a)["v"]
    return _array(np.asarray(a, dtype=np.float32) if a.dtype.kind != "f" else a, dtype)   # ints: read whole


def to_device_linear(a: np.ndarray, dtype):
    """A weight that a layer multiplies through `layers.linear` ([..., in, out]): QUANTIZED records
    stay FP8 on the device (`Fp8Weight`, scale per block of inputs and per output); columns that were
    not quantized (a fused projection of mixed pieces) stay in `dtype` beside them (`ColumnConcat`).
    A block of records that FP8 codes with one scale per input block cannot hold exactly is dequantized
    instead, never approximated. Plain arrays are `to_device(a, dtype)`."""
    if a.dtype != QUANTIZED:
        return to_device(a, dtype)
    from hybrid_jax.layers.linear import ColumnConcat  # noqa: PLC0415
    if isinstance(a, Lazy):                 # read by parts (`on_host`): the stored codes, re-laid
        runs = column_pieces(a)
        parts = [_kept_lazy(p) if quantized else to_device(as_values(p), dtype) for quantized, p in runs]
        if runs and all(p is not None for p in parts):
            return parts[0] if len(parts) == 1 else ColumnConcat(tuple(parts))
        a = np.asarray(a)                   # a re-layout cut through scale blocks: read whole
    quantized = np.all((a["s"] != 0).reshape(-1, a.shape[-1]), axis=0)            # per output column
    edges = [0] + [j for j in range(1, a.shape[-1]) if quantized[j] != quantized[j - 1]] + [a.shape[-1]]
    parts = [_kept(a[..., lo:hi], dtype) if quantized[lo] else to_device(a[..., lo:hi]["v"], dtype)
             for lo, hi in zip(edges[:-1], edges[1:])]
    return parts[0] if len(parts) == 1 else ColumnConcat(tuple(parts))


def _kept_lazy(a: Lazy):
    """Lazy QUANTIZED records -> an Fp8Weight of the stored codes (read by parts) and the block scales
    `_kept` would find in the weight read whole; None where `lazy_quantized` cannot follow them."""
    from hybrid_jax.layers.linear import Fp8Weight  # noqa: PLC0415
    parts = fp8_parts(a)
    got = kept_blocks(*parts, KEPT_BLOCKS) if parts is not None else None
    if got is None:
        return None
    scale, block = got
    return Fp8Weight(w=parts[0], scale=scale, block=block)


def _kept(a: np.ndarray, dtype):
    """QUANTIZED records [..., K, N] -> Fp8Weight when the per-element scale is constant over blocks of
    (bk inputs, bn outputs) from KEPT_BLOCKS (the largest that fit, down to single columns) and every
    value / scale is an FP8 code; else dequantized."""
    from hybrid_jax.layers.linear import Fp8Weight  # noqa: PLC0415
    K, N = a.shape[-2:]
    v, s = np.ascontiguousarray(a["v"]), np.ascontiguousarray(a["s"])
    codes = (v / s).astype(ml_dtypes.float8_e4m3fn)
    if not np.array_equal(codes.astype(np.float32) * s, v):
        return to_device(v, dtype)
    for bk in KEPT_BLOCKS:
        rows = constant(s, bk, -2)
        if rows is None:
            continue
        for bn in KEPT_BLOCKS + (1,):
            scale = constant(rows, bn, -1)
            if scale is not None:
                return Fp8Weight(w=_array(codes, codes.dtype), scale=_array(scale, scale.dtype), block=(bk, bn))
    return to_device(v, dtype)


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
        step = max(1, leaf.size // sample)
        if isinstance(leaf, (np.ndarray, Lazy)):     # a host weight (`on_host`): read only the sampled values
            at = np.unravel_index(np.arange(0, leaf.size, step)[:sample], leaf.shape)
            values = leaf.points(at) if isinstance(leaf, Lazy) else leaf[at]
        else:
            values = leaf.reshape(-1)[::step][:sample]
        h.update(np.asarray(values).tobytes())
    return h.hexdigest()
