"""Dynamic draft length: each request's K follows its running acceptance rate.

`AcceptanceTracker` keeps, per row, exponentially decayed counts of accepted drafts and of
acceptance trials (a verify step with k drafts and a accepted made a + [a < k] Bernoulli trials),
so `rate()` is a decayed maximum-likelihood estimate of the per-token acceptance probability alpha.
`choose_k` picks the k in [0, K] that maximises expected emitted tokens per unit of step cost,

    E(k) = 1 + alpha + ... + alpha^k          cost(k) = 1 + draft_cost * k

so a request whose drafts keep failing drops to k = 0 (plain decoding), and one whose drafts keep
landing climbs to K.
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

    def update(self, row: int, proposed: int, accepted: int):
        """A verify (or shadow) check of `proposed` drafts of which the first `accepted` matched."""
        if proposed <= 0:
            return
        self.accepted[row] = self.decay * self.accepted[row] + accepted
        self.trials[row] = self.decay * self.trials[row] + accepted + (1 if accepted < proposed else 0)

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
