"""Qwen3-Next (hybrid Gated DeltaNet + gated full attention, MoE) as pure functions.

`forward(params, cache, tokens, n_new)` runs T new tokens per row through every layer and returns
logits and the updated cache; prefill, chunked prefill and decode are the same function at
different T. Parameters use the layout below, produced once at load by `convert_hf_weights`
(`qwen3_next_params.py`):

  embed [V, Hd]; lm_head [Hd, V] (absent when tied); final_norm [Hd]
  layer: input_norm, post_norm [Hd]
    linear_attention: qkvz [Hd, H*(2K + 2rV)], ba [Hd, H*2r] (grouped per key head, r = HV / H), conv
                      [W, H*(2K + rV)] (q|k|v channels, grouped alike), A_log, dt_bias [HV], norm [V],
                      out_proj [HV*V, Hd]
    full_attention:   qg [Hd, Hq*2D] (query|gate per head), kv [Hd, Hkv*2D] (k|v per head), q_norm,
                      k_norm [D], o_proj [Hq*D, Hd]
    dense MLP:        mlp.gate_up [Hd, 2I], mlp.down [I, Hd]
    MoE:              moe.in_proj [Hd, E+1+2Is], moe.shared_down [Is, Hd], moe.gate_up [E, Hd, 2I],
                      moe.down [E, I, Hd]
  mtp (when the checkpoint has `mtp.*`): fc [2Hd, Hd], enorm, hnorm, norm [Hd], layers [full-attention
                      layers as above]; drafts for speculative decoding (`mtp_step`)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cache import ModelCache, init_cache
from cache.state import DEFAULT_KV_PAGE_SIZE, RecurrentGroup
from hybrid_jax.models.qwen3_next_config import ModelConfig
from hybrid_jax.layers.attention import gated_attention, gated_attention_ragged, write_kv
from hybrid_jax.layers.gated_deltanet import gated_deltanet, gated_deltanet_ragged
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.mlp import sparse_moe, swiglu
from hybrid_jax.layers.norms import rms_norm_zero_centered
from hybrid_jax.layers.rope import rope_cos_sin
from hybrid_jax.models.common import LayerStep, finish_ragged, finish_step, token_positions
from hybrid_jax.models.contract import LayerType, MTPHead, ModelFamily, StepOutput
from hybrid_jax.models.ragged import RaggedBatch
from hybrid_jax.parallel.context import kv_replicas
from hybrid_jax.models.qwen3_next_params import MTP_PREFIX, PARAM_AXES, convert_hf_weights, init_params


def new_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype, page_size: int = DEFAULT_KV_PAGE_SIZE
              ) -> ModelCache:
    """An empty cache for this model: one group per layer type; full KV in pages of `page_size` tokens
    (with r copies of each KV head under a layout that keeps them, `parallel.kv_replicas`)."""
    return init_cache(
        batch_size=batch_size, capacity=capacity, layer_types=cfg.layer_types, dtype=dtype,
        conv_dim=cfg.linear_conv_dim, conv_width=cfg.linear_conv_kernel_dim,
        linear_heads=(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        kv_heads=cfg.num_key_value_heads * kv_replicas(cfg.num_key_value_heads), head_dim=cfg.head_dim,
        page_size=page_size)


def _ffn(cfg: ModelConfig, lp: dict, x: jax.Array) -> jax.Array:
    if "moe" in lp:
        return sparse_moe(lp["moe"], x, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                          norm_topk_prob=cfg.norm_topk_prob)
    return swiglu(x, lp["mlp"]["gate_up"], lp["mlp"]["down"])


@dataclasses.dataclass
class HybridStep(LayerStep):
    """The working state of one forward over recurrent and paged-KV layers (see LayerStep): this family's,
    and Nemotron-H's (no RoPE: cos / sin stay None)."""
    cos: jax.Array | None = None
    sin: jax.Array | None = None
    fused_recurrent: bool = False
    per_token_states: bool = False
    defer_kv_write: bool = False
    ragged: RaggedBatch | None = None  # forward_ragged: the flat batch (positions, valid: [N] then)
    k_all: jax.Array | None = None     # the KV page stacks, written in place layer after layer
    v_all: jax.Array | None = None
    rec: RecurrentGroup | None = None  # the recurrent group, its layers' states written in place one by one
    per_token: list = dataclasses.field(default_factory=list)
    k_new: list = dataclasses.field(default_factory=list)
    v_new: list = dataclasses.field(default_factory=list)


