"""Speculative decoding, side by side in one run (n-gram prompt-lookup drafting):

  1. tokens/s with and without speculation (n-gram drafting in the on-device loop) on a repetitive
     workload (the continuation copies text the prompt already holds) and on a non-repetitive one
     (random prompts), greedy, with the outputs checked token-identical to plain greedy decoding;
     targets >= 2x and >= 0.95x;
  2. rollback by selection vs snapshot + replay: time, and the extra device memory each needs;
  3. the cost of taking a snapshot as the cache grows (a reference: flat) next to a deep copy.

The models: the shared tiny Qwen3-Next architecture (benchmarks/tiny_qwen3_next.py: 3 Gated
DeltaNet + 1 gated attention layer, MoE) and the same 4 layers wider ('medium', CONFIG_MEDIUM),
random weights, except that the embeddings are scaled up and the LM head is rewired so that greedy
decoding walks one fixed cycle through the whole vocabulary (token t -> sigma(t)). An untrained
model never repeats itself, so this is how the repetitive workload gets text whose continuation is
already in the context: its prompts quote the stretch of the cycle the model is about to produce
(as code editing re-emits code it was given), while the non-repetitive prompts are random tokens,
whose continuation has not been seen. Every layer still runs at full cost; only what the tokens are
changed.

Why two sizes. Speculation pays because a decode step costs about what reading the weights costs,
so checking K + 1 positions in one forward costs little more than one step. The medium model's
51 MiB of fp32 weights are past this CPU's 32 MiB last-level cache: its decode steps stream them
from memory, the regime of a served model on any hardware. The tiny model's 4.8 MiB stay in cache;
its decode step (~0.13 ms at batch 1) is bound by per-op overhead and small-matmul efficiency, and
a verify window saves only what larger matmuls gain in FLOP/s over small ones, which differs from
one CPU to the next (batch 8 at 2.6x-3.1x on one machine, 1.8x-1.9x on another), and prefill
(paid by both sides) is a large share of its time. Both are printed.

Section 1 runs at batch 1 and at batch 8 (--batch); sections 2 and 3 on the tiny model.

    python benchmarks/speculative.py [--max-tokens 224] [--k 32] [--batch 1,8] [--models tiny,medium]
"""
from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tiny_qwen3_next import CONFIG  # noqa: E402

from hybrid_jax import LLM, SamplingParams  # noqa: E402
from hybrid_jax.sampling import SamplerFlags  # noqa: E402
from hybrid_jax.speculative import verify  # noqa: E402


# The same 4 layers, wider: about 51 MiB of fp32 weights, past this CPU's 32 MiB last-level cache,
# so a plain decode step streams its weights from memory, as a served model's decode step does on
# any hardware (the regime speculation is for: K + 1 positions read the weights once). The tiny
# model's 4.8 MiB stay in cache, and its decode step is bound by per-op overhead and small-matmul
# efficiency instead, where a verify forward saves only what larger matmuls gain in FLOP/s.
CONFIG_MEDIUM = dict(CONFIG, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                     linear_value_head_dim=64, moe_intermediate_size=256, shared_expert_intermediate_size=256)
MODELS = {"tiny": CONFIG, "medium": CONFIG_MEDIUM}


def write_cycle_checkpoint(path: str, seed: int = 0, config: dict | None = None) -> np.ndarray:
    """The Qwen3-Next `config` (default: the tiny one) with its greedy next token rewired to
    sigma(t), one cycle over tokens 1 .. V-1 (token 0 is padding). Returns the cycle order [V-1]."""
    import torch  # noqa: PLC0415
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: PLC0415
    torch.manual_seed(seed)
    config = config or CONFIG
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config)).eval()
    V = config["vocab_size"]
    order = np.random.default_rng(seed).permutation(np.arange(1, V))
    with torch.no_grad():
        E = model.model.embed_tokens.weight
        E.mul_(1.0 / E[1:].std())                            # embeddings dominate the residual stream
        W = torch.zeros_like(model.lm_head.weight)           # [V, Hd]
        nxt = np.roll(order, -1)
        W[torch.as_tensor(nxt)] = E[torch.as_tensor(order)] / E[torch.as_tensor(order)].norm(dim=1, keepdim=True)
        model.lm_head.weight.copy_(8.0 * W)
    model.save_pretrained(path)
    return order


