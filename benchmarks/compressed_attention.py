"""DeepSeek-V4 compressed attention vs the same model with full attention: cache bytes and decode-step time.

(a) Memory, computed from the cache pytrees (cache/accounting.py: `jax.eval_shape` of the model's
    `new_cache`, so a 1M-token cache is measured without allocating it), bytes per token of one row at
    8k, 128k and 1M tokens, per object kind, for V4's own cache shape (43 layers: 23 HCA + 20 CSA,
    head_dim 512, window 128, rates 4 / 128, indexer dim 128; transformers' DeepseekV4Config defaults),
    cache dtype bf16 (tails' gates f32, as the model keeps them), against two full-attention caches
    of the same width:
      "V4, window=context"  the same V4 model with every layer a sliding layer whose window covers the
                            whole context: full attention over raw shared K = V entries (one head of 512);
      "full KV (K+V)"       a standard full-attention KV cache (cache.state KVGroup) with V4's layer
                            count, one KV head and head_dim 512, K and V stored separately.
(b) Decode-step time (batch 1, one token, jit, cache donated) at contexts 8k, 16k, 32k, 64k for a
    small-width V4-shaped config (V4's layer pattern over 6 layers, rates 4 / 128, window 128,
    index_topk 512; hidden 256, 8 heads of 64) against the same config with full attention: V4 has no
    plain full-attention layer type, so the baseline is every layer `sliding_attention` with a window
    that covers the whole context, which is exactly full attention over the same K = V entries with the
    same projections, sinks, mHC and MoE. The two are timed interleaved, median of --repeats steps
    after a compile, fp32, impl="auto" (the XLA paths on CPU).
    The caches are not prefilled: each is built at capacity context + 128 with random contents and
    its counters set consistently (lengths = context, compressed entry counts = context // rate, tails
    empty since every context is a multiple of 128). A step's time does not depend on the values, and
    every step reads and writes the whole state as a prefilled cache would. Cache bytes printed beside
    the times are those of these caches (capacity context + 128). The fitted slopes (us per 1k tokens
    of context, least squares over the contexts) and their ratio are printed.

    python benchmarks/compressed_attention.py [--contexts 8192,16384,32768,65536] [--repeats 7]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache import accounting as acc
from hybrid_jax.models import deepseek_v4 as v4
from hybrid_jax.models.deepseek_v4_config import deepseek_v4_config

SWA = "sliding_attention"
_ABBR = {SWA: "SWA", v4.CSA: "CSA", v4.HCA: "HCA"}
SLACK = 128          # capacity beyond the context: room for the timed steps, keeps capacities multiples of 128
LENGTHS = (8192, 131072, 1 << 20)


def real_v4_config():
    """V4's dims from transformers' DeepseekV4Config defaults when transformers is installed, else this
    project's defaults (which mirror them) with its 43 layers."""
    try:
        import transformers  # noqa: PLC0415
        return deepseek_v4_config(transformers.DeepseekV4Config().to_dict()), "transformers.DeepseekV4Config()"
    except ImportError:
        return deepseek_v4_config(dict(model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
                                       num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024)), \
            "deepseek_v4_config defaults"


def full_attention_twin(cfg):
    """The same V4 config with every layer a sliding layer; its window is set to the capacity per cache."""
    return dataclasses.replace(cfg, layer_types=(SWA,) * cfg.num_hidden_layers)


def cache_fns(cfg, dtype) -> dict:
    """Label -> new_cache(batch_size, capacity) of the three caches compared in (a)."""
    twin = full_attention_twin(cfg)
    return {"V4 (CSA+HCA)": lambda b, c: v4.new_cache(cfg, b, c, dtype),
            "V4, window=context": lambda b, c: v4.new_cache(dataclasses.replace(twin, sliding_window=c), b, c, dtype),
            "full KV (K+V)": acc.full_kv_cache_fn(cfg.num_hidden_layers, 1, cfg.head_dim, dtype)}


def memory_table():
    cfg, src = real_v4_config()
    dt = jnp.bfloat16
    accs = {label: acc.measure(fn) for label, fn in cache_fns(cfg, dt).items()}
    n_csa, n_hca = len(cfg.layers_of(v4.CSA)), len(cfg.layers_of(v4.HCA))
    print(f"(a) bytes per token of one row, from the cache pytrees (eval_shape); V4 dims from {src}: "
          f"{cfg.num_hidden_layers} layers ({n_hca} HCA rate {cfg.hca_rate}, {n_csa} CSA rate {cfg.csa_rate}), "
          f"head_dim {cfg.head_dim}, window {cfg.sliding_window}, indexer dim {cfg.index_head_dim}; bf16")
    kinds = [k for k in acc.KIND_ORDER if any(k in {g.kind for g in a.groups.values()} for a in accs.values())]
    wid = {k: max(len(k), 9) + 2 for k in kinds}
    print(f"{'model':20}{'tokens':>7}" + "".join(f"{k:>{wid[k]}}" for k in kinds)
          + f"{'total':>10}{'full KV / this':>16}")
    for row in acc.table(accs, LENGTHS, baseline="full KV (K+V)"):
        cells = "".join(f"{row['kinds'].get(k, 0.0):>{wid[k]}.1f}" for k in kinds)
        print(f"{row['model']:20}{_k(row['n']):>7}{cells}{row['total']:>10.1f}{row['baseline_over_this']:>15.2f}x")
    a, w = accs["V4 (CSA+HCA)"], accs["V4, window=context"]
    print(f"growth per token (slope): V4 {a.per_token:.0f} B, window=context {w.per_token:.0f} B, "
          f"full KV {accs['full KV (K+V)'].per_token:.0f} B; V4 fixed per row {acc.format_bytes(a.fixed)}")
    for n in LENGTHS:
        print(f"  one row at {_k(n):>5}: V4 {acc.format_bytes(a.total_per_token_at(n) * n):>11}"
              f"   window=context {acc.format_bytes(w.total_per_token_at(n) * n):>11}"
              f"   ratio {w.total_per_token_at(n) / a.total_per_token_at(n):.2f}x")


