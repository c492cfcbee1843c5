"""The engine's model runner: the pools, the step inputs, the drafter and the compiled steps, driven
from the host over bucketed static shapes, the cache pools donated to each call.

The engine's cache is one pytree of pools (cache.pools): paged groups hold pages every request
shares through block tables, slot groups one row per request (`max_num_seqs` rows, then a null row
that padding rows of a batch bucket point at, then the prefix cache's checkpoint units). The block
manager (cache.block_manager, owned by the engine) decides which pages and row each request holds;
a step receives the rows, their block tables and their lengths from the host (a `StepRows`, built by
engine/step_inputs.py). The step bodies are engine/steps.py (mixed, ragged, decode, verify and the
n-gram loop), compiled and warmed up by engine/compile.py; the drafter whose state rides along in
every padded step (none, a draft model, the MTP block) is engine/drafter.py, chosen by `set_draft` /
`set_mtp`; those and the speculative step's calls (draft, verify, the n-gram loop) are the runner's
speculative side, engine/runner_speculative.py.

Bb is a power of two up to the row count, T one of a few token buckets up to the token budget, so
the set of programs is finite and `warmup` can compile all of them before the first request.

Overlap: the mixed and decode steps are dispatched (`dispatch_mixed`, `dispatch_decode`) and read back
later (`land`), so the engine can enqueue the next step first. Each writes every row's last sampled
token into `slot_last` (on the device, one entry per row); a row whose last token is still on the
device (`from_dev`, the request's `num_inflight`) is fed from there, so the next step never waits
for a device-to-host copy. `slot_last` also holds each row's logits processors' state (penalty
counts, coefficients, logit bias: hybrid_jax/logits_processors.py), seeded by `seed_rows` when a
request with processors is placed in a row and counted by the steps.
"""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_manager import BlockManager, GroupGeometry
from cache.pools import build_pools, pool_geometry, size_pools
from hybrid_jax.decode_loop import decode_budget, steps_to_end
from hybrid_jax.engine.compile import MIXED_STATICS, Compiler, Programs
from hybrid_jax.engine.program_store import ProgramStore
from hybrid_jax.engine.program_table import ProgramKey
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.drafter import Drafter
from hybrid_jax.engine.prompt_logprobs import PromptFlight, plan_targets, prompt_width
from hybrid_jax.engine.request import attributed
from hybrid_jax.engine.runner_speculative import SpeculativeRunnerMixin
from hybrid_jax.engine.step_inputs import StepInputs
from hybrid_jax.engine.steps import StepContext
from hybrid_jax.errors import InputError
from hybrid_jax.generate import bucket
from hybrid_jax.logits_processors import ProcState, RowState, seeds
from hybrid_jax.structured.bitmask import WRITE_WIDTH
from hybrid_jax.structured.grammars import fill_rows, words
from hybrid_jax.models import get_model
from hybrid_jax.models.ragged import pack
from hybrid_jax.parallel.context import active
from hybrid_jax.parallel.placement import entry_copies
from hybrid_jax.sampling import FULL_SAMPLER, MAX_LOGIT_BIAS

MIN_T = 8


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
    prompt: PromptFlight | None = None     # a mixed step's prompt scores (engine/prompt_logprobs.py)

    def ready(self) -> bool:
        return all(a.is_ready() for a in (self.tokens, *self.lps))