def spec_llm(llm, config: dict) -> LLM:
    """An LLM over llm's weights that speculates with `config` (its engine core runs the on-device
    n-gram loop or the verify step, whichever the config asks for)."""
    return LLM.from_params(llm.config, llm.params, dtype="float32", max_model_len=llm.max_model_len,
                           speculative_config=config)


def run(llm, prompts, sp) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def timed(fn, repeats=3):
    """Best-of-`repeats` wall time of fn() (after one warm-up call) and its result."""
    res = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        best = min(best, time.perf_counter() - t0)
    return best, res


def timed_pair(f, g, repeats=11):
    """Wall times of f() and g(), run alternately `repeats` times (after one warm-up call each), so
    load from other processes on a shared machine hits both alike. Returns (best tf, f(), best tg,
    g(), the median over the repeats of tf / tg within each back-to-back pair)."""
    rf, rg = f(), g()
    tf, tg = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rf = f()
        t1 = time.perf_counter()
        rg = g()
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        tg.append(t2 - t1)
    return min(tf), rf, min(tg), rg, float(np.median(np.asarray(tf) / np.asarray(tg)))


def draft_cost(llm, k, B=1, cap=512) -> float:
    """Marginal cost of one more draft token in a verify step, in plain decode steps: (verify time at
    K = k minus at K = 1) / (k - 1), over the time of one step of the on-device decode loop."""
    flags = SamplerFlags(False, False, False)
    z = jnp.zeros((B,), jnp.int32)
    samp = (jnp.zeros((B,), jnp.uint32), jnp.zeros((B,), jnp.float32), z, jnp.ones((B,), jnp.float32))
    kw = dict(cfg=llm.config, impl="auto", flags=flags)
    cache = [llm.new_cache(B, cap)]
    select = jax.jit(functools.partial(verify.select_verified, **kw), donate_argnums=(1,))

    def step(kk):
        meta = jnp.asarray(np.stack([np.full(B, kk + 1), np.full(B, kk), np.zeros(B)]).astype(np.int32))
        v = select(llm.params, cache[0], jnp.ones((B, kk + 1), jnp.int32), meta, None, *samp)
        cache[0] = v.cache.replace(lengths=jnp.full((B,), cap // 2, jnp.int32))
        np.asarray(v.n_accepted)

    # K = 1 and K = k alternately, the median of the back-to-back differences: two separate best-of-10
    # runs, each caught in its own lull or burst of load, once put one more draft at 0.046 decode steps
    # on a machine where it costs ~0.2
    step(1), step(k)
    extra = []
    for _ in range(15):
        t0 = time.perf_counter()
        step(1)
        t1 = time.perf_counter()
        step(k)
        extra.append(time.perf_counter() - 2 * t1 + t0)
    rows = np.stack([z, z + 1, z, z + 10**6, z + 64]).astype(np.int32)

    def chunk():
        toks, cache[0] = verify.decode_chunk(llm.params, cache[0], jnp.asarray(rows), jnp.full((B, 1), -1, jnp.int32),
                                             *samp, steps=64, **kw)
        cache[0] = cache[0].replace(lengths=jnp.full((B,), cap // 2, jnp.int32))
        np.asarray(toks)

    t_tok = timed(chunk, repeats=5)[0] / 64
    return max(float(np.median(extra)), 0.0) / (k - 1) / t_tok


def workloads(order, n_req, rng):
    V = CONFIG["vocab_size"]
    pos = {int(t): i for i, t in enumerate(order)}
    rep, edited = [], []
    for _ in range(n_req):      # a 240-token stretch of the cycle, then its first 16 tokens again (256 in all)
        s = int(rng.integers(0, len(order)))
        walk = [int(order[(s + i) % len(order)]) for i in range(240)]
        rep.append(walk + walk[:16])
        quote = list(walk)      # the same, with every 24th token of the quoted stretch changed (an "edit")
        for i in range(30, 240, 24):
            quote[i] = int(rng.integers(1, V))
        edited.append(quote + walk[:16])
    rnd = [rng.integers(1, V, 64).tolist() for _ in range(n_req)]
    return {"repetitive": rep, "edited quote": edited, "non-repetitive": rnd}, pos


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=224)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes for section 1")
    ap.add_argument("--models", default="tiny,medium", help="comma-separated, of: " + ", ".join(MODELS))
    args = ap.parse_args()
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    batches = [int(b) for b in args.batch.split(",")]
    models = args.models.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; models: Qwen3-Next (3 GDN + 1 attention, MoE, vocab "
          f"{CONFIG['vocab_size']}) with a cycle-rewired LM head (see the docstring), 'tiny' (hidden "
          f"{CONFIG['hidden_size']}) and 'medium' (hidden {CONFIG_MEDIUM['hidden_size']}, weights past the CPU's "
          f"last-level cache); greedy, batch {args.batch}, {args.max_tokens} new tokens per request, n-gram drafting "
          f"K <= {args.k}; prompts: repetitive 256 tokens (a stretch of the cycle, then its start again: the "
          f"continuation copies it), edited quote: the same with every 24th quoted token changed (drafts fail "
          f"there), non-repetitive 64 random tokens")
    print("\n1. tokens/s, plain vs speculative (best of R, the two run alternately after a warm-up; outputs"
          " compared token by token)")
    print(f"   {'model':<6} {'weights':>7} {'batch':>5} {'workload':<15} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'ratio':>6} {'pairs':>6} {'identical':>9} {'accept':>6} {'tok/verify':>10} {'verify/fallback tokens':>22}")
    notes = []
    for model in models:
        tmp = tempfile.mkdtemp()
        order = write_cycle_checkpoint(tmp, config=MODELS[model])
        mllm = LLM(model=tmp, dtype="float32")
        mib = sum(x.nbytes for x in jax.tree_util.tree_leaves(mllm.params)) / 2**20
        cost = draft_cost(mllm, args.k)
        repeats = 11 if model == "tiny" else 9
        notes.append(f"{model}: draft_cost {cost:.3f} (one more verified draft token, in plain decode steps, calibrated "
                     f"here), R = {repeats}")
        if model == "tiny":
            llm, tiny_cost, wls = mllm, cost, workloads(order, batches[0], np.random.default_rng(1))[0]
        for B in batches:
            for name, prompts in workloads(order, B, np.random.default_rng(1))[0].items():
                sllm = spec_llm(mllm, {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                       "draft_cost": cost})
                run(sllm, prompts, sp)                      # warm-up: compiles every bucket this run visits
                sllm.engine.spec.reset_stats()
                t_plain, base, t_spec, got, pair = timed_pair(lambda: run(mllm, prompts, sp),
                                                              lambda: run(sllm, prompts, sp), repeats=repeats)
                n = sum(len(t) for t in base)
                s = sllm.spec_stats()
                print(f"   {model:<6} {mib:>5.1f}Mi {B:>5} {name:<15} {n / t_plain:>11.1f} {n / t_spec:>10.1f} "
                      f"{t_plain / t_spec:>5.2f}x {pair:>5.2f}x {str(got == base):>9} {s['acceptance_rate']:>6.2f} "
                      f"{s['mean_accepted_length']:>10.2f} {s['emitted_tokens']:>11d}/{s['fallback_tokens']:<10d}",
                      flush=True)
    print("   (ratio = best plain time / best speculative time; pairs = the median over the R back-to-back pairs of"
          "\n    plain time / speculative time, less swayed by a lucky or unlucky run on a shared machine;"
          "\n    'tok/verify' = tokens emitted per row-verify, bonus included; the last column counts tokens over"
          "\n    the R + 1 speculative runs (warm-up included): emitted by verify steps / by plain fallback chunks)")
    for line in notes:
        print("   " + line)
    if "tiny" not in models:
        return
    cost = tiny_cost

    print("\n2. rollback by selection vs snapshot + replay (tiny model, the workloads above at batch "
          f"{batches[0]}, per rollback mode; both through the engine's verify step, since replay has no on-device "
          "loop; best of 7, the two alternating; pairs = median of the back-to-back ratios)")
    for name, prompts in wls.items():
        llms = {}
        for mode in ("selection", "replay"):
            llms[mode] = spec_llm(llm, {"method": "ngram", "rollback": mode, "device_loop": False,
                                        "num_speculative_tokens": args.k, "draft_cost": cost})
            run(llms[mode], prompts, sp)                                # compiles
            llms[mode].engine.spec.reset_stats()
        R = 7
        ts, got_s, tr, got_r, pair = timed_pair(lambda: run(llms["selection"], prompts, sp),
                                                lambda: run(llms["replay"], prompts, sp), repeats=R)
        sr = llms["replay"].spec_stats()     # R + 1 runs since reset_stats (timed_pair's warm-up included)
        print(f"   {name:<15} selection {ts * 1e3:7.1f} ms   replay {tr * 1e3:7.1f} ms   replay/selection "
              f"{tr / ts:4.2f}x (pairs {1 / pair:4.2f}x)   identical {got_s == got_r}   replays "
              f"{sr['replays'] // (R + 1)} per run of {sr['verify_steps'] // (R + 1)} verify steps")
    memory(llm, args.k)

    print("\n3. snapshot cost as the cache grows (batch 4): a snapshot is a reference to the old pytree")
    print(f"   {'capacity':>8} {'cache MiB':>9} {'snapshot (ref) us':>17} {'deep copy us':>12}")
    for cap in (256, 1024, 4096, 16384):
        cache = llm.new_cache(4, cap)
        jax.block_until_ready(cache)
        mib = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) / 2**20
        t_ref, _ = timed(lambda: [cache for _ in range(1000)][-1], repeats=5)
        t_copy, _ = timed(lambda: jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, cache)), repeats=5)
        print(f"   {cap:>8} {mib:>9.2f} {t_ref / 1000 * 1e6:>17.3f} {t_copy * 1e6:>12.1f}")


