"""Offline speculative generation: `SpeculativeDecoder(...).generate(prompts, params, eos_ids)`.

The host loop per batch (rows padded to power-of-two buckets, every device step jitted):

  prefill -> first token (sampled like plain decoding)
  repeat until every row stopped:
    choose k[b] per row (dynamic K from its acceptance rate, or K), draft up to k[b] tokens (n-gram
        rows then fill the verify's bucket: it runs that many positions for every row anyway)
    if no row has a draft: one on-device chunk of plain decode steps (the K = 0 fallback); the
        n-gram drafter's proposal is checked against what the chunk produced ("shadow" acceptance),
        so a request whose text turns repetitive climbs back to K > 0; while those checks keep
        failing, chunks grow 4x each time (up to 32 x fallback_steps) so the host loop costs less and less
    else: ONE target forward over [pending, drafts], acceptance (greedy / rejection sampling) and
        rollback of the rejected tokens by selection or snapshot + replay

Greedy rows produce exactly the tokens of plain greedy decoding; sampled rows follow the target
distribution exactly (see acceptance.py). Stop tokens and max_tokens cut the emitted tokens on the host.
"""
from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from hybrid_jax.config import load_config
from hybrid_jax.errors import InputError
from hybrid_jax.generate import bucket, make_batch
from hybrid_jax.models import empty_cache, get_model
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.speculative.config import SpeculativeConfig, parse_speculative_config
from hybrid_jax.speculative.device_loop import LoopConfig, loop_buckets, ngram_generate
from hybrid_jax.speculative.drafters import DraftModelDrafter, NgramDrafter
from hybrid_jax.speculative.dynamic_k import AcceptanceTracker, cold_tail, tail_checks
from hybrid_jax.speculative.metrics import SpecMetrics
from hybrid_jax.speculative.verify import TargetSteps
from hybrid_jax.weights import open_checkpoint

MAX_CHUNK_GROWTH = 32        # fallback chunks grow 4x per quiet chunk, to at most 32 x fallback_steps
QUIET_MAX = 3                # quiet chunks in a row that reach it (4 ** 3 >= 32)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def load_draft_model(path: str, dtype: str = "auto"):
    """Reads a draft checkpoint the loader accepts. Returns (cfg, params, jnp dtype)."""
    reader = open_checkpoint(path)
    cfg = load_config(path)
    dt = _DTYPES[cfg.dtype if dtype == "auto" else dtype]
    params = get_model(cfg.model_type).convert_hf_weights(cfg, reader.get, reader.has, dt)
    return cfg, params, dt


