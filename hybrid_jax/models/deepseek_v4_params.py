"""DeepSeek-V4's parameters: their shapes, a deterministic random init, the one-time re-layout of a
transformers or original-release checkpoint into the layout `deepseek_v4.py` documents (the
release's tensor names resolved by `_resolver`), and the logical axes of each parameter."""
from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from hybrid_jax.models.deepseek_v4_config import DeepseekV4Config
from hybrid_jax.weights import checked_getter, concat, expert_weights, to_device, to_device_linear

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def _mtp_prefix(has) -> str | None:
    """The MTP block's prefix, as the converter spells it (the resolver finds "model."-prefixed
    names too), or None when the checkpoint has no block (no e_proj)."""
    return "mtp.0." if has("mtp.0.e_proj.weight") or has("model.mtp.0.e_proj.weight") else None


def _convert_mtp(cfg: DeepseekV4Config, t, has, p: str, layer, dev, mat, lin, hc) -> dict:
    """The release's `mtp.0.*`: e_proj, h_proj [Hd, Hd] (torch Linear), enorm, hnorm, norm [Hd],
    hc_head_fn [N, N*Hd] / hc_head_base [N] / hc_head_scale [1], and a decoder layer in the main
    layers' names (`attn.*`, `ffn.*`, `hc_attn_*`, ...; converted by `layer`). Its attention type is
    read off its tensors (a compressor: HCA, with an indexer: CSA) and must be the config's
    `mtp_layer_type`. Params: e_proj, h_proj [Hd, Hd], enorm, hnorm, norm [Hd], hc_head, layers [one]."""
    from hybrid_jax.errors import CheckpointError  # noqa: PLC0415
    Hd, N = cfg.hidden_size, cfg.hc_mult
    if has("mtp.1.e_proj.weight") or has("model.mtp.1.e_proj.weight"):
        raise CheckpointError("checkpoint has more than one MTP layer (mtp.1.*); DeepSeek-V4 releases have one")
    a = p + "self_attn."
    found = ("sliding_attention" if not has(_resolver(has)(a + "compressor.kv_proj.weight"))
             else CSA if has(_resolver(has)(a + "compressor.indexer.kv_proj.weight")) else HCA)
    if found != cfg.mtp_layer_type:
        raise CheckpointError(f"the MTP layer's tensors ({p}attn.*) are those of a {found} layer, but config.json "
                              f"makes it {cfg.mtp_layer_type} (entry {cfg.num_hidden_layers} of compress_ratios)")
    hash_moe = has(_resolver(has)(p + "mlp.gate.tid2eid"))
    return {"e_proj": lin(p + "e_proj.weight", Hd, Hd), "h_proj": lin(p + "h_proj.weight", Hd, Hd),
            "enorm": dev(t(p + "enorm.weight", (Hd,))), "hnorm": dev(t(p + "hnorm.weight", (Hd,))),
            "norm": dev(t(p + "norm.weight", (Hd,))), "hc_head": hc(p, "hc_head_fn", "hc_head_base", "hc_head_scale", N),
            "layers": [layer(p, cfg.mtp_layer_type, hash_moe)]}


def _shapes(cfg):
    H, D, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    return dict(Hd=cfg.hidden_size, H=H, D=D, G=G, r=cfg.o_lora_rank, Rq=cfg.q_lora_rank, N=cfg.hc_mult,
                Hi=cfg.index_n_heads, Di=cfg.index_head_dim, E=cfg.n_routed_experts, I=cfg.moe_intermediate_size,
                k=cfg.num_experts_per_tok)