def memory(llm, k):
    """Device memory a verify step allocates beyond its inputs, per rollback mode, from XLA's own
    accounting of the compiled programs (outputs + temporaries - outputs aliased to donated inputs)."""
    B = 4
    flags = SamplerFlags(False, False, False)
    z = jnp.zeros((B,), jnp.int32)
    kw = dict(cfg=llm.config, impl="auto", flags=flags)

    def new_bytes(fn, *a):
        m = jax.jit(functools.partial(fn, **kw), donate_argnums=(1,)).lower(*a).compile().memory_analysis()
        if m is None:
            return float("nan")
        return (m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes) / 2**20

    print(f"   memory (batch {B}, K {k}): MiB a verify step allocates (both include the attention's temporaries over"
          f"\n   the whole capacity); selection adds per-token state updates (scale with K), replay a whole new cache"
          f"\n   (the snapshot is kept until the replay has run, so the verify cannot write in place: scales with"
          f"\n   the cache)")
    print(f"   {'capacity':>8} {'cache MiB':>9} {'selection':>9} {'replay (verify + replay)':>24}")
    for cap in (1024, 16384):
        cache = llm.new_cache(B, cap)
        args = (llm.params, cache, jnp.zeros((B, k + 1), jnp.int32), jnp.stack([z + k + 1, z + k, z]), None,
                jnp.zeros((B,), jnp.uint32), jnp.zeros((B,), jnp.float32), z, jnp.ones((B,), jnp.float32))
        mib = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) / 2**20
        sel = new_bytes(verify.select_verified, *args)
        rep = new_bytes(verify.replay_verified, *args)
        print(f"   {cap:>8} {mib:>9.2f} {sel:>9.2f} {rep:>24.2f}")


if __name__ == "__main__":
    main()