def _linear_attention(cfg: ModelConfig, lp: dict, h: jax.Array, step: HybridStep, i: int) -> jax.Array:
    """Gated DeltaNet over the layer's slice of the recurrent group; the new conv / recurrent state
    are written into that slice in place."""
    rec = step.rec
    s = rec.layer_ids.index(i)
    # an in-place view (a decode step) lends the layer the pool: its token-by-token rule moves each row's
    # state once
    pooled = rec.view_rows is not None and step.ragged is None
    if pooled:
        conv0, (ssm0, rows) = rec.conv[s], rec.ssm_pool(s)
    else:
        conv0, ssm0 = rec.layer_state(s)
        rows = None
    heads = dict(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                 head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim, eps=cfg.rms_norm_eps,
                 gate_act=jax.nn.sigmoid if cfg.output_gate == "sigmoid" else jax.nn.silu)
    if step.ragged is not None:
        rb = step.ragged
        h, conv, ssm = gated_deltanet_ragged(lp["gdn"], h, rb.seq, rb.valid, rb.cu_seqlens, conv0, ssm0,
                                             impl=step.impl, **heads)
        step.rec = rec.with_layer_state(s, conv, ssm)
        return h
    res = gated_deltanet(
        lp["gdn"], h, step.valid, step.n_new, conv0, ssm0, impl=step.impl,
        fused_recurrent=step.fused_recurrent, per_token_states=step.per_token_states, state_rows=rows, **heads)
    step.rec = rec.with_layer_state(s, res[1], res[2], pooled=pooled)
    if step.per_token_states:
        step.per_token.append(res[3])
    return res[0]


def _full_attention(cfg: ModelConfig, lp: dict, h: jax.Array, step: HybridStep, i: int) -> jax.Array:
    """Gated attention over the KV pages. KV is written in place in the group's [L, P, ps, Hkv, D]
    stacks (slicing a layer out and stacking the layers back copies every page at every step), or,
    with defer_kv_write, only read and the new entries collected."""
    kv = step.cache.groups["full_attention"]
    heads = dict(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                 eps=cfg.rms_norm_eps, layer=kv.layer_ids.index(i))
    if step.ragged is not None:
        rb = step.ragged
        h, step.k_all, step.v_all = gated_attention_ragged(
            lp["attn"], h, step.cos, step.sin, rb.seq, rb.positions, rb.valid, rb.cu_seqlens,
            step.cache.lengths + rb.n_new, step.k_all, step.v_all, kv.page_table, impl=step.impl, **heads)
        return h
    h, k, v = gated_attention(
        lp["attn"], h, step.cos, step.sin, step.positions, step.valid, step.k_all, step.v_all, kv.page_table,
        defer_write=step.defer_kv_write, impl=step.impl, **heads)
    if step.defer_kv_write:
        step.k_new.append(k)
        step.v_new.append(v)
    else:
        step.k_all, step.v_all = k, v
    return h


# The family's layer types: the mixer each runs and the cache group it keeps its objects in.
LAYER_TYPES = {"linear_attention": LayerType(_linear_attention, ("linear_attention",)),
               "full_attention": LayerType(_full_attention, ("full_attention",))}