def _k(n: int) -> str:
    return f"{n // (1 << 20)}M" if n >= 1 << 20 else f"{n // 1024}k"


def small_v4_config():
    """A CPU-sized V4: the real layer pattern, rates, window and Top-K over 6 narrow layers."""
    return deepseek_v4_config(dict(
        model_type="deepseek_v4", vocab_size=1024, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
        head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64, index_n_heads=16, index_head_dim=32,
        index_topk=512, sliding_window=128, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        hc_mult=4, hc_sinkhorn_iters=20, eos_token_id=None, bos_token_id=None, pad_token_id=None))


def filled_cache(cfg, context: int, dtype, seed: int):
    """A one-row cache of capacity context + SLACK that looks `context` tokens long (see the docstring):
    float leaves random, page tables as made, lengths = context, entry counts = context // rate."""
    if context % 128:
        raise ValueError(f"context must be a multiple of 128 (tails stay empty); got {context}")
    cache = v4.new_cache(cfg, 1, context + SLACK, dtype)
    rng = np.random.default_rng(seed)

    def fill(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(0.5 * rng.standard_normal(x.shape, np.float32), x.dtype)
        return x
    groups = {}
    for name, g in cache.groups.items():
        g = jax.tree_util.tree_map(fill, g)
        if g.kind in ("compressed_kv", "indexer_entries"):
            rate = g.rate
            g = jax.tree_util.tree_map(lambda x: jnp.full_like(x, context // rate)
                                       if x.dtype == jnp.int32 and x.shape == (1,) else x, g)
        groups[name] = g
    return cache.replace(groups=groups, lengths=jnp.full((1,), context, jnp.int32))


def decode_timing(contexts, repeats: int):
    cfg = small_v4_config()
    dt = jnp.float32
    params = v4.init_params(cfg, seed=0, dtype=dt)
    twin = full_attention_twin(cfg)
    tok = jnp.ones((1, 1), jnp.int32)
    one = jnp.ones((1,), jnp.int32)
    print(f"\n(b) decode step, batch 1, fp32, {jax.default_backend()}: V4-shaped {cfg.num_hidden_layers} layers "
          f"({','.join(_ABBR[t] for t in cfg.layer_types)}), hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads x {cfg.head_dim}, window {cfg.sliding_window}, "
          f"rates {cfg.csa_rate}/{cfg.hca_rate}, index_topk {cfg.index_topk}\n"
          f"    vs the same model, every layer full attention (window = capacity); median of {repeats}, interleaved")
    print(f"{'context':>8}{'V4 ms':>10}{'full ms':>10}{'full / V4':>11}{'V4 cache':>13}{'full cache':>13}"
          f"{'bytes ratio':>13}")
    res = []
    for ctx in contexts:
        full_cfg = dataclasses.replace(twin, sliding_window=ctx + SLACK)
        steps, caches = {}, {}
        for label, c in (("v4", cfg), ("full", full_cfg)):
            steps[label] = jax.jit(lambda p, cache, c=c: (lambda o: (o.logits, o.cache))(v4.forward(c, p, cache, tok, one)),
                                   donate_argnums=1)
            caches[label] = filled_cache(c, ctx, dt, seed=ctx)
        nbytes = {k: sum(x.nbytes for x in jax.tree_util.tree_leaves(v)) for k, v in caches.items()}
        for label in steps:                               # compile + one warm step
            logits, caches[label] = jax.block_until_ready(steps[label](params, caches[label]))
            if not bool(jnp.all(jnp.isfinite(logits))):
                raise RuntimeError(f"{label} step at context {ctx} gave non-finite logits: the filled cache is bad")
        times = {"v4": [], "full": []}
        for _ in range(repeats):
            for label in ("v4", "full"):
                t0 = time.perf_counter()
                logits, caches[label] = steps[label](params, caches[label])
                jax.block_until_ready((logits, caches[label]))
                times[label].append(time.perf_counter() - t0)
        m = {k: statistics.median(v) for k, v in times.items()}
        res.append((ctx, m["v4"], m["full"]))
        print(f"{_k(ctx):>8}{m['v4'] * 1e3:>10.2f}{m['full'] * 1e3:>10.2f}{m['full'] / m['v4']:>10.2f}x"
              f"{acc.format_bytes(nbytes['v4']):>13}{acc.format_bytes(nbytes['full']):>13}"
              f"{nbytes['full'] / nbytes['v4']:>12.2f}x")
        del steps, caches
    x = np.array([r[0] for r in res], float) / 1024
    s_v4 = np.polyfit(x, [r[1] * 1e6 for r in res], 1)[0]
    s_full = np.polyfit(x, [r[2] * 1e6 for r in res], 1)[0]
    print(f"slope (least squares, us per 1k tokens of context): V4 {s_v4:.2f}, full attention {s_full:.2f}; "
          f"full / V4 = {s_full / s_v4:.1f}x" if s_v4 > 0 else
          f"slope (us per 1k tokens): V4 {s_v4:.2f} (flat within noise), full attention {s_full:.2f}")
    return res, s_v4, s_full


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,16384,32768,65536")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    memory_table()
    decode_timing([int(c) for c in args.contexts.split(",")], args.repeats)


if __name__ == "__main__":
    main()
