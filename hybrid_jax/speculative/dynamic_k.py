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
lost); the first rejection ends the streak.

A rejection after a long run says more than the rate does: text copied with local edits (code
editing, a quote with changes) rejects once per edit and goes on copying after it (the n-gram
drafter reads on past the edited token). So each row also keeps `run`, the tokens emitted since
its last rejection, and `gap`, the run that the last rejection ended. After a run of at least
MIN_RUN, the next check drafts at least the rest of the expected run and one more, so one verify
covers the stretch to the next edit instead of a short probe plus a second verify (as a TCP sender
remembers where it last saw loss); once the run outgrows the gap, slow start takes over again.
`draft_floor` is that lower bound and `AcceptanceTracker.next_k` takes the max of it and the
rate's choice. On a quote edited every 24 tokens, with the 3K/4 verify bucket of the on-device loop
(`device_loop.loop_buckets`), a request settles to one 25-position verify per edit, where it
alternated 9- and 17-position verifies (batch-1 same-process A/B, min ms per request at K = 32,
draft_cost 0.3: 26.7 with both, 29.5 with the floor alone, 29.7 with the bucket alone, 29.8 with
neither; plain 54.5).

A new request need not start from the prior alone: its prompt already says how copyable its text
is. `tail_checks` asks how prompt lookup would have done on the last WARM_TAIL tokens of the text
(each predicted from the tokens before it), and `AcceptanceTracker.warm_start` counts those checks
as acceptance trials, with a run of right guesses ending at the prompt's end (at least MIN_RUN)
as a streak and as the row's run so far. A prompt that quotes itself then drafts a full K from its first step, rather
than climbing 4, 8, 16 (batch-1 self-quoting workload, same-process A/B: 24.4 vs 26.8 ms per
request; edited quote 28.9 vs 32.5); a prompt whose tail lookup never once guessed right starts
with the longest plain decode chunk, rather than growing to it (random prompts: 2 chunks for 224
tokens instead of 5, 44.4 vs 45.6 ms, plain 44.2).
"""
from __future__ import annotations

import numpy as np

WARM_TAIL = 16     # prompt-tail positions a new request's prompt-lookup warm start checks
MIN_RUN = 8        # tokens copied in a row that count as copied text (warm streak, expected gap)


def quiet_max(growth: int) -> int:
    """Quiet chunks in a row (plain decode chunks whose shadow checks all failed; each grows the next
    chunk 4x) after which a chunk has reached `growth` x its first size: the least q with 4 ** q >=
    growth. Both speculation loops bound their quiet count with it: the engine's host loop at its
    MAX_CHUNK_GROWTH (engine/speculate.py), the on-device loop at max_chunk / chunk of its LoopConfig
    (speculative/device_loop.py); more quiet chunks would not grow a chunk further."""
    q = 0
    while 4 ** q < growth:
        q += 1
    return q


def tail_checks(history: np.ndarray, drafter, tail: int = WARM_TAIL) -> tuple[int, int, int]:
    """How prompt lookup would have predicted the last `tail` tokens of history [N] (the last one
    included), each from the tokens before it; drafter: an `NgramDrafter` (its propose_at and
    lookup_min). Positions with fewer than lookup_min + 1 tokens before them are not checked.
    Returns (right guesses, positions checked, run of right guesses ending at the last token)."""
    hits = checks = run = 0
    for i in range(max(len(history) - tail, drafter.lookup_min + 1), len(history)):
        p, _ = drafter.propose_at(history[:i], 1)
        hit = len(p) > 0 and int(p[0]) == int(history[i])
        hits, checks, run = hits + hit, checks + 1, (run + 1 if hit else 0)
    return hits, checks, run


def warm_tail_state(hits, checks, run):
    """(accepted, trials, streak) to add to / set in a new row's tracker from its tail checks:
    every checked position is one acceptance trial; a run of at least MIN_RUN right guesses is a
    streak (and the row's run so far). Elementwise on numpy or jax arrays (the on-device loop uses
    it too)."""
    return hits, checks, run * (run >= MIN_RUN)


def draft_floor(streak, run, gap, where=np.where):
    """Lower bound on a row's next draft length (see the module docstring): the rest of the expected
    run and one draft more, gap - run + 1 (so the check ends at the expected edit, whose draft then
    fails and is seen to), while a run of at least MIN_RUN was last seen and this one is shorter;
    else 2 * streak (slow start). Elementwise; `where` is np.where or jnp.where."""
    return where((gap >= MIN_RUN) & (run < gap), gap - run + 1, 2 * streak)


def cold_tail(hits, checks, tail: int = WARM_TAIL):
    """True where the tail was checked (at least half of it) and lookup never guessed right: such a
    row starts with the longest plain decode chunk. Elementwise on numpy or jax arrays."""
    return (hits == 0) & (checks >= tail // 2)


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
        self.run = np.zeros((n,), np.int64)        # tokens emitted since the last rejection
        self.gap = np.zeros((n,), np.int64)        # the run the last rejection ended, up to the failed draft

    def update(self, row: int, proposed: int, accepted: int):
        """A verify (or shadow) check of `proposed` drafts of which the first `accepted` matched."""
        if proposed <= 0:
            return
        self.accepted[row] = self.decay * self.accepted[row] + accepted
        self.trials[row] = self.decay * self.trials[row] + accepted + (1 if accepted < proposed else 0)
        full = accepted >= proposed
        self.streak[row] = proposed if full else 0
        if not full:
            self.gap[row] = self.run[row] + accepted
        self.run[row] = self.run[row] + accepted + 1 if full else 0     # the bonus token too

    def warm_start(self, row: int, hits: int, checks: int, run: int):
        """Seeds the row's counts from `tail_checks` of its prompt (see the module docstring)."""
        acc, trials, streak = warm_tail_state(hits, checks, run)
        self.accepted[row] += acc
        self.trials[row] += trials
        self.streak[row] = self.run[row] = streak

    def next_k(self, row: int, k_max: int, draft_cost: float) -> int:
        """Draft length for the row's next step: choose_k at its rate, at least `draft_floor` (the
        rest of the expected run, or double the last check's drafts when all of them landed)."""
        k = choose_k(float(self.rate()[row]), k_max, draft_cost)
        return max(k, min(int(draft_floor(self.streak[row], self.run[row], self.gap[row])), k_max))

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
