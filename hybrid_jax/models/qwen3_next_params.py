"""Qwen3-Next's parameters: their shapes, a deterministic random init, the one-time re-layout of a
Hugging Face checkpoint into the layout `qwen3_next.py` documents, and the logical axes of each
parameter for the device mesh. Qwen3.5 and Kimi-Linear reuse the re-layout's pieces."""
from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from hybrid_jax.models.qwen3_next_config import ModelConfig
from hybrid_jax.errors import CheckpointError
from hybrid_jax.weights import checked_getter, concat, dense_mlp_weights, expert_weights, to_device, to_device_linear

MTP_PREFIX = "mtp."      # where Qwen3-Next and Qwen3.5 checkpoints keep the MTP block


def _shapes(cfg: ModelConfig) -> dict:
    Hd = cfg.hidden_size
    H, HV, K, V = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return dict(Hd=Hd, H=H, HV=HV, K=K, V=V, Hq=Hq, Hkv=Hkv, D=D)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, rng=None) -> dict:
    """Deterministic random parameters in the converted layout (std 0.02, like HF's init).
    rng: the numpy Generator to draw from (default_rng(seed) when None; `hybrid_jax.plan` passes one that
    returns traced zeros, so that under jax.eval_shape nothing is drawn or allocated)."""
    s = _shapes(cfg)
    rng = np.random.default_rng(seed) if rng is None else rng

    def n(*shape, std=0.02):
        return jnp.asarray(rng.normal(0.0, std, shape), dtype)

    params = {"embed": n(cfg.vocab_size, s["Hd"]), "final_norm": jnp.zeros((s["Hd"],), dtype), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = n(s["Hd"], cfg.vocab_size)
    for i, kind in enumerate(cfg.layer_types):
        lp = {"input_norm": jnp.zeros((s["Hd"],), dtype), "post_norm": jnp.zeros((s["Hd"],), dtype)}
        if kind == "linear_attention":
            H, HV, K, V = s["H"], s["HV"], s["K"], s["V"]
            lp["gdn"] = {
                "qkvz": n(s["Hd"], 2 * H * K + 2 * HV * V), "ba": n(s["Hd"], 2 * HV),
                "conv": n(cfg.linear_conv_kernel_dim, cfg.linear_conv_dim, std=0.3),
                "A_log": jnp.asarray(np.log(rng.uniform(0.01, 16, HV)), dtype),
                "dt_bias": jnp.ones((HV,), dtype),
                "norm": jnp.ones((V,), dtype),
                "out_proj": n(HV * V, s["Hd"]),
            }
        else:
            Hq, Hkv, D = s["Hq"], s["Hkv"], s["D"]
            lp["attn"] = {"qg": n(s["Hd"], 2 * Hq * D), "kv": n(s["Hd"], 2 * Hkv * D), "q_norm": jnp.zeros((D,), dtype),
                          "k_norm": jnp.zeros((D,), dtype), "o_proj": n(Hq * D, s["Hd"])}
        if cfg.is_moe_layer(i):
            E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            lp["moe"] = {"in_proj": n(s["Hd"], E + 1 + 2 * Is), "shared_down": n(Is, s["Hd"]),
                         "gate_up": n(E, s["Hd"], 2 * I), "down": n(E, I, s["Hd"])}
        else:
            I = cfg.intermediate_size
            lp["mlp"] = {"gate_up": n(s["Hd"], 2 * I), "down": n(I, s["Hd"])}
        params["layers"].append(lp)
    return params


def expected_hf_keys(cfg: ModelConfig) -> list[str]:
    """The tensor names a checkpoint must hold (per-expert form for MoE experts)."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        keys.append("lm_head.weight")
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if kind == "linear_attention":
            keys += [p + "linear_attn." + n for n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight",
                                                       "A_log", "dt_bias", "norm.weight", "out_proj.weight")]
        else:
            keys += [p + "self_attn." + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                     "o_proj.weight", "q_norm.weight", "k_norm.weight")]
    return keys


def grouped_in_proj(cfg: ModelConfig, t, a: str) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's Gated DeltaNet input projections, already grouped per key head as the layers read
    them (torch layout [out, Hd]): (in_proj_qkvz [H * (K | K | r*V | r*V), Hd], in_proj_ba [H * (r | r), Hd])."""
    Hd, HK, HVV, HV = (cfg.hidden_size, cfg.linear_num_key_heads * cfg.linear_key_head_dim,
                       cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_num_value_heads)
    return t(a + "in_proj_qkvz.weight", (2 * HK + 2 * HVV, Hd)), t(a + "in_proj_ba.weight", (2 * HV, Hd))


def grouped_conv_channels(cfg: ModelConfig) -> np.ndarray:
    """Checkpoint conv channel (q | k | v, each heads in order) of each channel of the layers' per-key-head
    grouping (q_h | k_h | v_h for h = 0 .. H-1): index [H * (2K + rV)]."""
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return per_head_channels(H, K, (HV // H) * V)


def per_head_channels(H: int, K: int, rV: int) -> np.ndarray:
    """Index [H * (2K + rV)]: for each channel of a per-head grouping q_h | k_h | v_h (h = 0 .. H-1), its
    channel in the q | k | v order checkpoints store (q and k K wide per head, v rV wide)."""
    return np.concatenate([np.concatenate([h * K + np.arange(K), H * K + h * K + np.arange(K),
                                           2 * H * K + h * rV + np.arange(rV)]) for h in range(H)])


def convert_hf_weights(cfg: ModelConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                       dtype, progress: Callable[[], None] = lambda: None, *, prefix: str = "model.",
                       gdn_in_proj: Callable = grouped_in_proj) -> dict:
    """Re-lays a Hugging Face Qwen3-Next checkpoint into the layout above, once, at load.

    get(name) -> numpy array; has(name) -> bool. Raises CheckpointError naming a missing or
    misshapen tensor. A family with Qwen3-Next's layers and another checkpoint layout (Qwen3.5) passes
    the prefix of its text model's tensors and gdn_in_proj(cfg, t, "<layer>.linear_attn.") -> the rows of
    the qkvz and ba projections grouped per key head (`grouped_in_proj`'s layout)."""
    s = _shapes(cfg)
    Hd = s["Hd"]

    t = checked_getter(get, has, progress)

    def dev(a):
        return to_device(a, dtype)

    def lin(a):            # a weight the layers multiply through layers.linear (may stay FP8)
        return to_device_linear(a, dtype)

    params = {"embed": dev(t(prefix + "embed_tokens.weight", (cfg.vocab_size, Hd))),
              "final_norm": dev(t(prefix + "norm.weight", (Hd,))), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = dev(t("lm_head.weight", (cfg.vocab_size, Hd)).T)
    for i, kind in enumerate(cfg.layer_types):
        params["layers"].append(_convert_layer(cfg, t, has, f"{prefix}layers.{i}.", kind, cfg.is_moe_layer(i), dev,
                                               lin, gdn_in_proj))
    if has(MTP_PREFIX + "fc.weight"):
        params["mtp"] = _convert_mtp(cfg, t, has, dev, lin)
    return params


def _convert_mtp(cfg: ModelConfig, t, has, dev, lin) -> dict:
    """The MTP block (`mtp.*`, Qwen3-Next and Qwen3.5 alike): fc [Hd, 2Hd] over [embedding | hidden],
    pre_fc_norm_embedding / pre_fc_norm_hidden, full-attention decoder layers `mtp.layers.<i>.*` (MoE
    when a layer has a router, else a dense MLP), and its final norm. Params: fc [2Hd, Hd], enorm,
    hnorm, norm [Hd], layers [a layer's params, like the target's full-attention layers]."""
    Hd, p = cfg.hidden_size, MTP_PREFIX
    n = 0
    while has(f"{p}layers.{n}.input_layernorm.weight"):
        n += 1
    if n == 0:
        raise CheckpointError(f"checkpoint has {p}fc.weight but no MTP decoder layer ({p}layers.0.*)")
    return {"fc": lin(t(p + "fc.weight", (Hd, 2 * Hd)).T), "enorm": dev(t(p + "pre_fc_norm_embedding.weight", (Hd,))),
            "hnorm": dev(t(p + "pre_fc_norm_hidden.weight", (Hd,))), "norm": dev(t(p + "norm.weight", (Hd,))),
            "layers": [_convert_layer(cfg, t, has, f"{p}layers.{i}.", "full_attention",
                                      has(f"{p}layers.{i}.mlp.gate.weight"), dev, lin) for i in range(n)]}


def _convert_layer(cfg: ModelConfig, t, has, p: str, kind: str, moe: bool, dev, lin, gdn_in_proj=grouped_in_proj
                   ) -> dict:
    """One decoder layer's tensors under prefix p (`model.layers.3.`, `mtp.layers.0.`) -> its params."""
    Hd = cfg.hidden_size
    lp = {"input_norm": dev(t(p + "input_layernorm.weight", (Hd,))),
          "post_norm": dev(t(p + "post_attention_layernorm.weight", (Hd,)))}
    if kind == "linear_attention":
        lp["gdn"] = convert_gdn(cfg, t, p + "linear_attn.", dev, lin, gdn_in_proj)
    else:
        lp["attn"] = convert_gated_attention(cfg, t, p + "self_attn.", dev, lin)
    if moe:
        lp["moe"] = convert_moe(cfg, t, has, p + "mlp.", lin)
    else:
        gate_up, down = dense_mlp_weights(t, p + "mlp.", cfg.intermediate_size, Hd)
        lp["mlp"] = {"gate_up": lin(gate_up), "down": lin(down)}
    return lp


def convert_gdn(cfg: ModelConfig, t, a: str, dev, lin, gdn_in_proj=grouped_in_proj) -> dict:
    """A Gated DeltaNet mixer's tensors under `a` (`...linear_attn.`) -> its params (layers.gated_deltanet)."""
    s = _shapes(cfg)
    HV, V, Hd = s["HV"], s["V"], s["Hd"]
    conv = t(a + "conv1d.weight", (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim))
    qkvz, ba = gdn_in_proj(cfg, t, a)
    return {
        "qkvz": lin(qkvz.T), "ba": lin(ba.T), "conv": dev(conv[grouped_conv_channels(cfg), 0, :].T),
        "A_log": to_device(t(a + "A_log", (HV,)), jnp.float32),
        "dt_bias": to_device(t(a + "dt_bias", (HV,)), jnp.float32),
        "norm": dev(t(a + "norm.weight", (V,))),
        "out_proj": lin(t(a + "out_proj.weight", (Hd, HV * V)).T),
    }


def convert_gated_attention(cfg: ModelConfig, t, a: str, dev, lin) -> dict:
    """A gated attention's tensors under `a` (`...self_attn.`) -> its params (layers.attention)."""
    s = _shapes(cfg)
    Hq, Hkv, D, Hd = s["Hq"], s["Hkv"], s["D"], s["Hd"]
    # q_proj interleaves per head, [Hq, (query D | gate D)]: the layer reads it as stored; k and v
    # are interleaved per head alike, [Hkv, (k D | v D)]
    k = t(a + "k_proj.weight", (Hkv * D, Hd)).reshape(Hkv, 1, D, Hd)
    v = t(a + "v_proj.weight", (Hkv * D, Hd)).reshape(Hkv, 1, D, Hd)
    attn = {"qg": lin(t(a + "q_proj.weight", (2 * Hq * D, Hd)).T),
            "kv": lin(concat([k, v], axis=1).reshape(2 * Hkv * D, Hd).T),
            "q_norm": dev(t(a + "q_norm.weight", (D,))), "k_norm": dev(t(a + "k_norm.weight", (D,))),
            "o_proj": lin(t(a + "o_proj.weight", (Hd, Hq * D)).T)}
    if cfg.attention_bias:
        attn["qg_bias"] = dev(t(a + "q_proj.bias", (2 * Hq * D,)))
        attn["kv_bias"] = dev(np.stack([t(a + "k_proj.bias", (Hkv * D,)).reshape(Hkv, D),
                                        t(a + "v_proj.bias", (Hkv * D,)).reshape(Hkv, D)], axis=1).reshape(-1))
        attn["o_bias"] = dev(t(a + "o_proj.bias", (Hd,)))
    return attn


def convert_moe(cfg: ModelConfig, t, has, m: str, lin) -> dict:
    """A sparse MoE block's tensors under `m` (`...mlp.`) -> its params (layers.mlp.sparse_moe)."""
    E, I, Is, Hd = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.hidden_size
    router = t(m + "gate.weight", (E, Hd))
    sgate = t(m + "shared_expert_gate.weight", (1, Hd))
    sg = t(m + "shared_expert.gate_proj.weight", (Is, Hd))
    su = t(m + "shared_expert.up_proj.weight", (Is, Hd))
    gate_up, down = expert_weights(t, has, m, E, I, Hd)
    return {"in_proj": lin(concat([router, sgate, sg, su], axis=0).T),
            "shared_down": lin(t(m + "shared_expert.down_proj.weight", (Hd, Is)).T),
            "gate_up": lin(gate_up), "down": lin(down)}


# Logical axes of every parameter (hybrid_jax.parallel.rules), first match wins. The mixers' projections
# are grouped per head, so a device's columns are whole heads. The fused gate|up of the MLPs (and the
# router | shared gate | shared gate_up projection) are split contiguously by their columns: the SPMD
# partitioner moves their pieces' activations to where they meet.
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "*/gdn/qkvz": ("embed", "heads"),
    "*/gdn/ba": ("embed", "heads"),
    "*/gdn/conv": (None, "heads"),
    "*/gdn/A_log": ("heads",),
    "*/gdn/dt_bias": ("heads",),
    "*/gdn/norm": (None,),
    "*/gdn/out_proj": ("heads", "embed"),
    "*/attn/qg": ("embed", "heads"),
    "*/attn/qg_bias": ("heads",),
    "*/attn/kv": ("embed", "kv_heads"),
    "*/attn/kv_bias": ("kv_heads",),
    "*/attn/q_norm": (None,),
    "*/attn/k_norm": (None,),
    "*/attn/o_proj": ("heads", "embed"),
    "*/attn/o_bias": ("embed",),
    "*/mlp/gate_up": ("embed", "gate_up"),
    "*/mlp/down": ("mlp", "embed"),
    "*/moe/in_proj": ("embed", None),
    "*/moe/shared_down": ("mlp", "embed"),
    "*/moe/gate_up": ("experts", "embed", "expert_mlp"),
    "*/moe/down": ("experts", "expert_mlp", "embed"),
    "mtp/fc": (None, "embed"),
    "*norm": ("embed",),
}