def forward(cfg: ModelConfig, params: dict, cache: ModelCache, tokens: jax.Array, n_new: jax.Array, *,
            logits_at: str = "last", impl: str = "auto", return_hidden: bool = False,
            fused_recurrent: bool = False, per_token_states: bool = False, defer_kv_write: bool = False,
            inputs_embeds: jax.Array | None = None, return_final_hidden: bool = False) -> StepOutput:
    """Runs tokens through the model; each layer's token mixer is its type's (`LAYER_TYPES`).

    tokens: [B, T] int32 (row b's first n_new[b] entries are real, the rest padding); n_new: [B] int32.
    logits_at: "last" -> logits [B, V] at each row's last real token; "all" -> [B, T, V].
    Returns a StepOutput: logits and the new cache; with return_hidden, `hidden` is the residual
    stream after each layer ([L + 1] arrays [B, T, Hd], the embeddings first).
    Speculative decoding: fused_recurrent runs the linear-attention layers token by token whatever T;
    per_token_states (implies it) fills `states` with what the recurrent group's state after every
    position is made from (`gated_deltanet`'s, stacked over the L recurrent layers: conv_window
    [L, B, W-1+T, C], ssm0 [L, B, HV, K, V], k [L, B, T, H, K], g [L, B, T, HV], delta
    [L, B, T, HV, V]; `RecurrentGroup.truncate` reads it).
    defer_kv_write: the KV group is only read; `deferred` holds the new entries {"k", "v":
    [L, B, T, Hkv, D]} for `write_deferred_kv`, and the returned cache holds the input's KV arrays
    (its lengths and recurrent states are the step's).
    inputs_embeds [B, T, Hd]: the first layer's input instead of the tokens' embeddings (the MTP block).
    return_final_hidden: `final_hidden` is the residual stream after the last layer [B, T, Hd].
    """
    B, T = tokens.shape
    positions, valid = token_positions(cache, T, n_new)                  # [B, T] each
    x = params["embed"][tokens] if inputs_embeds is None else inputs_embeds
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope, seq_len=cache.lengths + n_new)
    step = HybridStep(cache, positions, valid, n_new, impl, cos=cos, sin=sin, fused_recurrent=fused_recurrent,
                 per_token_states=per_token_states, defer_kv_write=defer_kv_write)
    x, groups, hidden = _layers(cfg, params, x, step, return_hidden)
    out = finish_step(cfg, params, cache, groups, x, n_new, final_norm=final_norm, logits_at=logits_at,
                      hidden=hidden, final_hidden=x if return_final_hidden else None,
                      per_token=step.per_token if per_token_states else None)
    if defer_kv_write:
        out = out.replace(deferred={"k": jnp.stack(step.k_new), "v": jnp.stack(step.v_new)} if step.k_new else {})
    return out


def forward_ragged(cfg: ModelConfig, params: dict, cache: ModelCache, batch: RaggedBatch, *, impl: str = "auto",
                   return_final_hidden: bool = False) -> StepOutput:
    """One step over a ragged batch (hybrid_jax.models.ragged): sequence s's tokens batch.tokens
    [cu_seqlens[s], cu_seqlens[s + 1]) continue cache row s. Returns a StepOutput with logits [S, V]
    at each sequence's last token and the cache (lengths += n_new); the math is `forward`'s, with the
    linear-attention layers on the packed chunked rule and full attention on ragged paged attention;
    return_final_hidden: `final_hidden` [N, Hd] at every token."""
    x = params["embed"][batch.tokens][None]                                  # [1, N, Hd]
    seq_len = (cache.lengths + batch.n_new)[batch.seq]
    cos, sin = rope_cos_sin(batch.positions[:, None], cfg.rotary_dim, cfg.rope, seq_len=seq_len)
    step = HybridStep(cache, batch.positions, batch.valid, batch.n_new, impl, cos=cos[:, 0], sin=sin[:, 0], ragged=batch)
    x, groups, _ = _layers(cfg, params, x, step, False)
    return finish_ragged(cfg, params, cache, groups, x, batch, final_norm=final_norm,
                         return_final_hidden=return_final_hidden)


def _layers(cfg: ModelConfig, params: dict, x: jax.Array, step: HybridStep, return_hidden: bool):
    """Every layer over x [B, T, Hd] (a ragged batch: [1, N, Hd]), each token mixer its type's.
    Returns (the residual stream after the last layer, the cache's updated groups, the hidden states
    with return_hidden)."""
    cache = step.cache
    kv = cache.groups.get("full_attention")
    if kv is not None:
        step.k_all, step.v_all = kv.k, kv.v
    step.rec = cache.groups.get("linear_attention")
    hidden = [x] if return_hidden else None
    ragged = step.ragged is not None
    for i, lp in enumerate(params["layers"]):
        h = rms_norm_zero_centered(x, lp["input_norm"], cfg.rms_norm_eps)
        h = LAYER_TYPES[cfg.layer_types[i]].mixer(cfg, lp, h[0] if ragged else h, step, i)
        x = x + (h[None] if ragged else h)
        x = x + _ffn(cfg, lp, rms_norm_zero_centered(x, lp["post_norm"], cfg.rms_norm_eps))
        if return_hidden:
            hidden.append(x)
    groups = dict(cache.groups)
    if step.rec is not None:
        groups["linear_attention"] = step.rec
    if kv is not None:
        groups["full_attention"] = kv.replace(k=step.k_all, v=step.v_all)
    return x, groups, hidden