def init_params(cfg: DeepseekV4Config, seed: int = 0, dtype=jnp.float32, rng=None) -> dict:
    """Deterministic random parameters in the converted layout (std 0.02; norms and hc scales at 1).
    rng: the numpy Generator to draw from (default_rng(seed) when None; `hybrid_jax.plan` passes one that
    returns traced zeros, so that under jax.eval_shape nothing is drawn or allocated)."""
    s = _shapes(cfg)
    rng = np.random.default_rng(seed) if rng is None else rng

    def n(*shape, std=0.02, dt=dtype):
        return jnp.asarray(rng.normal(0.0, std, shape), dt)

    def ones(k, dt=dtype):
        return jnp.ones((k,), dt)

    Hd, N, f32 = s["Hd"], s["N"], jnp.float32
    hc = lambda: {"fn": n(N * Hd, (2 + N) * N, dt=f32), "base": jnp.zeros(((2 + N) * N,), f32), "scale": ones(3, f32)}
    params = {"embed": n(cfg.vocab_size, Hd), "final_norm": ones(Hd),
              "hc_head": {"fn": n(N * Hd, N, dt=f32), "base": jnp.zeros((N,), f32), "scale": ones(1, f32)},
              "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = n(Hd, cfg.vocab_size)
    for i in range(cfg.num_hidden_layers):
        H, D, G, r = s["H"], s["D"], s["G"], s["r"]
        at = {"q_a": n(Hd, s["Rq"]), "q_a_norm": ones(s["Rq"]), "q_b": n(s["Rq"], H * D), "kv": n(Hd, D),
              "kv_norm": ones(D), "sinks": jnp.zeros((H,), f32), "o_a": n(G, H * D // G, r), "o_b": n(G * r, Hd)}
        lt = cfg.layer_types[i]
        if lt != "sliding_attention":
            m, C = cfg.rate_of(lt), (2 * D if lt == CSA else D)
            at.update(c_kv=n(Hd, C), c_gate=n(Hd, C), c_bias=jnp.zeros((m, C), f32), c_norm=ones(D))
            if lt == CSA:
                Hi, Di = s["Hi"], s["Di"]
                at.update(i_kv=n(Hd, 2 * Di), i_gate=n(Hd, 2 * Di), i_bias=jnp.zeros((m, 2 * Di), f32),
                          i_norm=ones(Di), i_q=n(s["Rq"], Hi * Di), i_w=n(Hd, Hi, dt=f32))
        E, I, k = s["E"], s["I"], s["k"]
        mo = {"router": n(Hd, E, dt=f32), "gate_up": n(E, Hd, 2 * I), "down": n(E, I, Hd),
              "shared_gate_up": n(Hd, 2 * I), "shared_down": n(I, Hd)}
        if cfg.mlp_layer_types[i] == "hash_moe":
            mo["tid2eid"] = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(cfg.vocab_size)]), jnp.int32)
        else:
            mo["bias"] = jnp.zeros((E,), f32)
        params["layers"].append({"attn_norm": ones(Hd), "ffn_norm": ones(Hd), "attn_hc": hc(), "ffn_hc": hc(),
                                 "attn": at, "moe": mo})
    return params


