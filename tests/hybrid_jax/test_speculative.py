"""Speculative decoding: exact for stateful models.

* greedy output with speculation is token-identical to plain greedy `LLM.generate`, for Qwen3-Next
  (Gated DeltaNet + gated attention) and DeepSeek-V3.2 (MLA + indexer) tiny checkpoints, over
  several prompts (one that quotes itself, so drafts are accepted), batch sizes, K, both rollback
  modes, dynamic K on and off, n-gram and draft-model drafting;
* a verify step's cache after rollback (selection and snapshot + replay) equals the cache of plain
  decode steps over the kept tokens, and the version of a row that rejected anything changes;
* rejection sampling preserves the target distribution: chi-square goodness-of-fit tests on the
  probability math directly (vocabulary of 6, 40 000 draws, fixed seed, significance level 0.001);
* config parsing, the n-gram drafter and the dynamic-K rule, stats(); the on-device loop's n-gram
  proposal and dynamic-K rule equal the host drafter's and tracker's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from conftest import make_checkpoint
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.errors import InputError
from hybrid_jax.models import get_model
from hybrid_jax.sampling import SamplerFlags
from hybrid_jax.speculative import parse_speculative_config
from hybrid_jax.speculative import verify
from hybrid_jax.speculative.acceptance import rejection_sample
from hybrid_jax.speculative.device_loop import choose_k as device_choose_k, loop_buckets, ngram_propose, prompt_tail_checks
from hybrid_jax.speculative.drafters import NgramDrafter
from hybrid_jax.speculative.dynamic_k import WARM_TAIL, AcceptanceTracker, choose_k, draft_floor, tail_checks

ALPHA = 0.001            # significance level of the distribution tests
QWEN = dict(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2, num_experts=0, vocab_size=64)
DSV32 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, n_group=2,
             topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
             v_head_dim=12, qk_nope_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=32,
             first_k_dense_replace=1, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
             pad_token_id=None)
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return LLM(model=make_checkpoint(tmp_path_factory.mktemp("spec") / "q", seed=3, **QWEN), dtype="float32")


@pytest.fixture(scope="module")
def qwen_draft(tmp_path_factory):
    """Same shape as `qwen`, other weights: its drafts are partly accepted."""
    return make_checkpoint(tmp_path_factory.mktemp("spec") / "qd", seed=4, **QWEN)


@pytest.fixture(scope="module")
def dsv32(tmp_path_factory):
    import torch  # noqa: PLC0415
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: PLC0415
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("spec") / "ds")
    DeepseekV32ForCausalLM(DeepseekV32Config(**DSV32)).eval().save_pretrained(path)
    return LLM(model=path, dtype="float32")


def _prompts(vocab, lens, seed=0):
    rng = np.random.default_rng(seed)
    out = [rng.integers(0, vocab, n).tolist() for n in lens]
    out[0] = (out[0] * 4)[:max(lens[0], 12)]     # quotes itself: n-gram drafts get accepted
    return out


_BASELINES: dict = {}


def _plain(llm, prompts, sp=GREEDY):
    """Plain LLM.generate output (memoised: several tests share a baseline)."""
    key = (id(llm), repr(prompts), repr(sp))
    if key not in _BASELINES:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        _BASELINES[key] = [o.outputs[0].token_ids for o in outs]
    return _BASELINES[key]


_SPEC_LLMS: dict = {}


def _spec_llm(llm, config):
    """An LLM over the same weights with a speculative config, and its engine's speculator with fresh
    counters (memoised per checked config: its engine's programs compile once for every test using it)."""
    key = (id(llm), parse_speculative_config(config))
    if key not in _SPEC_LLMS:
        _SPEC_LLMS[key] = LLM.from_params(llm.config, llm.params, dtype=jnp.dtype(llm.dtype).name,
                                          max_model_len=llm.max_model_len, speculative_config=config)
    s = _SPEC_LLMS[key]
    s.engine.spec.reset_stats()
    return s, s.engine.spec


def _spec_out(llm, prompts, config, sp=GREEDY):
    """[(token ids, finish reason)] per prompt from the speculating LLM, and its speculator."""
    s, dec = _spec_llm(llm, config)
    outs = s.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], dec


def _spec(llm, prompts, config, sp=GREEDY):
    got, dec = _spec_out(llm, prompts, config, sp)
    return [t for t, _ in got], dec


