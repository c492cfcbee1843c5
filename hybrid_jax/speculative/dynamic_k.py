"""Dynamic draft length: each request's K follows its running acceptance rate.

`AcceptanceTracker` keeps, per row, exponentially decayed counts of accepted drafts and of
acceptance trials (a verify step with k drafts and a accepted made a + [a < k] Bernoulli trials),
so `rate()` is a decayed maximum-likelihood estimate of the per-token acceptance probability alpha.
`choose_k` picks the k in [0, K] that maximises expected emitted tokens per unit of step cost,

    E(k) = 1 + alpha + ... + alpha^k          cost(k) = 1 + draft_cost * k

so a request whose drafts keep failing drops to k = 0 (plain decoding), and one whose drafts keep
landing climbs to K.

The decayed rate lags a run of landing drafts: from the prior, a request that copies text accepts
everything for several steps while alpha crawls up and k with it, and those short verify steps
cost nearly as much as long ones. So a check that accepted all of its p drafts lets the next one
draft at least min(2p, K) ("slow start", as a TCP sender doubles its window while nothing is
lost); the first rejection ends the streak and k falls back to what the rate supports.
`AcceptanceTracker.next_k` combines the two.
"""
from __future__ import annotations

import numpy as np


class AcceptanceTracker:
    """Per-row decayed acceptance counts. n rows; decay in [0, 1); a prior of `prior_rate` worth
    `prior_weight` trials. The default prior (0.2) is below what pays for one draft at the default
    draft cost, so a new request starts with plain decode chunks and speculates once its drafts are
    seen to land (the n-gram drafter's shadow check, a draft model's probe)."""

    def __init__(self, n: int, decay: float = 0.8, prior_rate: float = 0.2, prior_weight: float = 1.0):
        self.decay = decay
        self.accepted = np.full((n,), prior_rate * prior_weight, np.float64)
        self.trials = np.full((n,), prior_weight, np.float64)
        self.streak = np.zeros((n,), np.int64)     # drafts of the last check if all landed, else 0

    def update(self, row: int, proposed: int, accepted: int):
        """A verify (or shadow) check of `proposed` drafts of which the first `accepted` matched."""
        if proposed <= 0:
            return
        self.accepted[row] = self.decay * self.accepted[row] + accepted
        self.trials[row] = self.decay * self.trials[row] + accepted + (1 if accepted < proposed else 0)
        self.streak[row] = proposed if accepted >= proposed else 0

    def next_k(self, row: int, k_max: int, draft_cost: float) -> int:
        """Draft length for the row's next step: choose_k at its rate, at least doubled after a
        check that accepted all of its drafts (see the module docstring)."""
        k = choose_k(float(self.rate()[row]), k_max, draft_cost)
        return max(k, min(2 * int(self.streak[row]), k_max))

    def rate(self) -> np.ndarray:
        """[n] estimated per-token acceptance probability."""
        return self.accepted / np.maximum(self.trials, 1e-9)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step of k drafts emits on average when each is accepted with probability alpha."""
    return float(sum(alpha ** i for i in range(k + 1)))


def choose_k(alpha: float, k_max: int, draft_cost: float) -> int:
    """argmax over k in [0, k_max] of expected_tokens(alpha, k) / (1 + draft_cost * k); ties -> smaller k."""
    best, best_val = 0, 1.0
    for k in range(1, k_max + 1):
        val = expected_tokens(alpha, k) / (1.0 + draft_cost * k)
        if val > best_val + 1e-12:
            best, best_val = k, val
    return best
