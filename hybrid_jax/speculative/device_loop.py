"""On-device speculative generation for prompt-lookup (n-gram) drafting: the whole cycle of
draft -> verify -> accept -> roll back -> emit runs inside ONE `lax.while_loop`, so no step goes back
to the host. The engine's host loop (engine/speculate.py, engine/speculative_step.py) pays a Python
dispatch, a device-to-host copy and the host-side n-gram search per verify step, several decode
steps' worth on CPU; here a cycle costs its device work only.

One iteration, per row b (B rows, all arrays on device):

  propose   the most recent earlier occurrence of the longest suffix n-gram of hist[b, :hlen[b]]
            (lookup_max .. lookup_min tokens), read on from there (periodically through the
            proposal itself past the end), exactly as `NgramDrafter.propose_at`; when nothing
            matches and the row still follows copied text past a rejected draft (`cursor`), the
            text after it, as `NgramDrafter.read_from`
  choose k  dynamic K on device: argmax_k E(k) / (1 + draft_cost k) at the row's decayed acceptance
            rate, at least doubled after a check that accepted all its drafts, and after a long
            run that a rejection ended, at least to the next edit expected (`dynamic_k.py`);
            before the loop, the rate, the streak and the chunk size are seeded from how prompt
            lookup would have predicted the tail of each row's prompt (`prompt_tail_checks`)
  step      `lax.switch` on the smallest compiled draft length Kb >= max_b k: when no row drafts, a
            chunk of plain decode steps (`verify.decode_chunk`; the proposal is checked against
            what it wrote, so a row whose text turns repetitive climbs back to k > 0; chunks grow
            4x, `chunk` up to `max_chunk` tokens, while those checks keep failing); else ONE verify
            forward over [pending, drafts] (T = Kb + 1), acceptance and rollback by selection
            of the recurrent state after the last kept token (`verify.py`). The forward runs Kb + 1 positions
            for every row, so every row with a proposal drafts min(Kb, its budget) tokens: free.
            For a model with deferred KV writes (`write_deferred_kv`: Qwen3-Next), the switch holds
            only the chunk's first forward or the verify, both reading the KV cache; one write after
            the switch puts their entries in and the chunk's other steps follow as a loop (0 steps
            after a verify), so no cache is written inside a branch (XLA copied it there each iteration)
  emit      the accepted tokens and the bonus, cut at a stop token or the row's token budget,
            appended to the output and to the history; a row that emitted its last token stops

Greedy rows emit exactly what plain greedy decoding emits (the verify forward runs the same
token-level recurrence as a decode step); sampled rows follow the target distribution (rejection
sampling against one-hot n-gram drafts). Rollback by snapshot + replay and draft models keep the
host loop.

Shapes: B rows; H history slots; K the largest draft length; N = max new tokens (static);
W = max(K + 1, max_chunk) tokens one iteration can emit per row.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hybrid_jax.decode_loop import allowed_drafts, allowed_tokens
from hybrid_jax.models import get_model
from hybrid_jax.sampling import SamplerFlags
from hybrid_jax.speculative.dynamic_k import WARM_TAIL, cold_tail, draft_floor, quiet_max, warm_tail_state
from hybrid_jax.speculative.verify import _fwd, decode_chunk, decode_from, select_verified


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static facts of one compiled loop."""
    K: int                      # largest draft length
    buckets: tuple[int, ...]    # compiled verify draft lengths, ascending, the last == K
    lookup_min: int
    lookup_max: int
    dynamic_k: bool
    max_new: int                # static bound on tokens emitted per row (buffer width, iteration bound)
    chunk: int = 4              # plain decode steps of the first iteration in which no row drafts;
    max_chunk: int = 128        # 4x per such iteration in a row whose proposals all failed, up to this

    @property
    def quiet_max(self) -> int:
        """Quiet iterations in a row after which a decode chunk is max_chunk long (`dynamic_k.quiet_max`;
        the count stops there, since more would not grow the chunk)."""
        return quiet_max(-(-self.max_chunk // self.chunk))


def loop_buckets(K: int, dynamic_k: bool) -> tuple[int, ...]:
    """Verify lengths one loop compiles: K, K/4, K/16, ... (>= 1), and K/2 and 3K/4 from K = 16 on.
    Each is one more forward in the program (compile time), so fewer than the host loop's powers of
    two; a short draft pads to the next one, and since every row fills the bucket, the steps between
    the longest matter most: K/2 halves the forward of a row that would land ~K/2 drafts (text
    edited every few dozen tokens: batch-1 edited-quote workload 80 vs 104 ms per request at K = 32,
    same-process A/B), and 3K/4 serves a row whose expected run (`dynamic_k.draft_floor`) falls
    between K/2 and 3K/4 with a forward a quarter shorter than K's."""
    if not dynamic_k:
        return (K,)
    out, k = {K // 2, 3 * K // 4} if K >= 16 else set(), K
    while k >= 1:
        out.add(k)
        k //= 4
    return tuple(sorted(out))


def read_periodic(hist, start, hlen, K):
    """hist [B, H]; start, hlen [B] (0 <= start < hlen). Returns [B, K]: hist[start + j] for
    start + j < hlen, continuing through the read tokens themselves past the end (period hlen - start)."""
    period = jnp.maximum(hlen - start, 1)
    idx = start[:, None] + jnp.arange(K)[None] % period[:, None]
    return jnp.take_along_axis(hist, jnp.clip(idx, 0, hist.shape[1] - 1), axis=1)


def ngram_propose(hist, hlen, K: int, lookup_min: int, lookup_max: int):
    """hist [B, H] int32 (prompt + emitted tokens, the last of them pending); hlen [B] int32.
    Returns (proposal [B, K] int32, start [B] int32: where in hist it begins, -1 when no n-gram of
    >= lookup_min tokens recurs). The same choice as `NgramDrafter.propose_at`."""
    B, H = hist.shape
    pos = jnp.arange(H)[None]
    last = jnp.take_along_axis(hist, jnp.maximum(hlen - 1, 0)[:, None], axis=1)            # [B, 1]
    cand = (pos < (hlen - 1)[:, None]) & (hist == last)                                    # match ends
    length = cand.astype(jnp.int32)
    alive = cand
    for m in range(1, lookup_max):
        prev = jnp.pad(hist, ((0, 0), (m, 0)), constant_values=-1)[:, :H]                 # hist[e - m]
        target = jnp.take_along_axis(hist, jnp.maximum(hlen - 1 - m, 0)[:, None], axis=1)
        alive = alive & (pos >= m) & (prev == target) & (m < hlen - 1)[:, None]
        length = length + alive
    best = jnp.max(length, axis=1)
    end = jnp.max(jnp.where(cand & (length == best[:, None]), pos, -1), axis=1)          # most recent
    ok = (best >= lookup_min) & (end >= 0)
    start = jnp.where(ok, end + 1, -1)
    return read_periodic(hist, jnp.maximum(start, 0), hlen, K), start


def choose_k(rate, floor, k_max: int, draft_cost):
    """Per-row `dynamic_k.AcceptanceTracker.next_k` on device. rate [B] f32; floor [B] int32
    (`dynamic_k.draft_floor`); draft_cost: a float or an f32 scalar."""
    ks = jnp.arange(k_max + 1, dtype=jnp.float32)
    expected = jnp.cumsum(rate[:, None] ** ks[None], axis=1)                  # 1 + a + ... + a^k
    k = jnp.argmax(expected / (1.0 + draft_cost * ks[None]), axis=1).astype(jnp.int32)
    return jnp.maximum(k, jnp.minimum(floor, k_max))


def prompt_tail_checks(hist, hlen, L: int, lookup_min: int, lookup_max: int):
    """`dynamic_k.tail_checks` on device: how `ngram_propose` would have predicted the last L
    tokens of hist[b, :hlen[b]], each from the tokens before it. hist [B, H] int32; hlen [B] int32.
    Returns (hits [B], checks [B], run [B]) int32: right guesses, positions checked (those with at
    least lookup_min + 1 tokens before them), right guesses in a row ending at the last token."""
    def one(j):                                         # predict hist[i], i = hlen - L + j, from hist[:i]
        i = hlen - L + j
        prop, start = ngram_propose(hist, jnp.maximum(i, 0), 1, lookup_min, lookup_max)
        tok = jnp.take_along_axis(hist, jnp.maximum(i, 0)[:, None], axis=1)[:, 0]
        valid = i >= lookup_min + 1
        return valid, valid & (start >= 0) & (prop[:, 0] == tok)
    valid, hit = jax.vmap(one, out_axes=1)(jnp.arange(L))                       # [B, L], oldest first
    run = jnp.sum(jnp.cumprod(hit[:, ::-1].astype(jnp.int32), axis=1), axis=1)
    return jnp.sum(hit, axis=1, dtype=jnp.int32), jnp.sum(valid, axis=1, dtype=jnp.int32), run


def _append(buf, at, toks, n):
    """buf [B, W]; at, n [B]; toks [B, J]: buf[b, at + j] = toks[b, j] for j < n[b] (W >= at + J)."""
    J = toks.shape[1]

    def row(r, a, t, c):
        old = jax.lax.dynamic_slice_in_dim(r, a, J)
        return jax.lax.dynamic_update_slice_in_dim(r, jnp.where(jnp.arange(J) < c, t, old), a, 0)
    return jax.vmap(row)(buf, at, toks, n)


class _Cycle:
    """One iteration of `ngram_generate`'s loop, over what the loop holds fixed: the target (params,
    cfg, impl), the rows' sampling (stop_ids [B, S], seeds, temperature, top_k, top_p [B], flags),
    the LoopConfig lc and tune [2] f32 (draft_cost, EWMA decay)."""

    def __init__(self, params, stop_ids, seeds, temperature, top_k, top_p, tune, *, cfg, impl, flags, lc):
        self.params, self.stop_ids, self.cfg, self.impl, self.flags, self.lc = params, stop_ids, cfg, impl, flags, lc
        self.sampling = (seeds, temperature, top_k, top_p)
        self.draft_cost, self.decay = tune[0], tune[1]
        self.B, self.K = seeds.shape[0], lc.K
        self.W = max(lc.K + 1, lc.max_chunk)         # tokens one iteration can emit per row
        self.model = get_model(cfg.model_type)

    # --- model work: a plain decode chunk, or the verify of Kb drafts ------------------------------------
    def decode_branch(self, cache, tokens, n_draft, n_fed, generated, remaining, n_steps):
        lc, B = self.lc, self.B
        rows = jnp.stack([tokens[:, 0], n_fed, generated, remaining, jnp.full((B,), n_steps, jnp.int32)])
        toks, cache = decode_chunk(self.params, cache, rows, self.stop_ids, *self.sampling, cfg=self.cfg,
                                   impl=self.impl, steps=lc.max_chunk, flags=self.flags)
        n_acc = jnp.sum(toks >= 0, axis=1).astype(jnp.int32) - 1
        return n_acc, jnp.pad(jnp.maximum(toks, 0), ((0, 0), (0, self.W - lc.max_chunk))), cache

    def verify_rows(self, cache, tokens, n_draft, n_fed, generated, Kb, defer: bool):
        """The verify of Kb drafts and rollback by selection. Returns (n_acc [B], out_tok [B, W],
        the cache after the kept tokens, the KV entries it did not write when defer, else None)."""
        meta = jnp.stack([n_fed, n_draft, generated])
        v = select_verified(self.params, cache, tokens[:, :Kb + 1], meta, None, *self.sampling, self.cfg, self.impl,
                            self.flags, defer_kv_write=defer)
        return v.n_accepted, jnp.pad(v.tokens, ((0, 0), (0, self.W - Kb - 1))), v.cache, v.deferred

    def verify_branch(self, Kb):
        def run(cache, tokens, n_draft, n_fed, generated, remaining, n_steps):
            return self.verify_rows(cache, tokens, n_draft, n_fed, generated, Kb, False)[:3]
        return run

    def first_forward(self, Kb):
        """A branch of the deferred step: the decode chunk's first forward (Kb = 0) or the verify of
        Kb drafts. Reads the cache; returns what changed (n_acc [B], out_tok [B, W], logits [B, V] for
        the chunk, the cache's lengths, version and the groups other than the deferred ones, the
        deferred KV entries padded to K + 1 positions)."""
        B, W, K = self.B, self.W, self.K

        def run(cache, tokens, n_draft, n_fed, generated):
            if Kb == 0:
                o = _fwd(self.cfg, self.impl, self.params, cache, tokens[:, :1], n_fed, defer_kv_write=True)
                logits, new, pend = o.logits, o.cache, o.deferred
                n_acc, out_tok = jnp.zeros((B,), jnp.int32), jnp.zeros((B, W), jnp.int32)
            else:
                n_acc, out_tok, new, pend = self.verify_rows(cache, tokens, n_draft, n_fed, generated, Kb, True)
                logits = jnp.zeros((B, self.cfg.vocab_size), jnp.float32)
            pend = jax.tree_util.tree_map(lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, K - Kb)] + [(0, 0)] * (a.ndim - 3)),
                                          pend)
            kept = {n: g for n, g in new.groups.items() if n not in self.model.deferred_groups}
            return n_acc, out_tok, logits, (new.lengths, new.version, kept), pend
        return run

    def step_deferred(self, idx, cache, tokens, k, n_fed, generated, remaining, n_steps):
        """One iteration's model work with the cache written outside any branch: XLA copies a cache
        that a conditional's branches update (twice at the loop level and once per branch entry, every
        iteration: the copies grow with the capacity). The switch runs the first forward (decode)
        or the verify, reading the cache; one write after it puts in their KV entries; the rest of a
        decode chunk runs after that as a loop of n_steps - 1 steps (none when the step verified)."""
        lc, B, K = self.lc, self.B, self.K
        n_acc, out_tok, logits, (lengths, version, kept), pend = jax.lax.switch(
            idx, [self.first_forward(0)] + [self.first_forward(b) for b in lc.buckets], cache, tokens, k, n_fed,
            generated)
        T = jnp.arange(K + 1)[None]
        positions, valid = cache.lengths[:, None] + T, T < n_fed[:, None]
        cache = self.model.write_deferred_kv(cache.replace(groups={**cache.groups, **kept}, lengths=lengths,
                                                           version=version), pend, positions, valid)
        rows = jnp.stack([tokens[:, 0], n_fed, generated, remaining, jnp.full((B,), jnp.where(idx == 0, n_steps, 0))])
        toks, cache = decode_from(self.params, cache, logits, rows, self.stop_ids, *self.sampling, cfg=self.cfg,
                                  impl=self.impl, steps=lc.max_chunk, flags=self.flags)
        toks = jnp.pad(toks, ((0, 0), (0, self.W - lc.max_chunk)))
        n_dec = jnp.sum(toks >= 0, axis=1).astype(jnp.int32) - 1
        return jnp.where(idx == 0, n_dec, n_acc), jnp.where(idx == 0, jnp.maximum(toks, 0), out_tok), cache

    def model_step(self, idx, cache, tokens, k, n_fed, generated, remaining, n_steps):
        """Branch idx (0: a decode chunk of n_steps, else the verify of buckets[idx - 1] drafts).
        Returns (n_acc [B], out_tok [B, W], cache)."""
        if self.model.write_deferred_kv is not None:
            return self.step_deferred(idx, cache, tokens, k, n_fed, generated, remaining, n_steps)
        return jax.lax.switch(idx, [self.decode_branch] + [self.verify_branch(b) for b in self.lc.buckets],
                              cache, tokens, k, n_fed, generated, remaining, n_steps)

    # --- emission and the draft length -----------------------------------------------------------------
    def emit(self, toks, n_want, out, n_out, hist, hlen, running, generated, remaining, stopped):
        """toks [B, J]; n_want [B]: each running row appends its first n_want tokens, cut at its
        budget and after its first stop token, to out and hist. Returns (n_emit [B], out, n_out, hist,
        hlen, running, generated, remaining, stopped), the counters after the emission."""
        n_emit = jnp.where(running, allowed_tokens(n_want, remaining, jnp), 0)
        is_stop = jnp.any(toks[:, :, None] == self.stop_ids[:, None, :], axis=-1)      # tokens >= 0, pads -1
        is_stop = is_stop & (jnp.arange(toks.shape[1])[None] < n_emit[:, None])
        first_stop, hit = jnp.argmax(is_stop, axis=1), jnp.any(is_stop, axis=1)
        n_emit = jnp.where(hit, first_stop + 1, n_emit)
        out, hist = _append(out, n_out, toks, n_emit), _append(hist, hlen, toks, n_emit)
        remaining = remaining - n_emit
        return (n_emit, out, n_out + n_emit, hist, hlen + n_emit, running & ~hit & (remaining > 0),
                generated + n_emit, remaining, stopped | hit)

    def propose(self, hist, hlen, running, remaining, acc, trials, streak, run, gap, cursor):
        """Each row's proposal and draft length: (prop [B, K], start [B], k [B], idx: the branch)."""
        lc, K = self.lc, self.K
        prop, start = ngram_propose(hist, hlen, K, lc.lookup_min, lc.lookup_max)
        follow = (start < 0) & (cursor >= 0) & (cursor < hlen)            # past an edit: read on
        prop = jnp.where(follow[:, None], read_periodic(hist, jnp.maximum(cursor, 0), hlen, K), prop)
        start = jnp.where(follow, cursor, start)
        if lc.dynamic_k:
            want = choose_k(acc / jnp.maximum(trials, 1e-9), draft_floor(streak, run, gap, jnp.where), K,
                            self.draft_cost)
        else:
            want = jnp.full((self.B,), K, jnp.int32)
        want = allowed_drafts(want, remaining, jnp)
        k = jnp.where(running & (start >= 0) & (want > 0), want, 0)
        kmax = jnp.max(k)
        idx = jnp.where(kmax == 0, 0, 1 + jnp.searchsorted(jnp.asarray(lc.buckets), kmax))
        # A verify runs Kb + 1 positions for every row, whatever its k: drafts up to Kb cost nothing
        # more, so every row with a proposal fills the bucket (more chances to land, same step).
        kb = jnp.asarray((0,) + lc.buckets, jnp.int32)[idx]
        k = jnp.where(running & (start >= 0) & (kb > 0), allowed_drafts(kb, remaining, jnp), 0)
        return prop, start, k, idx

    def statistics(self, idx, k, n_acc, n_emit, prop, out_tok, start, running, remaining, acc, trials, streak,
                   run, gap):
        """The acceptance statistics after an iteration: verified rows, and (decode chunk) the shadow
        check of each proposal against the tokens the chunk emitted. Returns (acc, trials, streak,
        run, gap, shadow [B])."""
        K = self.K
        shadow = ((idx == 0) & running & (start >= 0) & (remaining > 1) if self.lc.dynamic_k
                  else jnp.zeros((self.B,), bool))
        L = jnp.minimum(jnp.minimum(n_emit, K), remaining - 1)
        lead = jnp.cumprod((prop == out_tok[:, :K]) & (jnp.arange(K)[None] < L[:, None]), axis=1)
        proposed = jnp.where(k > 0, k, jnp.where(shadow, L, 0))
        accepted = jnp.where(k > 0, n_acc, jnp.where(shadow, jnp.sum(lead, axis=1).astype(jnp.int32), 0))
        upd = proposed > 0
        decay = self.decay
        acc = jnp.where(upd, decay * acc + accepted, acc)
        trials = jnp.where(upd, decay * trials + accepted + (accepted < proposed), trials)
        full = accepted >= proposed
        streak = jnp.where(upd, jnp.where(full, proposed, 0), streak)
        gap = jnp.where(upd & ~full, run + accepted, gap)
        run = jnp.where(upd, jnp.where(full, run + accepted + 1, 0), run)
        return acc, trials, streak, run, gap, shadow & (accepted > 0)

    def body(self, s):
        lc, K = self.lc, self.K
        it, cache, hist, hlen, running, generated, remaining, out, n_out, stopped, acc, trials, streak, run, gap, \
            cursor, log, branch, quiet = s
        prop, start, k, idx = self.propose(hist, hlen, running, remaining, acc, trials, streak, run, gap, cursor)
        pending = jnp.take_along_axis(hist, jnp.maximum(hlen - 1, 0)[:, None], axis=1)
        tokens = jnp.concatenate([pending, jnp.where(jnp.arange(K)[None] < k[:, None], prop, 0)], axis=1)
        n_fed = jnp.where(running, 1 + k, 0).astype(jnp.int32)
        n_steps = jnp.minimum(lc.chunk * 4 ** quiet, lc.max_chunk)
        n_acc, out_tok, cache = self.model_step(idx, cache, tokens, k, n_fed, generated, remaining, n_steps)
        # emit: accepted drafts + the bonus (the counters before it are still needed below)
        n_emit, out, n_out2, hist, hlen2, running2, generated2, remaining2, stopped = self.emit(
            out_tok, n_acc + 1, out, n_out, hist, hlen, running, generated, remaining, stopped)
        log = log.at[:, it].set(jnp.stack([jnp.where(k > 0, k, -1), n_acc, generated, n_emit]))
        branch = branch.at[it].set(jnp.where(idx == 0, 0, jnp.asarray((0,) + lc.buckets)[idx]))
        acc, trials, streak, run, gap, landed = self.statistics(idx, k, n_acc, n_emit, prop, out_tok, start, running,
                                                                remaining, acc, trials, streak, run, gap)
        # decode chunks grow while no proposal lands (as the host loop's do), back to `chunk` after a hit
        quiet = jnp.where((idx == 0) & lc.dynamic_k & ~jnp.any(landed), jnp.minimum(quiet + 1, lc.quiet_max), 0)
        cursor = jnp.where(idx == 0, -1, jnp.where(k > 0, jnp.where(start >= 0, start + n_acc + 1, -1), cursor))
        return (it + 1, cache, hist, hlen2, running2, generated2, remaining2, out, n_out2, stopped, acc, trials,
                streak, run, gap, cursor, log, branch, quiet)


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "flags", "lc"), donate_argnums=(1,))
def ngram_generate(params, cache, hist, first, rows, tune, stop_ids, seeds, temperature, top_k, top_p, *, cfg,
                   impl, flags: SamplerFlags, lc: LoopConfig):
    """Speculative generation after prefill, entirely on device.
    cache: the rows after their prompts; hist [B, H] int32: the prompt per row, H >= max prompt + 1 + N + W;
    first [B] int32: the token prefill sampled, not yet emitted (taken as a device array, so the host
    dispatches prefill and this loop back to back, without waiting for the prefill in between);
    rows [4, B] int32: hlen (prompt tokens in hist), running (0 / 1), generated (tokens emitted so
    far), remaining (tokens the row may still emit, the first included); tune [2] f32: (draft_cost,
    EWMA decay of the acceptance counts), values rather than static, so other settings reuse the
    program; stop_ids [B, S] int32 (-1 padded);
    seeds [B] uint32, temperature, top_p [B] f32, top_k [B] int32.
    Returns (out [B, N + W] int32: emitted tokens, the first included, n_out [B], stopped [B] bool
    (a stop token ended the row), log [4, N, B] int32 per iteration: k drafted (-1 when the row did
    not verify), accepted, generated before, tokens emitted; branch [N] int32: -1 unused, 0 decode,
    else the verify's draft length; cache)."""
    cycle = _Cycle(params, stop_ids, seeds, temperature, top_k, top_p, tune, cfg=cfg, impl=impl, flags=flags, lc=lc)
    N, W, B = lc.max_new, cycle.W, hist.shape[0]
    hlen, running, generated, remaining = rows[0], rows[1] > 0, rows[2], rows[3]

    def cond(s):
        return (s[0] < N) & jnp.any(s[4])

    # the first token (sampled by prefill) goes out the way the loop's tokens do
    z = jnp.zeros((B,), jnp.int32)
    _, out, n_out, hist, hlen, running, generated, remaining, stopped = cycle.emit(
        first[:, None], z + 1, jnp.full((B, N + W), -1, jnp.int32), z, hist, hlen, running & (remaining > 0),
        generated, remaining, jnp.zeros((B,), bool))
    f32 = jnp.float32
    acc, trials, streak, quiet = jnp.full((B,), 0.2, f32), jnp.ones((B,), f32), jnp.zeros((B,), jnp.int32), jnp.int32(0)
    if lc.dynamic_k:       # seed each row's acceptance from prompt lookup over its text's tail
        hits, checks, run = prompt_tail_checks(hist, hlen, WARM_TAIL, lc.lookup_min, lc.lookup_max)
        acc0, trials0, streak = warm_tail_state(hits, checks, run)
        acc, trials = acc + acc0, trials + trials0
        quiet = jnp.where(jnp.all(~running | cold_tail(hits, checks)), lc.quiet_max, 0).astype(jnp.int32)
    state = (jnp.int32(0), cache, hist, hlen, running, generated, remaining, out, n_out, stopped,
             acc, trials, streak, streak, jnp.zeros((B,), jnp.int32), jnp.full((B,), -1, jnp.int32),
             jnp.full((4, N, B), -1, jnp.int32), jnp.full((N,), -1, jnp.int32), quiet)
    s = jax.lax.while_loop(cond, cycle.body, state)
    _, cache, _, _, _, _, _, out, n_out, stopped, _, _, _, _, _, _, log, branch, _ = s
    return out, n_out, stopped, log, branch, cache