# The tests share batch buckets, capacities and K where they can, so programs compile once for all.
LENS = [5, 12, 20]        # 3 prompts: batch bucket 4, prompt bucket 32


# --- greedy equality -------------------------------------------------------------------------------

# selection runs the engine's on-device loop (dynamic K there; the DeepSeek test runs it with a fixed
# K), replay the engine's verify step.
@pytest.mark.parametrize("rollback,dynamic,batches", [("selection", True, (LENS, [9])), ("replay", False, (LENS,))])
def test_qwen3_next_greedy_identical(qwen, rollback, dynamic, batches):
    # A low draft cost makes dynamic K speculate from the first step, so short runs verify a lot.
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback, "dynamic_k": dynamic,
           "draft_cost": 0.05}
    llm, dec = _spec_llm(qwen, cfg)
    for i, lens in enumerate(batches):
        prompts = _prompts(64, lens, seed=i)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == _plain(qwen, prompts)
    s = dec.stats()
    assert 0 < s["accepted_tokens"] < s["draft_tokens"]           # both acceptance and rollback ran
    assert (s["replays"] > 0) == (rollback == "replay")


@pytest.mark.parametrize("rollback", ["selection", "replay"])
def test_deepseek_v32_greedy_identical(dsv32, rollback):
    prompts = _prompts(64, [6, 30], seed=2)       # 30 > index_topk: the indexer really selects
    got, dec = _spec(dsv32, prompts, {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback,
                                      "dynamic_k": False})
    assert got == _plain(dsv32, prompts)
    assert 0 < dec.stats()["accepted_tokens"] < dec.stats()["draft_tokens"]


def test_draft_model_greedy_identical_and_sampling_runs(qwen, qwen_draft):
    prompts = _prompts(64, LENS)
    cfg = {"method": "draft_model", "model": qwen_draft, "num_speculative_tokens": 3, "dynamic_k": False}
    got, dec = _spec(qwen, prompts, cfg)
    assert got == _plain(qwen, prompts)
    s = dec.stats()
    assert 0 < s["acceptance_rate"] < 1 and s["draft_time_s"] > 0
    # Sampled rows use the draft's q in rejection sampling; a seed makes the run reproducible.
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=7)
    a, _ = _spec(qwen, prompts, dict(cfg, rollback="replay"), sp=sp)
    b, _ = _spec(qwen, prompts, dict(cfg, rollback="replay"), sp=sp)
    assert a == b and all(len(t) == 24 and all(0 <= x < 64 for x in t) for t in a)


@pytest.mark.parametrize("device_loop", [True, False])
def test_first_token_stop_and_one_token_budget_like_plain(qwen, device_loop):
    """The first token comes from prefill (the on-device loop starts after it): a stop token there,
    or max_tokens = 1, ends the row at once, as in plain decoding."""
    prompts = _prompts(64, LENS)
    first = [t[0] for t in _plain(qwen, prompts)]
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "device_loop": device_loop}
    sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first[1]])
    got, _ = _spec_out(qwen, prompts, cfg, sp)
    assert [t for t, _ in got] == _plain(qwen, prompts, sp)
    assert got[1] == ([first[1]], "stop") and all(len(t) > 1 for t, _ in got[:1] + got[2:] if t[0] != first[1])
    one, _ = _spec_out(qwen, prompts, cfg, SamplingParams(temperature=0, max_tokens=1))
    assert one == [([f], "length") for f in first]


@pytest.mark.parametrize("rollback", ["selection", "replay"])      # selection: the on-device loop
def test_stop_tokens_and_max_tokens_cut_like_plain(qwen, rollback):
    prompts = _prompts(64, LENS)
    stop = _plain(qwen, prompts)[0][6]            # a token row 0 emits mid-way
    sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])
    # A fixed K verifies at every step (dynamic K would read these random prompts' tails as cold
    # and decode the 24 tokens in one plain chunk), so the stop token lands inside a verify window.
    got, dec = _spec(qwen, prompts, {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback,
                                     "dynamic_k": False}, sp=sp)
    assert got == _plain(qwen, prompts, sp)
    s = dec.stats()
    assert s["verify_steps"] > 0 and 0 < s["accepted_tokens"] < s["draft_tokens"]
    assert got[0][-1] == stop and len(got[0]) <= 7
    log = dec.step_log()
    assert len(log) == s["row_verifies"] and all(0 <= a <= k for _, _, k, a in log)
    assert sum(a + 1 for _, _, _, a in log) == s["emitted_tokens"]


