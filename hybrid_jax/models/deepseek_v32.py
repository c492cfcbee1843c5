"""DeepSeek-V3.2 (MLA + DSA sparse attention, DeepSeek MoE) as pure functions, like qwen3_next.py.

Parameters (converted once at load by `convert_hf_weights`):
  embed [V, Hd]; lm_head [Hd, V] (absent when tied); final_norm [Hd]
  layer: input_norm, post_norm [Hd]
    attn: q_a [Hd, Rq], q_a_norm [Rq], q_b [Rq, H*(nope+Dr)], kv_a [Hd, R+Dr], kv_a_norm [R],
          w_uk [H, nope, R], w_uv [H, v, R] (kv_b split for the absorbed form), o_proj [H*v, Hd],
          idx_q [Rq, Hi*Di], idx_k [Hd, Di], idx_k_norm(_bias) [Di], idx_w [Hd, Hi] f32
    dense MLP: mlp.gate_up [Hd, 2I], mlp.down [I, Hd]
    MoE:       moe.router [Hd, E] f32, moe.bias [E] f32, moe.gate_up [E, Hd, 2Im], moe.down [E, Im, Hd],
               moe.shared_gate_up [Hd, 2*Im*n_shared], moe.shared_down [Im*n_shared, Hd]
  mtp (when the checkpoint has the MTP layer): see `_convert_mtp`
Cache: groups "sparse_attention" (paged latent + RoPE key) and "indexer" (paged indexer keys).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cache import ModelCache
from cache.mla import init_mla_groups
from hybrid_jax.errors import CheckpointError
from hybrid_jax.layers import mlp as mlp_lib
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.mla import rms_norm, sparse_attention
from hybrid_jax.layers.rope import rope_cos_sin
from hybrid_jax.models.common import LayerStep, finish_ragged, finish_step, token_positions
from hybrid_jax.models.contract import LayerType, MTPHead, ModelFamily, StepOutput
from hybrid_jax.models.ragged import RaggedBatch
from hybrid_jax.weights import checked_getter, concat, dense_mlp_weights, expert_weights, to_device, to_device_linear
from hybrid_jax.models.deepseek_v32_config import DeepseekV32Config


def new_cache(cfg: DeepseekV32Config, batch_size: int, capacity: int, dtype, index_dtype=None,
              page_size: int | None = None) -> ModelCache:
    """An empty cache: the paged latent group and the indexer-key group (index_dtype=fp8 for fp8 keys).
    Their page sizes are the config's (latent_page_size, index_page_size); page_size, the full-KV page
    size of the families that have full attention, has nothing to size here."""
    groups = init_mla_groups(batch_size=batch_size, capacity=capacity, layer_ids=cfg.attention_layers(),
                             index_layer_ids=cfg.layers_of("sparse_attention"),
                             kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
                             index_dim=cfg.index_head_dim, dtype=dtype, latent_page_size=cfg.latent_page_size,
                             index_page_size=cfg.index_page_size, index_dtype=index_dtype)
    return ModelCache(groups=groups, lengths=jnp.zeros((batch_size,), jnp.int32),
                      version=jnp.zeros((batch_size,), jnp.int32))


def grouped_topk_route(cfg, p: dict, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's router over x2 [M, Hd]: sigmoid scores, the correction bias in the choice only,
    group-limited Top-K (groups ranked by the sum of their two best experts), weights from the raw
    sigmoid, renormalised (norm_topk_prob), times routed_scaling_factor. Returns (idx [M, k], w [M, k]
    in x2's dtype). Reads cfg's n_routed_experts, n_group, topk_group, num_experts_per_tok."""
    E, G, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    scores = jax.nn.sigmoid(x2.astype(jnp.float32) @ p["router"])                       # [M, E]
    choice = scores + p["bias"]
    top2 = jax.lax.top_k(choice.reshape(-1, G, E // G), 2)[0]
    _, gidx = jax.lax.top_k(jnp.sum(top2, axis=-1), cfg.topk_group)                      # [M, tg]
    gmask = jnp.sum(jax.nn.one_hot(gidx, G, dtype=jnp.int32), axis=1) > 0               # [M, G]
    choice = jnp.where(jnp.repeat(gmask, E // G, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx, (w * cfg.routed_scaling_factor).astype(x2.dtype)


def deepseek_moe(cfg: DeepseekV32Config, p: dict, x: jax.Array) -> jax.Array:
    """x [B, T, Hd]. The routed experts chosen by `grouped_topk_route`, plus the shared experts."""
    B, T, Hd = x.shape
    x2 = x.reshape(B * T, Hd)
    idx, w = grouped_topk_route(cfg, p, x2)
    routed = mlp_lib.routed_experts(x2, idx, w, p["gate_up"], p["down"])
    shared = mlp_lib.swiglu(x2, p["shared_gate_up"], p["shared_down"])
    return (routed + shared).reshape(B, T, Hd)


@dataclasses.dataclass
class _Step(LayerStep):
    """The working state of one forward of this family (see LayerStep). The pools are written in
    place in their [L, ...] stacks (slicing a layer out and stacking the layers back copies every pool
    at every step)."""
    cos: jax.Array | None = None
    sin: jax.Array | None = None
    latent: jax.Array | None = None
    rope: jax.Array | None = None
    keys: jax.Array | None = None
    scale: jax.Array | None = None
    hits: list = dataclasses.field(default_factory=list)
    selected: jax.Array | None = None    # the last indexer layer's Top-K (a shared layer attends over it)
    ragged: RaggedBatch | None = None    # forward_ragged: the flat batch (positions, valid [1, N] then)


def _sparse_attention(cfg: DeepseekV32Config, lp: dict, h: jax.Array, step: _Step, i: int) -> jax.Array:
    """MLA with DSA's indexer Top-K over the paged latent and indexer-key groups."""
    return _mla(cfg, lp, h, step, i, shared=False)


def _shared_sparse_attention(cfg: DeepseekV32Config, lp: dict, h: jax.Array, step: _Step, i: int) -> jax.Array:
    """MLA over the Top-K the previous indexer layer selected (GLM's "shared" indexer layers): no indexer
    of its own, nothing in the indexer group."""
    if step.selected is None:
        raise ValueError(f"layer {i} reuses an indexer selection, but no earlier layer ran its indexer")
    return _mla(cfg, lp, h, step, i, shared=True)


def _mla(cfg: DeepseekV32Config, lp: dict, h: jax.Array, step: _Step, i: int, shared: bool) -> jax.Array:
    lg, ig = step.cache.groups["sparse_attention"], step.cache.groups["indexer"]
    h, step.latent, step.rope, step.keys, step.scale, hit, step.selected = sparse_attention(
        lp["attn"], h, step.cos, step.sin, step.positions, step.valid, step.cache.lengths, step.n_new,
        step.latent, step.rope, step.keys, step.scale, lg.page_table, ig.page_table, lg.page_resident,
        num_heads=cfg.num_attention_heads, nope=cfg.qk_nope_head_dim, rope_dim=cfg.qk_rope_head_dim,
        v_dim=cfg.v_head_dim, kv_lora_rank=cfg.kv_lora_rank, index_heads=cfg.index_n_heads,
        index_dim=cfg.index_head_dim, index_topk=cfg.index_topk, eps=cfg.latent_norm_eps, impl=step.impl,
        layer=lg.layer_ids.index(i), scale=cfg.softmax_scale, ragged=step.ragged,
        index_rope_interleaved=cfg.index_rope_interleaved,
        index_layer=None if shared else ig.layer_ids.index(i), selected=step.selected if shared else None)
    step.hits.append(hit)
    return h


# The family's layer types: their mixers and the cache groups they keep their objects in. DeepSeek-V3.2's
# layers are all "sparse_attention"; GLM-5's config may make some "shared_sparse_attention".
LAYER_TYPES = {"sparse_attention": LayerType(_sparse_attention, ("sparse_attention", "indexer")),
               "shared_sparse_attention": LayerType(_shared_sparse_attention, ("sparse_attention",))}


def forward(cfg: DeepseekV32Config, params: dict, cache: ModelCache, tokens: jax.Array, n_new: jax.Array, *,
            logits_at: str = "last", impl: str = "auto", return_hidden: bool = False,
            fused_recurrent: bool = False, per_token_states: bool = False, defer_kv_write: bool = False, inputs_embeds: jax.Array | None = None,
            return_final_hidden: bool = False) -> StepOutput:
    """tokens [B, T] int32 (right-padded), n_new [B]. Same contract as qwen3_next.forward (inputs_embeds
    too). The latent group's `hit_rate` [B] holds the step's resident fraction of selected positions
    (mean over layers). The family has no recurrent layers: fused_recurrent changes nothing and
    per_token_states gives `states` {}. It cannot defer its per-position writes (its FAMILY has no
    write_deferred_kv): defer_kv_write=True is a ValueError."""
    if defer_kv_write:
        raise ValueError(f"{cfg.model_type} cannot defer its per-position cache writes (defer_kv_write)")
    B, T = tokens.shape
    positions, valid = token_positions(cache, T, n_new)                  # [B, T] each
    x = params["embed"][tokens] if inputs_embeds is None else inputs_embeds
    cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope, seq_len=cache.lengths + n_new)
    step = _Step(cache, positions, valid, n_new, impl, cos=cos, sin=sin)
    x, groups, hidden = _layers(cfg, params, x, step, return_hidden)
    return finish_step(cfg, params, cache, groups, x, n_new, final_norm=final_norm, logits_at=logits_at,
                       hidden=hidden, final_hidden=x if return_final_hidden else None,
                       per_token=[] if per_token_states else None)


def forward_ragged(cfg: DeepseekV32Config, params: dict, cache: ModelCache, batch: RaggedBatch, *,
                   impl: str = "auto", return_final_hidden: bool = False) -> StepOutput:
    """One step over a ragged batch (hybrid_jax.models.ragged), as qwen3_next.forward_ragged: logits [S, V]
    at each sequence's last token. The per-token work runs on the flat [1, N] batch; the latent and
    indexer entries are written token-major and the indexer and sparse MLA run on the batch's tiles
    (pallas_kernels.sparse_attention.ragged). The latent group's hit_rate is per sequence [S]."""
    x = params["embed"][batch.tokens][None]                                  # [1, N, Hd]
    seq_len = (cache.lengths + batch.n_new)[batch.seq]
    cos, sin = rope_cos_sin(batch.positions[:, None], cfg.qk_rope_head_dim, cfg.rope, seq_len=seq_len)
    step = _Step(cache, batch.positions[None], batch.valid[None], batch.n_new, impl, cos=cos[:, 0][None],
                 sin=sin[:, 0][None], ragged=batch)
    x, groups, _ = _layers(cfg, params, x, step, False)
    return finish_ragged(cfg, params, cache, groups, x, batch, final_norm=final_norm,
                         return_final_hidden=return_final_hidden)


def _layers(cfg: DeepseekV32Config, params: dict, x: jax.Array, step: _Step, return_hidden: bool):
    """Every layer over x [B, T, Hd] (a ragged batch: [1, N, Hd]). Returns (the residual stream after the
    last layer, the cache's updated groups, the hidden states with return_hidden)."""
    cache = step.cache
    lg, ig = cache.groups["sparse_attention"], cache.groups["indexer"]
    step.latent, step.rope, step.keys, step.scale = lg.latent, lg.rope, ig.keys, ig.scale
    hidden = [x] if return_hidden else None
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
        x = x + LAYER_TYPES[cfg.layer_types[i]].mixer(cfg, lp, h, step, i)
        x = x + ffn(cfg, lp, rms_norm(x, lp["post_norm"], cfg.rms_norm_eps))
        if return_hidden:
            hidden.append(x)
    groups = dict(cache.groups)
    groups["sparse_attention"] = lg.replace(latent=step.latent, rope=step.rope,
                                            hit_rate=jnp.mean(jnp.stack(step.hits), axis=0))
    groups["indexer"] = ig.replace(keys=step.keys, scale=step.scale)
    return x, groups, hidden


def final_norm(cfg: DeepseekV32Config, params: dict, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


# ------------------------------------------------------------------------------------------------
# The multi-token-prediction block (`params["mtp"]`), stored as decoder layer `num_hidden_layers`
# with enorm / hnorm / eh_proj / shared_head (DeepSeek-V3's MTP module), run by
# hybrid_jax.speculative.mtp as a drafter.

def mtp_prefixes(cfg: DeepseekV32Config) -> tuple[str, ...]:
    """Where the checkpoint keeps the MTP block: every tensor there must be read by the loader."""
    return (f"model.layers.{cfg.num_hidden_layers}.",)


def mtp_config(cfg: DeepseekV32Config) -> DeepseekV32Config:
    """The MTP block's decoder layer as a one-layer model (its FFN follows its params: MoE or dense)."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=("sparse_attention",), mlp_layer_types=("dense",))


def mtp_new_cache(cfg: DeepseekV32Config, batch_size: int, capacity: int, dtype) -> ModelCache:
    return new_cache(mtp_config(cfg), batch_size, capacity, dtype)


def target_hidden(cfg: DeepseekV32Config, params: dict, hidden: list) -> jax.Array:
    """The hidden state the MTP block reads: the last layer's output after the final norm [B, T, Hd]."""
    return final_norm(cfg, params, hidden[-1])


def mtp_step(cfg: DeepseekV32Config, params: dict, cache: ModelCache, tokens: jax.Array, hidden: jax.Array,
             n_new: jax.Array, *, impl: str = "auto"):
    """One pass of the MTP block over tokens [B, T] (the token after each position) and hidden [B, T, Hd]:
    eh_proj([enorm(embed(tokens)) | hnorm(hidden)]) -> its decoder layer (MLA + indexer over its own
    cache, MoE) -> the residual stream, which a further draft reads and `mtp_logits` normalises
    (shared_head.norm). The embedding at position 0 is zeroed, as vLLM's DeepSeek MTP does."""
    mp = params["mtp"]
    eps = cfg.rms_norm_eps
    positions, _ = token_positions(cache, tokens.shape[1], n_new)
    e = mp.get("embed", params["embed"])[tokens]
    e = rms_norm(jnp.where((positions == 0)[..., None], 0, e).astype(e.dtype), mp["enorm"], eps)
    h = rms_norm(hidden.astype(e.dtype), mp["hnorm"], eps)
    x = linear(jnp.concatenate([e, h], axis=-1), mp["eh_proj"])
    block = {"embed": params["embed"], "final_norm": mp["head_norm"], "layers": mp["layers"][:1]}
    out = forward(mtp_config(cfg), block, cache, tokens, n_new, impl=impl, return_hidden=True, inputs_embeds=x)
    return out.hidden[-1], out.cache


def mtp_logits(cfg: DeepseekV32Config, params: dict, h: jax.Array) -> jax.Array:
    """shared_head: its norm, then its head (the target's LM head when the checkpoint's is the same)."""
    mp = params["mtp"]
    head = mp.get("head", params["lm_head"] if "lm_head" in params else params["embed"].T)
    return jnp.dot(rms_norm(h, mp["head_norm"], cfg.rms_norm_eps), head, preferred_element_type=jnp.float32)


def _attn_shapes(cfg):
    H, Hd = cfg.num_attention_heads, cfg.hidden_size
    return dict(Hd=Hd, H=H, Rq=cfg.q_lora_rank, R=cfg.kv_lora_rank, Dr=cfg.qk_rope_head_dim,
                nope=cfg.qk_nope_head_dim, v=cfg.v_head_dim, Hi=cfg.index_n_heads, Di=cfg.index_head_dim)


def init_params(cfg: DeepseekV32Config, seed: int = 0, dtype=jnp.float32, rng=None) -> dict:
    """Deterministic random parameters in the converted layout (std 0.02; norms at 1).
    rng: the numpy Generator to draw from (default_rng(seed) when None; `hybrid_jax.plan` passes one that
    returns traced zeros, so that under jax.eval_shape nothing is drawn or allocated)."""
    s = _attn_shapes(cfg)
    rng = np.random.default_rng(seed) if rng is None else rng

    def n(*shape, std=0.02, dt=dtype):
        return jnp.asarray(rng.normal(0.0, std, shape), dt)

    Hd, H = s["Hd"], s["H"]
    params = {"embed": n(cfg.vocab_size, Hd), "final_norm": jnp.ones((Hd,), dtype), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = n(Hd, cfg.vocab_size)
    for i in range(cfg.num_hidden_layers):
        lp = {"input_norm": jnp.ones((Hd,), dtype), "post_norm": jnp.ones((Hd,), dtype)}
        lp["attn"] = {"q_a": n(Hd, s["Rq"]), "q_a_norm": jnp.ones((s["Rq"],), dtype),
                      "q_b": n(s["Rq"], H * (s["nope"] + s["Dr"])), "kv_a": n(Hd, s["R"] + s["Dr"]),
                      "kv_a_norm": jnp.ones((s["R"],), dtype), "w_uk": n(H, s["nope"], s["R"]),
                      "w_uv": n(H, s["v"], s["R"]), "o_proj": n(H * s["v"], Hd)}
        if cfg.layer_types[i] == "sparse_attention":           # a layer that runs its indexer
            lp["attn"].update({"idx_q": n(s["Rq"], s["Hi"] * s["Di"]), "idx_k": n(Hd, s["Di"]),
                               "idx_k_norm": jnp.ones((s["Di"],), dtype),
                               "idx_k_norm_bias": jnp.zeros((s["Di"],), dtype),
                               "idx_w": n(Hd, s["Hi"], dt=jnp.float32)})
        lp.update(init_ffn(cfg, i, n))
        params["layers"].append(lp)
    return params


def convert_hf_weights(cfg: DeepseekV32Config, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                       dtype, progress: Callable[[], None] = lambda: None) -> dict:
    """Re-lays a transformers DeepseekV32ForCausalLM checkpoint into the layout above, once.
    Raises CheckpointError naming a missing or misshapen tensor."""
    Hd = cfg.hidden_size
    t = checked_getter(get, has, progress)

    def dev(a, dt=None):
        return to_device(a, dt or dtype)

    def lin(a):            # a weight the layers multiply through layers.linear (may stay FP8)
        return to_device_linear(a, dtype)

    params = {"embed": dev(t("model.embed_tokens.weight", (cfg.vocab_size, Hd))),
              "final_norm": dev(t("model.norm.weight", (Hd,))), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = dev(t("lm_head.weight", (cfg.vocab_size, Hd)).T)
    for i in range(cfg.num_hidden_layers):
        params["layers"].append(_convert_layer(cfg, t, has, f"model.layers.{i}.", cfg.is_moe_layer(i), dev, lin,
                                               indexer=cfg.layer_types[i] == "sparse_attention"))
    if has(mtp_prefixes(cfg)[0] + "eh_proj.weight"):
        params["mtp"] = _convert_mtp(cfg, t, has, params, dev, lin)
    return params


def _convert_mtp(cfg: DeepseekV32Config, t, has, params: dict, dev, lin) -> dict:
    """DeepSeek-V3's MTP module, stored as layer `num_hidden_layers`: enorm, hnorm [Hd], eh_proj [Hd, 2Hd]
    over [embedding | hidden], shared_head.norm, shared_head.head [V, Hd], an optional copy of the
    embedding (`embed_tokens`), and a decoder layer (MoE when it has a router). The head and the
    embedding copy are kept only where they differ from the target's (they are shared in the releases).
    Params: eh_proj [2Hd, Hd], enorm, hnorm, head_norm [Hd], layers [one layer], optional head [Hd, V]
    and embed [V, Hd]."""
    Hd, V = cfg.hidden_size, cfg.vocab_size
    (p,) = mtp_prefixes(cfg)
    if has(f"model.layers.{cfg.num_hidden_layers + 1}.eh_proj.weight"):
        raise CheckpointError(f"checkpoint has more than one MTP layer (model.layers.{cfg.num_hidden_layers + 1}.*); "
                              f"DeepSeek-V3.2 releases have one")
    mp = {"eh_proj": lin(t(p + "eh_proj.weight", (Hd, 2 * Hd)).T), "enorm": dev(t(p + "enorm.weight", (Hd,))),
          "hnorm": dev(t(p + "hnorm.weight", (Hd,))), "head_norm": dev(t(p + "shared_head.norm.weight", (Hd,))),
          "layers": [_convert_layer(cfg, t, has, p, has(p + "mlp.gate.weight"), dev, lin)]}
    head = t(p + "shared_head.head.weight", (V, Hd))
    target_head = t("model.embed_tokens.weight") if cfg.tie_word_embeddings else t("lm_head.weight")
    if not np.array_equal(np.asarray(head), np.asarray(target_head)):
        mp["head"] = dev(head.T)
    if has(p + "embed_tokens.weight"):
        embed = t(p + "embed_tokens.weight", (V, Hd))
        if not np.array_equal(np.asarray(embed), np.asarray(t("model.embed_tokens.weight"))):
            mp["embed"] = dev(embed)
    return mp


def _convert_layer(cfg: DeepseekV32Config, t, has, p: str, moe: bool, dev, lin, indexer: bool = True) -> dict:
    """One decoder layer's tensors under prefix p (`model.layers.3.`) -> its params (without an indexer:
    a GLM "shared" layer, which has none)."""
    s = _attn_shapes(cfg)
    Hd, H = s["Hd"], s["H"]
    a = p + "self_attn."
    lp = {"input_norm": dev(t(p + "input_layernorm.weight", (Hd,))),
          "post_norm": dev(t(p + "post_attention_layernorm.weight", (Hd,)))}
    kvb = t(a + "kv_b_proj.weight", (H * (s["nope"] + s["v"]), s["R"])).reshape(H, s["nope"] + s["v"], s["R"])
    at = {"q_a": lin(t(a + "q_a_proj.weight", (s["Rq"], Hd)).T),
          "q_a_norm": dev(t(a + "q_a_layernorm.weight", (s["Rq"],))),
          "q_b": lin(t(a + "q_b_proj.weight", (H * (s["nope"] + s["Dr"]), s["Rq"])).T),
          "kv_a": lin(t(a + "kv_a_proj_with_mqa.weight", (s["R"] + s["Dr"], Hd)).T),
          "kv_a_norm": dev(t(a + "kv_a_layernorm.weight", (s["R"],))),
          "w_uk": lin(kvb[:, :s["nope"]]), "w_uv": lin(kvb[:, s["nope"]:]),
          "o_proj": lin(t(a + "o_proj.weight", (Hd, H * s["v"])).T)}
    if indexer:
        at.update({"idx_q": lin(t(a + "indexer.wq_b.weight", (s["Hi"] * s["Di"], s["Rq"])).T),
                   "idx_k": lin(t(a + "indexer.wk.weight", (s["Di"], Hd)).T),
                   "idx_k_norm": dev(t(a + "indexer.k_norm.weight", (s["Di"],))),
                   "idx_k_norm_bias": dev(t(a + "indexer.k_norm.bias", (s["Di"],))),
                   "idx_w": dev(t(a + "indexer.weights_proj.weight", (s["Hi"], Hd)).T, jnp.float32)})
    if cfg.attention_bias:
        at["q_a_bias"] = dev(t(a + "q_a_proj.bias", (s["Rq"],)))
        at["kv_a_bias"] = dev(t(a + "kv_a_proj_with_mqa.bias", (s["R"] + s["Dr"],)))
        at["o_bias"] = dev(t(a + "o_proj.bias", (Hd,)))
    lp["attn"] = at
    lp.update(convert_ffn(cfg, t, has, p + "mlp.", moe, dev, lin))
    return lp


def convert_ffn(cfg, t, has, m: str, moe: bool, dev, lin, expert_names=("gate_proj", "up_proj", "down_proj")) -> dict:
    """A DeepSeek feed-forward under prefix m (`model.layers.3.mlp.`): {"moe": ...} (router [E, Hd], its
    correction bias, the routed experts, spelt `expert_names` (gate, up, down), and the shared experts) or
    {"mlp": ...} (a dense SwiGLU). Kimi-Linear's releases keep the same under `block_sparse_moe.`, experts
    as w1 / w3 / w2."""
    Hd = cfg.hidden_size
    if moe:
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        Is = I * cfg.n_shared_experts
        gate_up, down = expert_weights(t, has, m, E, I, Hd, names=expert_names)
        return {"moe": {
            "router": dev(t(m + "gate.weight", (E, Hd)).T, jnp.float32),
            "bias": dev(t(m + "gate.e_score_correction_bias", (E,)), jnp.float32),
            "gate_up": lin(gate_up), "down": lin(down),
            "shared_gate_up": lin(concat([t(m + "shared_experts.gate_proj.weight", (Is, Hd)),
                                          t(m + "shared_experts.up_proj.weight", (Is, Hd))], 0).T),
            "shared_down": lin(t(m + "shared_experts.down_proj.weight", (Hd, Is)).T)}}
    gate_up, down = dense_mlp_weights(t, m, cfg.intermediate_size, Hd)
    return {"mlp": {"gate_up": lin(gate_up), "down": lin(down)}}


def init_ffn(cfg, i: int, n) -> dict:
    """Layer i's random feed-forward in the converted layout (`convert_ffn`'s); n(*shape, dt=) draws."""
    Hd = cfg.hidden_size
    if cfg.is_moe_layer(i):
        E, I, Is = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        return {"moe": {"router": n(Hd, E, dt=jnp.float32), "bias": jnp.zeros((E,), jnp.float32),
                        "gate_up": n(E, Hd, 2 * I), "down": n(E, I, Hd),
                        "shared_gate_up": n(Hd, 2 * Is), "shared_down": n(Is, Hd)}}
    I = cfg.intermediate_size
    return {"mlp": {"gate_up": n(Hd, 2 * I), "down": n(I, Hd)}}


def ffn(cfg, lp: dict, y: jax.Array) -> jax.Array:
    """The layer's feed-forward on y [B, T, Hd] (after its norm): the MoE or the dense MLP."""
    return deepseek_moe(cfg, lp["moe"], y) if "moe" in lp else mlp_lib.swiglu(y, lp["mlp"]["gate_up"],
                                                                               lp["mlp"]["down"])


# Logical axes of every parameter (hybrid_jax.parallel.rules). MLA splits by heads: q_b's columns and
# w_uk / w_uv / o_proj are head-major; the low-rank down projections (q_a, kv_a) and the latent cache
# are shared by every head and stay whole. The indexer splits by its heads too (idx_q's head-major
# columns, idx_w's per-head weights): each device scores the keys with its heads and the partial scores
# are all-reduced before the Top-K (one [T, S] all-reduce per layer, instead of every device running
# all 64 heads: on a long context the indexer's scoring is most of a layer's FLOPs); its key projection
# and the indexer keys are shared by every head and stay whole. Experts split whole under expert
# parallelism, else by their columns; the router and its bias are whole.
FFN_AXES = {      # the feed-forward's (`convert_ffn`'s layout), which Kimi-Linear shares
    "*/mlp/gate_up": ("embed", "gate_up"),
    "*/mlp/down": ("mlp", "embed"),
    "*/moe/router": ("embed", None),
    "*/moe/bias": (None,),
    "*/moe/gate_up": ("experts", "embed", "expert_mlp"),
    "*/moe/down": ("experts", "expert_mlp", "embed"),
    "*/moe/shared_gate_up": ("embed", "gate_up"),
    "*/moe/shared_down": ("mlp", "embed"),
}
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "*/attn/q_a": ("embed", None),
    "*/attn/q_a_bias": (None,),
    "*/attn/q_b": (None, "heads"),
    "*/attn/kv_a": ("embed", None),
    "*/attn/kv_a_bias": (None,),
    "*/attn/w_uk": ("heads", None, None),
    "*/attn/w_uv": ("heads", None, None),
    "*/attn/o_proj": ("heads", "embed"),
    "*/attn/o_bias": ("embed",),
    "*/attn/idx_q": (None, "heads"),
    "*/attn/idx_k": ("embed", None),
    "*/attn/idx_w": ("embed", "heads"),
    "*/attn/idx_k_norm_bias": (None,),
    **FFN_AXES,
    "mtp/eh_proj": (None, "embed"),
    "mtp/head": ("embed", "vocab"),
    "mtp/embed": ("vocab", "embed"),
    "*norm": (None,),
}

FAMILY = ModelFamily(
    name="deepseek_v32", forward=forward, forward_ragged=forward_ragged, new_cache=new_cache, init_params=init_params,
    convert_hf_weights=convert_hf_weights, final_norm=final_norm, layer_types=LAYER_TYPES,
    mtp=MTPHead(prefixes=mtp_prefixes, new_cache=mtp_new_cache, target_hidden=target_hidden, step=mtp_step,
                logits=mtp_logits),
    param_axes=PARAM_AXES)