# The cache groups a forward with defer_kv_write leaves unwritten (`write_deferred_kv` writes them).
DEFERRED_GROUPS = ("full_attention",)


def write_deferred_kv(cache: ModelCache, pending: dict, positions: jax.Array, valid: jax.Array) -> ModelCache:
    """Writes a forward's `deferred` (with defer_kv_write): pending {"k", "v": [L, B, T, Hkv, D]}
    (or {} for a model without attention layers) at positions [B, T] where valid [B, T], every
    layer in one in-place write per array."""
    if not pending:
        return cache
    (group,) = DEFERRED_GROUPS
    kv = cache.groups[group]
    kv = kv.replace(k=write_kv(kv.k, pending["k"], kv.page_table, positions, valid, slice(None)),
                    v=write_kv(kv.v, pending["v"], kv.page_table, positions, valid, slice(None)))
    return cache.replace(groups={**cache.groups, group: kv})


def final_norm(cfg: ModelConfig, params: dict, x: jax.Array) -> jax.Array:
    return rms_norm_zero_centered(x, params["final_norm"], cfg.rms_norm_eps)


# ------------------------------------------------------------------------------------------------
# The multi-token-prediction block (`params["mtp"]`, loaded from `mtp.*`), run by
# hybrid_jax.speculative.mtp as a drafter: at position i it reads the token at i + 1 and a hidden
# state of position i, and predicts the token at i + 2.

def mtp_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """Where the checkpoint keeps the MTP block: every tensor there must be read by the loader."""
    return (MTP_PREFIX,)


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP block's decoder layer as a one-layer model of the family (its cache is that model's)."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=("full_attention",), mlp_only_layers=())


def mtp_new_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype) -> ModelCache:
    return new_cache(mtp_config(cfg), batch_size, capacity, dtype)


def target_hidden(cfg: ModelConfig, params: dict, hidden: list) -> jax.Array:
    """The hidden state the MTP block reads from the target: the last layer's output after the final
    norm, [B, T, Hd], from forward(..., return_hidden=True)'s list."""
    return final_norm(cfg, params, hidden[-1])


def mtp_step(cfg: ModelConfig, params: dict, cache: ModelCache, tokens: jax.Array, hidden: jax.Array,
             n_new: jax.Array, *, impl: str = "auto"):
    """One pass of the MTP block over tokens [B, T] (the token after each position) and hidden [B, T, Hd]
    (the target's `target_hidden` at each position, or the block's own output for a further draft):
    fc([pre_fc_norm_embedding(embed(tokens)) | pre_fc_norm_hidden(hidden)]) -> the block's full-attention
    layer (over its own KV cache) -> its norm. Returns (hidden out [B, T, Hd], the block's next input
    and what `mtp_logits` reads; cache)."""
    mp = params["mtp"]
    eps = cfg.rms_norm_eps
    e = rms_norm_zero_centered(params["embed"][tokens], mp["enorm"], eps)
    h = rms_norm_zero_centered(hidden.astype(e.dtype), mp["hnorm"], eps)
    x = linear(jnp.concatenate([e, h], axis=-1), mp["fc"])
    block = {"embed": params["embed"], "final_norm": mp["norm"], "layers": mp["layers"][:1]}
    out = forward(mtp_config(cfg), block, cache, tokens, n_new, impl=impl, return_hidden=True, inputs_embeds=x)
    return final_norm(cfg, block, out.hidden[-1]), out.cache


def mtp_logits(cfg: ModelConfig, params: dict, h: jax.Array) -> jax.Array:
    """The target's LM head over the MTP block's output h [..., Hd] -> float32 logits [..., V]."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(h, head, preferred_element_type=jnp.float32)


FAMILY = ModelFamily(
    name="qwen3_next", forward=forward, forward_ragged=forward_ragged, new_cache=new_cache, init_params=init_params,
    convert_hf_weights=convert_hf_weights, final_norm=final_norm, layer_types=LAYER_TYPES,
    write_deferred_kv=write_deferred_kv, deferred_groups=DEFERRED_GROUPS,
    mtp=MTPHead(prefixes=mtp_prefixes, new_cache=mtp_new_cache, target_hidden=target_hidden, step=mtp_step,
                logits=mtp_logits),
    param_axes=PARAM_AXES)
