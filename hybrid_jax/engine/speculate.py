"""Speculative decoding inside the engine core: the host side of every proposer.

A decode-only engine step normally runs plain decode iterations on device. With a speculative
config, each running request first gets a draft length k from its own acceptance rate (dynamic K,
`hybrid_jax.speculative.dynamic_k`) and a proposal: n-gram prompt lookup over its history (and,
past a rejected draft of copied text, the source text after the edit: the request's cursor), or
drafts written on device by a draft model or the checkpoint's MTP block (from state kept in
step with the target's rows). If any row has a draft, the step is ONE verify forward
of [pending, d_1 .. d_K] (`ModelRunner.run_verify`), with acceptance and rollback (selection or
snapshot + replay) on device; rows without a draft ride along with k = 0. When no row drafts, a
chunk of plain decode steps runs and the proposals made before it are checked against what it
produced ("shadow" acceptance), so a request whose text turns repetitive starts speculating; while
those checks keep failing the chunks grow 4x (offline runs, up to 32 x fallback_steps), and a batch
whose prompts prompt lookup never once predicted starts with the longest chunk.

Offline n-gram drafting with rollback by selection runs the whole draft / verify / accept cycle in
one on-device loop instead (`uses_device_loop`, `ModelRunner.run_ngram_loop`); its statistics land
in the same `SpecMetrics`.
"""
from __future__ import annotations

import numpy as np

from hybrid_jax.decode_loop import allowed_drafts
from hybrid_jax.errors import InputError
from hybrid_jax.speculative.config import SpeculativeConfig, parse_speculative_config, resolve_rollback
from hybrid_jax.speculative.drafters import NgramDrafter, load_draft_model
from hybrid_jax.speculative.dynamic_k import AcceptanceTracker, cold_tail, quiet_max, tail_checks
from hybrid_jax.speculative.metrics import SpecMetrics

PROBE_EVERY = 8          # a draft-model row at k = 0 drafts one token every PROBE_EVERY decode steps
# The MTP block is the drafter the model was trained with (published acceptance of its first draft:
# 0.6 - 0.9): a new request's dynamic K starts from this rate, so it speculates from its first step
# (the default prior, 0.2, waits for evidence), and then follows what its drafts actually do.
MTP_PRIOR_RATE = 0.6
MAX_CHUNK_GROWTH = 32    # offline fallback chunks grow 4x per quiet chunk, to at most 32 x fallback_steps
QUIET_MAX = quiet_max(MAX_CHUNK_GROWTH)     # quiet chunks in a row that reach it (3: 4 ** 3 >= 32)


