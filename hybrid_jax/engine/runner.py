"""Jit-compiled engine steps over bucketed static shapes, with the cache pools donated to each call.

The engine's cache is one pytree of pools (cache.pools): paged groups hold pages every request
shares through block tables, slot groups one row per request (`max_num_seqs` rows, then a null row
that padding rows of a batch bucket point at, then the prefix cache's checkpoint units). The block
manager (cache.block_manager, owned by the engine) decides which pages and row each request holds;
a step receives the rows, their block tables and their lengths from the host (engine/step_inputs.py
builds them), gathers the view its forward reads (`take_view`), runs the model, samples on device
and scatters the rows back:

  mixed step   [Bb, T] tokens: prefill chunks and decodes together, one sample per row at most
  decode step  [Bb] last tokens: `decode_steps` iterations in a `lax.while_loop`, with stop token
               ids and max-token limits checked on device
  verify step  [Bb, K+1] tokens: speculative drafts checked in one forward, rejected ones rolled back

A drafter with state on device rides along in every step: a draft model's own cache rows, or the MTP
block's state (`hybrid_jax.speculative.mtp`), which also reads the target's hidden states.

Bb is a power of two up to the row count, T one of a few token buckets up to the token budget, so
the set of programs is finite and `warmup` can compile all of them before the first request.

Overlap: the mixed and decode steps are dispatched (`dispatch_mixed`, `dispatch_decode`) and read back
later (`land`), so the engine can enqueue the next step first. Each writes every row's last sampled
token into `slot_last` (on the device, one entry per row); a row whose last token is still on the
device (`from_dev`, the request's `num_inflight`) is fed from there, so the next step never waits
for a device-to-host copy.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache import put_rows, take_rows
from cache.block_manager import BlockManager, GroupGeometry
from cache.pools import (build_pools, copy_pages, pool_geometry, put_view,
                         size_pools, take_view)
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.request import attributed
from hybrid_jax.engine.step_inputs import LOGPROBS_WIDTH, StepInputs
from hybrid_jax.errors import InputError
from hybrid_jax.generate import bucket
from hybrid_jax.models import get_model
from hybrid_jax.models.ragged import pack
from hybrid_jax.parallel.context import Traced, active
from hybrid_jax.parallel.placement import entry_copies
from hybrid_jax.sampling import FULL_SAMPLER, sample, token_logprobs

MIN_T = 8


def enable_persistent_compilation_cache(path: str | None):
    """Turns on JAX's persistent compilation cache (keyed by JAX on program, shapes and hardware)."""
    if not path:
        return
    import os  # noqa: PLC0415
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def default_budget(abstract, max_num_seqs: int, max_model_len: int) -> int:
    """Bytes the old row layout took: every request row preallocated at max_model_len, plus the null
    row. With pages, the same bytes serve as many requests as their actual lengths allow."""
    rows = max_num_seqs + 1
    row_bytes = sum(g.row_nbytes() for g in abstract.groups.values())
    pages = sum(-(-max_model_len // g.page_tokens) * g.page_nbytes() for g in abstract.groups.values() if g.paged)
    return rows * row_bytes + max_num_seqs * pages


@dataclasses.dataclass
class Dispatched:
    """A mixed or decode step enqueued on the device and not read back yet (`ModelRunner.land`):
    tokens [Bb] (mixed) or [Bb, steps] (decode) and logprob triples, for the first n rows."""
    n: int
    tokens: jax.Array
    lps: tuple
    program: tuple             # which compiled program ran (its device time stands in when not measured)
    dispatched: float          # perf_counter at dispatch

    def ready(self) -> bool:
        return all(a.is_ready() for a in (self.tokens, *self.lps))


class ModelRunner:
    def __init__(self, cfg, params, dtype, ecfg: EngineConfig, impl: str = "auto", layout=None, eos_ids=()):
        self.cfg, self.params, self.ecfg, self.impl, self.dtype = cfg, params, ecfg, impl, dtype
        self.eos_ids = tuple(eos_ids)     # the model's end-of-sequence ids (a row stops on them unless ignore_eos)
        self.layout = layout      # hybrid_jax.parallel.Layout: the pools are split like the parameters
        self.model = get_model(cfg.model_type)
        self.null_slot = ecfg.max_num_seqs            # the null row: padding rows of a bucket point at it
        rows = ecfg.max_num_seqs + 1
        with active(layout):      # the cache's shapes may follow the layout (parallel.kv_replicas)
            abstract = jax.eval_shape(lambda: self.model.new_cache(cfg, 1, ecfg.max_model_len, dtype,
                                                                   page_size=ecfg.prefix_block_size))
        self.abstract = abstract
        # pool fields that keep copies of each entry under the layout (KV heads once per device): the
        # prefix cache's disk tier stores one, so what it writes restores under any layout
        self.copies = ()
        if layout is not None:
            with active(None):
                logical = jax.eval_shape(lambda: self.model.new_cache(cfg, 1, ecfg.max_model_len, dtype,
                                                                      page_size=ecfg.prefix_block_size))
            self.copies = entry_copies(logical, abstract)
        budget = ecfg.kv_cache_bytes or default_budget(abstract, ecfg.max_num_seqs, ecfg.max_model_len)
        prefix_cap = (ecfg.prefix_cache_bytes or budget) if ecfg.enable_prefix_caching else 0
        try:
            self.pages, self.units = size_pools(
                abstract, rows=rows, budget_bytes=budget, min_tokens=ecfg.max_model_len, prefix_cap_bytes=prefix_cap,
                checkpoint_every=ecfg.prefix_checkpoint_interval * ecfg.prefix_block_size)
        except ValueError as e:
            raise InputError(f"kv_cache_bytes: {e}") from None
        self.budget_bytes = budget
        self.cache_shardings = layout.cache_shardings(abstract) if layout is not None else None
        self.cache = self._new_pools()
        # block-table width of each paged group: pages a request of max_model_len tokens lists
        self.widths = {n: g.page_table.shape[1] for n, g in abstract.groups.items() if g.paged}
        # the rows' inputs of each step, built on the host (its block manager is set by the engine)
        self.inputs = StepInputs(self.null_slot, self.widths, ecfg.max_stop_ids, self.eos_ids, cfg.vocab_size)
        self._mixed = jax.jit(self._mixed_fn, static_argnames=("flags", "top_n"), donate_argnames=("cache", "dcache"))
        self._ragged = jax.jit(self._ragged_fn, static_argnames=("flags", "top_n"), donate_argnames=("cache",))
        # Mixed steps (prefill chunks beside decodes) run as one flat token-major batch when the family
        # has a ragged forward, no drafter state rides along (a draft model / the MTP block advance on
        # the padded [B, T] tokens) and padding would cost more tokens (dispatch_mixed); else padded.
        self.ragged = self.model.forward_ragged is not None
        self._decode = jax.jit(self._decode_fn, static_argnames=("steps", "flags", "top_n"),
                               donate_argnames=("cache", "dcache"))
        self._verify = jax.jit(self._verify_fn, static_argnames=("flags", "replay"),
                               donate_argnames=("cache", "dcache"))
        self._loop = jax.jit(self._loop_fn, static_argnames=("lc",), donate_argnames=("cache",))
        if layout is not None:      # traced with the layout current: the per-device ops see the mesh
            for name in ("_mixed", "_ragged", "_decode", "_verify", "_loop"):
                setattr(self, name, Traced(layout, getattr(self, name)))
        self._copy_pages = jax.jit(copy_pages, donate_argnames=("pools",))
        # A draft model (speculative decoding) keeps its own cache rows in step with the target's:
        # every prefill chunk and decode iteration feeds it the same tokens. With the MTP drafter
        # (self.mtp), dcache holds the MTP state instead and dparams stays None.
        self.dcfg = self.dparams = self.dmodel = self.dcache = None
        self.mtp = False
        self.slot_last = self._new_slot_last()
        self.wait_seconds = 0.0        # time the host spent blocked on step results (`_wait`, `land`)
        self.device_seconds = 0.0      # time the device spent running steps, as far as the host saw it
        self._device_free = 0.0        # when the last step the host read finished (perf_counter)
        self._typical: dict = {}       # program -> its last measured device time

    @property
    def blocks(self) -> BlockManager | None:
        """The engine's block manager (it owns it): the rows' block tables come from it."""
        return self.inputs.blocks

    @blocks.setter
    def blocks(self, blocks: BlockManager | None):
        self.inputs.blocks = blocks

    def _new_slot_last(self):
        """[max_num_seqs + 1] int32 on the device (replicated on a mesh): each row's last sampled token."""
        z = jnp.zeros((self.ecfg.max_num_seqs + 1,), jnp.int32)
        return z if self.layout is None else jax.device_put(z, self.layout.replicated)

    def _wait(self, *outs):
        """Blocks until a step dispatched just now is ready (verify and loop steps, read at once): the
        wait is the step's device time."""
        t = time.perf_counter()
        jax.block_until_ready(outs)
        now = time.perf_counter()
        self.wait_seconds += now - t
        self.device_seconds += now - max(t, self._device_free)
        self._device_free = now

    def land(self, d: "Dispatched"):
        """Reads a dispatched step's results: (tokens [n, W] int32, -1 where a row sampled nothing;
        logprob triples [n, W], [n, W, top_n] x 2). Device time: from when the device could start it
        (its dispatch, or the end of the step before) to when it finished; when it finished before the
        host looked, the program's last measured time stands in for it (the device idled after it)."""
        t = time.perf_counter()
        start = max(d.dispatched, self._device_free)
        if d.ready():
            busy = min(t - start, self._typical.get(d.program, t - start))
            self._device_free = max(start + busy, self._device_free)
        else:
            jax.block_until_ready((d.tokens, d.lps))
            now = time.perf_counter()
            self.wait_seconds += now - t
            busy = now - start
            self._typical[d.program] = busy
            self._device_free = now
        self.device_seconds += busy
        tok = np.asarray(d.tokens)[:d.n]
        lps = tuple(np.asarray(a)[:d.n] for a in d.lps)
        if tok.ndim == 1:                 # a mixed step: one token per row at most
            return tok[:, None], tuple(a[:, None] for a in lps)
        return tok, lps

    def _new_pools(self):
        """Fresh, empty pools; on a mesh, created in place by each device (its part only: no device ever
        holds a whole pool)."""
        def build():
            return build_pools(self.abstract, self.ecfg.max_num_seqs + 1, self.pages, self.units)
        return build() if self.layout is None else jax.jit(build, out_shardings=self.cache_shardings)()

    def _pin(self, view):
        """A step's view of the pools (or a forward's output cache) pinned to the pools' layout on a mesh:
        inside a step's loop too, the partitioner keeps every pool as it is stored (left free, it may
        split a replicated KV pool the way the attention reads it, and gather it back whole at the
        step's end)."""
        return view if self.layout is None else self.layout.pin(view)

    def _put_view(self, cache, rows, view):
        """put_view, with the pools' shardings pinned on a mesh (so the donated buffers are reused
        step after step instead of the partitioner choosing another layout for the output)."""
        out = put_view(cache, rows, view)
        return out if self.layout is None else jax.lax.with_sharding_constraint(out, self.cache_shardings)

    def geometry(self) -> list[GroupGeometry]:
        """What the block manager hands out: every paged group's pages, every slot group's checkpoint
        units (rows after the request rows and the null row)."""
        return pool_geometry(self.cache, self.ecfg.max_num_seqs + 1)

    def copy_on_write(self, copies: dict[str, list[tuple[int, int]]]):
        """Copies the pages a request is about to write but shares (`BlockManager.reserve`): (source,
        copy) pairs per paged group, in compiled copies of fixed width (the row count)."""
        W = self.ecfg.max_num_seqs
        most = max((len(v) for v in copies.values()), default=0)
        for start in range(0, most, W):
            plan = {}
            for n in self.widths:
                src, dst = np.full((W,), -1, np.int32), np.full((W,), -1, np.int32)
                for i, (a, b) in enumerate(copies.get(n, [])[start:start + W]):
                    src[i], dst[i] = a, b
                plan[n] = (src, dst)
            self.cache = self._copy_pages(self.cache, plan)

    # --- buckets -----------------------------------------------------------------------------------
    def batch_buckets(self) -> list[int]:
        top = bucket(self.ecfg.max_num_seqs)
        return [1 << i for i in range(top.bit_length())]

    def token_buckets(self) -> list[int]:
        """MIN_T, 4 MIN_T, 16 MIN_T, ... up to the token budget: a step pads its tokens at most 4x,
        and the number of programs to compile stays small."""
        top = bucket(self.ecfg.max_num_batched_tokens, MIN_T)
        out = [MIN_T]
        while out[-1] < top:
            out.append(min(out[-1] * 4, top))
        return out

    def chunk_cap(self, rows: int) -> int:
        """Longest prefill chunk for a step of `rows` rows: the largest token bucket whose padded
        step (batch bucket x tokens) stays within the token budget, so that a prefill beside many
        decodes costs about one decode step instead of stalling them all."""
        if self.ragged:        # a ragged step costs its real tokens: the scheduler's budget is the only cap
            return self.ecfg.max_num_batched_tokens
        fit = self.ecfg.max_num_batched_tokens // bucket(rows)
        return max([b for b in self.token_buckets() if b <= fit] or [MIN_T])

    def token_bucket(self, n: int) -> int:
        return next(b for b in self.token_buckets() if b >= n)

    def num_compiled(self) -> int:
        """Programs compiled so far by this runner (one per bucket and static option)."""
        return (self._mixed._cache_size() + self._ragged._cache_size() + self._decode._cache_size()
                + self._verify._cache_size()
                + self._loop._cache_size() + self._copy_pages._cache_size())

    # --- traced step functions ---------------------------------------------------------------------
    def _sample(self, logits, r, flags, top_n):
        keys = jax.vmap(jax.random.key)(r.seeds)
        tok = sample(logits, keys, r.steps, r.temperature, r.top_k, r.top_p, flags)
        return tok, token_logprobs(logits, tok, top_n)

    def set_draft(self, dcfg, dparams, ddtype, extra: int):
        """Attaches a draft model; its cache rows hold `extra` more positions (scratch drafts)."""
        self.dcfg, self.dparams, self.dmodel = dcfg, dparams, get_model(dcfg.model_type)
        self.ragged = False
        cap = self.cache.lengths.shape[0]
        self._draft_shape = (cap, self.ecfg.max_model_len + extra, ddtype)
        self.dcache = self.dmodel.new_cache(dcfg, *self._draft_shape)

    def reset_pools(self):
        """Fresh, empty pools (and draft rows): after a failed step, whose call may have consumed the
        donated ones. The compiled programs stay."""
        self.cache = self._new_pools()
        self.slot_last = self._new_slot_last()
        if self.dcache is not None:
            self.dcache = self.dmodel.new_cache(self.dcfg, *self._draft_shape)

    def set_mtp(self, extra: int):
        """Drafts with the target's own MTP block (params["mtp"]); its cache rows hold `extra` more
        positions (scratch drafts)."""
        from hybrid_jax.speculative import mtp  # noqa: PLC0415
        self.mtp = True
        self.ragged = False
        with active(self.layout):     # the MTP block is the target's: its cache follows the layout
            self.dcache = mtp.new_state(self.model, self.cfg, self.cache.lengths.shape[0],
                                        self.ecfg.max_model_len + extra, self.dtype)

    def _target(self, params, sub, tokens, n_new, **kw):
        """The target's forward (a StepOutput; with the MTP drafter its `hidden` is asked for)."""
        out = self.model.forward(self.cfg, params, self._pin(sub), tokens, n_new, impl=self.impl,
                                 return_hidden=self.mtp, **kw)
        return out.replace(cache=self._pin(out.cache))

    def _mtp_hidden(self, params, out):
        """What the MTP block reads from a target forward's output (a StepOutput or a Verified): [B, T, Hd]."""
        return self.model.mtp.target_hidden(self.cfg, params, out.hidden)

    def _mtp_advance(self, params, dsub, tokens, hidden, n_new, fresh=None):
        from hybrid_jax.speculative import mtp  # noqa: PLC0415
        return mtp.advance(self.model, self.cfg, params, dsub, tokens, hidden, n_new, fresh, impl=self.impl)

    def _dfwd(self, dparams, dsub, tokens, n_new, **kw):
        with active(None):        # a draft model is not split: its cache and forward ignore the layout
            return self.dmodel.forward(self.dcfg, dparams, dsub, tokens, n_new, impl=self.impl, **kw)

    @staticmethod
    def _noted(last, rows, tok):
        """slot_last with each row's new last token tok [Bb] (-1: the row sampled none) written in."""
        return last.at[rows].set(jnp.where(tok >= 0, tok, last[rows]))

    def _mixed_fn(self, params, cache, last, r, reset, tokens, n_new, do_sample, dparams=None, dcache=None, *,
                  flags, top_n):
        tokens = tokens.at[:, 0].set(jnp.where(r.from_dev, last[r.rows], tokens[:, 0]))
        sub = take_view(cache, r.rows, r.tables, r.lengths, reset)
        out = self._target(params, sub, tokens, n_new)
        logits, sub = out.logits, out.cache
        tok, lps = self._sample(logits, r, flags, top_n)
        tok = jnp.where(do_sample, tok, -1)
        if self.mtp:
            from hybrid_jax.speculative import mtp  # noqa: PLC0415
            fresh = r.fresh
            dsub = self._mtp_advance(params, mtp.take(dcache, r.rows, fresh), tokens, self._mtp_hidden(params, out),
                                     n_new, fresh)
            dcache = mtp.put(dcache, r.rows, dsub)
        elif dcache is not None:
            dsub = self._dfwd(dparams, take_rows(dcache, r.rows, reset), tokens, n_new).cache
            dcache = put_rows(dcache, r.rows, dsub)
        return tok, lps, self._put_view(cache, r.rows, sub), dcache, self._noted(last, r.rows, tok)

    def _ragged_fn(self, params, cache, last, r, reset, batch, do_sample, *, flags, top_n):
        """`_mixed_fn` over a ragged batch (models.ragged.RaggedBatch of the step's S rows)."""
        first = batch.cu_seqlens[:-1]            # each row's first token (a row fed from the device has one)
        fed = jnp.where(r.from_dev, last[r.rows], batch.tokens[jnp.minimum(first, batch.tokens.shape[0] - 1)])
        batch = batch.replace(tokens=batch.tokens.at[first].set(fed, mode="drop"))
        sub = take_view(cache, r.rows, r.tables, r.lengths, reset)
        out = self.model.forward_ragged(self.cfg, params, self._pin(sub), batch, impl=self.impl)
        tok, lps = self._sample(out.logits, r, flags, top_n)
        tok = jnp.where(do_sample, tok, -1)
        return tok, lps, self._put_view(cache, r.rows, out.cache), self._noted(last, r.rows, tok)

    def _decode_fn(self, params, cache, last, r, last_tok, active, stop_ids, remaining, dparams=None, dcache=None,
                   *, steps, flags, top_n):
        from hybrid_jax.speculative import mtp  # noqa: PLC0415
        last_tok = jnp.where(r.from_dev, last[r.rows], last_tok)
        # in place: each layer reads and writes its rows of the recurrent pools once per token
        sub = take_view(cache, r.rows, r.tables, r.lengths, in_place=True)
        dsub = None
        if dcache is not None:
            dsub = mtp.take(dcache, r.rows) if self.mtp else take_rows(dcache, r.rows)
        Bb = last_tok.shape[0]
        out = jnp.full((Bb, steps), -1, jnp.int32)
        lp_c = jnp.zeros((Bb, steps), jnp.float32)
        lp_v = jnp.zeros((Bb, steps, top_n), jnp.float32)
        lp_i = jnp.zeros((Bb, steps, top_n), jnp.int32)

        def body(state):
            j, tok, active, sub, dsub, out, lp_c, lp_v, lp_i = state
            fed, n = jnp.maximum(tok, 0)[:, None], active.astype(jnp.int32)
            o = self._target(params, sub, fed, n)
            logits, sub = o.logits, o.cache
            if self.mtp:
                dsub = self._mtp_advance(params, dsub, fed, self._mtp_hidden(params, o), n)
            elif dsub is not None:
                dsub = self._dfwd(dparams, dsub, fed, n).cache
            rj = r.replace(steps=r.steps + j)
            new, (c, v, i) = self._sample(logits, rj, flags, top_n)
            new = jnp.where(active, new, -1)
            out, lp_c = out.at[:, j].set(new), lp_c.at[:, j].set(c)
            lp_v, lp_i = lp_v.at[:, j].set(v), lp_i.at[:, j].set(i)
            stop = jnp.any(new[:, None] == stop_ids, axis=-1) | (j + 1 >= remaining)
            return j + 1, new, active & ~stop, sub, dsub, out, lp_c, lp_v, lp_i

        def cond(state):
            return (state[0] < steps) & jnp.any(state[2])

        state = (jnp.int32(0), last_tok, active & (remaining > 0), sub, dsub, out, lp_c, lp_v, lp_i)
        _, _, _, sub, dsub, out, lp_c, lp_v, lp_i = jax.lax.while_loop(cond, body, state)
        if dcache is not None:
            dcache = mtp.put(dcache, r.rows, dsub) if self.mtp else put_rows(dcache, r.rows, dsub)
        n_out = jnp.sum(out >= 0, axis=1)
        final = jnp.where(n_out > 0, jnp.take_along_axis(out, jnp.maximum(n_out - 1, 0)[:, None], 1)[:, 0], -1)
        return out, (lp_c, lp_v, lp_i), self._put_view(cache, r.rows, sub), dcache, self._noted(last, r.rows,
                                                                                                     final)

    def _draft(self, step, carry, r, pending, K, flags):
        """K draft tokens per row: step(carry, token [Bb]) -> (logits [Bb, V], carry) is the drafter (a
        draft model on a scratch copy of its rows, or the MTP block), fed the pending token first and
        then its own drafts. Returns (drafts [Bb, K], q [Bb, K, V])."""
        from hybrid_jax.speculative.acceptance import processed_logits  # noqa: PLC0415
        from hybrid_jax.speculative.drafters import DRAFT_SALT  # noqa: PLC0415
        keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), DRAFT_SALT))(r.seeds)

        def draw(j, logits):
            tok = sample(logits, keys, r.steps + j, r.temperature, r.top_k, r.top_p, flags)
            q = jax.nn.softmax(processed_logits(logits[:, None], r.temperature, r.top_k, r.top_p, flags)[:, 0],
                               axis=-1)
            return tok, q

        logits, carry = step(carry, pending)
        t0, q0 = draw(0, logits)
        drafts = jnp.zeros((t0.shape[0], K), jnp.int32).at[:, 0].set(t0)
        qs = jnp.zeros((t0.shape[0], K) + q0.shape[1:], jnp.float32).at[:, 0].set(q0)

        def body(j, state):
            carry, drafts, qs = state
            logits, carry = step(carry, drafts[:, j - 1])
            t, q = draw(j, logits)
            return carry, drafts.at[:, j].set(t), qs.at[:, j].set(q)

        _, drafts, qs = jax.lax.fori_loop(1, K, body, (carry, drafts, qs))
        return drafts, qs

    def _verify_fn(self, params, cache, r, tokens, meta, dparams=None, dcache=None, *, flags, replay):
        """Speculative verify of tokens [Bb, K+1] = [pending, d_1 .. d_K] per slot row in ONE forward;
        meta [2, Bb] = (n_fed = 1 + n_draft, 0 for padding rows; n_draft). Rejected tokens are rolled
        back by selection of the recurrent state after the last kept token, or (replay) by running the kept tokens
        from the pre-verify rows again; the rows' versions change when anything was rejected.
        Returns (n_accepted [Bb], tokens [Bb, K+1]: the first n_accepted + 1 are emitted, cache)."""
        from hybrid_jax.speculative.verify import replay_verified, select_verified  # noqa: PLC0415
        sub = take_view(cache, r.rows, r.tables, r.lengths)   # the snapshot, for replay (never donated)
        from hybrid_jax.speculative import mtp  # noqa: PLC0415
        n_fed, n_draft = meta[0], meta[1]
        draft_probs = None
        run = (n_fed > 0).astype(jnp.int32)
        if dcache is not None:                     # the drafter writes the drafts (host sent the pending token)
            if self.mtp:
                dsub = mtp.take(dcache, r.rows)
                step, carry = mtp.draft_step(self.model, self.cfg, params, run, self.impl), mtp.draft_carry(dsub)
            else:
                dsub = take_rows(dcache, r.rows)

                def step(c, tok):
                    o = self._dfwd(dparams, c, tok[:, None], run)
                    return o.logits, o.cache
                carry = dsub
            drafts, draft_probs = self._draft(step, carry, r, tokens[:, 0], tokens.shape[1] - 1, flags)
            tokens = tokens.at[:, 1:].set(drafts)
        verified = replay_verified if replay else select_verified
        v = verified(params, sub, tokens, jnp.stack([n_fed, n_draft, r.steps]), draft_probs, r.seeds,
                     r.temperature, r.top_k, r.top_p, self.cfg, self.impl, flags, return_hidden=self.mtp)
        n_keep = jnp.where(n_fed > 0, 1 + v.n_accepted, 0).astype(jnp.int32)
        if self.mtp:                               # the MTP block takes the kept tokens from its resume point
            h = self._mtp_hidden(params, v)
            dcache = mtp.put(dcache, r.rows, self._mtp_advance(params, dsub, tokens, h, n_keep))
        elif dcache is not None:                   # the draft takes the kept tokens from its resume point
            dcache = put_rows(dcache, r.rows, self._dfwd(dparams, dsub, tokens, n_keep).cache)
        return v.n_accepted, v.tokens, self._put_view(cache, r.rows, v.cache), dcache

    def run_verify(self, reqs, drafts, K: int, replay: bool):
        """reqs: decoding requests; drafts: [k_i] int32 per request (k_i <= K, may be 0); K: a
        compiled draft length. Returns (n_accepted [n], tokens [n, K+1])."""
        n = len(reqs)
        Bb = bucket(n)
        tokens = np.zeros((Bb, K + 1), np.int32)
        meta = np.zeros((2, Bb), np.int32)
        for i, (q, d) in enumerate(zip(reqs, drafts)):
            with attributed(q):
                tokens[i, 0] = q.output_ids[-1]
                tokens[i, 1:1 + len(d)] = d
                meta[0, i], meta[1, i] = 1 + len(d), len(d)
        n_acc, out, self.cache, self.dcache = self._verify(
            self.params, self.cache, self.inputs.rows(reqs, Bb), tokens, meta, self.dparams,
            self.dcache, flags=FULL_SAMPLER, replay=replay)
        self._wait(n_acc, out)
        return np.asarray(n_acc)[:n], np.asarray(out)[:n]

    def _loop_fn(self, params, cache, r, hist, first, rows, tune, stop_ids, *, lc):
        """`speculative.device_loop.ngram_generate` over the rows' view of the pools."""
        from hybrid_jax.speculative.device_loop import ngram_generate  # noqa: PLC0415
        sub = take_view(cache, r.rows, r.tables, r.lengths)
        out, n_out, _, log, branch, sub = ngram_generate(
            params, sub, hist, first, rows, tune, stop_ids, r.seeds, r.temperature, r.top_k, r.top_p,
            cfg=self.cfg, impl=self.impl, flags=FULL_SAMPLER, lc=lc)
        return out, n_out, log, branch, self._put_view(cache, r.rows, sub)

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

    # --- host calls ---------------------------------------------------------------------------------
    def dispatch_mixed(self, plan_rows) -> Dispatched:
        """Enqueues a mixed step of scheduler rows (prefill chunks and decodes; `land` gives tokens
        [n, 1], -1 for a row that does not sample); a row whose request has tokens in flight is fed its
        last one from `slot_last`."""
        reqs = [p.request for p in plan_rows]
        n = len(reqs)
        Bb = bucket(n)
        reset = np.zeros((Bb,), bool)
        do_sample = np.zeros((Bb,), bool)
        fresh = np.zeros((Bb,), bool)
        chunks = []
        for i, p in enumerate(plan_rows):
            q = p.request
            with attributed(q):
                # a row fed from the device (its last token in flight) gets a placeholder the step replaces
                chunks.append(q.all_ids[q.num_computed:q.num_computed + p.num_tokens] if not q.num_inflight else [0])
                reset[i], do_sample[i] = p.reset, p.sample
                # the MTP state starts over with the row, and after a prefix hit (it holds no prefix)
                fresh[i] = p.reset or (q.num_cached_tokens > 0 and q.num_computed == q.num_cached_tokens)
        top_n = self.inputs.top_n(reqs)
        r = self.inputs.rows(reqs, Bb)
        T = self.token_bucket(max(len(c) for c in chunks))
        N = self.token_bucket(sum(len(c) for c in chunks))
        # Ragged when padding to the longest row would cost more tokens than the flat batch (several
        # rows of unequal length); a step of one row, or of equal rows, is no smaller flat, and the
        # padded step is the faster program for it (XLA:CPU: ~13% on a 512-token chunk over 4k).
        t = time.perf_counter()
        if self.ragged and Bb * T > N:
            batch = pack(chunks, [p.request.num_computed for p in plan_rows], N, Bb)
            tok, lps, self.cache, self.slot_last = self._ragged(self.params, self.cache, self.slot_last, r, reset,
                                                                batch, do_sample, flags=FULL_SAMPLER, top_n=top_n)
            program = ("ragged", Bb, N, top_n)
        else:
            tokens = np.zeros((Bb, T), np.int32)
            n_new = np.zeros((Bb,), np.int32)
            for i, c in enumerate(chunks):
                tokens[i, :len(c)] = c
                n_new[i] = len(c)
            if self.mtp:
                r = r.replace(fresh=fresh)
            tok, lps, self.cache, self.dcache, self.slot_last = self._mixed(
                self.params, self.cache, self.slot_last, r, reset, tokens, n_new,
                do_sample, self.dparams, self.dcache, flags=FULL_SAMPLER, top_n=top_n)
            program = ("mixed", Bb, T, top_n)
        return Dispatched(n, tok, lps, program, t)

    def dispatch_decode(self, reqs, steps: int, caps: list[int] | None = None) -> Dispatched:
        """Enqueues up to `steps` decode iterations for running requests (each stops at a stop id, its
        max_tokens or caps[i] tokens, on device; `land` gives tokens [n, steps], -1 past a row's end);
        a request with tokens in flight is fed its last from `slot_last`."""
        n = len(reqs)
        Bb = bucket(n)
        last = np.zeros((Bb,), np.int32)
        active = np.zeros((Bb,), bool)
        remaining = np.zeros((Bb,), np.int32)
        if n:
            last[:n] = [q.output_ids[-1] if not q.num_inflight else 0 for q in reqs]
            active[:n] = True
            remaining[:n] = [q.remaining_tokens for q in reqs]
            if caps is not None:
                remaining[:n] = np.minimum(remaining[:n], caps)
        stop_ids = self.inputs.stop_ids(reqs, Bb)
        t, top_n = time.perf_counter(), self.inputs.top_n(reqs)
        out, lps, self.cache, self.dcache, self.slot_last = self._decode(
            self.params, self.cache, self.slot_last, self.inputs.rows(reqs, Bb), last, active, stop_ids,
            remaining, self.dparams, self.dcache, steps=steps, flags=FULL_SAMPLER, top_n=top_n)
        return Dispatched(n, out, lps, ("decode", Bb, steps, top_n), t)

    # --- warm-up -----------------------------------------------------------------------------------
    def warmup(self, mode: str):
        """Compiles the step programs ahead of serving: `minimal` = every decode bucket and the mixed
        step at the smallest token bucket; `all` = every (batch, token) bucket, with and without
        logprobs, and (with prefix caching) the copy-on-write of shared pages: every program a step
        can run. The cache comes back untouched: every row points at the null slot."""
        if mode == "none":
            return
        if mode == "all" and self.ecfg.enable_prefix_caching and self.widths:
            W = self.ecfg.max_num_seqs
            pad = (np.full((W,), -1, np.int32), np.full((W,), -1, np.int32))
            self.cache = self._copy_pages(self.cache, {n: pad for n in self.widths})
        tbs = self.token_buckets() if mode == "all" else self.token_buckets()[:1]
        widths = (0, LOGPROBS_WIDTH) if mode == "all" else (0,)
        for Bb in self.batch_buckets():
            r = self.inputs.rows([], Bb)
            z = np.zeros((Bb,), bool)     # numpy, as the steps pass them: one dispatch-cache entry per program
            rm = r.replace(fresh=np.zeros((Bb,), bool)) if self.mtp else r
            for top_n in widths:
                for T in tbs:
                    if self.ragged and Bb > 1:        # a step of several rows may run either way
                        _, _, self.cache, self.slot_last = self._ragged(
                            self.params, self.cache, self.slot_last, r, z, pack([], [], T, Bb), z, flags=FULL_SAMPLER,
                            top_n=top_n)
                    _, _, self.cache, self.dcache, self.slot_last = self._mixed(
                        self.params, self.cache, self.slot_last, rm, z, np.zeros((Bb, T), np.int32),
                        np.zeros((Bb,), np.int32), z, self.dparams, self.dcache, flags=FULL_SAMPLER, top_n=top_n)
                _, _, self.cache, self.dcache, self.slot_last = self._decode(
                    self.params, self.cache, self.slot_last, r, np.zeros((Bb,), np.int32), z,
                    np.full((Bb, self.ecfg.max_stop_ids), -1, np.int32), np.zeros((Bb,), np.int32), self.dparams,
                    self.dcache, steps=self.ecfg.decode_steps, flags=FULL_SAMPLER, top_n=top_n)
        jax.block_until_ready(self.cache)

    def warmup_verify(self, k_buckets, replay: bool):
        """Compiles the verify step for every (batch bucket, draft length) pair; every row is padding."""
        for Bb in self.batch_buckets():
            for K in k_buckets:
                _, _, self.cache, self.dcache = self._verify(
                    self.params, self.cache, self.inputs.rows([], Bb), np.zeros((Bb, K + 1), np.int32),
                    np.zeros((2, Bb), np.int32), self.dparams, self.dcache, flags=FULL_SAMPLER, replay=replay)
        jax.block_until_ready(self.cache)
