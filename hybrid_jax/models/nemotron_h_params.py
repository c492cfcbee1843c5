"""Nemotron-H's parameters: a deterministic random init and the one-time re-layout of a checkpoint
(the release's names under `backbone.`, as transformers saves them; `model.` also read) into the
layout `models.nemotron_h` documents."""
from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from hybrid_jax.layers.mamba2 import Mamba2Dims, group_major, param_shapes
from hybrid_jax.models.nemotron_h_config import NemotronHConfig
from hybrid_jax.weights import QUANTIZED, checked_getter, concat, stack, to_device, to_device_linear

F32_PARAMS = ("dt_bias", "A_log", "D")    # the Mamba2 decay / skip parameters stay float32
LANES = 128     # a TPU tile's minor dimension


def expert_columns(cfg: NemotronHConfig) -> int:
    """The routed experts' intermediate size as stored: moe_intermediate_size rounded up to a multiple of
    128, the added columns of up and rows of down zero (relu2(0) = 0: the output is unchanged). A TPU lays
    out an up stack [E, Hd, I] with I not a multiple of 128 (Nemotron-3-Nano's 1856) Hd-minor, which its
    grouped matmul cannot read: the compiled decode step then copied every expert's up weights, each step."""
    return -(-cfg.moe_intermediate_size // LANES) * LANES


def _pad_experts(cfg: NemotronHConfig, up, down):
    """up [E, He, I], down [E, I, He] with `expert_columns` - I zero columns / rows appended (an FP8 record
    stack kept as it is: its block scales are laid out for I)."""
    extra = expert_columns(cfg) - up.shape[-1]
    if extra == 0 or up.dtype == QUANTIZED or down.dtype == QUANTIZED:
        return up, down
    E, He, _ = up.shape
    return (concat([up, np.zeros((E, He, extra), up.dtype)], axis=2),
            concat([down, np.zeros((E, extra, He), down.dtype)], axis=1))


def mamba_dims(cfg: NemotronHConfig) -> Mamba2Dims:
    """The Mamba2 layers' sizes, as layers.mamba2 reads them."""
    return Mamba2Dims(num_heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim, n_groups=cfg.n_groups,
                      state_size=cfg.ssm_state_size, conv_kernel=cfg.conv_kernel, eps=cfg.rms_norm_eps,
                      time_step_limit=cfg.time_step_limit)


def init_params(cfg: NemotronHConfig, seed: int = 0, dtype=jnp.float32, rng=None) -> dict:
    """Deterministic random parameters in the converted layout (std 0.02; norms at 1; A_log, dt_bias as
    Mamba2 initialises them). rng: as deepseek_v32.init_params."""
    rng = np.random.default_rng(seed) if rng is None else rng

    def n(*shape, std=0.02, dt=dtype):
        return jnp.asarray(rng.normal(0.0, std, shape), dt)

    Hd = cfg.hidden_size
    params = {"embed": n(cfg.vocab_size, Hd), "final_norm": jnp.ones((Hd,), dtype), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = n(Hd, cfg.vocab_size)
    for kind in cfg.layer_types:
        lp = {"norm": jnp.ones((Hd,), dtype)}
        if kind == "linear_attention":
            shapes = param_shapes(Hd, mamba_dims(cfg))
            m = {k: n(*s) for k, s in shapes.items()}
            m.update(norm=jnp.ones(shapes["norm"], dtype), D=jnp.ones(shapes["D"], jnp.float32),
                     A_log=jnp.asarray(np.log(rng.uniform(1.0, 16.0, shapes["A_log"])), jnp.float32),
                     dt_bias=jnp.asarray(np.log(np.expm1(rng.uniform(1e-3, 0.1, shapes["dt_bias"]))), jnp.float32))
            lp["mamba"] = m
        elif kind == "full_attention":
            Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            lp["attn"] = {"q": n(Hd, Hq * D), "k": n(Hd, Hkv * D), "v": n(Hd, Hkv * D), "o_proj": n(Hq * D, Hd)}
        elif kind == "mlp":
            lp["mlp"] = {"up": n(Hd, cfg.intermediate_size), "down": n(cfg.intermediate_size, Hd)}
        else:
            E, I, Is = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
            He, extra = cfg.moe_latent_size or Hd, expert_columns(cfg) - I
            moe = {"router": n(Hd, E, dt=jnp.float32), "bias": jnp.zeros((E,), jnp.float32),
                   "up": jnp.pad(n(E, He, I), ((0, 0), (0, 0), (0, extra))),
                   "down": jnp.pad(n(E, I, He), ((0, 0), (0, extra), (0, 0))),
                   "shared_up": n(Hd, Is), "shared_down": n(Is, Hd)}
            if cfg.moe_latent_size:
                moe.update(latent_in=n(Hd, He), latent_out=n(He, Hd))
            lp["moe"] = moe
        params["layers"].append(lp)
    return params


def convert_hf_weights(cfg: NemotronHConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                       dtype, progress: Callable[[], None] = lambda: None) -> dict:
    """Re-lays a Nemotron-H checkpoint into the layout above. Raises CheckpointError naming a missing or
    misshapen tensor. The MTP block (`mtp.*`) is not read (nemotron_h_config: said, not silent)."""
    Hd = cfg.hidden_size
    t = checked_getter(get, has, progress)
    root = "model." if has("model.embeddings.weight") else "backbone."

    def dev(a, dt=None):
        return to_device(a, dt or dtype)

    def lin(a):
        return to_device_linear(a, dtype)

    params = {"embed": dev(t(root + "embeddings.weight", (cfg.vocab_size, Hd))),
              "final_norm": dev(t(root + "norm_f.weight", (Hd,))), "layers": []}
    # transformers' Nemotron-H never ties (its head is always its own): a stored head is the head; only a
    # checkpoint without one that asks for tying reads the embedding
    if has("lm_head.weight") or not cfg.tie_word_embeddings:
        params["lm_head"] = dev(t("lm_head.weight", (cfg.vocab_size, Hd)).T)
    convert = {"linear_attention": _convert_mamba, "full_attention": _convert_attention, "mlp": _convert_mlp,
               "moe": _convert_moe}
    for i, kind in enumerate(cfg.layer_types):
        p = f"{root}layers.{i}."
        lp = {"norm": dev(t(p + "norm.weight", (Hd,)))}
        lp.update(convert[kind](cfg, t, has, p + "mixer.", dev, lin))
        params["layers"].append(lp)
    return params


def _convert_mamba(cfg: NemotronHConfig, t, has, a: str, dev, lin) -> dict:
    """The mixer's weights, in_proj's columns and the conv's channels re-laid group-major
    (`layers.mamba2.group_major`: a device's contiguous share of them is whole groups)."""
    d = mamba_dims(cfg)
    shapes = param_shapes(cfg.hidden_size, d)
    W, C = shapes["conv"]
    bias = t(a + "conv1d.bias", (C,)) if cfg.use_conv_bias else np.zeros((C,), np.float32)
    in_proj = group_major(t(a + "in_proj.weight", shapes["in_proj"][::-1]), d, 0, concat, with_z_dt=True)
    conv = group_major(np.asarray(t(a + "conv1d.weight", (C, 1, W)))[:, 0, :], d, 0, np.concatenate, with_z_dt=False)
    m = {"in_proj": lin(in_proj.T), "conv": dev(conv.T),
         "conv_bias": dev(group_major(np.asarray(bias), d, 0, np.concatenate, with_z_dt=False)),
         "norm": dev(t(a + "norm.weight", shapes["norm"])),
         "out_proj": lin(t(a + "out_proj.weight", shapes["out_proj"][::-1]).T)}
    m.update({k: dev(t(a + k, shapes[k]), jnp.float32) for k in F32_PARAMS})
    return {"mamba": m}


def _convert_attention(cfg: NemotronHConfig, t, has, a: str, dev, lin) -> dict:
    Hd, Hq, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {"attn": {"q": lin(t(a + "q_proj.weight", (Hq * D, Hd)).T), "k": lin(t(a + "k_proj.weight", (Hkv * D, Hd)).T),
                     "v": lin(t(a + "v_proj.weight", (Hkv * D, Hd)).T),
                     "o_proj": lin(t(a + "o_proj.weight", (Hd, Hq * D)).T)}}


def _convert_mlp(cfg: NemotronHConfig, t, has, a: str, dev, lin) -> dict:
    Hd, I = cfg.hidden_size, cfg.intermediate_size
    return {"mlp": {"up": lin(t(a + "up_proj.weight", (I, Hd)).T), "down": lin(t(a + "down_proj.weight", (Hd, I)).T)}}


def _convert_moe(cfg: NemotronHConfig, t, has, a: str, dev, lin) -> dict:
    """Router, correction bias, the routed experts (stacked `experts.up_proj` [E, I, Hd'] or per expert
    `experts.<e>.up_proj.weight`), the shared MLP and the latent projections when configured."""
    Hd, E, I, Is = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
    He = cfg.moe_latent_size or Hd
    if has(a + "experts.up_proj"):
        up = np.swapaxes(t(a + "experts.up_proj", (E, I, He)), 1, 2)
        down = np.swapaxes(t(a + "experts.down_proj", (E, He, I)), 1, 2)
    else:
        up = stack([t(f"{a}experts.{e}.up_proj.weight", (I, He)).T for e in range(E)])
        down = stack([t(f"{a}experts.{e}.down_proj.weight", (He, I)).T for e in range(E)])
    up, down = _pad_experts(cfg, up, down)
    moe = {"router": dev(t(a + "gate.weight", (E, Hd)).T, jnp.float32),
           "bias": dev(t(a + "gate.e_score_correction_bias", (E,)), jnp.float32),
           "up": lin(up), "down": lin(down),
           "shared_up": lin(t(a + "shared_experts.up_proj.weight", (Is, Hd)).T),
           "shared_down": lin(t(a + "shared_experts.down_proj.weight", (Hd, Is)).T)}
    if cfg.moe_latent_size:
        moe.update(latent_in=lin(t(a + "fc1_latent_proj.weight", (He, Hd)).T),
                   latent_out=lin(t(a + "fc2_latent_proj.weight", (Hd, He)).T))
    return {"moe": moe}


# Logical axes of every parameter (hybrid_jax.parallel.rules), first match wins. A Mamba2 layer splits by
# its groups: in_proj's columns and the conv's channels are group-major (`layers.mamba2.group_major`), so
# a device's contiguous share is whole groups with their heads' z, x, dt and the B / C those heads read;
# the per-head A_log / D / dt_bias, the gated norm's channels (normed per group) and out_proj's rows
# follow the heads. tensor_parallel_size must divide n_groups (`NemotronHConfig.head_counts`): with fewer
# groups than devices a group's B / C would be needed on several devices, which this layout does not copy.
# Attention splits by query heads (KV heads replicated when fewer than the devices), the relu2 MLP and
# shared expert column then row parallel, the routed experts as DeepSeek's (whole under expert
# parallelism, else by their columns); the router, its bias and the latent projections stay whole.
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "*/mamba/in_proj": ("embed", "heads"),
    "*/mamba/conv": (None, "heads"),
    "*/mamba/conv_bias": ("heads",),
    "*/mamba/dt_bias": ("heads",),
    "*/mamba/A_log": ("heads",),
    "*/mamba/D": ("heads",),
    "*/mamba/norm": ("heads",),
    "*/mamba/out_proj": ("heads", "embed"),
    "*/attn/q": ("embed", "heads"),
    "*/attn/k": ("embed", "kv_heads"),
    "*/attn/v": ("embed", "kv_heads"),
    "*/attn/o_proj": ("heads", "embed"),
    "*/mlp/up": ("embed", "mlp"),
    "*/mlp/down": ("mlp", "embed"),
    "*/moe/router": ("embed", None),
    "*/moe/bias": (None,),
    "*/moe/up": ("experts", "embed", "expert_mlp"),
    "*/moe/down": ("experts", "expert_mlp", "embed"),
    "*/moe/shared_up": ("embed", "mlp"),
    "*/moe/shared_down": ("mlp", "embed"),
    "*/moe/latent_in": ("embed", None),
    "*/moe/latent_out": (None, "embed"),
    "*norm": (None,),
}
