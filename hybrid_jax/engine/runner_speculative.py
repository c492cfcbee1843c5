"""The runner's speculative side: the drafter it carries and the host calls of a speculative step.

`SpeculativeRunnerMixin` is part of `ModelRunner` (engine/runner.py), as vLLM's runner mixes in its
LoRA and KV-connector sides: it reads and replaces the runner's pools (`cache`) and drafter state
(`dcache`) and runs the compiled draft / verify / n-gram-loop programs (engine/steps.py) the runner
built. The host's side of speculation (which drafts, acceptance figures, the fallback to plain
decoding) is engine/speculative_step.py; the drafters are engine/drafter.py.

- `set_draft` / `set_mtp`: the drafter the steps carry (a draft model, the target's MTP block).
- `draft`: a drafter on the device drafts alone, for a verify whose drafts the host must read first.
- `run_verify`: one verify of every row's drafts [Bb, K+1], accepted and rolled back on the device.
- `run_ngram_loop`: n-gram speculation to each request's end in one on-device loop.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hybrid_jax.engine.drafter import Drafter, DraftModel, MTPDrafter
from hybrid_jax.engine.program_table import ProgramKey
from hybrid_jax.engine.request import attributed
from hybrid_jax.generate import bucket
from hybrid_jax.sampling import FULL_SAMPLER


class SpeculativeRunnerMixin:
    """The speculative calls of `ModelRunner` (see the module's docstring); every attribute they use
    (params, cache, dcache, drafter, inputs, the compiled `_draft` / `_verify` / `_loop`) is the
    runner's."""

    # --- the drafter ------------------------------------------------------------------------------
    def _use(self, drafter: Drafter):
        """Makes `drafter` the one the steps carry: its state on the device, the programs traced with it
        (a drafter with state steps padded batches only)."""
        self.drafter = drafter
        self.ragged = self.ragged and drafter.ragged
        self.dcache = drafter.new_state()
        self._build_programs()

    def set_draft(self, dcfg, dparams, ddtype, extra: int):
        """Attaches a draft model; its cache rows hold `extra` more positions (scratch drafts)."""
        self._use(DraftModel(dcfg, dparams, ddtype, self.cache.lengths.shape[0], self.ecfg.max_model_len + extra,
                             self.impl))

    def set_mtp(self, extra: int):
        """Drafts with the target's own MTP block (params["mtp"]); its cache rows hold `extra` more
        positions (scratch drafts)."""
        self._use(MTPDrafter(self.model, self.cfg, self.dtype, self.cache.lengths.shape[0],
                             self.ecfg.max_model_len + extra, self.impl, self.layout))

    def _verify_inputs(self, reqs, drafts, K: int, key: ProgramKey):
        """A verify's (or a draft step's) tokens [Bb, K+1] (each row's pending token, then its drafts) and
        meta [2, Bb], Bb the smallest compiled batch bucket of `key`'s kind and options that covers them."""
        Bb = self.cover(dataclasses.replace(key, shape=(bucket(len(reqs)), K))).shape[0]
        tokens = np.zeros((Bb, K + 1), np.int32)
        meta = np.zeros((2, Bb), np.int32)
        for i, (q, d) in enumerate(zip(reqs, drafts)):
            with attributed(q):
                tokens[i, 0] = q.output_ids[-1]
                tokens[i, 1:1 + len(d)] = d
                meta[0, i], meta[1, i] = 1 + len(d), len(d)
        return tokens, meta

    def draft(self, reqs, lengths, K: int):
        """A drafter on the device drafts alone (`draft_step`), for a verify whose drafts the host must
        read first: (drafts, one [k_i] int32 per request, k_i = lengths[i]; their distributions [Bb, K, V],
        left on the device for `run_verify(given=...)`)."""
        tokens, meta = self._verify_inputs(reqs, [np.zeros((k,), np.int32) for k in lengths], K,
                                           ProgramKey.of("draft", flags=FULL_SAMPLER))
        out, probs = self._draft(self.params, self.inputs.rows(reqs, tokens.shape[0]), tokens, meta,
                                 self.drafter.params, self.dcache, flags=FULL_SAMPLER)
        self._wait(out)
        out = np.asarray(out)
        return [out[i, 1:1 + k] for i, k in enumerate(lengths)], probs

    def run_verify(self, reqs, drafts, K: int, replay: bool, given=None):
        """reqs: decoding requests; drafts: [k_i] int32 per request (k_i <= K, may be 0); K: a
        compiled draft length; given: the distributions a drafter on the device drew them from (`draft`;
        None: the drafter drafts inside the verify, or the drafts are the host's). Returns (n_accepted
        [n], tokens [n, K+1])."""
        n = len(reqs)
        tokens, meta = self._verify_inputs(reqs, drafts, K, ProgramKey.of("verify", flags=FULL_SAMPLER, replay=replay,
                                                                          given=given is not None))
        Bb = tokens.shape[0]
        allowed = self.inputs.verify_masks(Bb, K, masked=any(q.masked for q in reqs))
        for i, (q, d) in enumerate(zip(reqs, drafts)):
            if q.masked:           # each position's mask, along the draft (the grammar allows it)
                with attributed(q):
                    q.grammar.fill_along(d, allowed[i])
        kw = {} if given is None else {"given": given}
        n_acc, out, self.cache, self.dcache = self._verify(
            self.params, self.cache, self.inputs.rows(reqs, Bb), tokens, meta, allowed, self.drafter.params,
            self.dcache, flags=FULL_SAMPLER, replay=replay, **kw)
        self._wait(n_acc, out)
        return np.asarray(n_acc)[:n], np.asarray(out)[:n]

    def run_ngram_loop(self, reqs, spec):
        """Runs decoding requests to their ends with n-gram speculation in ONE on-device loop (draft,
        verify, accept, roll back by selection, emit: no host round trip per step), over their rows
        and pages (all of them allocated up to each request's limit). spec: the SpeculativeConfig.
        Returns (tokens [n, W] int32 emitted, -1 past a row's end; log [4, N, n]; branch [N]; see
        `ngram_generate`)."""
        from hybrid_jax.speculative.device_loop import LoopConfig, loop_buckets  # noqa: PLC0415
        n = len(reqs)
        Bb = bucket(n)
        K = spec.num_speculative_tokens
        lc = LoopConfig(K=K, buckets=loop_buckets(K, spec.dynamic_k), lookup_min=spec.prompt_lookup_min,
                        lookup_max=spec.prompt_lookup_max, dynamic_k=spec.dynamic_k,
                        max_new=bucket(max(q.remaining_tokens for q in reqs) + 1, 16), chunk=spec.fallback_steps,
                        max_chunk=max(spec.fallback_steps, 128))
        W = max(K + 1, lc.max_chunk)
        hist = np.zeros((Bb, bucket(max(len(q.all_ids) for q in reqs) + lc.max_new + W, 64)), np.int32)
        first = np.zeros((Bb,), np.int32)
        rows = np.zeros((4, Bb), np.int32)
        for i, q in enumerate(reqs):
            # The loop emits its first token itself: that is the request's pending token, already out.
            with attributed(q):
                ids = q.all_ids
                hist[i, :len(ids) - 1] = ids[:-1]
                first[i] = ids[-1]
                rows[:, i] = (len(ids) - 1, 1, len(q.output_ids) - 1, q.remaining_tokens + 1)
        tune = np.asarray([spec.draft_cost, spec.ewma_decay], np.float32)
        out, n_out, log, branch, self.cache = self._loop(self.params, self.cache, self.inputs.rows(reqs, Bb), hist, first,
                                                         rows, tune, self.inputs.stop_ids(reqs, Bb), lc=lc)
        self._wait(out, n_out, log, branch)
        out, n_out = np.asarray(out)[:n], np.asarray(n_out)[:n]
        toks = np.where(np.arange(out.shape[1] - 1)[None] < (n_out - 1)[:, None], out[:, 1:], -1)
        return toks, np.asarray(log)[:, :, :n], np.asarray(branch)