# transformers' DeepseekV4 names -> the original DeepSeek names (what save_pretrained writes back, and the
# published checkpoints use, with or without the "model." prefix). Order matters: specific rules first.
_ORIGINAL_NAMES = [(r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
                   (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
                   (r"\.compressor\.indexer\.", ".indexer.compressor."), (r"\.self_attn\.", ".attn."),
                   (r"\.mlp\.", ".ffn."), (r"\.input_layernorm\.", ".attn_norm."),
                   (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
                   (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"), (r"\.sinks$", ".attn_sink"),
                   (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"), (r"\.q_a_proj\.", ".wq_a."),
                   (r"\.q_b_proj\.", ".wq_b."), (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
                   (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
                   (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."), (r"\.kv_proj\.", ".wkv."),
                   (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
                   (r"\.q_a_norm\.", ".q_norm."), (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
                   (r"^lm_head\.", "head."), (r"^model\.embed_tokens\.", "embed."),
                   (r"^model\.hc_head\.hc_", "hc_head_")]


def _resolver(has):
    """native name -> the name this checkpoint stores it under (the native one when none exists): the
    original DeepSeek name, with or without the "model." prefix (the published checkpoints have none),
    and the attention's KV norm as `attn.norm` (what transformers writes back) or `attn.kv_norm`."""
    import re  # noqa: PLC0415

    def resolve(name: str) -> str:
        orig, orig_kv = name, name
        for pat, rep in _ORIGINAL_NAMES:
            orig = re.sub(pat, rep, orig)
            orig_kv = orig_kv if rep == ".norm." else re.sub(pat, rep, orig_kv)
        for c in (name, orig, orig.removeprefix("model."), "model." + orig, orig_kv, orig_kv.removeprefix("model.")):
            if has(c):
                return c
        return name
    return resolve


def _hash_table(tab, prefix: str, E: int):
    """A hash-routed layer's token -> experts table [V, k], read whole so that every id is checked."""
    tab = np.asarray(tab)
    if tab.min() < 0 or tab.max() >= E:
        from hybrid_jax.errors import CheckpointError  # noqa: PLC0415
        raise CheckpointError(f"{prefix}gate.tid2eid holds expert ids outside [0, {E})")
    return to_device(tab, jnp.int32)


def convert_hf_weights(cfg: DeepseekV4Config, get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                       dtype, progress: Callable[[], None] = lambda: None) -> dict:
    """Re-lays a transformers DeepseekV4ForCausalLM checkpoint into the layout above, once.
    Raises CheckpointError naming a missing or misshapen tensor."""
    s = _shapes(cfg)
    Hd, N, H, D, G, r, Rq = s["Hd"], s["N"], s["H"], s["D"], s["G"], s["r"], s["Rq"]
    resolve = _resolver(has)
    t0 = checked_getter(get, has, progress)
    t = (lambda name, shape=None: t0(resolve(name), shape))
    f32 = jnp.float32

    def dev(a, dt=None):
        return to_device(a, dt or dtype)

    def mat(name, out, inp, dt=None):          # torch Linear [out, in] -> [in, out]
        return dev(t(name, (out, inp)).T, dt)

    def lin(name, out, inp):                   # the same, multiplied through layers.linear (may stay FP8)
        return to_device_linear(t(name, (out, inp)).T, dtype)

    def hc(prefix, a, b, c, k):
        return {"fn": mat(prefix + a, k, N * Hd, f32), "base": dev(t(prefix + b, (k,)), f32),
                "scale": dev(t(prefix + c, (3 if k != N else 1,)), f32)}

    m_ = "model."
    params = {"embed": dev(t(m_ + "embed_tokens.weight", (cfg.vocab_size, Hd))),
              "final_norm": dev(t(m_ + "norm.weight", (Hd,))),
              "hc_head": hc(m_ + "hc_head.", "hc_fn", "hc_base", "hc_scale", N), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = mat("lm_head.weight", cfg.vocab_size, Hd)

    def layer(p: str, lt: str, hash_moe: bool) -> dict:
        """One decoder layer's tensors under the transformers-style prefix p (`model.layers.3.`; resolved
        to the release's names where the checkpoint has those) -> its params."""
        a = p + "self_attn."
        o_a = t(a + "o_a_proj.weight", (G * r, H * D // G)).reshape(G, r, H * D // G).transpose(0, 2, 1)
        at = {"q_a": lin(a + "q_a_proj.weight", Rq, Hd), "q_a_norm": dev(t(a + "q_a_norm.weight", (Rq,))),
              "q_b": lin(a + "q_b_proj.weight", H * D, Rq), "kv": lin(a + "kv_proj.weight", D, Hd),
              "kv_norm": dev(t(a + "kv_norm.weight", (D,))), "sinks": dev(t(a + "sinks", (H,)), f32),
              "o_a": to_device_linear(o_a, dtype), "o_b": lin(a + "o_b_proj.weight", Hd, G * r)}
        if lt != "sliding_attention":
            c = a + "compressor."
            m, C = cfg.rate_of(lt), (2 * D if lt == CSA else D)
            at.update(c_kv=lin(c + "kv_proj.weight", C, Hd), c_gate=lin(c + "gate_proj.weight", C, Hd),
                      c_bias=dev(t(c + "position_bias", (m, C)), f32), c_norm=dev(t(c + "kv_norm.weight", (D,))))
            if lt == CSA:
                ix, Hi, Di = c + "indexer.", s["Hi"], s["Di"]
                at.update(i_kv=lin(ix + "kv_proj.weight", 2 * Di, Hd), i_gate=lin(ix + "gate_proj.weight", 2 * Di, Hd),
                          i_bias=dev(t(ix + "position_bias", (m, 2 * Di)), f32),
                          i_norm=dev(t(ix + "kv_norm.weight", (Di,))), i_q=lin(ix + "q_b_proj.weight", Hi * Di, Rq),
                          i_w=mat(ix + "scorer.weights_proj.weight", Hi, Hd, f32))
        ml = p + "mlp."
        E, I, k = s["E"], s["I"], s["k"]
        if has(ml + "experts.gate_up_proj"):
            gate_up, down = expert_weights(t, has, ml, E, I, Hd)
        else:       # original layout: per expert w1 (gate), w3 (up) [I, Hd], w2 (down) [Hd, I]
            ex = resolve(ml + "shared_experts.gate_proj.weight").replace("shared_experts.w1.weight", "")
            gate_up, down = expert_weights(t0, has, ex, E, I, Hd, names=("w1", "w3", "w2"))
        mo = {"router": mat(ml + "gate.weight", E, Hd, f32), "gate_up": to_device_linear(gate_up, dtype),
              "down": to_device_linear(down, dtype),
              "shared_gate_up": to_device_linear(concat([t(ml + "shared_experts.gate_proj.weight", (I, Hd)),
                                                         t(ml + "shared_experts.up_proj.weight", (I, Hd))], 0).T,
                                                 dtype),
              "shared_down": lin(ml + "shared_experts.down_proj.weight", Hd, I)}
        if hash_moe:
            mo["tid2eid"] = _hash_table(t(ml + "gate.tid2eid", (cfg.vocab_size, k)), ml, E)
        else:
            mo["bias"] = dev(t(ml + "gate.e_score_correction_bias", (E,)), f32)
        return {"attn_norm": dev(t(p + "input_layernorm.weight", (Hd,))),
                "ffn_norm": dev(t(p + "post_attention_layernorm.weight", (Hd,))),
                "attn_hc": hc(p + "attn_hc.", "fn", "base", "scale", (2 + N) * N),
                "ffn_hc": hc(p + "ffn_hc.", "fn", "base", "scale", (2 + N) * N),
                "attn": at, "moe": mo}

    for i in range(cfg.num_hidden_layers):
        params["layers"].append(layer(f"{m_}layers.{i}.", cfg.layer_types[i], cfg.mlp_layer_types[i] == "hash_moe"))
    mtp = _mtp_prefix(has)
    if mtp is not None:
        params["mtp"] = _convert_mtp(cfg, t, has, mtp, layer, dev, mat, lin, hc)
    return params


# Logical axes of every parameter (hybrid_jax.parallel.rules), first match wins ("*" spans "/": the MTP
# block's layer matches the layers' patterns). The query heads (q_b's head-major columns), their sinks
# and the grouped output projection split by heads: o_a by its groups, o_b by its rows (each group's
# o_lora outputs: row parallel, one all-reduce). The indexer splits by its heads (its Top-K sums the
# devices' scores). The shared K = V projection, the compressors, the hyper-connections and the router
# (and the hash table) are whole. Experts split whole under expert parallelism, else by their
# intermediate columns; the shared expert is column then row parallel (gate | up laid out per device).
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "*/attn/q_a": ("embed", None),
    "*/attn/q_b": (None, "heads"),
    "*/attn/kv": ("embed", None),
    "*/attn/sinks": ("heads",),
    "*/attn/o_a": ("heads", None, None),
    "*/attn/o_b": ("heads", "embed"),
    "*/attn/c_kv": ("embed", None),
    "*/attn/c_gate": ("embed", None),
    "*/attn/c_bias": (None, None),
    "*/attn/i_kv": ("embed", None),
    "*/attn/i_gate": ("embed", None),
    "*/attn/i_bias": (None, None),
    "*/attn/i_q": (None, "heads"),
    "*/attn/i_w": ("embed", "heads"),
    "*/moe/router": ("embed", None),
    "*/moe/bias": (None,),
    "*/moe/tid2eid": (None, None),
    "*/moe/gate_up": ("experts", "embed", "expert_mlp"),
    "*/moe/down": ("experts", "expert_mlp", "embed"),
    "*/moe/shared_gate_up": ("embed", "gate_up"),
    "*/moe/shared_down": ("mlp", "embed"),
    "*hc*/fn": (None, None),
    "*hc*/base": (None,),
    "*hc*/scale": (None,),
    "mtp/e_proj": (None, "embed"),
    "mtp/h_proj": (None, "embed"),
    "*norm": (None,),
}