def test_device_loop_sampled_rows_follow_their_seeds(qwen):
    """Sampled rows in the on-device loop: a seed reproduces its tokens, another seed changes them."""
    prompts = _prompts(64, LENS)
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "draft_cost": 0.05}
    sp = [SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=s) for s in (7, 7, 8)]
    a, dec = _spec(qwen, prompts, cfg, sp=sp[0])
    b, _ = _spec(qwen, prompts, cfg, sp=sp[1])
    c, _ = _spec(qwen, prompts, cfg, sp=sp[2])
    assert a == b and a != c
    assert all(len(t) == 24 and all(0 <= x < 64 for x in t) for t in a)
    assert dec.stats()["verify_steps"] > 0


# --- rollback --------------------------------------------------------------------------------------

def _decode_steps(cfg, params, cache, tokens):
    """Reference: plain single-token decode steps. tokens: list (per row) of token lists."""
    fwd = jax.jit(lambda c, t, n: get_model(cfg.model_type).forward(cfg, params, c, t, n).cache)
    for j in range(max(map(len, tokens))):
        t = jnp.asarray([[r[j] if j < len(r) else 0] for r in tokens], jnp.int32)
        cache = fwd(cache, t, jnp.asarray([int(j < len(r)) for r in tokens], jnp.int32))
    return cache


def _row_positions(g, field, b):
    """Row b's entries of a paged KV field, read through its page table, in token order: [L, S, Hkv, D]."""
    a = np.asarray(getattr(g, field))[:, np.asarray(g.page_table[b])]          # [L, NP, ps, Hkv, D]
    return a.reshape((a.shape[0], -1) + a.shape[3:])


def test_rollback_selection_and_replay_equal_plain_decode(qwen):
    cfg, params = qwen.config, qwen.params
    prompts = _prompts(64, LENS)
    cont = _plain(qwen, prompts)
    # pending = first generated token; drafts: all right / right, wrong, right / wrong (2 drafts);
    # the 4th row is padding (feeds nothing).
    drafts = [cont[0][1:4], [cont[1][1], (cont[1][2] + 1) % 64, cont[1][3]], [(cont[2][1] + 1) % 64, cont[2][2], 0]]
    n_draft = np.array([3, 3, 2, 0], np.int32)
    n_fed = jnp.asarray([4, 4, 3, 0], jnp.int32)
    tokens = jnp.asarray([[c[0]] + d for c, d in zip(cont, drafts)] + [[0] * 4], jnp.int32)
    flags = SamplerFlags(False, False, False)
    z = jnp.zeros((4,), jnp.int32)
    seeds, temp, top_p = jnp.zeros((4,), jnp.uint32), jnp.zeros((4,), jnp.float32), jnp.ones((4,), jnp.float32)

    fwd = jax.jit(lambda c, t, n: get_model(cfg.model_type).forward(cfg, params, c, t, n).cache)

    def prefilled():
        c = get_model(cfg.model_type).new_cache(cfg, 4, 64, qwen.dtype)
        t = np.zeros((4, 32), np.int32)
        for i, p in enumerate(prompts):
            t[i, :len(p)] = p
        return fwd(c, jnp.asarray(t), jnp.asarray(LENS + [0], jnp.int32))

    meta = jnp.stack([n_fed, jnp.asarray(n_draft), z])                        # n_fed, n_draft, step
    args = (tokens, meta, None, seeds, temp, z, top_p, cfg, "auto", flags)
    base = prefilled()
    v0 = np.asarray(base.version)
    v = jax.jit(lambda c: verify.select_verified(params, c, *args))(prefilled())
    sel = v.cache
    assert np.asarray(v.n_accepted)[:3].tolist() == [3, 1, 0]
    emitted = [np.asarray(v.tokens)[i, :a + 1].tolist() for i, a in enumerate([3, 1, 0])]
    assert emitted == [c[1:a + 2] for c, a in zip(cont, [3, 1, 0])]         # kept drafts, then the target's token
    v = jax.jit(lambda c: verify.replay_verified(params, c, *args))(base)
    rep = v.cache
    assert np.asarray(v.n_accepted)[:3].tolist() == [3, 1, 0]
    ref = _decode_steps(cfg, params, prefilled(), [c[:a + 1] for c, a in zip(cont, [3, 1, 0])] + [[]])
    for got in (sel, rep):
        np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
        # every row that fed tokens got a new version; those that rejected some, a second one
        np.testing.assert_array_equal(np.asarray(got.version), v0 + np.array([1, 2, 2, 0]))
        rg, rr = got.groups["linear_attention"], ref.groups["linear_attention"]
        np.testing.assert_allclose(np.asarray(rg.ssm), np.asarray(rr.ssm), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(rg.conv), np.asarray(rr.conv), rtol=1e-5, atol=1e-6)
        kg, kr = got.groups["full_attention"], ref.groups["full_attention"]
        for b, n in enumerate(np.asarray(ref.lengths)):       # live slots equal; rejected ones are past lengths
            for f in ("k", "v"):
                np.testing.assert_allclose(_row_positions(kg, f, b)[:, :n], _row_positions(kr, f, b)[:, :n],
                                           rtol=1e-5, atol=1e-6)


