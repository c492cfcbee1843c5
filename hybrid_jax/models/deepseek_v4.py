"""DeepSeek-V4 (sliding window + CSA / HCA compressed attention, mHC streams, hash / Top-K MoE) as pure
functions, like deepseek_v32.py.

Parameters (converted once at load by `convert_hf_weights`; N = hc_mult, G = o_groups):
  embed [V, Hd]; lm_head [Hd, V] (absent when tied); final_norm [Hd]; hc_head: fn [N*Hd, N], base [N], scale [1]
  layer: attn_norm, ffn_norm [Hd]; attn_hc, ffn_hc: fn [N*Hd, (2+N)N], base [(2+N)N], scale [3]
    attn: q_a [Hd, Rq], q_a_norm [Rq], q_b [Rq, H*D], kv [Hd, D], kv_norm [D], sinks [H],
          o_a [G, H*D/G, r] (grouped), o_b [G*r, Hd]
          compressed layers: c_kv, c_gate [Hd, C], c_bias [m, C], c_norm [D]   (C = 2D for CSA, D for HCA)
          CSA indexer: i_kv, i_gate [Hd, 2Di], i_bias [m, 2Di], i_norm [Di], i_q [Rq, Hi*Di], i_w [Hd, Hi]
    moe: router [Hd, E] f32, bias [E] f32 (Top-K layers) | tid2eid [V, k] int32 (hash layers),
         gate_up [E, Hd, 2I], down [E, I, Hd], shared_gate_up [Hd, 2I], shared_down [I, Hd]
  mtp (when the checkpoint has the MTP block `mtp.0.*`): see `_convert_mtp`
Cache (cache/compressed.py): "sliding_window" for every layer; per compressed type its paged entries
(pool [L, P, ps, D] + page table [B, NP]), tail, and for CSA the overlap state and the indexer's
paged entries / tail / overlap.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cache import ModelCache
from cache.compressed import init_compressed_groups
from hybrid_jax.layers.compressed_attention import compressed_attention, inv_freq
from hybrid_jax.layers.hyper_connections import hc_head, hc_merge, hc_weights
from hybrid_jax.layers.linear import linear
from hybrid_jax.layers.mla import rms_norm
from hybrid_jax.layers.mlp import routed_experts, swiglu
from hybrid_jax.models.common import LayerStep, finish_step, token_positions
from hybrid_jax.models.contract import LayerType, MTPHead, ModelFamily, StepOutput
from hybrid_jax.models.deepseek_v4_config import DeepseekV4Config
from hybrid_jax.models.ragged import RaggedBatch, over_tiles
from hybrid_jax.models.deepseek_v4_params import CSA, HCA, PARAM_AXES, convert_hf_weights, init_params

# this family's cache group -> (field of the group, key in a layer's compressor state)
_CSA_FIELDS = {"compressed_sparse_attention": (("entries", "entries"), ("page_table", "table"), ("count", "count")),
               "csa_tail": (("kv", "tail_kv"), ("gate", "tail_gate"), ("count", "tail_count")),
               "csa_overlap": (("kv", "overlap_kv"), ("gate", "overlap_gate")),
               "csa_indexer": (("entries", "idx_entries"), ("page_table", "idx_table"), ("count", "idx_count")),
               "csa_indexer_tail": (("kv", "idx_tail_kv"), ("gate", "idx_tail_gate"), ("count", "idx_tail_count")),
               "csa_indexer_overlap": (("kv", "idx_overlap_kv"), ("gate", "idx_overlap_gate"))}
_HCA_FIELDS = {"heavily_compressed_attention": (("entries", "entries"), ("page_table", "table"),
                                                ("count", "count")),
               "hca_tail": (("kv", "tail_kv"), ("gate", "tail_gate"), ("count", "tail_count"))}
_PER_ROW = ("count", "page_table")    # fields shared by the group's layers ([B, ...], not [L, ...])
# Page pools ([L, P, ps, D]) go to the layer whole, with the layer's slot, and are written in place:
# slicing a layer out and stacking the layers back copies every pool at every step.
_POOLS = {"entries": "slot", "idx_entries": "idx_slot"}
# Tokens per tile of a long sequence in a ragged step (`over_tiles`): its tiles run one after another.
RAGGED_TILE = 128


def new_cache(cfg: DeepseekV4Config, batch_size: int, capacity: int, dtype, page_size: int | None = None) -> ModelCache:
    """An empty cache (groups in cache/compressed.py) for batch_size rows of up to capacity tokens. Entry
    pages cover cache.compressed.ENTRY_PAGE_TOKENS tokens; page_size, the full-KV page size of the
    families that have full attention, has nothing to size here."""
    groups = init_compressed_groups(
        batch_size=batch_size, capacity=capacity, dtype=dtype, window=cfg.sliding_window, head_dim=cfg.head_dim,
        all_layers=tuple(range(cfg.num_hidden_layers)), csa_layers=cfg.layers_of(CSA), csa_rate=cfg.csa_rate,
        index_dim=cfg.index_head_dim, hca_layers=cfg.layers_of(HCA), hca_rate=cfg.hca_rate)
    return ModelCache(groups=groups, lengths=jnp.zeros((batch_size,), jnp.int32),
                      version=jnp.zeros((batch_size,), jnp.int32))


def _fields(layer_type):
    return _CSA_FIELDS if layer_type == CSA else _HCA_FIELDS if layer_type == HCA else {}


def _layer_state(groups, layer_type, i):
    st = {}
    for gname, pairs in _fields(layer_type).items():
        g = groups[gname]
        s = g.layer_ids.index(i)
        for f, key in pairs:
            a = getattr(g, f)
            st[key] = a if f in _PER_ROW or key in _POOLS else a[s]
            if key in _POOLS:
                st[_POOLS[key]] = s
    return st


def _score(cfg, logits):
    if cfg.scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if cfg.scoring_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def moe(cfg: DeepseekV4Config, p: dict, x, tokens):
    """x [B, T, Hd], tokens [B, T]. Scores score_fn(x W_r); experts from tid2eid[token] (hash) or Top-K of
    scores + bias; weights = chosen scores renormalised (always) * routed_scaling_factor; + shared expert.
    SwiGLU pre-activations are clamped at swiglu_limit (gate above, up both sides)."""
    B, T, Hd = x.shape
    x2 = x.reshape(B * T, Hd)
    scores = _score(cfg, x2.astype(jnp.float32) @ p["router"])                         # [M, E]
    if "tid2eid" in p:
        idx = p["tid2eid"][tokens.reshape(-1)]
    else:
        _, idx = jax.lax.top_k(scores + p["bias"], cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    routed = routed_experts(x2, idx, w, p["gate_up"], p["down"], limit=cfg.swiglu_limit)
    shared = swiglu(x2, p["shared_gate_up"], p["shared_down"], limit=cfg.swiglu_limit)
    return (routed + shared).reshape(B, T, Hd).astype(x.dtype)


@dataclasses.dataclass
class _Step(LayerStep):
    """The working state of one forward of this family (see LayerStep)."""
    freqs_main: jax.Array | None = None
    freqs_compress: jax.Array | None = None
    groups: dict = dataclasses.field(default_factory=dict)   # the cache's groups, entry pools replaced as written
    rings: list = dataclasses.field(default_factory=list)
    states: dict = dataclasses.field(default_factory=dict)
    ragged: RaggedBatch | None = None    # forward_ragged: the flat batch


def _compressed(layer_type: str):
    """The mixer of one of the family's attention types: the sliding window, plus for CSA / HCA the
    compressed entries (and CSA's indexer) of cache/compressed.py's groups."""
    def mixer(cfg: DeepseekV4Config, lp: dict, h: jax.Array, step: _Step, i: int) -> jax.Array:
        win = step.cache.groups["sliding_window"]
        ring, state = win.kv[win.layer_ids.index(i)], _layer_state(step.groups, layer_type, i)

        def attend(x, positions, valid, lengths, n_new, ring, state):
            return compressed_attention(lp["attn"], x, layer_type, positions, valid, lengths, n_new, ring, state,
                                        step.freqs_main, step.freqs_compress, cfg=cfg, impl=step.impl,
                                        pools_in_place=True)
        if step.ragged is None:
            out, ring, st = attend(h, step.positions, step.valid, step.cache.lengths, step.n_new, ring, state)
        else:   # the layer's row state (ring, tails, overlaps, counts) advances tile by tile
            pools = {k: state.pop(k) for k in list(state) if k in _POOLS}
            slots = {k: state.pop(k) for k in list(state) if k in _POOLS.values()}

            def tile_step(x, positions, valid, lengths, n_new, rows, pools):
                o, ring_t, st_t = attend(x, positions, valid, lengths, n_new, rows[0], {**rows[1], **pools, **slots})
                return o, (ring_t, {k: st_t[k] for k in rows[1]}), {k: st_t[k] for k in pools}
            out, (ring, rows), pools = over_tiles(tile_step, h[0], (ring, state), pools, step.ragged,
                                                  step.cache.lengths, prefill_tile=RAGGED_TILE)
            out, st = out[None], {**rows, **pools, **slots}
        step.rings.append(ring)
        step.states[i] = st
        for gname, pairs in _fields(layer_type).items():      # the written pools, for the group's next layer
            step.groups[gname] = step.groups[gname].replace(**{f: st[key] for f, key in pairs if key in _POOLS})
        return out
    return mixer


# The family's layer types: the mixer each runs and the cache groups it keeps its objects in.
LAYER_TYPES = {"sliding_attention": LayerType(_compressed("sliding_attention"), ("sliding_window",)),
               CSA: LayerType(_compressed(CSA), ("sliding_window", *_CSA_FIELDS)),
               HCA: LayerType(_compressed(HCA), ("sliding_window", *_HCA_FIELDS))}


def _layers(cfg: DeepseekV4Config, layers: list, cache: ModelCache, x, tokens, positions, valid, n_new, impl: str,
            return_hidden: bool, ragged: RaggedBatch | None = None):
    """The decoder layers over the mHC streams x [B, T, N, Hd] (the model's, or the MTP block's one),
    each token mixer its type's (`LAYER_TYPES`): (streams after the last layer, the cache's new groups,
    [input, each layer's output] or None)."""
    hidden = [x] if return_hidden else None
    step = _Step(cache, positions, valid, n_new, impl, freqs_main=inv_freq(cfg.rope_main, cfg.rope_dim("main")),
                 freqs_compress=inv_freq(cfg.rope_compress, cfg.rope_dim("compress")), groups=dict(cache.groups),
                 ragged=ragged)
    hc = dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    for i, lp in enumerate(layers):
        post, comb, col = hc_weights(lp["attn_hc"], x, **hc)
        h = rms_norm(col, lp["attn_norm"], cfg.rms_norm_eps)
        x = hc_merge(post, comb, LAYER_TYPES[cfg.layer_types[i]].mixer(cfg, lp, h, step, i), x)
        post, comb, col = hc_weights(lp["ffn_hc"], x, **hc)
        y = moe(cfg, lp["moe"], rms_norm(col, lp["ffn_norm"], cfg.rms_norm_eps), tokens)
        x = hc_merge(post, comb, y, x)
        if return_hidden:
            hidden.append(x)
    groups, states = step.groups, step.states
    new_groups = dict(groups)
    new_groups["sliding_window"] = groups["sliding_window"].replace(kv=jnp.stack(step.rings))   # window-sized
    for lt in (CSA, HCA):
        ids = cfg.layers_of(lt)
        if not ids:
            continue
        for gname, pairs in _fields(lt).items():
            upd = {f: (states[ids[-1]][key] if f in _PER_ROW or key in _POOLS
                       else jnp.stack([states[i][key] for i in ids]))
                   for f, key in pairs}
            new_groups[gname] = groups[gname].replace(**upd)
    return x, new_groups, hidden


def forward(cfg: DeepseekV4Config, params: dict, cache: ModelCache, tokens: jax.Array, n_new: jax.Array, *,
            logits_at: str = "last", impl: str = "auto", return_hidden: bool = False,
            fused_recurrent: bool = False, per_token_states: bool = False, defer_kv_write: bool = False,
            return_final_hidden: bool = False) -> StepOutput:
    """tokens [B, T] int32 (right-padded), n_new [B]. Same contract as deepseek_v32.forward; the hidden
    states are the mHC streams [B, T, N, Hd] (final_norm collapses them). No recurrent layers:
    fused_recurrent changes nothing and per_token_states gives `states` {}. It cannot defer its
    per-position writes (its FAMILY has no write_deferred_kv): defer_kv_write=True is a ValueError."""
    if defer_kv_write:
        raise ValueError(f"{cfg.model_type} cannot defer its per-position cache writes (defer_kv_write)")
    B, T = tokens.shape
    positions, valid = token_positions(cache, T, n_new)
    e = params["embed"][tokens]
    x = jnp.broadcast_to(e[:, :, None, :], (B, T, cfg.hc_mult, e.shape[-1]))
    x, new_groups, hidden = _layers(cfg, params["layers"], cache, x, tokens, positions, valid, n_new, impl,
                                    return_hidden)
    xh = hc_head(params["hc_head"], x, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    # final_hidden: the streams, as `final_norm` takes them
    return finish_step(cfg, params, cache, new_groups, xh, n_new, final_norm=_norm, logits_at=logits_at,
                       hidden=hidden, final_hidden=x if return_final_hidden else None,
                       per_token=[] if per_token_states else None)


def forward_ragged(cfg: DeepseekV4Config, params: dict, cache: ModelCache, batch: RaggedBatch, *,
                   impl: str = "auto", return_final_hidden: bool = False) -> StepOutput:
    """One step over a ragged batch (hybrid_jax.models.ragged), as deepseek_v32.forward_ragged: logits [S, V]
    at each sequence's last token. mHC, the MoE and every projection run on the flat [1, N] batch; each
    attention layer runs on the batch's tiles as rows (`over_tiles`: its window ring, compressor tails and
    overlaps advance tile by tile, the entry pools are written in place)."""
    e = params["embed"][batch.tokens][None]                                  # [1, N, Hd]
    x = jnp.broadcast_to(e[:, :, None, :], e.shape[:2] + (cfg.hc_mult, e.shape[-1]))
    x, new_groups, _ = _layers(cfg, params["layers"], cache, x, batch.tokens[None], batch.positions[None],
                               batch.valid[None], batch.n_new, impl, False, ragged=batch)
    xh = hc_head(params["hc_head"], x, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)[0]   # [N, Hd]
    out = finish_step(cfg, params, cache, new_groups, xh[batch.last_index()][:, None], batch.n_new, final_norm=_norm,
                      logits_at="all")
    return out.replace(logits=out.logits[:, 0], final_hidden=x[0] if return_final_hidden else None)


def _norm(cfg, params, x):
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def final_norm(cfg: DeepseekV4Config, params: dict, x: jax.Array) -> jax.Array:
    """x: the mHC streams [..., N, Hd] -> the hyper head's collapse, then the final RMSNorm [..., Hd]."""
    return _norm(cfg, params, hc_head(params["hc_head"], x, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps))


# ------------------------------------------------------------------------------------------------
# The multi-token-prediction block (`params["mtp"]`), the checkpoint's `mtp.0.*`, run by
# hybrid_jax.speculative.mtp as a drafter. transformers' DeepseekV4ForCausalLM has no MTP module (it
# ignores `mtp.*` at load), so the block follows DeepSeek's own reference (the release's
# inference/model.py `MTPBlock`, a `Block` with extras), whose math is:
#   e = enorm(embed(token after))                                  [B, T, Hd]   (the shared embedding)
#   x = e_proj(e)[:, :, None] + h_proj(hnorm(h))                   [B, T, N, Hd]
#       h: the target's mHC streams after its last layer (before the hyper head), hnorm per stream
#   x = the block's decoder layer (hc_attn / attention / hc_ffn / MoE, as every V4 layer) over x
#   logits = head(norm(hc_head_mtp(x)))                            its own hyper head and norm, the shared head
# Drafts after the first read the block's own output streams x (as V3's MTP reads its own output).
# The layer's attention type is config.json's entry num_hidden_layers of compress_ratios (0, a
# sliding-window layer, in the published V4-Flash config); its MoE is Top-K (hash routing is only
# for the first num_hash_layers layers), or hash where the block ships a tid2eid table.

def mtp_prefixes(cfg: DeepseekV4Config) -> tuple[str, ...]:
    """Where the checkpoint keeps the MTP block: every tensor there must be read by the loader."""
    return ("mtp.", "model.mtp.")


def mtp_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """The MTP block's decoder layer as a one-layer model (its MoE follows its params: hash or Top-K)."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(cfg.mtp_layer_type,), mlp_layer_types=("moe",))


def mtp_new_cache(cfg: DeepseekV4Config, batch_size: int, capacity: int, dtype) -> ModelCache:
    return new_cache(mtp_config(cfg), batch_size, capacity, dtype)


def mtp_hidden_shape(cfg: DeepseekV4Config) -> tuple[int, ...]:
    """The shape of one position's hidden state the block reads: the N mHC streams."""
    return (cfg.hc_mult, cfg.hidden_size)


def target_hidden(cfg: DeepseekV4Config, params: dict, hidden: list) -> jax.Array:
    """The hidden state the MTP block reads: the last layer's output streams [B, T, N, Hd] (before the
    hyper head and the final norm, as DeepSeek's MTPBlock takes them)."""
    return hidden[-1]


def mtp_step(cfg: DeepseekV4Config, params: dict, cache: ModelCache, tokens: jax.Array, hidden: jax.Array,
             n_new: jax.Array, *, impl: str = "auto"):
    """One pass of the MTP block over tokens [B, T] (the token after each position) and hidden
    [B, T, N, Hd] (see above): (its output streams [B, T, N, Hd], which `mtp_logits` reads and a
    further draft is fed, and its cache)."""
    mp = params["mtp"]
    eps = cfg.rms_norm_eps
    positions, valid = token_positions(cache, tokens.shape[1], n_new)
    e = rms_norm(params["embed"][tokens], mp["enorm"], eps)
    h = rms_norm(hidden.astype(e.dtype), mp["hnorm"], eps)
    x = linear(e, mp["e_proj"])[:, :, None, :] + linear(h, mp["h_proj"])
    x, groups, _ = _layers(mtp_config(cfg), mp["layers"], cache, x, tokens, positions, valid, n_new, impl, False)
    return x, cache.replace(groups=groups, lengths=cache.lengths + n_new,
                            version=cache.version + (n_new > 0).astype(jnp.int32))


def mtp_logits(cfg: DeepseekV4Config, params: dict, h: jax.Array) -> jax.Array:
    """The block's head over its output streams h [..., N, Hd]: its hyper head, its norm, then the
    target's LM head (shared) -> [..., V] f32."""
    mp = params["mtp"]
    x = rms_norm(hc_head(mp["hc_head"], h, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps), mp["norm"],
                 cfg.rms_norm_eps)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(x, head, preferred_element_type=jnp.float32)


FAMILY = ModelFamily(
    name="deepseek_v4", forward=forward, forward_ragged=forward_ragged, new_cache=new_cache, init_params=init_params,
    convert_hf_weights=convert_hf_weights, final_norm=final_norm, layer_types=LAYER_TYPES,
    mtp=MTPHead(prefixes=mtp_prefixes, new_cache=mtp_new_cache, target_hidden=target_hidden, step=mtp_step,
                logits=mtp_logits, hidden_shape=mtp_hidden_shape),
    param_axes=PARAM_AXES)
