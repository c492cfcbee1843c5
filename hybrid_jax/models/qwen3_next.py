"""Qwen3-Next (hybrid Gated DeltaNet + gated full attention, MoE) as pure functions.

`forward(params, cache, tokens, n_new)` runs T new tokens per row through every layer and returns
logits and the updated cache; prefill, chunked prefill and decode are the same function at
different T. Parameters use the layout below, produced once at load by `convert_hf_weights`:

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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cache import ModelCache, init_cache
from cache.state import DEFAULT_KV_PAGE_SIZE, RecurrentGroup
from hybrid_jax.models.qwen3_next_config import ModelConfig
from hybrid_jax.layers.attention import gated_attention, gated_attention_ragged, write_kv
from hybrid_jax.layers.gated_deltanet import gated_deltanet, gated_deltanet_ragged
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.mlp import sparse_moe, swiglu
from hybrid_jax.layers.norms import rms_norm_zero_centered
from hybrid_jax.layers.rope import rope_cos_sin
from hybrid_jax.models.common import LayerStep, finish_step, token_positions
from hybrid_jax.models.contract import LayerType, MTPHead, ModelFamily, StepOutput
from hybrid_jax.models.ragged import RaggedBatch
from hybrid_jax.parallel.context import kv_replicas
from hybrid_jax.errors import CheckpointError
from hybrid_jax.weights import checked_getter, concat, dense_mlp_weights, expert_weights, to_device, to_device_linear


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
class _Step(LayerStep):
    """The working state of one forward of this family (see LayerStep)."""
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


def _linear_attention(cfg: ModelConfig, lp: dict, h: jax.Array, step: _Step, i: int) -> jax.Array:
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
                 head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim, eps=cfg.rms_norm_eps)
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


def _full_attention(cfg: ModelConfig, lp: dict, h: jax.Array, step: _Step, i: int) -> jax.Array:
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
            inputs_embeds: jax.Array | None = None) -> StepOutput:
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
    """
    B, T = tokens.shape
    positions, valid = token_positions(cache, T, n_new)                  # [B, T] each
    x = params["embed"][tokens] if inputs_embeds is None else inputs_embeds
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope, seq_len=cache.lengths + n_new)
    step = _Step(cache, positions, valid, n_new, impl, cos=cos, sin=sin, fused_recurrent=fused_recurrent,
                 per_token_states=per_token_states, defer_kv_write=defer_kv_write)
    x, groups, hidden = _layers(cfg, params, x, step, return_hidden)
    out = finish_step(cfg, params, cache, groups, x, n_new, final_norm=final_norm, logits_at=logits_at,
                      hidden=hidden)
    if per_token_states:
        states = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *step.per_token) if step.per_token else {}
        out = out.replace(states=states)
    if defer_kv_write:
        out = out.replace(deferred={"k": jnp.stack(step.k_new), "v": jnp.stack(step.v_new)} if step.k_new else {})
    return out


def forward_ragged(cfg: ModelConfig, params: dict, cache: ModelCache, batch: RaggedBatch, *, impl: str = "auto"
                   ) -> StepOutput:
    """One step over a ragged batch (hybrid_jax.models.ragged): sequence s's tokens batch.tokens
    [cu_seqlens[s], cu_seqlens[s + 1]) continue cache row s. Returns a StepOutput with logits [S, V]
    at each sequence's last token and the cache (lengths += n_new); the math is `forward`'s, with the
    linear-attention layers on the packed chunked rule and full attention on ragged paged attention."""
    x = params["embed"][batch.tokens][None]                                  # [1, N, Hd]
    seq_len = (cache.lengths + batch.n_new)[batch.seq]
    cos, sin = rope_cos_sin(batch.positions[:, None], cfg.rotary_dim, cfg.rope, seq_len=seq_len)
    step = _Step(cache, batch.positions, batch.valid, batch.n_new, impl, cos=cos[:, 0], sin=sin[:, 0], ragged=batch)
    x, groups, _ = _layers(cfg, params, x, step, False)
    x = x[0][batch.last_index()][:, None]                                    # [S, 1, Hd]
    out = finish_step(cfg, params, cache, groups, x, batch.n_new, final_norm=final_norm, logits_at="all")
    return out.replace(logits=out.logits[:, 0])


