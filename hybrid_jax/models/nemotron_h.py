"""Nemotron-H (Mamba2 + GQA attention without positional encoding + relu2 MLP / MoE) as pure functions,
recombined from the project's pieces: the Mamba2 mixer (layers.mamba2, over a recurrent cache group
under the Mamba2 SSD ABI id), paged causal attention (layers.attention.paged_attend over the full-KV
group), DeepSeek's grouped Top-K router (models.deepseek_v32) over ungated relu2 experts
(layers.mlp.routed_experts).

Each layer is one block: x + mixer(rms_norm(x)), the mixer its type's (`LAYER_TYPES`); no layer has a
second (feed-forward) half. Parameters (`nemotron_h_params.py`):
  embed [V, Hd]; lm_head [Hd, V] (absent when tied); final_norm [Hd]
  layer: norm [Hd] and one of
    mamba (linear_attention): layers.mamba2.param_shapes
    attn (full_attention):    q [Hd, Hq*D], k, v [Hd, Hkv*D], o_proj [Hq*D, Hd]
    mlp:                      up [Hd, I], down [I, Hd]
    moe:                      router [Hd, E] f32, bias [E] f32, up [E, Hd', I'], down [E, I', Hd'] (I' =
                              moe_intermediate_size rounded up to 128: `nemotron_h_params.expert_columns`),
                              shared_up [Hd, Is], shared_down [Is, Hd], and with a latent size Hd'
                              latent_in [Hd, Hd'], latent_out [Hd', Hd]
Cache: "linear_attention" (conv window [L, B, W-1, C] + SSM state [L, B, H, P, N] f32, a
`cache.state.RecurrentGroup` written by abi.MAMBA2_SSD) and "full_attention" (paged KV, `KVGroup`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cache import ModelCache
from cache.mla import contiguous_page_table, write_paged_flat
from cache.state import DEFAULT_KV_PAGE_SIZE, KVGroup, recurrent_group
from hybrid_jax.layers.attention import paged_attend, pinned_pool, ragged_read
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.mamba2 import mamba2_mixer, mamba2_mixer_ragged
from hybrid_jax.layers.mla import rms_norm
from hybrid_jax.layers.mlp import relu2, routed_experts
from hybrid_jax.models.common import finish_ragged, finish_step, token_positions
from hybrid_jax.models.contract import LayerType, ModelFamily, StepOutput
from hybrid_jax.models.deepseek_v32 import grouped_topk_route
from hybrid_jax.models.nemotron_h_config import NemotronHConfig
from hybrid_jax.models.ragged import RaggedBatch
from hybrid_jax.models.nemotron_h_params import PARAM_AXES, convert_hf_weights, init_params, mamba_dims
from hybrid_jax.models.qwen3_next import DEFERRED_GROUPS, HybridStep, write_deferred_kv
from hybrid_jax.parallel.context import kv_replicas
from pallas_kernels import abi as kernel_abi


def new_cache(cfg: NemotronHConfig, batch_size: int, capacity: int, dtype, page_size: int = DEFAULT_KV_PAGE_SIZE
              ) -> ModelCache:
    """An empty cache: the Mamba2 layers' conv windows and SSM states ([H, headdim, dstate] f32 a row, transformers' layout),
    the attention layers' KV pages (contiguous per row, pages of min(page_size, capacity) tokens)."""
    groups = {}
    mamba, attn = cfg.layers_of("linear_attention"), cfg.layers_of("full_attention")
    if mamba:
        groups["linear_attention"] = recurrent_group(
            mamba, batch_size, cfg.conv_kernel, cfg.mamba_conv_dim,
            (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size), dtype, writer_abi=kernel_abi.MAMBA2_SSD.id)
    if attn:
        ps = min(page_size, capacity)
        table = contiguous_page_table(batch_size, capacity, ps)
        hkv = cfg.num_key_value_heads * kv_replicas(cfg.num_key_value_heads)
        shape = (len(attn), table.size, ps, hkv, cfg.head_dim)
        groups["full_attention"] = KVGroup(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), page_table=table,
                                           layer_ids=attn)
    return ModelCache(groups=groups, lengths=jnp.zeros((batch_size,), jnp.int32),
                      version=jnp.zeros((batch_size,), jnp.int32))