# --- rejection sampling preserves the target distribution --------------------------------------------

def _chi2_p(samples, probs):
    counts = np.bincount(samples, minlength=len(probs))
    probs = np.asarray(probs, np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return sps.chisquare(counts[keep], expected * (counts.sum() / expected.sum())).pvalue


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
def test_rejection_sampling_preserves_target_distribution(drafter):
    N, V, K = 40_000, 6, 2
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V), size=K + 1).astype(np.float32)            # target, per position
    p[0, 5] = 0.0                                                            # a token the target never emits
    p /= p.sum(-1, keepdims=True)
    if drafter == "draft_model":
        q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)
        draft = np.stack([rng.choice(V, size=N, p=q[j] / q[j].sum()) for j in range(K)], 1).astype(np.int32)
        q_arr = jnp.broadcast_to(jnp.asarray(q), (N, K, V))
    else:       # a deterministic drafter always proposing the same tokens: q is one-hot
        draft = np.tile(np.argmax(p[:K], axis=-1).astype(np.int32)[None], (N, 1))
        q_arr = None
    keys = jax.vmap(jax.random.key)(jnp.arange(N, dtype=jnp.uint32))
    n_acc, out = jax.jit(rejection_sample)(jnp.broadcast_to(jnp.asarray(p), (N, K + 1, V)), jnp.asarray(draft),
                                           q_arr, jnp.full((N,), K, jnp.int32), keys, jnp.zeros((N,), jnp.int32))
    n_acc, out = np.asarray(n_acc), np.asarray(out)
    assert _chi2_p(out[:, 0], p[0]) > ALPHA                                  # first token ~ p_0
    second = n_acc >= 1                                                      # draft 1 kept: next token ~ p_1
    assert second.sum() > 1000 and _chi2_p(out[second, 1], p[1]) > ALPHA
    third = n_acc >= 2                                                       # both kept: bonus ~ p_2
    assert third.sum() > 500 and _chi2_p(out[third, 2], p[2]) > ALPHA
    # The test has power: the draft's own distribution is rejected as the first token's law.
    wrong = (q[0] if drafter == "draft_model" else np.eye(V)[draft[0, 0]]).astype(np.float64) + 1e-3
    assert _chi2_p(out[:, 0], wrong / wrong.sum()) < ALPHA


# --- pieces ----------------------------------------------------------------------------------------

def test_parse_speculative_config(tmp_path):
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.rollback, c.dynamic_k) == \
        ("ngram", 4, 3, "auto", True)
    assert c.k_buckets() == (1, 2, 4) and c.k_bucket(3) == 4
    assert parse_speculative_config({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2,
                                     "rollback": "replay"}).model == str(tmp_path)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("bad,words", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rollback": "undo"}, "rollback"),
    ({"method": "ngram", "num_speculative_tokens": 2, "dynamic_k": "yes"}, "dynamic_k"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speed": 9}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/no/such/dir", "num_speculative_tokens": 2}, "/no/such/dir"),
    ("ngram", "dict"),
])
def test_bad_speculative_config_names_the_problem(bad, words):
    with pytest.raises(InputError, match=words):
        parse_speculative_config(bad)