def _layers(cfg: ModelConfig, params: dict, x: jax.Array, step: _Step, return_hidden: bool):
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

MTP_PREFIX = "mtp."


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


# ------------------------------------------------------------------------------------------------
# Parameters: deterministic init (the embedded default) and the one-time HF re-layout.

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
    s = _shapes(cfg)
    Hd = s["Hd"]
    lp = {"input_norm": dev(t(p + "input_layernorm.weight", (Hd,))),
          "post_norm": dev(t(p + "post_attention_layernorm.weight", (Hd,)))}
    if kind == "linear_attention":
        HV, V = s["HV"], s["V"]
        a = p + "linear_attn."
        conv = t(a + "conv1d.weight", (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim))
        qkvz, ba = gdn_in_proj(cfg, t, a)
        lp["gdn"] = {
            "qkvz": lin(qkvz.T), "ba": lin(ba.T), "conv": dev(conv[grouped_conv_channels(cfg), 0, :].T),
            "A_log": to_device(t(a + "A_log", (HV,)), jnp.float32),
            "dt_bias": to_device(t(a + "dt_bias", (HV,)), jnp.float32),
            "norm": dev(t(a + "norm.weight", (V,))),
            "out_proj": lin(t(a + "out_proj.weight", (Hd, HV * V)).T),
        }
    else:
        Hq, Hkv, D = s["Hq"], s["Hkv"], s["D"]
        a = p + "self_attn."
        # q_proj interleaves per head, [Hq, (query D | gate D)]: the layer reads it as stored; k and v
        # are interleaved per head alike, [Hkv, (k D | v D)]
        k = t(a + "k_proj.weight", (Hkv * D, Hd)).reshape(Hkv, 1, D, Hd)
        v = t(a + "v_proj.weight", (Hkv * D, Hd)).reshape(Hkv, 1, D, Hd)
        lp["attn"] = {"qg": lin(t(a + "q_proj.weight", (2 * Hq * D, Hd)).T),
                      "kv": lin(concat([k, v], axis=1).reshape(2 * Hkv * D, Hd).T),
                      "q_norm": dev(t(a + "q_norm.weight", (D,))), "k_norm": dev(t(a + "k_norm.weight", (D,))),
                      "o_proj": lin(t(a + "o_proj.weight", (Hd, Hq * D)).T)}
        if cfg.attention_bias:
            lp["attn"]["qg_bias"] = dev(t(a + "q_proj.bias", (2 * Hq * D,)))
            lp["attn"]["kv_bias"] = dev(np.stack([t(a + "k_proj.bias", (Hkv * D,)).reshape(Hkv, D),
                                                  t(a + "v_proj.bias", (Hkv * D,)).reshape(Hkv, D)], axis=1).reshape(-1))
            lp["attn"]["o_bias"] = dev(t(a + "o_proj.bias", (Hd,)))
    m = p + "mlp."
    if moe:
        E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        router = t(m + "gate.weight", (E, Hd))
        sgate = t(m + "shared_expert_gate.weight", (1, Hd))
        sg = t(m + "shared_expert.gate_proj.weight", (Is, Hd))
        su = t(m + "shared_expert.up_proj.weight", (Is, Hd))
        gate_up, down = expert_weights(t, has, m, E, I, Hd)
        lp["moe"] = {"in_proj": lin(concat([router, sgate, sg, su], axis=0).T),
                     "shared_down": lin(t(m + "shared_expert.down_proj.weight", (Hd, Is)).T),
                     "gate_up": lin(gate_up), "down": lin(down)}
    else:
        gate_up, down = dense_mlp_weights(t, m, cfg.intermediate_size, Hd)
        lp["mlp"] = {"gate_up": lin(gate_up), "down": lin(down)}
    return lp


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

FAMILY = ModelFamily(
    name="qwen3_next", forward=forward, forward_ragged=forward_ragged, new_cache=new_cache, init_params=init_params,
    convert_hf_weights=convert_hf_weights, final_norm=final_norm, layer_types=LAYER_TYPES,
    write_deferred_kv=write_deferred_kv, deferred_groups=DEFERRED_GROUPS,
    mtp=MTPHead(prefixes=mtp_prefixes, new_cache=mtp_new_cache, target_hidden=target_hidden, step=mtp_step,
                logits=mtp_logits),
    param_axes=PARAM_AXES)