def _mamba(cfg: NemotronHConfig, lp: dict, h: jax.Array, step: HybridStep, i: int) -> jax.Array:
    """The Mamba2 mixer over the layer's slice of the recurrent group (an in-place view lends the pool to
    the token-by-token rule, as qwen3_next's linear attention)."""
    rec = step.rec
    s = rec.layer_ids.index(i)
    if step.ragged is not None:
        rb = step.ragged
        out, conv, ssm = mamba2_mixer_ragged(lp["mamba"], h[0], rb.seq, rb.valid, rb.cu_seqlens, *rec.layer_state(s),
                                             dims=mamba_dims(cfg), impl=step.impl)
        step.rec = rec.with_layer_state(s, conv, ssm)
        return out[None]
    pooled = rec.view_rows is not None
    if pooled:
        conv0, (ssm0, rows) = rec.conv[s], rec.ssm_pool(s)
    else:
        (conv0, ssm0), rows = rec.layer_state(s), None
    res = mamba2_mixer(lp["mamba"], h, step.valid, step.n_new, conv0, ssm0, dims=mamba_dims(cfg), impl=step.impl,
                       fused_recurrent=step.fused_recurrent, per_token_states=step.per_token_states, state_rows=rows)
    step.rec = rec.with_layer_state(s, res[1], res[2], pooled=pooled)
    if step.per_token_states:
        step.per_token.append(res[3])
    return res[0]


def _attention(cfg: NemotronHConfig, lp: dict, h: jax.Array, step: HybridStep, i: int) -> jax.Array:
    """GQA without positional encoding over the KV pages (written in place in the group's stacks, or
    collected with defer_kv_write)."""
    p, (B, T, _) = lp["attn"], h.shape
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = linear(h, p["q"]).reshape(B, T, Hq, D)
    k, v = linear(h, p["k"]).reshape(B, T, Hkv, D), linear(h, p["v"]).reshape(B, T, Hkv, D)
    r = kv_replicas(Hkv)
    if r > 1:     # the cache holds r copies of each KV head (parallel.kv_replicas)
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    kv = step.cache.groups["full_attention"]
    if step.ragged is not None:
        return _attention_ragged(cfg, p, q[0], k[0], v[0], step, kv.layer_ids.index(i))[None].astype(h.dtype)
    out, k2, v2 = paged_attend(q, k, v, step.positions, step.valid, step.k_all, step.v_all, kv.page_table,
                               layer=kv.layer_ids.index(i), defer_write=step.defer_kv_write, impl=step.impl)
    if step.defer_kv_write:
        step.k_new.append(k2)
        step.v_new.append(v2)
    else:
        step.k_all, step.v_all = k2, v2
    return linear(out.astype(h.dtype), p["o_proj"])


def _attention_ragged(cfg: NemotronHConfig, p: dict, q, k, v, step: HybridStep, layer: int) -> jax.Array:
    """A ragged batch's attention (q [N, Hq, D], k, v [N, Hkv, D]): the new entries written in place at
    their sequences' positions, then each sequence's pages read for its queries (`ragged_read`)."""
    rb, kv = step.ragged, step.cache.groups["full_attention"]
    step.k_all = pinned_pool(write_paged_flat(step.k_all, k, kv.page_table, rb.seq, rb.positions, rb.valid, layer))
    step.v_all = pinned_pool(write_paged_flat(step.v_all, v, kv.page_table, rb.seq, rb.positions, rb.valid, layer))
    o = ragged_read(q, step.k_all, step.v_all, step.cache.lengths + rb.n_new, kv.page_table, rb.cu_seqlens,
                    sm_scale=cfg.head_dim ** -0.5, impl=step.impl, layer=layer)
    return linear(o.reshape(q.shape[0], -1).astype(q.dtype), p["o_proj"])


def _mlp(cfg: NemotronHConfig, lp: dict, h: jax.Array, step: HybridStep, i: int) -> jax.Array:
    return linear(relu2(linear(h, lp["mlp"]["up"])), lp["mlp"]["down"])


def _moe(cfg: NemotronHConfig, lp: dict, h: jax.Array, step: HybridStep, i: int) -> jax.Array:
    """Routed relu2 experts (inside the latent projection when there is one) plus the shared relu2 MLP."""
    p, (B, T, Hd) = lp["moe"], h.shape
    x2 = h.reshape(B * T, Hd)
    idx, w = grouped_topk_route(cfg, p, x2)
    xe = linear(x2, p["latent_in"]) if "latent_in" in p else x2
    routed = routed_experts(xe, idx, w, p["up"], p["down"], activation=relu2)
    if "latent_out" in p:
        routed = linear(routed, p["latent_out"])
    shared = linear(relu2(linear(x2, p["shared_up"])), p["shared_down"])
    return (routed + shared).reshape(B, T, Hd)


