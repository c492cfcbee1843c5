"""LLMEngine: requests in, streamed outputs out, one scheduler step at a time.

The engine builds the rooms and answers for them: the runner (engine/runner.py: the device pools and
the compiled step programs), the scheduler (engine/scheduler.py: the one owner of request state,
pages and the prefix glue), the speculator, and the step loop (engine/step_loop.py: schedule ->
execute -> update as in vLLM v1's engine core, the overlap of steps and the recovery from a failed
step). Itself it keeps admission (`add_request`, engine/limits.py), the warm-up (engine/startup.py),
the prefix store's controls and the figures /metrics reads.

Memory: the runner's pools (cache.pools) and one block manager (cache.block_manager), the
scheduler's, that hands out their rows, pages and checkpoint units to the requests and to the prefix
cache, which shares its stored pages with the requests that hit them.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from cache.block_manager import BlockManager
from cache.kv_events import KVEventLog
from cache.prefix_cache import PrefixCache, PrefixCacheConfig
from cache.prefix_disk import DiskConfig
from hybrid_jax.engine.compile import enable_persistent_compilation_cache
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.contracts import LoadedModel, Loads, as_loaded
from hybrid_jax.engine.fork import can_fork
from hybrid_jax.engine.kv_event_publisher import KVEventPublisher, KVEventsConfig
from hybrid_jax.engine.limits import admit
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.outputs import OutputProcessor
from hybrid_jax.engine.prefix_manager import PrefixManager
from hybrid_jax.engine.request import EngineOutput, ForkGroup, Request
from hybrid_jax.engine.runner import ModelRunner
from hybrid_jax.engine.scheduler import Scheduler
from hybrid_jax.engine.speculate import EngineSpeculator
from hybrid_jax.engine.speculative_step import SpeculativeStep
from hybrid_jax.engine.startup import Startup, plan
from hybrid_jax.engine.step_loop import StepLoop
from hybrid_jax.engine.startup_status import StartupClock, StartupStatus, status
from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.structured.grammars import GrammarCompiler

log = logging.getLogger("hybrid_jax.engine")


class LLMEngine:
    def __init__(self, model: LoadedModel | Loads, config: EngineConfig | None = None,
                 metrics: EngineMetrics | None = None, data_parallel_rank: int = 0):
        """model: the LoadedModel to serve (an LLM facade hands over its own); metrics: a registry shared
        with other engines (data-parallel replicas: the owner binds its live figures); by default the
        engine's own. data_parallel_rank: this replica's (its KV events' endpoint and mark)."""
        self.loaded = m = as_loaded(model)
        self.config = c = config or EngineConfig()
        if c.max_model_len > m.max_model_len:
            raise InputError(f"engine max_model_len {c.max_model_len} exceeds the model's {m.max_model_len}")
        enable_persistent_compilation_cache(c.compilation_cache_dir)
        self.metrics = metrics or EngineMetrics()
        self.runner = ModelRunner(m.config, m.params, m.dtype, c, impl=m.impl, layout=m.layout, eos_ids=m.eos_ids)
        blocks = BlockManager(self.runner.geometry(), num_rows=c.max_num_seqs)
        self.runner.blocks = blocks
        self.spec = self._speculator() if c.speculative_config else None
        self._cache_config: tuple[int, int] | None = None       # `cache_config`, once asked
        events = KVEventsConfig.parse(c.kv_events_config)
        self.kv_events = KVEventLog() if events is not None else None
        prefix = (PrefixManager(self.runner, self._store_settings(), self._disk_config(), blocks, self.metrics,
                                c.run_to_completion, c.prefix_publish_chunk_ends, events=self.kv_events)
                  if c.enable_prefix_caching else None)
        self.kv_publisher = KVEventPublisher(events, data_parallel_rank) if events is not None else None
        k_max = self.spec.spec.num_speculative_tokens + 1 if self.spec is not None else 1
        # pages a decoding request gets ahead of its writes: a decode call's tokens or a verify's
        # K + 1, or (run_to_completion) everything up to its max_tokens
        lookahead = None if c.run_to_completion else max(c.decode_steps, k_max)
        self.scheduler = Scheduler(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                                   blocks=blocks, lookahead=lookahead, chunk_cap=self.runner.chunk_cap,
                                   prefix=prefix, metrics=self.metrics,
                                   outputs=OutputProcessor(m.tokenizer, c.detokenize, m.eos_ids, self.metrics),
                                   decode_steps=c.decode_steps, run_to_completion=c.run_to_completion,
                                   speculative=self.spec is not None, forking=can_fork(self.runner))
        if metrics is None:
            self.metrics.bind(self.live_figures)
        self.speculative = (SpeculativeStep(self.runner, self.spec, self.metrics, c.run_to_completion)
                            if self.spec is not None else None)
        self.loop = StepLoop(self.scheduler, self.runner, self.metrics, self.spec, self.speculative,
                             overlap=c.async_scheduling and self.spec is None and not c.run_to_completion,
                             max_num_seqs=c.max_num_seqs)
        self._rng = np.random.default_rng(c.seed)   # seeds of requests that bring none
        self._grammars: GrammarCompiler | None = None   # structured outputs' compiles (made on first use)
        self.startup: Startup | None = None     # the warm-up's plan and progress (engine/startup.py)
        self.clock = StartupClock()             # when the load's phases ended (set by llm.build_engine)

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured outputs' grammar compiler (hybrid_jax/structured/grammars.py), made on first use."""
        if self._grammars is None:
            m = self.loaded
            self._grammars = GrammarCompiler(m.tokenizer, m.config.vocab_size, m.eos_ids)
        return self._grammars

    def _speculator(self) -> EngineSpeculator:
        m = self.loaded
        spec = EngineSpeculator(self.config.speculative_config, m.config.vocab_size, self.runner.abstract.groups)
        extra = spec.spec.num_speculative_tokens + 1
        if spec.draft is not None:
            dcfg, dparams, ddtype = spec.draft
            self.runner.set_draft(dcfg, dparams, ddtype, extra=extra)
        elif spec.spec.method == "mtp":
            from hybrid_jax.speculative.mtp import check_mtp  # noqa: PLC0415
            check_mtp(self.runner.model, m.config, m.params, m.name)
            self.runner.set_mtp(extra=extra)
        return spec

    def _store_settings(self) -> PrefixCacheConfig:
        m, c = self.loaded, self.config
        return PrefixCacheConfig(
            cap_bytes=c.prefix_cache_bytes or self.runner.budget_bytes, fingerprint=m.fingerprint(),
            dtype=jnp.dtype(m.dtype).name, block_size=c.prefix_block_size,
            checkpoint_interval=c.prefix_checkpoint_interval, checkpoint_grid=c.checkpoint_grid,
            sharding=m.layout.key if m.layout else "replicated", copies=self.runner.copies)

    def _disk_config(self) -> DiskConfig | None:
        c = self.config
        if c.kv_cache_dir is None:
            return None
        return DiskConfig(directory=c.kv_cache_dir, cap_bytes=c.kv_cache_dir_bytes, policy=c.prefetch_policy,
                          timeout_s=c.prefetch_timeout_s)

    # --- what the scheduler owns, for callers and tests ----------------------------------------------
    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix store (None with prefix caching off)."""
        return self.scheduler.prefix.store if self.scheduler.prefix is not None else None

    @property
    def points(self):
        return self.scheduler.prefix.points

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    # --- requests ----------------------------------------------------------------------------------
    def check(self, prompt: Any, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Admission: raises InputError for a prompt or parameters this model and engine cannot
        serve (see engine/limits.py); returns the prompt's text and token ids."""
        return admit(prompt, params, self.loaded.tokenizer, self.loaded.config.vocab_size, self.config.max_model_len,
                     speculative=self.spec is not None)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival: float | None = None, group: ForkGroup | None = None) -> Request:
        """Queues a request. `arrival` (time.monotonic()) is when its client sent it: latency figures
        count from there (default: now). `group`: the request is one of the k sequences of a request
        with n = k (add the leader, index 0, first): the group prefills its prompt once and forks
        (engine/fork.py). Without it, an id of the server's fan-out, `<group id>#<index>/<k>`, names
        the group (ForkGroup.from_request_id)."""
        params = params or SamplingParams()
        if request_id in self.scheduler.requests:
            raise InputError(f"request id {request_id!r} is already in use")
        text, ids = self.check(prompt, params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        if group is not None and not isinstance(group, ForkGroup):
            raise InputError(f"group must be a ForkGroup or None, got {type(group).__name__}")
        group = ForkGroup.from_request_id(request_id) if group is None else group
        req = Request(request_id=request_id, prompt_ids=ids, params=params, seed=seed, prompt_text=text,
                      arrival=time.monotonic() if arrival is None else arrival, group=group)
        if params.structured_outputs is not None:        # compiled off this thread; admitted once ready
            if self.loaded.tokenizer is None:
                raise InputError("structured outputs need the model's tokenizer; this model has none")
            so = params.structured_outputs
            gate = tuple(self.loaded.tokenizer.encode(so.after, add_bos=False)) if so.after else ()
            req.grammar = self.grammars.request(so, gate)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str):
        if self.scheduler.abort(request_id):
            self.loop.forget(request_id)
            self.loop.land_if_finished()

    def abort_all(self) -> list[str]:
        """Aborts every request the engine holds (after a step raised past its own isolation: nothing
        is known about the state it left); returns their ids."""
        ids = list(self.scheduler.requests)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def live_figures(self) -> dict:
        """What /metrics shows of the present (read from another thread: plain reads, retried if a
        dict changed size under us)."""
        s = self.scheduler
        misses: dict[str, int] = {}
        for _ in range(3):
            try:
                if s.prefix is not None:
                    misses = s.prefix.misses()
                usage = s.cache_usage()
                break
            except RuntimeError:
                usage = {}
        return {"waiting": len(s.waiting), "running": len(s.running), "cache_usage": usage,
                "compiled": self.num_compiled(), "stalls": self.runner.compiler.stats.stalls,
                "by_source": self.runner.compiler.table.by_source(), "startup": self.startup_status(),
                "paged_groups": {n for n, g in s.blocks.groups.items() if g.paged}, "prefix_misses": misses,
                "cache_config": self.cache_config(),
                "disk_tier": s.prefix.disk_health() if s.prefix is not None else None}

    def cache_config(self) -> tuple[int, int]:
        """(block size, blocks): the prefix cache's block in tokens (a full-attention page) and how many
        such blocks the tightest paged pool holds (0 for a model with no paged group). The pools keep
        their shapes for the engine's life, so it is worked out once."""
        if self._cache_config is None:
            b = self.config.prefix_block_size
            tokens = [g.page_tokens * g.num_units for g in self.runner.geometry() if g.paged]
            self._cache_config = (b, min(tokens) // b if tokens else 0)
        return self._cache_config

    def startup_status(self) -> StartupStatus | None:
        """Where the load and warm-up are (engine/startup_status.py); None for an engine that
        `hybrid_jax.llm.build_engine` did not build (no load was timed)."""
        if self.clock.weights_at is None:
            return None
        progress = [self.startup.progress] if self.startup is not None else []
        return status(progress, [self.runner.compiler.stats], self.clock)

    @property
    def overlapped(self) -> int:
        """Steps enqueued while the one before was still in flight."""
        return self.loop.overlapped

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        """Whether a step has work: requests to run, or tokens in flight for one that has not finished
        (a step in flight for finished requests only is read back at once: `StepLoop.land_if_finished`)."""
        s = self.scheduler
        return bool(s.waiting) or len(s.running) > s.releasing() or self.loop.in_flight()

    def warmup(self, mode: str | None = None, on_progress=None, background: bool = True):
        """Builds the step programs the warm-up mode names (engine/startup.py): the ready set now, every
        CPU compiling (or read from the program store); with mode "all" the smaller buckets then on a
        background thread (`wait_compiled`; background=False: now). After a warm-up, a step that finds
        no compiled program to run in is a stall, counted (`compile.Compiler.program`).
        on_progress(StartupProgress) after each program."""
        t0 = time.perf_counter()
        mode = mode or self.config.warmup
        if mode != "none" and self.loaded.tokenizer is not None:
            self.grammars.prepare()     # the grammar library's tokenizer, converted on its worker meanwhile
        spec = self.spec.spec if self.spec is not None else None
        self.startup = Startup(self.runner, plan(self.runner, mode, spec), on_progress)
        self.startup.ready_phase()
        if self.scheduler.prefix is not None and mode != "none":
            self.scheduler.prefix.warmup()
        if mode != "none":
            self.runner.compiler.serving = True
        self.warmup_seconds = time.perf_counter() - t0
        self.startup.start_background()
        if not background:
            self.wait_compiled()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Blocks until the warm-up's background compiles are done; whether they are."""
        return self.startup.wait(timeout) if self.startup is not None else True

    def num_compiled(self) -> int:
        """Programs compiled so far: the step buckets plus the prefix cache's save and load."""
        return self.runner.num_compiled() + (self.prefix.num_compiled() if self.prefix else 0)

    # --- prefix cache ------------------------------------------------------------------------------
    def flush_publishes(self):
        """Runs the publishes queued by the last step (`Scheduler.flush_publishes`): callers do it once
        the step's tokens are out (the async loop, generate())."""
        self.scheduler.flush_publishes()
        self._publish_kv_events()

    def reset_prefix_cache(self, prefix_cache_bytes: int | None = None):
        """Drops every cached prefix and the counters (optionally with a new store cap); running
        requests keep their rows. The new store's disk tier is the one `self.config` names now. The
        store's programs compile again on next use."""
        if self.scheduler.prefix is None:
            raise InputError("prefix caching is off: EngineConfig(enable_prefix_caching=True)")
        self.flush_publishes()
        self.scheduler.prefix.reset(self.blocks, prefix_cache_bytes, clear_points=False, disk=self._disk_config())
        self._publish_kv_events()

    def close(self):
        """Closes the prefix store (waits for the disk tier's pending writes)."""
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.close()
        if self._grammars is not None:
            self._grammars.close()
        if self.kv_publisher is not None:
            self._publish_kv_events()
            self.kv_publisher.close()

    def cache_stats(self) -> dict:
        """Prefix-cache figures (hit rate, validation pass rate, effective reuse, misses by reason,
        bytes per kind and per group); {"enabled": False} when prefix caching is off."""
        if self.scheduler.prefix is None:
            return {"enabled": False}
        self.flush_publishes()
        return {"enabled": True, **self.prefix.cache_stats(), "decode_publishes": self.points.decode_publishes,
                "pools": self.pool_usage()}

    def pool_usage(self) -> dict:
        """Per cache group: pages (or checkpoint units) in use and in the pool."""
        return self.scheduler.pool_usage()

    def cache_usage(self) -> dict[str, float]:
        """Share of each cache group's pages (or checkpoint units) in use."""
        return self.scheduler.cache_usage()

    def spec_stats(self) -> dict:
        """Speculative decoding figures; {"enabled": False} without a speculative config."""
        return {"enabled": True, **self.spec.stats()} if self.spec is not None else {"enabled": False}

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One scheduler step (engine/step_loop.py). A failure attributable to one request fails only
        that request (an output with finish_reason "error"); any other failure rebuilds the pools and
        the requests go on. Nothing a request sends makes this raise."""
        outs = self.loop.step()
        self._publish_kv_events()
        return outs

    def _publish_kv_events(self):
        """Hands the prefix cache's new KV events to the routers' publisher (engine/kv_event_publisher.py)."""
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.kv_events.take())

    # --- offline convenience -----------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[EngineOutput]:
        """Runs prompts to completion through the continuous-batching loop; outputs in prompt order (each
        the request's last, with the prompt_logprobs its first carried)."""
        sps = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, sps):
            self.add_request(rid, p, sp)
        final: dict[str, EngineOutput] = {}
        prompt_lps: dict[str, list] = {}
        while any(rid not in final for rid in ids):
            for o in self.step():
                if o.prompt_logprobs is not None:
                    prompt_lps[o.request_id] = o.prompt_logprobs
                if o.finished:
                    final[o.request_id] = o
        self.flush_publishes()
        return [dataclasses.replace(final[rid], prompt_logprobs=prompt_lps.get(rid)) for rid in ids]
