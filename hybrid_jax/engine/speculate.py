"""Speculative decoding inside the continuous-batching engine (n-gram, draft-model or MTP drafts).

A decode-only engine step normally runs `decode_steps` plain iterations on device. With a
speculative config, each running request first gets a draft length k from its own acceptance rate
(dynamic K, `hybrid_jax.speculative.dynamic_k`) and an n-gram proposal from its history; if any row
has a draft, the step is ONE verify forward of [pending, d_1 .. d_K] over the slot rows instead
(a draft model or the checkpoint's MTP block writes its drafts on device just before, from state kept
in step with the target's rows)
(`ModelRunner.run_verify`), with acceptance and rollback (selection or snapshot + replay) on device.
Rows without a draft ride along with k = 0 (they emit one token, like a plain step). When no row
drafts, the plain multi-step decode runs and the proposals made before it are checked against what
it produced ("shadow" acceptance), so a request whose text turns repetitive starts speculating.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hybrid_jax.errors import InputError
from hybrid_jax.speculative.config import SpeculativeConfig, parse_speculative_config
from hybrid_jax.speculative.drafters import NgramDrafter
from hybrid_jax.speculative.dynamic_k import AcceptanceTracker, tail_checks


@dataclasses.dataclass
class SpecCounters:
    verify_steps: int = 0
    row_verifies: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["acceptance_rate"] = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        d["mean_accepted_length"] = self.emitted_tokens / self.row_verifies if self.row_verifies else 0.0
        return d


PROBE_EVERY = 8      # a draft-model row at k = 0 drafts one token every PROBE_EVERY decode steps
# The MTP block is the drafter the model was trained with (published acceptance of its first draft:
# 0.6 - 0.9): a new request's dynamic K starts from this rate, so it speculates from its first step
# (the default prior, 0.2, waits for evidence), and then follows what its drafts actually do.
MTP_PRIOR_RATE = 0.6


class EngineSpeculator:
    """Host side of speculation in the engine: per-request draft lengths and n-gram drafts. With
    method "draft_model" the drafts are written on device by the runner's draft model; here only
    their lengths are chosen (a row at k = 0 probes with one draft now and then, so it can climb); the
    same for method "mtp", whose drafter is the target's own MTP block (`speculative/mtp.py`)."""

    def __init__(self, config: dict | SpeculativeConfig, target_vocab: int):
        self.spec = parse_speculative_config(config)
        self.drafter = None
        self.draft = None
        if self.spec.method == "ngram":
            self.drafter = NgramDrafter(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        elif self.spec.method == "draft_model":
            from hybrid_jax.speculative import load_draft_model  # noqa: PLC0415
            self.draft = load_draft_model(self.spec.model, self.spec.draft_dtype)
            if self.draft[0].vocab_size != target_vocab:
                raise InputError(f"draft model vocabulary ({self.draft[0].vocab_size}) differs from the target's "
                                 f"({target_vocab}); a draft model must share the tokenizer")
        self.trackers: dict[str, AcceptanceTracker] = {}
        self.steps: dict[str, int] = {}
        self.counters = SpecCounters()

    def forget(self, request_id: str):
        self.trackers.pop(request_id, None)
        self.steps.pop(request_id, None)

    def _tracker(self, rid: str, ids=None) -> AcceptanceTracker:
        """The request's tracker; a new one for an n-gram request is seeded from how prompt lookup
        would have predicted the tail of its text so far, ids [N] (`dynamic_k.tail_checks`)."""
        t = self.trackers.get(rid)
        if t is None:
            prior = {"prior_rate": MTP_PRIOR_RATE} if self.spec.method == "mtp" else {}
            t = self.trackers[rid] = AcceptanceTracker(1, self.spec.ewma_decay, **prior)
            if self.drafter is not None and ids is not None:
                t.warm_start(0, *tail_checks(np.asarray(ids, np.int64), self.drafter))
        return t

    def plan(self, reqs) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per request: (drafts to verify [k] int32 (k may be 0), n-gram proposal for a shadow check).
        Rows asking for logprobs never draft (a verify step returns none)."""
        K = self.spec.num_speculative_tokens
        drafts, shadows = [], []
        for q in reqs:
            if self.drafter is not None:
                prop = self.drafter.propose(np.asarray(q.all_ids, np.int64), K)
            else:                     # written on device (draft model, MTP); only the length matters here
                prop = np.zeros((K,), np.int32)
            k = K
            if self.spec.dynamic_k:
                k = self._tracker(q.request_id, q.all_ids).next_k(0, K, self.spec.draft_cost)
                n = self.steps[q.request_id] = self.steps.get(q.request_id, 0) + 1
                if self.drafter is None and k == 0 and n % PROBE_EVERY == 0:
                    k = 1
            k = min(k, len(prop), q.remaining_tokens - 1)
            if q.params.logprobs is not None:
                k = 0
            drafts.append(np.asarray(prop[:max(k, 0)], np.int32))
            shadows.append(np.asarray(prop if self.drafter is not None else prop[:0], np.int32))
        if self.drafter is not None and any(len(d) for d in drafts):
            # The verify runs k_bucket + 1 positions for every row whatever its k, so n-gram drafts
            # up to the bucket cost nothing more: every row with a proposal fills it.
            Kb = self.k_bucket(max(len(d) for d in drafts))
            for i, q in enumerate(reqs):
                if q.params.logprobs is None:
                    fill = min(Kb, len(shadows[i]), q.remaining_tokens - 1)
                    if fill > len(drafts[i]):
                        drafts[i] = shadows[i][:fill]
        return drafts, shadows

    def k_bucket(self, k: int) -> int:
        return self.spec.k_bucket(max(k, 1))

    def record_verify(self, reqs, drafts, n_acc):
        """After a verify step: n_acc [n] accepted drafts per row."""
        c = self.counters
        c.verify_steps += 1
        for q, d, a in zip(reqs, drafts, n_acc):
            if len(d):
                c.row_verifies += 1
                c.draft_tokens += len(d)
                c.accepted_tokens += int(a)
                c.emitted_tokens += int(a) + 1
                self._tracker(q.request_id).update(0, len(d), int(a))

    def record_shadow(self, reqs, shadows, produced):
        """After a plain decode step: how many of each proposal matched the tokens produced."""
        for q, prop, toks in zip(reqs, shadows, produced):
            toks = [int(t) for t in toks if t >= 0]
            n = min(len(prop), len(toks))
            if n == 0:
                continue
            match = np.asarray(prop[:n]) == np.asarray(toks[:n])
            a = int(np.argmin(match)) if not match.all() else n
            self._tracker(q.request_id).update(0, n, a)

    def stats(self) -> dict:
        return {**self.counters.as_dict(), "method": self.spec.method,
                "num_speculative_tokens": self.spec.num_speculative_tokens, "rollback": self.spec.rollback,
                "dynamic_k": self.spec.dynamic_k}