def test_auto_rollback_follows_the_cache_groups():
    """"auto" is selection where every group can be truncated by selection (Gated DeltaNet state, pages)
    and replay where a group is rewritten in place (DeepSeek-V4's window ring, tails, entry counts); an
    explicit "selection" there is refused, naming the groups."""
    from cache.compressed import init_compressed_groups  # noqa: PLC0415
    from cache.state import init_cache  # noqa: PLC0415
    from hybrid_jax.speculative.config import resolve_rollback  # noqa: PLC0415
    qwen = init_cache(batch_size=1, capacity=16, layer_types=("linear_attention", "full_attention"),
                      dtype=jnp.float32, conv_dim=8, conv_width=4, linear_heads=(2, 4, 4), kv_heads=1, head_dim=4,
                      page_size=8).groups
    v4 = init_compressed_groups(batch_size=1, capacity=16, dtype=jnp.float32, window=4, head_dim=8, all_layers=(0, 1),
                                csa_layers=(1,), csa_rate=4, index_dim=8, hca_layers=(), hca_rate=8)
    auto = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert resolve_rollback(auto, qwen).rollback == "selection"
    assert resolve_rollback(auto, v4).rollback == "replay"
    explicit = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "rollback": "selection"})
    assert resolve_rollback(explicit, qwen).rollback == "selection"
    with pytest.raises(InputError, match="sliding_window"):
        resolve_rollback(explicit, v4)


def test_ngram_drafter():
    d = NgramDrafter(1, 3)
    h = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2])
    assert d.propose(h, 2).tolist() == [3, 7]           # longest suffix (1, 2) most recently followed by 3, 7
    assert d.propose(np.array([4, 6, 4, 6]), 5).tolist() == [4, 6, 4, 6, 4]   # reads on through a short loop
    assert d.propose(np.array([1, 2, 3]), 3).size == 0  # nothing recurs
    assert NgramDrafter(2, 3).propose(np.array([1, 9, 3, 1]), 2).size == 0   # only a 1-gram recurs
    toks, start = d.propose_at(h, 2)
    assert start == 7 and toks.tolist() == [3, 7]  # the most recent (1, 2) sits at 5..6: the copy starts at 7
    assert NgramDrafter.read_from(np.array([4, 5, 6]), 1, 4).tolist() == [5, 6, 5, 6]


@pytest.mark.parametrize("lo,hi", [(1, 4), (2, 3), (1, 1)])
def test_device_ngram_proposal_equals_host_drafter(lo, hi):
    rng = np.random.default_rng(lo * 10 + hi)
    K, H = 6, 40
    hists = []
    for i in range(24):
        n = int(rng.integers(2, 30))
        h = rng.integers(0, 5 if i % 2 else 40, n)            # small alphabets recur, large ones rarely
        if i % 3 == 0:
            h = np.concatenate([h, h[: int(rng.integers(1, n + 1))]])   # quotes itself
        hists.append(h[:H - 1])
    buf = np.full((len(hists), H), 99, np.int32)                 # slots past the history hold junk
    for i, h in enumerate(hists):
        buf[i, :len(h)] = h
    lens = np.array([len(h) for h in hists], np.int32)
    prop, start = jax.jit(ngram_propose, static_argnums=(2, 3, 4))(jnp.asarray(buf), jnp.asarray(lens), K, lo, hi)
    found = 0
    for i, h in enumerate(hists):
        want, want_start = NgramDrafter(lo, hi).propose_at(h, K)
        assert int(start[i]) == want_start, i
        if want_start >= 0:
            found += 1
            assert np.asarray(prop[i]).tolist() == want.tolist(), i
    assert 0 < found < len(hists)


