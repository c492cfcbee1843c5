"""Block-scaled quantized checkpoints: what `quantization_config` says, and the host-side decoding.

The releases this project loads store their linear weights in two formats (config.json's
`quantization_config`, `quant_method: "fp8"`):

  FP8   weight [..., O, I] float8_e4m3fn with a scale per (bo x bi) block (`weight_block_size`,
        128 x 128 in every release; edge blocks may be partial): scale [..., ceil(O/bo), ceil(I/bi)],
        named `<name>_scale_inv` (Hugging Face / DeepSeek-V3 layout, float32) or `<module>.scale`
        (DeepSeek-V4's own layout, float8_e8m0fnu: powers of two). value = code * scale.
  FP4   (DeepSeek-V4 experts, `expert_dtype: "fp4"`) e2m1 codes, two per byte, low nibble first:
        weight [..., O, I/2] int8 (or safetensors' F4 [..., O, I]); scale [..., O, ceil(I/32)]
        float8_e8m0fnu, one per 32 inputs.

`QuantConfig.parse` validates the config dict (an unknown method or key is a ConfigError naming it;
`scale_fmt` "ue8m0" only says the scales are powers of two: they are used as stored). A tensor's
value is its code (`unpack_fp4` for FP4) times `scale_map`, its block scale spread over every element;
the kept-on-device mode carries that map through the weight re-layout (see `weights.py`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import ml_dtypes
import numpy as np

from hybrid_jax.errors import ConfigError

FP4_BLOCK = 32                         # inputs per FP4 scale
# e2m1 code -> value (sign bit 3, exponent bits 2-1, mantissa bit 0)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn),)
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
                np.dtype(ml_dtypes.float8_e8m0fnu))
PACKED_FP4_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))

# Keys of a `quant_method: fp8` config and the values this loader implements.
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "modules_to_not_convert",
             "ignored_layers", "modules_to_convert", "expert_dtype", "dequantize"}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's `quantization_config` (FP8 block-scaled weights, optionally FP4 experts).

    block: (bo, bi) outputs x inputs per FP8 scale, or None for one scale per tensor.
    skip: `modules_to_not_convert` patterns (transformers' matching: a prefix ending at a module
    boundary, a regex with that boundary, or a suffix)."""
    block: tuple[int, int] | None = (128, 128)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"
    skip: tuple[str, ...] = ()

    @staticmethod
    def parse(q: Any, expert_dtype: str | None = None) -> QuantConfig:
        """config.json's quantization_config (and DeepSeek-V4's top-level `expert_dtype`) -> QuantConfig."""
        if not isinstance(q, dict):
            raise ConfigError(f"quantization_config must be a JSON object; got {type(q).__name__}")
        method = q.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8': block-scaled "
                              f"FP8 weights, with DeepSeek-V4's FP4 experts)")
        unknown = sorted(set(q) - _FP8_KEYS)
        if unknown:
            raise ConfigError(f"quantization_config has key(s) {unknown} this loader does not implement; known: "
                              f"{sorted(_FP8_KEYS)}")
        if q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quantization_config.fmt {q['fmt']!r} is not supported (only 'e4m3')")
        if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise ConfigError(f"quantization_config.activation_scheme {q['activation_scheme']!r} is not supported "
                              f"(only 'dynamic': no activation scales are read)")
        scale_fmt = q.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise ConfigError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported ('float' or 'ue8m0')")
        ed = q.get("expert_dtype", expert_dtype) or "fp8"
        if ed not in ("fp8", "fp4"):
            raise ConfigError(f"quantization_config.expert_dtype {ed!r} is not supported ('fp8' or 'fp4')")
        block = q.get("weight_block_size", (128, 128))
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ConfigError(f"quantization_config.weight_block_size must be two positive integers; got {block!r}")
            block = (int(block[0]), int(block[1]))
        skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise ConfigError(f"quantization_config.modules_to_not_convert must be a list of names; got {skip!r}")
        return QuantConfig(block=block, scale_fmt=scale_fmt, expert_dtype=ed, skip=tuple(skip))

    def converted(self, tensor: str) -> bool:
        """Whether the module owning `tensor` ("<module>.weight") may hold quantized weights."""
        module = tensor.rsplit(".", 1)[0] if tensor.endswith((".weight", ".scale")) else tensor
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.skip)


def scale_names(name: str) -> tuple[str, ...]:
    """Where a quantized tensor's scale may be stored: `<name>_scale_inv` (Hugging Face, DeepSeek-V3)
    and, for `<module>.weight`, `<module>.scale` (DeepSeek-V4's own layout)."""
    names = (name + "_scale_inv",)
    if name.endswith(".weight"):
        names += (name[: -len(".weight")] + ".scale",)
    return names


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale shape of an FP8 tensor [..., O, I]: [..., ceil(O/bo), ceil(I/bi)] (() per tensor)."""
    if block is None:
        return ()
    *lead, O, I = shape
    return (*lead, math.ceil(O / block[0]), math.ceil(I / block[1]))


def fp4_shapes(packed_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Packed int8 [..., O, I/2] -> (values [..., O, I], scale [..., O, ceil(I/32)])."""
    *lead, O, half = packed_shape
    return (*lead, O, 2 * half), (*lead, O, math.ceil(2 * half / FP4_BLOCK))


def scale_map(scale: np.ndarray, shape: tuple[int, ...], block: tuple[int, int] | None) -> np.ndarray:
    """A block scale spread over every element: scale [..., nbo, nbi] -> [..., O, I] float32 (edge blocks
    cropped); block None: one scale for the whole tensor."""
    s = np.asarray(scale, np.float32)
    if block is None:
        return np.broadcast_to(s.reshape(()), shape)
    *lead, O, I = shape
    s = np.repeat(np.repeat(s, block[0], axis=-2)[..., :O, :], block[1], axis=-1)[..., :I]
    return s


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Two e2m1 codes per byte, low nibble first: [..., n] bytes -> [..., 2n] float32 code values."""
    b = np.asarray(packed).view(np.uint8)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))
    return FP4_VALUES[codes]
