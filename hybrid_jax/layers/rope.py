"""Rotary position embedding for every family: one `RopeSpec` read from config.json, the frequency
schedules transformers defines (default, linear, dynamic NTK, YaRN), Qwen3.5's interleaved mRoPE, and
DeepSeek's YaRN correction of the softmax scale.

  RopeSpec.parse(rope_dict, ...)      `rope_parameters` / legacy `rope_scaling` (see `rope_dict`) -> spec;
                                      a rope_type not implemented is a ConfigError naming it
  frequencies(spec, dim, seq_len)     inverse frequencies [dim/2] ([B, dim/2] for dynamic NTK)
  rope_cos_sin(positions, dim, spec)  cos, sin [B, T, dim] (the halves repeated, rotate-half layout;
                                      the interleaved-pair layouts read the first half), times YaRN's
                                      attention factor
  mrope_cos_sin(positions3, dim, spec)  the same from (temporal, height, width) positions [3, B, T]
  apply_rope(x, cos, sin)             rotate-half RoPE on the first channels (partial RoPE)
  softmax_scale(spec, head_dim)       head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for DeepSeek YaRN

Dynamic NTK follows transformers per request: past the trained length the base grows with the row's
length after the step (seq_len = lengths + n_new), so a prompt prefilled in one step gets the
frequencies transformers gives it, and each decode step those of its new length.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from hybrid_jax.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn")
# rope dict keys and what reads them; any other key is refused (it would change the math unread)
_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
         "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "mrope_section",
         "mrope_interleaved"}


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE: rope_type (ROPE_TYPES), base theta, the rotated fraction of the head, and the
    scaling parameters of its type (unused ones at their defaults)."""
    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0                         # linear, dynamic, yarn
    max_position_embeddings: int = 0            # dynamic: the trained length
    original_max_position_embeddings: int = 0   # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0               # yarn: multiplies cos and sin
    mscale_all_dim: float = 0.0                 # yarn (DeepSeek): softmax scale *= mscale(factor, this)^2
    truncate: bool = True                       # yarn: integer correction range
    mrope_section: tuple[int, ...] = ()         # mRoPE: frequencies per (temporal, height, width)
    mrope_interleaved: bool = False

    @staticmethod
    def parse(r: dict[str, Any], *, family: str, theta: float = 10000.0, partial_rotary_factor: float = 1.0,
              max_position_embeddings: int = 0, types: tuple[str, ...] = ROPE_TYPES) -> RopeSpec:
        """A rope dict (`rope_dict`'s result, or one of DeepSeek-V4's nested ones) -> RopeSpec. theta,
        partial_rotary_factor: the config's top-level values, used when the dict has none."""
        unknown = sorted(set(r) - _KEYS)
        if unknown:
            raise ConfigError(f"rope parameters {unknown} are not implemented for {family}; known: {sorted(_KEYS)}")
        rt = r.get("rope_type") or r.get("type") or "default"
        if rt not in types:
            raise ConfigError(f"rope_type {rt!r} is not supported for {family}; supported: {list(types)}")
        mrope = tuple(int(s) for s in r.get("mrope_section") or ())
        if mrope and (len(mrope) != 3 or min(mrope) < 0):
            raise ConfigError(f"mrope_section must be three non-negative sizes; got {list(mrope)}")
        base = dict(theta=float(r.get("rope_theta") or theta),
                    partial_rotary_factor=float(r.get("partial_rotary_factor", partial_rotary_factor)),
                    mrope_section=mrope, mrope_interleaved=bool(r.get("mrope_interleaved", False)))
        if rt == "default":
            return RopeSpec("default", **base)
        if rt in ("linear", "dynamic"):
            if r.get("factor") is None or float(r["factor"]) < 1.0:
                raise ConfigError(f"rope_type {rt!r} needs a factor >= 1; got {r.get('factor')!r}")
            return RopeSpec(rt, factor=float(r["factor"]), max_position_embeddings=int(max_position_embeddings), **base)
        omax = int(r.get("original_max_position_embeddings") or max_position_embeddings)
        factor = r.get("factor")
        factor = float(factor) if factor is not None else max_position_embeddings / omax
        ms, msa = r.get("mscale"), r.get("mscale_all_dim")
        af = r.get("attention_factor")
        if af is None:        # transformers' YaRN default
            af = _mscale(factor, ms) / _mscale(factor, msa) if ms and msa else _mscale(factor)
        return RopeSpec("yarn", factor=factor, original_max_position_embeddings=omax,
                        beta_fast=float(r.get("beta_fast") or 32), beta_slow=float(r.get("beta_slow") or 1),
                        attention_factor=float(af), mscale_all_dim=float(msa or 0.0),
                        truncate=bool(r.get("truncate", True)), **base)

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def rope_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A config's rope dict: `rope_parameters` (transformers 5) or the legacy `rope_scaling` (DeepSeek,
    Qwen releases), with the legacy `type` spelled `rope_type`; both present must agree. {} when neither is."""
    def norm(x):
        x = dict(x)
        if "type" in x:
            t = x.pop("type")
            if x.setdefault("rope_type", t) != t:
                raise ConfigError(f"rope parameters name two rope types: rope_type {x['rope_type']!r} and type {t!r}")
        return x
    rp, rs = d.get("rope_parameters"), d.get("rope_scaling")
    if rp and rs:
        a, b = norm(rp), norm(rs)
        if any(a[k] != b[k] for k in a.keys() & b.keys() if k != "rope_theta"):
            raise ConfigError(f"config.json's rope_parameters {rp} and rope_scaling {rs} disagree")
        return {**b, **a}
    return norm(rp or rs or {})


def _mscale(scale: float, m: float | None = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * (m if m else 1.0) * math.log(scale) + 1.0


def softmax_scale(spec: RopeSpec, head_dim: int) -> float:
    """The attention softmax scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a DeepSeek
    YaRN spec (one with mscale_all_dim), as DeepSeek defines it."""
    scale = head_dim ** -0.5
    if spec.rope_type == "yarn" and spec.mscale_all_dim:
        scale *= _mscale(spec.factor, spec.mscale_all_dim) ** 2
    return scale


def frequencies(spec: RopeSpec, dim: int, seq_len: jax.Array | None = None) -> jax.Array:
    """Inverse frequencies of the `dim` rotated channels: [dim/2] fp32, or [B, dim/2] for dynamic NTK
    (seq_len [B]: each row's length after the step)."""
    exps = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    base = spec.theta
    if spec.rope_type == "linear":
        return 1.0 / (base ** exps) / spec.factor
    if spec.rope_type == "dynamic":
        if seq_len is None:
            raise ValueError("dynamic NTK RoPE needs each row's length (seq_len)")
        L = jnp.maximum(seq_len.astype(jnp.float32), float(spec.max_position_embeddings))[:, None]
        grown = base * (spec.factor * L / spec.max_position_embeddings - (spec.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (grown ** exps)
    extra = 1.0 / (base ** exps)
    if spec.rope_type != "yarn":
        return extra

    def corr(rot):
        return dim * math.log(spec.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = corr(spec.beta_fast), corr(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    keep = 1.0 - jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return 1.0 / (spec.factor * base ** exps) * (1.0 - keep) + extra * keep


def rope_angles(positions: jax.Array, dim: int, spec: RopeSpec, seq_len: jax.Array | None = None) -> jax.Array:
    """positions [B, T] int -> angles position * frequency [B, T, dim/2] fp32."""
    f = frequencies(spec, dim, seq_len)
    f = f[:, None, :] if f.ndim == 2 else f
    return positions.astype(jnp.float32)[..., None] * f


def rope_cos_sin(positions: jax.Array, rotary_dim: int, spec: RopeSpec, seq_len: jax.Array | None = None):
    """positions: [B, T] int -> cos, sin: [B, T, rotary_dim] fp32 (halves repeated; times the attention
    factor). seq_len [B]: each row's length after this step (dynamic NTK)."""
    a = rope_angles(positions, rotary_dim, spec, seq_len)
    emb = jnp.concatenate([a, a], axis=-1)
    return jnp.cos(emb) * spec.attention_factor, jnp.sin(emb) * spec.attention_factor


def mrope_cos_sin(positions: jax.Array, rotary_dim: int, spec: RopeSpec):
    """Multimodal RoPE: positions [3, B, T] (temporal, height, width) -> cos, sin [B, T, rotary_dim].
    Frequency j takes the temporal position, except, interleaved (Qwen3.5), j = 1 mod 3 below
    3 * mrope_section[1] (height) and j = 2 mod 3 below 3 * mrope_section[2] (width); contiguous
    (Qwen2-VL), the sections in order. With the three positions equal (text) it is `rope_cos_sin`."""
    a = rope_angles(positions.reshape(-1, positions.shape[-1]), rotary_dim, spec).reshape(
        positions.shape + (rotary_dim // 2,))                                        # [3, B, T, R/2]
    j = jnp.arange(rotary_dim // 2)
    t, h, w = spec.mrope_section or (rotary_dim // 2, 0, 0)
    if spec.mrope_interleaved:
        axis = jnp.where((j % 3 == 1) & (j < 3 * h), 1, jnp.where((j % 3 == 2) & (j < 3 * w), 2, 0))
    else:
        axis = jnp.where(j < t, 0, jnp.where(j < t + h, 1, 2))
    sel = jnp.take_along_axis(jnp.moveaxis(a, 0, -1), axis[None, None, :, None], axis=-1)[..., 0]
    emb = jnp.concatenate([sel, sel], axis=-1)
    return jnp.cos(emb) * spec.attention_factor, jnp.sin(emb) * spec.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, D]; cos, sin: [B, T, R] with R <= D. Channels past R pass through."""
    R = cos.shape[-1]
    xr, xp = x[..., :R], x[..., R:]
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    rot = jnp.concatenate([-xr[..., R // 2:], xr[..., :R // 2]], axis=-1)
    return jnp.concatenate([xr * c + rot * s, xp], axis=-1)