@pytest.mark.parametrize("lo,hi", [(1, 4), (2, 3)])
def test_device_prompt_tail_checks_equal_host(lo, hi):
    """The warm start's prompt-tail checks on device count what the host drafter would have guessed."""
    rng = np.random.default_rng(lo * 7 + hi)
    H, hists = 64, []
    for i in range(30):
        n = int(rng.integers(1, 40))
        h = rng.integers(0, 4 if i % 2 else 50, n)
        if i % 3 == 0:
            h = np.concatenate([h, h[: int(rng.integers(1, n + 1))]])          # quotes itself
        hists.append(h[:H - 1])
    buf = np.full((len(hists), H), 99, np.int32)
    for i, h in enumerate(hists):
        buf[i, :len(h)] = h
    lens = np.array([len(h) for h in hists], np.int32)
    got = jax.jit(prompt_tail_checks, static_argnums=(2, 3, 4))(jnp.asarray(buf), jnp.asarray(lens), WARM_TAIL, lo, hi)
    got = np.stack([np.asarray(x) for x in got], axis=1)
    want = np.array([tail_checks(h, NgramDrafter(lo, hi)) for h in hists])
    assert got.tolist() == want.tolist()
    hits, checks, run = want.T
    assert (hits == 0).any() and (run >= WARM_TAIL // 2).any() and ((hits > 0) & (run == 0)).any()
    assert checks.max() == WARM_TAIL and checks.min() < WARM_TAIL


def test_tail_checks_of_a_quote_and_of_text_that_never_recurs():
    walk = np.random.default_rng(0).permutation(100)[:40]
    quote = np.concatenate([walk, walk[:20]])
    assert tail_checks(quote, NgramDrafter(1, 4)) == (WARM_TAIL, WARM_TAIL, WARM_TAIL)
    assert tail_checks(walk, NgramDrafter(1, 4)) == (0, WARM_TAIL, 0)
    t = AcceptanceTracker(2)
    t.warm_start(0, WARM_TAIL, WARM_TAIL, WARM_TAIL)     # copied text: a full K from the first step
    t.warm_start(1, 5, WARM_TAIL, 5)                       # a short run is no streak
    assert t.next_k(0, 32, 0.5) == 32 and t.streak[1] == 0
    assert t.rate()[0] > 0.9 and t.rate()[1] < 0.4


@pytest.mark.parametrize("device_loop", [True, False])
def test_warm_start_drafts_a_full_k_on_a_quoting_prompt_and_skips_to_long_chunks_on_a_cold_one(qwen, device_loop):
    """A prompt whose tail prompt lookup predicts drafts K at once (no slow start from plain chunks);
    a prompt where no lookup ever lands decodes in the longest plain chunk from the start."""
    rng = np.random.default_rng(0)
    seed = rng.integers(0, 64, 12).tolist()
    looped = seed + _plain(qwen, [seed], SamplingParams(temperature=0, max_tokens=40))[0]   # greedy text loops
    cfg = {"method": "ngram", "num_speculative_tokens": 8, "device_loop": device_loop}
    sp = SamplingParams(temperature=0, max_tokens=40)
    got, dec = _spec(qwen, [looped], cfg, sp)
    assert got == _plain(qwen, [looped], sp)
    _, _, run = tail_checks(np.asarray(looped + got[0][:1]), NgramDrafter())
    assert run >= WARM_TAIL // 2                      # the premise: the tail is copied text
    s, log = dec.stats(), dec.step_log()
    assert s["fallback_chunks"] == 0 and log[0][1:3] == (1, 8)        # first step: verify, k = K
    cold = rng.permutation(64)[:30].tolist()          # no token recurs: lookup never guesses
    got, dec = _spec(qwen, [cold], cfg, sp)
    assert got == _plain(qwen, [cold], sp)
    s = dec.stats()
    assert s["fallback_chunks"] == 1 and s["fallback_tokens"] == 39 and s["verify_steps"] == 0


def test_device_dynamic_k_equals_host_rule():
    rng = np.random.default_rng(0)
    n = 60
    rates = rng.uniform(0.0, 0.98, n).astype(np.float32)
    streak, run, gap = (rng.choice([0, 1, 3, 8, 20], n), rng.integers(0, 30, n), rng.choice([0, 5, 8, 12, 40], n))
    floor = draft_floor(jnp.asarray(streak), jnp.asarray(run), jnp.asarray(gap), jnp.where)
    got = np.asarray(device_choose_k(jnp.asarray(rates), floor, 16, 0.3))
    t = AcceptanceTracker(n)
    t.accepted, t.trials = rates.astype(np.float64), np.ones(n)
    t.streak, t.run, t.gap = streak, run, gap
    want = [t.next_k(r, 16, 0.3) for r in range(n)]
    assert got.tolist() == want and len(set(want)) > 4
    rate_only = [choose_k(float(a), 16, 0.3) for a in rates]
    assert sum(w > r for w, r in zip(want, rate_only)) > 10      # the floor raised k in many rows


def test_dynamic_k_follows_acceptance():
    assert choose_k(0.0, 4, 0.25) == 0 and choose_k(0.99, 4, 0.25) == 4
    ks = [choose_k(a, 8, 0.25) for a in np.linspace(0, 0.99, 12)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8
    t = AcceptanceTracker(2, decay=0.5)
    for _ in range(6):
        t.update(0, 4, 4)           # row 0: every draft accepted
        t.update(1, 4, 0)           # row 1: every draft rejected
    r = t.rate()
    assert r[0] > 0.9 and r[1] < 0.1


def test_dynamic_k_slow_start_doubles_while_every_draft_lands():
    t = AcceptanceTracker(1)                 # prior rate 0.2: the rate alone drafts nothing yet
    assert t.next_k(0, 32, 0.5) == choose_k(0.2, 32, 0.5) == 0
    t.update(0, 4, 4)                        # a shadow check: all 4 proposed tokens matched
    ks = [t.next_k(0, 32, 0.5)]
    for _ in range(4):
        t.update(0, ks[-1], ks[-1])          # each verify accepts all its drafts
        ks.append(t.next_k(0, 32, 0.5))
    assert ks == [8, 16, 32, 32, 32]
    assert choose_k(float(t.rate()[0]), 32, 0.5) < 32     # the lagging rate alone would draft less
    t.update(0, 32, 5)                       # a rejection ends the streak, but a run of 102 was seen:
    assert t.gap[0] == 102 and t.next_k(0, 32, 0.5) == 32         # the copy is expected to go on
    t.update(0, 32, 2)                       # a short run: back to what the rate supports
    assert t.next_k(0, 32, 0.5) == choose_k(float(t.rate()[0]), 32, 0.5) < 32


@pytest.mark.parametrize("period", [24, 13, 40])
def test_dynamic_k_settles_to_one_verify_per_edit_on_text_edited_every_period_tokens(period):
    """Drafts of copied text fail once per edit (every `period` tokens) and land everywhere else:
    after the first edits, each verify drafts up to and including the next edit (period - 1 drafts
    land, the edited token is the bonus): one verify per edit, two when the period exceeds K + 1 (K
    drafts and their bonus, then the rest); the rate alone would draft far less."""
    t, K, pos, ks = AcceptanceTracker(1), 32, 0, []
    t.update(0, 8, 8)                        # the copy was seen to land
    for _ in range(12):
        k = t.next_k(0, K, 0.5)
        to_edit = period - 1 - pos % period  # drafts before the next edited token
        a = min(k, to_edit)
        t.update(0, k, a)
        pos += a + 1
        ks.append((k, a))
    steady = ks[-6:]
    if period <= K:
        assert all(k == period and a == period - 1 for k, a in steady), ks
    else:
        assert all((k, a) == (K, K) or a == period - K - 2 < k for k, a in steady), ks
        assert sum(a == K for _, a in steady) == 3, ks                   # two verifies per edit
    assert choose_k(float(t.rate()[0]), K, 0.5) < min(period, K) // 2


@pytest.mark.parametrize("device_loop", [True, False])
def test_ngram_drafts_fill_the_verify_bucket(qwen, device_loop):
    """A verify runs Kb + 1 positions for every row whatever k the acceptance rate asked for, so an
    n-gram row drafts up to the bucket (or to its token budget): the extra drafts are free."""
    rng = np.random.default_rng(0)
    seeds = [rng.integers(0, 64, n).tolist() for n in (12, 20, 9, 16)][::3]
    first = _plain(qwen, seeds, SamplingParams(temperature=0, max_tokens=40))
    prompts = [p + o for p, o in zip(seeds, first)]      # the model's greedy text falls into loops
    sp = SamplingParams(temperature=0, max_tokens=64)
    got, dec = _spec(qwen, prompts, {"method": "ngram", "num_speculative_tokens": 12, "device_loop": device_loop}, sp)
    assert got == _plain(qwen, prompts, sp)
    buckets = set(loop_buckets(12, True)) if device_loop else set(dec.spec.k_buckets())
    log = dec.step_log()
    assert len(log) >= 2
    for _, pos, k, _ in log:
        assert k in buckets or k == sp.max_tokens - pos - 1, (k, pos, sorted(buckets))


def test_dynamic_k_falls_back_to_plain_decode_on_non_repetitive_text(qwen):
    prompts = [np.random.default_rng(9 + i).integers(0, 64, n).tolist() for i, n in enumerate(LENS)]
    got, dec = _spec(qwen, prompts, {"method": "ngram", "num_speculative_tokens": 3})
    assert got == _plain(qwen, prompts)
    s = dec.stats()
    assert s["fallback_tokens"] > 0 and s["fallback_chunks"] >= 2
    assert set(s) >= {"acceptance_rate", "mean_accepted_length", "draft_time_s", "verify_time_s"}
    log = dec.step_log()
    assert all(0 <= a <= k for _, _, k, a in log) and len(log) == s["row_verifies"]