class EngineSpeculator:
    """Per-request draft lengths, n-gram proposals and acceptance statistics. With method
    "draft_model" the drafts are written on device by the runner's draft model; here only their
    lengths are chosen (a row at k = 0 probes with one draft now and then, so it can climb); the same
    for method "mtp", whose drafter is the target's own MTP block (`speculative/mtp.py`)."""

    def __init__(self, config: dict | SpeculativeConfig, target_vocab: int, groups: dict):
        """groups: the target's cache groups ({name: CacheGroup}), which decide an "auto" rollback."""
        self.spec = resolve_rollback(parse_speculative_config(config), groups)
        self.drafter = None
        self.draft = None
        if self.spec.method == "ngram":
            self.drafter = NgramDrafter(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        elif self.spec.method == "draft_model":
            self.draft = load_draft_model(self.spec.model, self.spec.draft_dtype)
            if self.draft[0].vocab_size != target_vocab:
                raise InputError(f"draft model vocabulary ({self.draft[0].vocab_size}) differs from the target's "
                                 f"({target_vocab}); a draft model must share the tokenizer")
        self.trackers: dict[str, AcceptanceTracker] = {}
        self.steps: dict[str, int] = {}
        self.cursor: dict[str, int] = {}     # n-gram: where in its history a request's copied text goes on
        self.source: dict[str, int] = {}     # n-gram: where this step's proposal starts in the history
        self.cold: dict[str, bool] = {}      # prompt lookup never predicted the request's prompt tail
        self.quiet = 0                       # plain chunks in a row whose shadow checks all failed
        self.metrics = SpecMetrics()

    @property
    def uses_device_loop(self) -> bool:
        """n-gram drafting with rollback by selection may run as the runner's on-device loop."""
        return self.drafter is not None and self.spec.rollback == "selection" and self.spec.device_loop

    def forget(self, request_id: str):
        for d in (self.trackers, self.steps, self.cursor, self.source, self.cold):
            d.pop(request_id, None)

    def reset_stats(self):
        self.metrics = SpecMetrics()

    def _tracker(self, rid: str, ids=None) -> AcceptanceTracker:
        """The request's tracker; a new one for an n-gram request is seeded from how prompt lookup
        would have predicted the tail of its text so far, ids [N] (`dynamic_k.tail_checks`)."""
        t = self.trackers.get(rid)
        if t is None:
            prior = {"prior_rate": MTP_PRIOR_RATE} if self.spec.method == "mtp" else {}
            t = self.trackers[rid] = AcceptanceTracker(1, self.spec.ewma_decay, **prior)
            if self.drafter is not None and ids is not None:
                hits, checks, run = tail_checks(np.asarray(ids, np.int64), self.drafter)
                t.warm_start(0, hits, checks, run)
                self.cold[rid] = bool(cold_tail(hits, checks))
        return t

    def _propose(self, q, n: int) -> np.ndarray:
        """Up to n n-gram drafts for request q; past a rejected draft with no n-gram match yet, the
        source text after the edited token (`NgramDrafter.read_from`)."""
        ids = np.asarray(q.all_ids, np.int64)
        prop, start = self.drafter.propose_at(ids, n)
        cur = self.cursor.get(q.request_id, -1)
        if len(prop) == 0 and n > 0 and 0 <= cur < len(ids):
            prop, start = self.drafter.read_from(ids, cur, n), cur
        self.source[q.request_id] = start
        return prop

    def plan(self, reqs) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per request: (drafts to verify [k] int32 (k may be 0), n-gram proposal for a shadow check).
        Rows asking for logprobs never draft (a verify step returns none)."""
        K = self.spec.num_speculative_tokens
        drafts, shadows = [], []
        for q in reqs:
            if self.drafter is not None:
                self._tracker(q.request_id, q.all_ids)
                prop = self._propose(q, int(allowed_drafts(K, q.remaining_tokens)))
            else:                     # written on device (draft model, MTP); only the length matters here
                prop = np.zeros((K,), np.int32)
            k = K
            if self.spec.dynamic_k:
                k = self._tracker(q.request_id, q.all_ids).next_k(0, K, self.spec.draft_cost)
                n = self.steps[q.request_id] = self.steps.get(q.request_id, 0) + 1
                if self.drafter is None and k == 0 and n % PROBE_EVERY == 0:
                    k = 1
            k = int(allowed_drafts(min(k, len(prop)), q.remaining_tokens))
            if q.params.logprobs is not None or (q.grammar is not None and not q.masked):
                k = 0     # (a row before its grammar's gate drafts none: the gate may come mid-draft)
            drafts.append(np.asarray(prop[:max(k, 0)], np.int32))
            shadows.append(np.asarray(prop if self.drafter is not None else prop[:0], np.int32))
        if self.drafter is not None and any(len(d) for d in drafts):
            # The verify runs k_bucket + 1 positions for every row whatever its k, so n-gram drafts
            # up to the bucket cost nothing more: every row with a proposal fills it.
            Kb = self.k_bucket(max(len(d) for d in drafts))
            for i, q in enumerate(reqs):
                if q.params.logprobs is None:
                    fill = int(allowed_drafts(min(Kb, len(shadows[i])), q.remaining_tokens))
                    if fill > len(drafts[i]):
                        drafts[i] = shadows[i][:fill]
            for i, q in enumerate(reqs):          # a grammar's row drafts only what its grammar allows
                if q.grammar is not None:
                    drafts[i] = drafts[i][:q.grammar.valid_prefix(drafts[i])] if q.masked else drafts[i][:0]
        return drafts, shadows

    def k_bucket(self, k: int) -> int:
        return self.spec.k_bucket(max(k, 1))

    def fallback_steps(self, reqs) -> int:
        """Plain decode steps of an offline chunk in which no row drafts: fallback_steps, grown 4x per
        quiet chunk before it (up to MAX_CHUNK_GROWTH x), and the longest at once when every row's
        prompt was cold for prompt lookup."""
        quiet = self.quiet
        if self.drafter is not None and self.spec.dynamic_k and all(self.cold.get(q.request_id) for q in reqs):
            quiet = QUIET_MAX
        return self.spec.fallback_steps * min(4 ** quiet, MAX_CHUNK_GROWTH)

    def record_verify(self, reqs, drafts, n_acc, seconds: float = 0.0):
        """After a verify step: n_acc [n] accepted drafts per row."""
        m = self.metrics
        m.verify_steps += 1
        m.verify_time_s += seconds
        m.replays += self.spec.rollback == "replay" and any(int(a) < len(d) for d, a in zip(drafts, n_acc))
        self.quiet = 0
        for q, d, a in zip(reqs, drafts, n_acc):
            rid = q.request_id
            if len(d):
                m.record(rid, len(q.output_ids), len(d), int(a))
                self._tracker(rid).update(0, len(d), int(a))
                self.cold[rid] = False
                src = self.source.get(rid, -1)
                # the copied text goes on after the token the target wrote in place of draft a + 1
                self.cursor[rid] = src + int(a) + 1 if src >= 0 else -1

    def record_shadow(self, reqs, shadows, produced, seconds: float = 0.0):
        """After a plain decode chunk: how many of each proposal matched the tokens produced."""
        m = self.metrics
        m.fallback_chunks += 1
        m.decode_time_s += seconds
        hit = False
        for q, prop, toks in zip(reqs, shadows, produced):
            toks = [int(t) for t in toks if t >= 0]
            m.fallback_tokens += len(toks)
            self.cursor[q.request_id] = -1
            n = min(len(prop), len(toks))
            if n == 0:
                continue
            match = np.asarray(prop[:n]) == np.asarray(toks[:n])
            a = int(np.argmin(match)) if not match.all() else n
            self._tracker(q.request_id).update(0, n, a)
            hit |= a > 0
        grow = self.spec.dynamic_k and self.drafter is not None and not hit     # a fixed K keeps looking
        self.quiet = min(self.quiet + 1, QUIET_MAX) if grow else 0

    def record_loop(self, reqs, log, branch, seconds: float = 0.0):
        """After an on-device loop (`ModelRunner.run_ngram_loop`): log [4, N, n] per iteration (k
        drafted or -1, accepted, generated before, tokens emitted); branch [N] (-1 unused, 0 a plain
        chunk, else the verify's draft length)."""
        m = self.metrics
        ks, accs, gens, emits = log
        m.verify_time_s += seconds
        m.verify_steps += int(np.sum(branch > 0))
        m.fallback_chunks += int(np.sum(branch == 0))
        m.fallback_tokens += int(np.sum(np.maximum(emits[branch == 0], 0)))
        for it in np.flatnonzero(branch > 0):
            for i in np.flatnonzero(ks[it] > 0):
                m.record(reqs[i].request_id, int(gens[it, i]), int(ks[it, i]), int(accs[it, i]))

    def step_log(self) -> list[tuple[str, int, int, int]]:
        """(request id, tokens generated before the step, k drafted, k accepted) per row-verify."""
        return list(self.metrics.log)

    def stats(self) -> dict:
        return {**self.metrics.as_dict(), "method": self.spec.method,
                "num_speculative_tokens": self.spec.num_speculative_tokens, "rollback": self.spec.rollback,
                "dynamic_k": self.spec.dynamic_k}