class SpeculativeDecoder:
    """Speculative generation for one target model.

    cfg, params, dtype: the target (as LLM holds them); spec_config: a SpeculativeConfig or its
    vLLM-shaped dict; impl: kernel choice; draft: (cfg, params, dtype) of a draft model, or None to
    load spec_config.model (method "draft_model"); max_num_seqs: rows per batch."""

    def __init__(self, cfg, params, dtype, spec_config: SpeculativeConfig | dict, impl: str = "auto",
                 draft=None, max_num_seqs: int = 16):
        self.spec = parse_speculative_config(spec_config)
        if self.spec is None:
            raise InputError("SpeculativeDecoder needs a speculative_config")
        self.cfg, self.params, self.dtype = cfg, params, dtype
        self.model = get_model(cfg.model_type)
        self.steps, self.impl = TargetSteps(cfg, impl), impl
        if not isinstance(max_num_seqs, int) or max_num_seqs <= 0:
            raise InputError(f"max_num_seqs must be a positive integer; got {max_num_seqs!r}")
        self.max_num_seqs = max_num_seqs
        self.ngram = self.drafter = None
        if self.spec.method == "ngram":
            self.ngram = NgramDrafter(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        else:
            if draft is None:
                draft = load_draft_model(self.spec.model, self.spec.draft_dtype)
            dcfg, dparams, ddtype = draft
            if dcfg.vocab_size != cfg.vocab_size:
                raise InputError(f"draft model vocabulary ({dcfg.vocab_size}) differs from the target's "
                                 f"({cfg.vocab_size}); a draft model must share the tokenizer")
            self.drafter = DraftModelDrafter(dcfg, dparams, ddtype, impl)
        self.metrics = SpecMetrics()

    # --- public API --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Acceptance rate, mean accepted length (tokens per row-verify, bonus included), draft /
        verify / fallback-decode / prefill time (s), counters, and the configuration."""
        d = self.metrics.as_dict()
        d.update(method=self.spec.method, num_speculative_tokens=self.spec.num_speculative_tokens,
                 rollback=self.spec.rollback, dynamic_k=self.spec.dynamic_k)
        return d

    def step_log(self) -> list[tuple[int, int, int, int]]:
        """(request index, tokens generated before the step, k drafted, k accepted) per row-verify."""
        return list(self.metrics.log)

    def reset_stats(self):
        self.metrics = SpecMetrics()

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], eos_ids=(),
                 seeds: list[int] | None = None) -> list[tuple[list[int], str]]:
        """prompts: token id lists; params: one SamplingParams per prompt; eos_ids: stop ids added
        unless ignore_eos; seeds: per-row default seeds for unseeded sampled rows (default 0..n-1).
        Returns [(token_ids, finish_reason "stop" | "length")] in prompt order."""
        if not prompts:
            raise InputError("no prompts given")
        if len(params) != len(prompts):
            raise InputError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise InputError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise InputError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise InputError(f"params must be SamplingParams; got {type(p).__name__}")
            p.validate()
            if p.logprobs is not None:
                raise InputError("logprobs are not supported with speculative decoding; drop speculative_config "
                                 "or logprobs")
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise InputError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, tuple[list[int], str]] = {}
        for s in range(0, len(order), self.max_num_seqs):
            idx = order[s:s + self.max_num_seqs]
            res = self._run_batch([list(map(int, prompts[i])) for i in idx], [params[i] for i in idx],
                                  tuple(eos_ids), [seeds[i] for i in idx], idx)
            results.update(zip(idx, res))
        return [results[i] for i in range(len(prompts))]

    # --- one batch ---------------------------------------------------------------------------------
    def _run_batch(self, prompts, sps, eos_ids, seeds, req_ids):
        spec, st, m = self.spec, self.steps, self.metrics
        b = make_batch(prompts, sps, eos_ids, seeds)
        n, B = len(prompts), b.tokens.shape[0]
        if self.ngram is not None and spec.rollback == "selection" and spec.device_loop:
            return self._device_loop(b, n, req_ids)
        samp = tuple(jnp.asarray(x) for x in (b.seeds, b.temperature, b.top_k, b.top_p))
        stop_dev = jnp.asarray(b.stop_ids)
        t0 = time.perf_counter()
        cache = empty_cache(self.cfg, B, b.capacity, self.dtype)
        first, cache = st.prefill(self.params, cache, jnp.asarray(b.tokens), jnp.asarray(b.n_prompt), *samp,
                                  flags=b.flags)
        dcache = None
        if self.drafter is not None:
            dcache = self.drafter.new_cache(B, b.capacity)
            dcache = self.drafter.prefill(self.drafter.params, dcache, jnp.asarray(b.tokens), jnp.asarray(b.n_prompt))
        first = np.asarray(first)
        m.prefill_time_s += time.perf_counter() - t0

        hist = np.zeros((B, b.capacity + spec.num_speculative_tokens + 1), np.int32)
        hist[:, :b.tokens.shape[1]] = b.tokens
        hlen = b.n_prompt.astype(np.int64).copy()
        stop_arr = [r[r >= 0] for r in b.stop_ids]
        out: list[list[int]] = [[] for _ in range(n)]
        reason = ["length"] * n
        running = np.zeros((B,), bool)
        running[:n] = True
        generated = np.zeros((B,), np.int32)
        pending = np.zeros((B,), np.int32)
        catch: list[list[int]] = [[] for _ in range(B)]     # emitted since the draft model's last call
        tracker = AcceptanceTracker(B, spec.ewma_decay)
        probe = np.zeros((B,), bool)
        cursor = np.full((B,), -1, np.int64)   # n-gram: where in the history the copied text goes on
        src = np.full((B,), -1, np.int64)      # n-gram: where this step's proposal starts
        quiet = 0          # fallback chunks in a row whose shadow check found nothing: chunks grow

        def emit(r, toks):
            """Appends tokens [n] to row r, cut after a stop token or at max_tokens."""
            toks = np.asarray(toks, np.int32)
            cut = min(len(toks), int(b.max_new[r] - generated[r]))
            hits = np.flatnonzero(np.isin(toks[:cut], stop_arr[r]))
            if hits.size:
                cut = int(hits[0]) + 1
                reason[r], running[r] = "stop", False
            toks = toks[:cut]
            out[r].extend(toks.tolist())
            hist[r, hlen[r]:hlen[r] + cut] = toks
            hlen[r] += cut
            generated[r] += cut
            if cut:
                pending[r] = toks[-1]
            if self.drafter is not None:
                catch[r].extend(toks.tolist())
            if generated[r] >= b.max_new[r]:
                running[r] = False

        for r in range(n):
            emit(r, [first[r]])
        if self.ngram is not None and spec.dynamic_k:     # seed each row from lookup over its prompt's tail
            cold = True
            for r in range(n):
                hits, checks, run = tail_checks(hist[r, :hlen[r]], self.ngram)
                tracker.warm_start(r, hits, checks, run)
                cold &= bool(cold_tail(hits, checks)) or not running[r]
            quiet = QUIET_MAX if cold else 0
        K = spec.num_speculative_tokens
        while running.any():
            rows = np.flatnonzero(running)
            rem = b.max_new - generated
            k_rows = np.zeros((B,), np.int32)
            proposals, shadow = {}, {}
            t0 = time.perf_counter()
            full = {}       # n-gram: row -> (its proposal at full length, start); drafts are prefixes

            def propose(r):
                if r not in full:
                    n = min(K, int(rem[r]) - 1)
                    p, s = self.ngram.propose_at(hist[r, :hlen[r]], n)
                    if len(p) == 0 and n > 0 and 0 <= cursor[r] < hlen[r]:      # past an edit
                        p, s = self.ngram.read_from(hist[r, :hlen[r]], cursor[r], n), cursor[r]
                    full[r] = p, s
                return full[r]

            for r in rows:
                want = tracker.next_k(r, K, spec.draft_cost) if spec.dynamic_k else K
                if probe[r]:
                    want, probe[r] = max(want, 1), False
                want = min(want, int(rem[r]) - 1)
                if self.ngram is not None:
                    if want > 0:
                        p, src[r] = propose(r)
                        proposals[r] = p[:want]
                        k_rows[r] = len(proposals[r])
                    elif spec.dynamic_k and rem[r] > 1:
                        shadow[r] = self.ngram.propose(hist[r, :hlen[r]], min(K, int(rem[r]) - 1))
                else:
                    k_rows[r] = max(want, 0)
            if self.ngram is not None:
                m.draft_time_s += time.perf_counter() - t0

            if k_rows.max() == 0:                                   # nobody speculates: plain decode
                t0 = time.perf_counter()
                n_steps = spec.fallback_steps * min(4 ** quiet, MAX_CHUNK_GROWTH)
                host = np.stack([pending, running, generated, rem, np.full((B,), n_steps)]).astype(np.int32)
                toks, cache = st.decode_chunk(self.params, cache, jnp.asarray(host), stop_dev, *samp,
                                              steps=spec.fallback_steps * MAX_CHUNK_GROWTH, flags=b.flags)
                toks = np.asarray(toks)
                m.decode_time_s += time.perf_counter() - t0
                m.fallback_chunks += 1
                hit = False
                for r in rows:
                    row = toks[r][toks[r] >= 0]
                    m.fallback_tokens += len(row)
                    if r in shadow and len(shadow[r]) and len(row):
                        p = shadow[r][:len(row)]
                        a = int(np.cumprod(p == row[:len(p)]).sum())
                        tracker.update(r, len(p), a)
                        hit |= a > 0
                    emit(r, row)
                    probe[r] = self.drafter is not None
                    cursor[r] = -1
                grow = spec.dynamic_k and self.drafter is None and not hit    # a fixed K keeps looking
                quiet = quiet + 1 if grow else 0
                continue
            quiet = 0

            Kb = spec.k_bucket(int(k_rows.max()))
            if self.ngram is not None:
                # The verify runs Kb + 1 positions for every row whatever its k, so drafts up to Kb
                # cost nothing more: every row with a proposal fills the bucket.
                for r in rows:
                    fill = min(Kb, int(rem[r]) - 1)
                    if fill > k_rows[r]:
                        p, start = propose(r)
                        p = p[:fill]
                        if len(p) > k_rows[r]:
                            proposals[r], src[r], k_rows[r] = p, start, len(p)
            tokens = np.zeros((B, Kb + 1), np.int32)
            tokens[:, 0] = pending
            probs = None
            if self.ngram is not None:
                for r, p in proposals.items():
                    tokens[r, 1:1 + len(p)] = p
            else:
                t0 = time.perf_counter()
                width = bucket(max(len(catch[r]) for r in rows), spec.num_speculative_tokens + 1)
                ct = np.zeros((B, width), np.int32)
                nc = np.zeros((B,), np.int32)
                for r in rows:
                    ct[r, :len(catch[r])] = catch[r]
                    nc[r] = len(catch[r])
                    catch[r] = []
                drafts, probs, dcache = self.drafter.draft(
                    self.drafter.params, dcache, jnp.asarray(ct), jnp.asarray(nc), samp[0], jnp.asarray(generated),
                    *samp[1:], k=Kb, flags=b.flags)
                tokens[:, 1:] = np.asarray(drafts)
                m.draft_time_s += time.perf_counter() - t0
            n_fed = np.where(running, 1 + k_rows, 0).astype(np.int32)

            t0 = time.perf_counter()
            args = (self.params, cache, jnp.asarray(tokens), jnp.asarray(np.stack([n_fed, k_rows, generated])), probs,
                    *samp)
            if spec.rollback == "selection":
                n_acc, out_tok, cache = st.verify_select(*args, flags=b.flags)
                n_acc = np.asarray(n_acc)
            else:
                snapshot = cache                                      # a reference: nothing is copied
                n_acc, out_tok, vcache, n_keep = st.verify_keep(*args, flags=b.flags)
                n_acc = np.asarray(n_acc)
                if np.any(np.asarray(n_keep) < n_fed):
                    cache = st.replay(self.params, snapshot, args[2], args[3], n_keep, vcache.version)
                    m.replays += 1
                else:
                    cache = vcache
                del snapshot, vcache
            out_tok = np.asarray(out_tok)
            m.verify_time_s += time.perf_counter() - t0
            m.verify_steps += 1
            for r in rows:
                a = int(n_acc[r])
                if k_rows[r] > 0:
                    m.record(req_ids[r], int(generated[r]), int(k_rows[r]), a)
                    tracker.update(r, int(k_rows[r]), a)
                    # the copied text goes on after the token the target wrote in place of draft a + 1
                    cursor[r] = src[r] + a + 1 if src[r] >= 0 else -1
                emit(r, out_tok[r, :a + 1])
        return [(out[r], reason[r]) for r in range(n)]

    def _device_loop(self, b, n, req_ids):
        """One batch with n-gram drafting and rollback by selection: prefill, then the rest in ONE
        on-device loop (`device_loop.ngram_generate`), dispatched back to back: the loop takes the
        first token as a device array, so the host never waits between the two, and its host arrays
        go to the jitted calls as numpy arrays (copied in the call, ~10x cheaper than jnp.asarray
        each on CPU). Returns [(token_ids, finish_reason)] per row."""
        spec, m = self.spec, self.metrics
        K = spec.num_speculative_tokens
        B = b.tokens.shape[0]
        N = int(b.max_new.max())
        lc = LoopConfig(K=K, buckets=loop_buckets(K, spec.dynamic_k), lookup_min=spec.prompt_lookup_min,
                        lookup_max=spec.prompt_lookup_max, dynamic_k=spec.dynamic_k, max_new=bucket(N, 16),
                        chunk=spec.fallback_steps,
                        max_chunk=max(spec.fallback_steps, 128))
        samp = (b.seeds, b.temperature, b.top_k, b.top_p)
        t0 = time.perf_counter()
        cache = empty_cache(self.cfg, B, b.capacity, self.dtype)
        first, cache = self.steps.prefill(self.params, cache, b.tokens, b.n_prompt, *samp, flags=b.flags)
        H = bucket(int(b.n_prompt.max()) + 1 + lc.max_new + max(K + 1, lc.max_chunk), 64)
        h = np.zeros((B, H), np.int32)
        h[:, :b.tokens.shape[1]] = b.tokens
        rows = np.stack([b.n_prompt, np.arange(B) < n, np.zeros((B,)), b.max_new]).astype(np.int32)
        tune = np.asarray([spec.draft_cost, spec.ewma_decay], np.float32)
        toks, n_out, stopped, log, branch, _ = ngram_generate(
            self.params, cache, h, first, rows, tune, b.stop_ids, *samp, cfg=self.cfg, impl=self.impl,
            flags=b.flags, lc=lc)
        first.block_until_ready()
        t1 = time.perf_counter()
        m.prefill_time_s += t1 - t0        # from the dispatch until the first token is ready
        toks, n_out, stopped, log, branch = (np.asarray(x) for x in (toks, n_out, stopped, log, branch))
        m.verify_time_s += time.perf_counter() - t1
        m.verify_steps += int(np.sum(branch > 0))
        m.fallback_chunks += int(np.sum(branch == 0))
        ks, accs, gens, emits = log
        m.fallback_tokens += int(np.sum(np.maximum(emits[branch == 0, :n], 0)))
        for it in np.flatnonzero(branch > 0):
            for r in np.flatnonzero(ks[it, :n] > 0):
                m.record(req_ids[r], int(gens[it, r]), int(ks[it, r]), int(accs[it, r]))
        return [(toks[r, :n_out[r]].tolist(), "stop" if stopped[r] else "length") for r in range(n)]