class ModelRunner(SpeculativeRunnerMixin):
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
        # Mixed steps (prefill chunks beside decodes) run as one flat token-major batch when the family
        # has a ragged forward, no drafter state rides along (a draft model / the MTP block advance on
        # the padded [B, T] tokens) and padding would cost more tokens (dispatch_mixed); else padded.
        self.ragged = self.model.forward_ragged is not None
        # The drafter (engine/drafter.py) the steps carry: none until `set_draft` / `set_mtp` choose one;
        # dcache holds its state on the device (None without one).
        self.drafter, self.dcache = Drafter(), None
        # the program store (engine/program_store.py) beside JAX's compilation cache (None: none)
        ccd = ecfg.compilation_cache_dir
        self.store = ProgramStore(os.path.join(ccd, "hybrid_jax_programs")) if ccd else None
        self._build_programs()
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

    def _new_slot_last(self) -> RowState:
        """Per row ([max_num_seqs + 1]) on the device (replicated on a mesh): its last sampled token and
        its logits processors' state (`logits_processors.RowState`)."""
        rows = self.ecfg.max_num_seqs + 1
        z = RowState(last=jnp.zeros((rows,), jnp.int32),
                     procs=ProcState.empty(rows, self.cfg.vocab_size, MAX_LOGIT_BIAS, self.inputs.held_width),
                     allowed=jnp.full((rows, words(self.cfg.vocab_size)), -1, jnp.int32))
        return jax.device_put(z, jax.devices()[0] if self.layout is None else self.layout.replicated)

    def seed_rows(self, reqs):
        """Seeds the processors' state of requests with logits processors just placed in their rows (the
        prompt and the outputs so far: admission, and resumption after preemption or recovery), with the
        seeding program in calls of a fixed width."""
        for q in reqs:
            with attributed(q):
                for s in seeds(q.slot, q.prompt_ids, q.output_ids, q.params, self.inputs.held_ids(q.params),
                               MAX_LOGIT_BIAS):
                    self.slot_last = self._seed(self.slot_last, s)

    def write_masks(self, reqs):
        """Writes the structured-output bitmask of each request's next token (its grammar's matcher, as
        of the tokens it has emitted) into its row, with the writing program in calls of a fixed width
        (structured/bitmask.py). Only the requests whose rows sample under a grammar this step."""
        W = words(self.cfg.vocab_size)
        for start in range(0, len(reqs), WRITE_WIDTH):
            part = reqs[start:start + WRITE_WIDTH]
            rows = np.full((WRITE_WIDTH,), self.ecfg.max_num_seqs + 1, np.int32)     # padding: dropped
            buf = np.zeros((WRITE_WIDTH, W), np.int32)
            fill_rows([q.grammar for q in part], buf)
            rows[:len(part)] = [q.slot for q in part]
            self.slot_last = self._masks(self.slot_last, rows, buf)

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
        try:
            return self._land(d)
        except jax.errors.JaxRuntimeError as e:      # a stored program missing a function: compiled afresh
            self.compiler.forget_unrunnable(d.program, e)       # when the step runs again (step recovery)
            raise

    def _land(self, d: "Dispatched"):
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
        holds a whole pool). Committed to their devices, as every step's outputs are: the state's arrays
        look the same to every program before the first step as after it (a jitted program, e.g. the
        prefix store's, keys its cache on whether an argument is committed)."""
        def build():
            return build_pools(self.abstract, self.ecfg.max_num_seqs + 1, self.pages, self.units)
        if self.layout is None:
            return jax.device_put(build(), jax.devices()[0])
        return jax.jit(build, out_shardings=self.cache_shardings)()

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
        Bb = bucket(rows)
        fit = [b for b in self.token_buckets() if b <= self.ecfg.max_num_batched_tokens // Bb]
        if self.compiler.serving:      # while smaller buckets compile in the background: what is compiled
            fit = [b for b in fit if self.compiler.table.cover(ProgramKey("mixed", (Bb, b), MIXED_STATICS))]
        return max(fit or [MIN_T])

    def token_bucket(self, n: int) -> int:
        return next(b for b in self.token_buckets() if b >= n)

    def num_compiled(self) -> int:
        """Programs compiled so far by this runner (one per bucket and static option)."""
        return self._programs.num_compiled()

    def _build_programs(self):
        """The step programs (engine/compile.Programs) over the runner's context and drafter, and their
        table and compiler. They are the runner's `_mixed`, `_ragged`, `_decode`, `_verify`, `_loop`,
        `_copy_pages`, `_seed`, `_fork_rows`, `_masks`, `_draft` (tests and benchmarks wrap them one at
        a time)."""
        ctx = StepContext(self.model, self.cfg, self.impl, self.layout, self.cache_shardings, self.drafter)
        serving = getattr(self, "compiler", None) is not None and self.compiler.serving
        self.compiler = Compiler(self._context(), self.store)
        self.compiler.serving = serving
        self._programs = p = Programs(ctx, self.compiler)
        self._mixed, self._ragged, self._decode, self._verify = p.mixed, p.ragged, p.decode, p.verify
        self._loop, self._copy_pages, self._seed, self._fork_rows = p.loop, p.copy_pages, p.seed, p.fork_rows
        self._masks, self._draft = p.masks, p.draft

    def _context(self) -> dict:
        """What the step context is, for the program store's key: the family and its config, dtype,
        kernels, the layout, the drafter (engine/program_store.py)."""
        d, lay = self.drafter, self.layout
        return {"model": self.cfg.model_type, "cfg": repr(self.cfg), "dtype": str(self.dtype), "impl": self.impl,
                "layout": None if lay is None else {"config": repr(lay.pc), "mesh": dict(lay.mesh.shape),
                                                    "devices": [int(x.id) for x in lay.mesh.devices.flat]},
                "drafter": {"kind": type(d).__name__, "cfg": repr(getattr(d, "cfg", None))}}

    def cover(self, need: ProgramKey) -> ProgramKey:
        """The compiled program a step that needs `need` runs in: itself, or a larger compiled bucket
        of the same kind and options (the step padded to it); `need` when none is compiled (it is then
        compiled on first use: `compile.Compiler.program`). Before a warm-up (warmup="none": offline runs)
        each step compiles its own bucket on first use instead: a step in its own bucket is the faster."""
        if not self.compiler.serving:
            return need
        return self.compiler.table.cover(need) or need

    def reset_pools(self):
        """Fresh, empty pools (and drafter state): after a failed step, whose call may have consumed the
        donated ones. The compiled programs stay."""
        self.cache = self._new_pools()
        self.slot_last = self._new_slot_last()
        self.dcache = self.drafter.new_state()

    # --- host calls ---------------------------------------------------------------------------------
    def _mixed_key(self, plan_rows) -> ProgramKey:
        """The program a mixed step of these rows runs: ragged when padding to the longest row would cost
        more tokens than the flat batch (several rows of unequal length; a step of one row, or of equal
        rows, is no smaller flat, and the padded step is the faster program for it: XLA:CPU ~13% on a
        512-token chunk over 4k), else padded; the smallest compiled bucket of either kind that covers
        it (the preferred kind first)."""
        reqs = [p.request for p in plan_rows]
        Bb = bucket(len(reqs))
        lens = [1 if p.request.num_inflight else p.num_tokens for p in plan_rows]
        T, N = self.token_bucket(max(lens)), self.token_bucket(sum(lens))
        statics = dict(flags=FULL_SAMPLER, top_n=self.inputs.top_n(reqs), prompt_n=prompt_width(reqs, self.cfg.vocab_size))
        padded = ProgramKey.of("mixed", (Bb, T), **statics)
        if not self.ragged:
            return self.cover(padded)
        flat = ProgramKey.of("ragged", (Bb, N), **statics)
        first, second = (flat, padded) if Bb * T > N else (padded, flat)
        if not self.compiler.serving:
            return first
        table = self.compiler.table
        return table.cover(first) or table.cover(second) or first

    def _mixed_args(self, plan_rows, key: ProgramKey):
        """A mixed step's arguments (after params, pools and `slot_last`) and keywords for program `key`
        (engine/compile.SHAPE: mixed [Bb, T] or ragged [Bb, N]), and the prompt scores' spans."""
        reqs = [p.request for p in plan_rows]
        Bb = key.shape[0]
        reset, do_sample, fresh = np.zeros((Bb,), bool), np.zeros((Bb,), bool), np.zeros((Bb,), bool)
        chunks = []
        for i, p in enumerate(plan_rows):
            q = p.request
            with attributed(q):
                # a row fed from the device (its last token in flight) gets a placeholder the step replaces
                chunks.append(q.all_ids[q.num_computed:q.num_computed + p.num_tokens] if not q.num_inflight else [0])
                reset[i], do_sample[i] = p.reset, p.sample
                # the MTP state starts over with the row, and after a prefix hit (it holds no prefix)
                fresh[i] = p.reset or (q.num_cached_tokens > 0 and q.num_computed == q.num_cached_tokens)
        r = self.inputs.rows(reqs, Bb)
        if key.kind == "ragged":
            N = key.shape[1]
            batch = pack(chunks, [p.request.num_computed for p in plan_rows], N, Bb)
            targets, spans = plan_targets(plan_rows, batch.cu_seqlens, N)
            return (r, reset, batch, do_sample), {"targets": targets}, spans
        T = key.shape[1]
        tokens, n_new = np.zeros((Bb, T), np.int32), np.zeros((Bb,), np.int32)
        for i, c in enumerate(chunks):
            tokens[i, :len(c)] = c
            n_new[i] = len(c)
        if self.drafter.fresh_rows:
            r = r.replace(fresh=fresh)
        targets, spans = plan_targets(plan_rows, np.arange(Bb) * T, Bb * T)
        return (r, reset, tokens, n_new, do_sample), {"targets": targets.reshape(Bb, T)}, spans

    def dispatch_mixed(self, plan_rows) -> Dispatched:
        """Enqueues a mixed step of scheduler rows (prefill chunks and decodes; `land` gives tokens
        [n, 1], -1 for a row that does not sample); a row whose request has tokens in flight is fed its
        last one from `slot_last`."""
        key = self._mixed_key(plan_rows)
        args, kw, spans = self._mixed_args(plan_rows, key)
        statics = key.static_kwargs()
        t = time.perf_counter()
        if key.kind == "ragged":
            tok, lps, self.cache, self.slot_last, plp = self._ragged(
                self.params, self.cache, self.slot_last, *args, **statics, **kw)
        else:
            tok, lps, self.cache, self.dcache, self.slot_last, plp = self._mixed(
                self.params, self.cache, self.slot_last, *args, self.drafter.params, self.dcache, **statics, **kw)
        return Dispatched(len(plan_rows), tok, lps, key, t, PromptFlight(spans, plp) if spans else None)

    def decode_width(self, steps: int, reqs) -> int:
        """The iterations a decode program is compiled for: `steps`, or offline (before any warm-up: each
        step compiles its own program) no more than `steps_to_end`, the width an offline
        decode-to-the-end call of them takes. No row samples past its max_tokens, so
        the narrower program emits the same tokens; plain chunks that grow (4, 16, 64, 128 iterations:
        offline speculation finding no drafts) then compile only the widths their requests can fill, not
        every width of the ladder (a whole-model compile each)."""
        if self.compiler.serving or not reqs:
            return steps
        return min(steps, steps_to_end(q.remaining_tokens for q in reqs))

    def _decode_args(self, reqs, Bb: int, caps: list[int] | None = None) -> tuple:
        """A decode step's arguments after params, pools and `slot_last`: (rows, last tokens [Bb], active
        [Bb], stop ids [Bb, S], remaining [Bb])."""
        n = len(reqs)
        last = np.zeros((Bb,), np.int32)
        active = np.zeros((Bb,), bool)
        remaining = np.zeros((Bb,), np.int32)
        if n:
            last[:n] = [q.output_ids[-1] if not q.num_inflight else 0 for q in reqs]
            active[:n] = True
            remaining[:n] = decode_budget(np.asarray([q.remaining_tokens for q in reqs]), caps)
        return self.inputs.rows(reqs, Bb), last, active, self.inputs.stop_ids(reqs, Bb), remaining

    def dispatch_decode(self, reqs, steps: int, caps: list[int] | None = None) -> Dispatched:
        """Enqueues up to `steps` decode iterations for running requests (each stops at a stop id, its
        max_tokens or caps[i] tokens, on device; `land` gives tokens [n, steps], -1 past a row's end);
        a request with tokens in flight is fed its last from `slot_last`."""
        key = self.cover(ProgramKey.of("decode", (bucket(len(reqs)),), steps=self.decode_width(steps, reqs),
                                       flags=FULL_SAMPLER, top_n=self.inputs.top_n(reqs)))
        args = self._decode_args(reqs, key.shape[0], caps)
        t = time.perf_counter()
        out, lps, self.cache, self.dcache, self.slot_last = self._decode(
            self.params, self.cache, self.slot_last, *args, self.drafter.params, self.dcache, **key.static_kwargs())
        return Dispatched(len(reqs), out, lps, key, t)