# The family's layer types: the mixer each runs and the cache group it keeps its objects in.
LAYER_TYPES = {"linear_attention": LayerType(_mamba, ("linear_attention",)),
               "full_attention": LayerType(_attention, ("full_attention",)),
               "mlp": LayerType(_mlp, ()),
               "moe": LayerType(_moe, ())}


def forward(cfg: NemotronHConfig, params: dict, cache: ModelCache, tokens: jax.Array, n_new: jax.Array, *,
            logits_at: str = "last", impl: str = "auto", return_hidden: bool = False,
            fused_recurrent: bool = False, per_token_states: bool = False, defer_kv_write: bool = False,
            inputs_embeds: jax.Array | None = None, return_final_hidden: bool = False) -> StepOutput:
    """tokens [B, T] int32 (right-padded), n_new [B]. Same contract as qwen3_next.forward: fused_recurrent
    and per_token_states act on the Mamba2 layers (`states`: layers.mamba2's parts stacked over the L
    Mamba2 layers, which `RecurrentGroup.truncate` reads without an l2norm on B); defer_kv_write leaves
    the KV pages unwritten and returns the new entries in `deferred` for `write_deferred_kv`."""
    positions, valid = token_positions(cache, tokens.shape[1], n_new)
    x = params["embed"][tokens] if inputs_embeds is None else inputs_embeds
    step = HybridStep(cache, positions, valid, n_new, impl, fused_recurrent=fused_recurrent,
                 per_token_states=per_token_states, defer_kv_write=defer_kv_write)
    x, groups, hidden = _layers(cfg, params, x, step, return_hidden)
    out = finish_step(cfg, params, cache, groups, x, n_new, final_norm=final_norm, logits_at=logits_at,
                      hidden=hidden, final_hidden=x if return_final_hidden else None,
                      per_token=step.per_token if per_token_states else None)
    if defer_kv_write:
        out = out.replace(deferred={"k": jnp.stack(step.k_new), "v": jnp.stack(step.v_new)} if step.k_new else {})
    return out


def forward_ragged(cfg: NemotronHConfig, params: dict, cache: ModelCache, batch: RaggedBatch, *, impl: str = "auto",
                   return_final_hidden: bool = False) -> StepOutput:
    """One step over a ragged batch (hybrid_jax.models.ragged), as qwen3_next.forward_ragged: the Mamba2
    layers on the packed chunked rule (`mamba2_mixer_ragged`), attention on ragged paged attention.
    Returns logits [S, V] at each sequence's last token; return_final_hidden: `final_hidden` [N, Hd]."""
    x = params["embed"][batch.tokens][None]                                  # [1, N, Hd]
    step = HybridStep(cache, batch.positions, batch.valid, batch.n_new, impl, ragged=batch)
    x, groups, _ = _layers(cfg, params, x, step, False)
    return finish_ragged(cfg, params, cache, groups, x, batch, final_norm=final_norm,
                         return_final_hidden=return_final_hidden)


def _layers(cfg: NemotronHConfig, params: dict, x: jax.Array, step: HybridStep, return_hidden: bool):
    """Every block over x [B, T, Hd] (a ragged batch: [1, N, Hd]): x + mixer(rms_norm(x)). Returns (the
    residual stream after the last block, the cache's updated groups, the hidden states with return_hidden)."""
    cache = step.cache
    kv = cache.groups.get("full_attention")
    if kv is not None:
        step.k_all, step.v_all = kv.k, kv.v
    step.rec = cache.groups.get("linear_attention")
    hidden = [x] if return_hidden else None
    for i, lp in enumerate(params["layers"]):
        x = x + LAYER_TYPES[cfg.layer_types[i]].mixer(cfg, lp, rms_norm(x, lp["norm"], cfg.rms_norm_eps), step, i)
        if return_hidden:
            hidden.append(x)
    groups = dict(cache.groups)
    if step.rec is not None:
        groups["linear_attention"] = step.rec
    if kv is not None:
        groups["full_attention"] = kv.replace(k=step.k_all, v=step.v_all)
    return x, groups, hidden


def final_norm(cfg: NemotronHConfig, params: dict, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


FAMILY = ModelFamily(
    name="nemotron_h", forward=forward, forward_ragged=forward_ragged, new_cache=new_cache, init_params=init_params,
    convert_hf_weights=convert_hf_weights, final_norm=final_norm, layer_types=LAYER_TYPES,
    write_deferred_kv=write_deferred_kv, deferred_groups=DEFERRED_GROUPS, param_axes=PARAM_AXES)
