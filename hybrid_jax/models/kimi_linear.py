"""Kimi-Linear (Kimi Delta Attention + MLA without positional encoding, DeepSeek MoE) as pure functions,
recombined from the project's pieces: the KDA mixer (layers.kimi_delta_attention, Gated DeltaNet's conv
and kernels with a per-channel decay), MLA over DeepSeek's latent pools (layers.mla.nope_attention), and
DeepSeek-V3.2's feed-forward and its conversion (models.deepseek_v32). `forward_ragged` steps a flat batch
(models.ragged): KDA as Gated DeltaNet's ragged rule, MLA on DeepSeek's ragged tiles.

Parameters (converted once at load by `convert_hf_weights`):
  embed [V, Hd]; lm_head [Hd, V] (absent when tied); final_norm [Hd]
  layer: input_norm, post_norm [Hd]
    linear_attention (kda): qkv [Hd, H*3D] (q_h | k_h | v_h per head), conv [W, H*3D] (grouped alike),
          f_a [Hd, D], f_b [D, H*D], dt_bias [H*D] f32, A_log [H] f32, b [Hd, H], g_a [Hd, D], g_b [D, H*D],
          norm [D], o_proj [H*D, Hd]
    full_attention (attn): q [Hd, Hq*(nope+Dr)], kv_a [Hd, R+Dr], kv_a_norm [R], w_uk [Hq, nope, R],
          w_uv [Hq, v, R] (kv_b split for the absorbed form), o_proj [Hq*v, Hd]
    feed-forward: deepseek_v32's (mlp, or moe with router, bias, experts and shared experts)
Cache: groups "linear_attention" (conv window + KDA state, `cache.state.RecurrentGroup` under KDA's ABI
id) and "full_attention" (the paged MLA latent and shared key, `cache.mla.MLALatentGroup`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cache import ModelCache
from cache.mla import init_latent_group
from cache.state import RecurrentGroup, recurrent_group
from hybrid_jax.layers.kimi_delta_attention import kimi_delta_attention, kimi_delta_attention_ragged
from hybrid_jax.layers.mla import nope_attention, rms_norm
from hybrid_jax.models.common import LayerStep, finish_ragged, finish_step, token_positions
from hybrid_jax.models.contract import LayerType, ModelFamily, StepOutput
from hybrid_jax.models.deepseek_v32 import FFN_AXES, convert_ffn, ffn, init_ffn
from hybrid_jax.models.kimi_linear_config import KimiLinearConfig
from hybrid_jax.models.ragged import RaggedBatch
from hybrid_jax.models.qwen3_next_params import per_head_channels
from hybrid_jax.weights import checked_getter, concat, to_device, to_device_linear
from pallas_kernels import abi as kernel_abi


def new_cache(cfg: KimiLinearConfig, batch_size: int, capacity: int, dtype, page_size: int | None = None
              ) -> ModelCache:
    """An empty cache: the KDA layers' conv windows and states, the MLA layers' latent pages (in pages of
    the config's latent_page_size; page_size, the full-KV page size of other families, sizes nothing here)."""
    groups = {}
    kda, mla = cfg.layers_of("linear_attention"), cfg.layers_of("full_attention")
    H, D = cfg.linear_num_heads, cfg.linear_head_dim
    if kda:
        groups["linear_attention"] = recurrent_group(kda, batch_size, cfg.linear_conv_kernel_dim, cfg.linear_conv_dim,
                                                     (H, D, D), dtype, writer_abi=kernel_abi.KIMI_DELTA_ATTENTION.id)
    if mla:
        groups["full_attention"] = init_latent_group(batch_size=batch_size, capacity=capacity, layer_ids=mla,
                                                     kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
                                                     dtype=dtype, page_size=cfg.latent_page_size)
    return ModelCache(groups=groups, lengths=jnp.zeros((batch_size,), jnp.int32),
                      version=jnp.zeros((batch_size,), jnp.int32))


@dataclasses.dataclass
class _Step(LayerStep):
    """The working state of one forward of this family (see LayerStep); the latent pools are written in
    place in their [L, ...] stacks."""
    fused_recurrent: bool = False
    per_token_states: bool = False
    latent: jax.Array | None = None
    rope: jax.Array | None = None
    rec: RecurrentGroup | None = None  # the KDA group, its layers' states written in place one by one
    per_token: list = dataclasses.field(default_factory=list)
    ragged: RaggedBatch | None = None  # forward_ragged: the flat batch (positions, valid [1, N] then)


def _kda(cfg: KimiLinearConfig, lp: dict, h: jax.Array, step: _Step, i: int) -> jax.Array:
    rec = step.rec
    s = rec.layer_ids.index(i)
    heads = dict(num_heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim, eps=cfg.rms_norm_eps, impl=step.impl)
    if step.ragged is not None:
        rb = step.ragged
        out, conv, ssm = kimi_delta_attention_ragged(lp["kda"], h[0], rb.seq, rb.valid, rb.cu_seqlens,
                                                     *rec.layer_state(s), **heads)
        step.rec = rec.with_layer_state(s, conv, ssm)
        return out[None]
    res = kimi_delta_attention(lp["kda"], h, step.valid, step.n_new, *rec.layer_state(s),
                               fused_recurrent=step.fused_recurrent, per_token_states=step.per_token_states, **heads)
    step.rec = rec.with_layer_state(s, res[1], res[2])
    if step.per_token_states:
        step.per_token.append(res[3])
    return res[0]


def _mla(cfg: KimiLinearConfig, lp: dict, h: jax.Array, step: _Step, i: int) -> jax.Array:
    lg = step.cache.groups["full_attention"]
    h, step.latent, step.rope = nope_attention(
        lp["attn"], h, step.positions, step.valid, step.cache.lengths, step.n_new, step.latent, step.rope,
        lg.page_table, num_heads=cfg.num_attention_heads, nope=cfg.qk_nope_head_dim, rope_dim=cfg.qk_rope_head_dim,
        v_dim=cfg.v_head_dim, kv_lora_rank=cfg.kv_lora_rank, scale=cfg.softmax_scale,
        layer=lg.layer_ids.index(i), ragged=step.ragged)
    return h


LAYER_TYPES = {"linear_attention": LayerType(_kda, ("linear_attention",)),
               "full_attention": LayerType(_mla, ("full_attention",))}


def forward(cfg: KimiLinearConfig, params: dict, cache: ModelCache, tokens: jax.Array, n_new: jax.Array, *,
            logits_at: str = "last", impl: str = "auto", return_hidden: bool = False,
            fused_recurrent: bool = False, per_token_states: bool = False, defer_kv_write: bool = False,
            inputs_embeds: jax.Array | None = None, return_final_hidden: bool = False) -> StepOutput:
    """tokens [B, T] int32 (right-padded), n_new [B]. Same contract as qwen3_next.forward: fused_recurrent
    and per_token_states act on the KDA layers (`states` as gated_deltanet's, g [L, B, T, H, D] per
    channel); the family cannot defer its per-position writes (defer_kv_write=True is a ValueError)."""
    if defer_kv_write:
        raise ValueError(f"{cfg.model_type} cannot defer its per-position cache writes (defer_kv_write)")
    B, T = tokens.shape
    positions, valid = token_positions(cache, T, n_new)
    x = params["embed"][tokens] if inputs_embeds is None else inputs_embeds
    step = _Step(cache, positions, valid, n_new, impl, fused_recurrent=fused_recurrent or per_token_states,
                 per_token_states=per_token_states)
    x, groups, hidden = _layers(cfg, params, x, step, return_hidden)
    return finish_step(cfg, params, cache, groups, x, n_new, final_norm=final_norm, logits_at=logits_at,
                       hidden=hidden, final_hidden=x if return_final_hidden else None,
                       per_token=step.per_token if per_token_states else None)


def forward_ragged(cfg: KimiLinearConfig, params: dict, cache: ModelCache, batch: RaggedBatch, *, impl: str = "auto",
                   return_final_hidden: bool = False) -> StepOutput:
    """One step over a ragged batch (hybrid_jax.models.ragged), as qwen3_next.forward_ragged: logits [S, V]
    at each sequence's last token. The KDA layers run the packed chunked rule after the ragged causal conv
    (as Gated DeltaNet's); the MLA layers write their latent entries token-major and read each sequence's
    pages on the batch's tiles (`layers.mla.nope_attention` with ragged)."""
    x = params["embed"][batch.tokens][None]                                  # [1, N, Hd]
    step = _Step(cache, batch.positions[None], batch.valid[None], batch.n_new, impl, ragged=batch)
    x, groups, _ = _layers(cfg, params, x, step, False)
    return finish_ragged(cfg, params, cache, groups, x, batch, final_norm=final_norm,
                         return_final_hidden=return_final_hidden)


def _layers(cfg: KimiLinearConfig, params: dict, x: jax.Array, step: _Step, return_hidden: bool):
    """Every layer over x [B, T, Hd] (a ragged batch: [1, N, Hd]). Returns (the residual stream after the
    last layer, the cache's updated groups, the hidden states with return_hidden)."""
    cache = step.cache
    lg = cache.groups.get("full_attention")
    if lg is not None:
        step.latent, step.rope = lg.latent, lg.rope
    step.rec = cache.groups.get("linear_attention")
    hidden = [x] if return_hidden else None
    for i, lp in enumerate(params["layers"]):
        x = x + LAYER_TYPES[cfg.layer_types[i]].mixer(cfg, lp, rms_norm(x, lp["input_norm"], cfg.rms_norm_eps), step, i)
        x = x + ffn(cfg, lp, rms_norm(x, lp["post_norm"], cfg.rms_norm_eps))
        if return_hidden:
            hidden.append(x)
    groups = dict(cache.groups)
    if step.rec is not None:
        groups["linear_attention"] = step.rec
    if lg is not None:
        groups["full_attention"] = lg.replace(latent=step.latent, rope=step.rope)
    return x, groups, hidden


def final_norm(cfg: KimiLinearConfig, params: dict, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


# ------------------------------------------------------------------------------------------------
# Parameters: deterministic init and the one-time HF re-layout.

def init_params(cfg: KimiLinearConfig, seed: int = 0, dtype=jnp.float32, rng=None) -> dict:
    """Deterministic random parameters in the converted layout (std 0.02; norms at 1; decay parameters
    as Kimi initialises them). rng: as deepseek_v32.init_params."""
    rng = np.random.default_rng(seed) if rng is None else rng

    def n(*shape, std=0.02, dt=dtype):
        return jnp.asarray(rng.normal(0.0, std, shape), dt)

    Hd, H, D = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    Hq, R, Dr, nope, v = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    params = {"embed": n(cfg.vocab_size, Hd), "final_norm": jnp.ones((Hd,), dtype), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = n(Hd, cfg.vocab_size)
    for i, kind in enumerate(cfg.layer_types):
        lp = {"input_norm": jnp.ones((Hd,), dtype), "post_norm": jnp.ones((Hd,), dtype)}
        if kind == "linear_attention":
            lp["kda"] = {"qkv": n(Hd, 3 * H * D), "conv": n(cfg.linear_conv_kernel_dim, 3 * H * D, std=0.3),
                         "f_a": n(Hd, D), "f_b": n(D, H * D), "dt_bias": n(H * D, std=1.0, dt=jnp.float32),
                         "A_log": jnp.asarray(np.log(rng.uniform(1.0, 16.0, H)), jnp.float32),
                         "b": n(Hd, H), "g_a": n(Hd, D), "g_b": n(D, H * D), "norm": jnp.ones((D,), dtype),
                         "o_proj": n(H * D, Hd)}
        else:
            lp["attn"] = {"q": n(Hd, Hq * (nope + Dr)), "kv_a": n(Hd, R + Dr), "kv_a_norm": jnp.ones((R,), dtype),
                          "w_uk": n(Hq, nope, R), "w_uv": n(Hq, v, R), "o_proj": n(Hq * v, Hd)}
        lp.update(init_ffn(cfg, i, n))
        params["layers"].append(lp)
    return params


def convert_hf_weights(cfg: KimiLinearConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                       dtype, progress: Callable[[], None] = lambda: None) -> dict:
    """Re-lays a Kimi-Linear checkpoint (the release's names, as transformers saves them too: q_conv1d /
    k_conv1d / v_conv1d, f_a_proj, block_sparse_moe with experts w1 / w3 / w2) into the layout above.
    Raises CheckpointError naming a missing or misshapen tensor."""
    Hd = cfg.hidden_size
    t = checked_getter(get, has, progress)

    def dev(a, dt=None):
        return to_device(a, dt or dtype)

    def lin(a):
        return to_device_linear(a, dtype)

    params = {"embed": dev(t("model.embed_tokens.weight", (cfg.vocab_size, Hd))),
              "final_norm": dev(t("model.norm.weight", (Hd,))), "layers": []}
    # transformers' Kimi-Linear never ties its head (tie_word_embeddings is not read): a stored head is the
    # head; only a checkpoint without one that asks for tying reads the embedding
    if has("lm_head.weight") or not cfg.tie_word_embeddings:
        params["lm_head"] = dev(t("lm_head.weight", (cfg.vocab_size, Hd)).T)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        lp = {"input_norm": dev(t(p + "input_layernorm.weight", (Hd,))),
              "post_norm": dev(t(p + "post_attention_layernorm.weight", (Hd,)))}
        lp.update(_convert_kda(cfg, t, p + "self_attn.", dev, lin) if kind == "linear_attention"
                  else _convert_mla(cfg, t, p + "self_attn.", dev, lin))
        lp.update(convert_ffn(cfg, t, has, p + "block_sparse_moe.", cfg.is_moe_layer(i), dev, lin,
                              expert_names=("w1", "w3", "w2")))
        params["layers"].append(lp)
    return params


def _convert_kda(cfg: KimiLinearConfig, t, a: str, dev, lin) -> dict:
    Hd, H, D, W = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    HD = H * D
    order = per_head_channels(H, D, D)            # q | k | v -> q_h | k_h | v_h, as Qwen3-Next's conv channels
    qkv = concat([t(a + f"{x}_proj.weight", (HD, Hd)) for x in "qkv"], 0)                # [3HD, Hd] q | k | v
    conv = concat([t(a + f"{x}_conv1d.weight", (HD, 1, W)) for x in "qkv"], 0)           # [3HD, 1, W]
    return {"kda": {
        "qkv": lin(np.asarray(qkv)[order].T), "conv": dev(np.asarray(conv)[order, 0, :].T),
        "f_a": lin(t(a + "f_a_proj.weight", (D, Hd)).T), "f_b": lin(t(a + "f_b_proj.weight", (HD, D)).T),
        "dt_bias": dev(t(a + "dt_bias", (HD,)), jnp.float32),
        "A_log": dev(np.asarray(t(a + "A_log", (1, 1, H, 1))).reshape(H), jnp.float32),
        "b": lin(t(a + "b_proj.weight", (H, Hd)).T),
        "g_a": lin(t(a + "g_a_proj.weight", (D, Hd)).T), "g_b": lin(t(a + "g_b_proj.weight", (HD, D)).T),
        "norm": dev(t(a + "o_norm.weight", (D,))), "o_proj": lin(t(a + "o_proj.weight", (Hd, HD)).T)}}


def _convert_mla(cfg: KimiLinearConfig, t, a: str, dev, lin) -> dict:
    Hd, H, R, Dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    kvb = t(a + "kv_b_proj.weight", (H * (nope + v), R)).reshape(H, nope + v, R)
    return {"attn": {"q": lin(t(a + "q_proj.weight", (H * (nope + Dr), Hd)).T),
                     "kv_a": lin(t(a + "kv_a_proj_with_mqa.weight", (R + Dr, Hd)).T),
                     "kv_a_norm": dev(t(a + "kv_a_layernorm.weight", (R,))),
                     "w_uk": lin(kvb[:, :nope]), "w_uv": lin(kvb[:, nope:]),
                     "o_proj": lin(t(a + "o_proj.weight", (Hd, H * v)).T)}}


# Logical axes of every parameter (hybrid_jax.parallel.rules), first match wins. KDA splits by heads (its
# projections grouped per head; the low-rank gate inputs f_a / g_a are shared and stay whole); MLA by heads
# as DeepSeek's, the latent projection whole; the feed-forward as deepseek_v32's.
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "*/kda/qkv": ("embed", "heads"),
    "*/kda/conv": (None, "heads"),
    "*/kda/f_a": ("embed", None),
    "*/kda/f_b": (None, "heads"),
    "*/kda/dt_bias": ("heads",),
    "*/kda/A_log": ("heads",),
    "*/kda/b": ("embed", "heads"),
    "*/kda/g_a": ("embed", None),
    "*/kda/g_b": (None, "heads"),
    "*/kda/o_proj": ("heads", "embed"),
    "*/attn/q": ("embed", "heads"),
    "*/attn/kv_a": ("embed", None),
    "*/attn/w_uk": ("heads", None, None),
    "*/attn/w_uv": ("heads", None, None),
    "*/attn/o_proj": ("heads", "embed"),
    **FFN_AXES,
    "*norm": (None,),
}

FAMILY = ModelFamily(
    name="kimi_linear", forward=forward, forward_ragged=forward_ragged, new_cache=new_cache, init_params=init_params,
    convert_hf_weights=convert_hf_weights, final_norm=final_norm, layer_types=LAYER_TYPES, param_axes=PARAM_AXES)
