"""The offline API in vLLM's shape: `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

`LLM` loads a checkpoint and is a client of the engine core (hybrid_jax.engine.LLMEngine), like the
server: `generate` adds its requests and steps the engine until they finish. The engine runs with
`run_to_completion` (a decode step takes every decoding row to its end in one device call), so an
offline batch costs a prefill and one decode call per wave of `max_num_seqs` requests. With a
speculative_config the same engine speculates (n-gram drafting with rollback by selection as one
on-device loop per wave; other proposers and rollback by replay through the engine's verify step)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hybrid_jax.default_model import DEFAULT_MODEL_NAME, checkpoint_dir
from hybrid_jax.engine.contracts import LoadedModel
from hybrid_jax.engine.limits import check_request
from hybrid_jax.errors import ConfigError, InputError
from hybrid_jax.generate import Generator
from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import FamilyConfig, load_config
from hybrid_jax.parallel.config import ParallelConfig
from hybrid_jax.parallel.placement import Layout, make_layout
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.engine.limits import encode_prompt
from hybrid_jax.tokenizer import ByteTokenizer, load_tokenizer
from hybrid_jax.weights import LARGE_CHECKPOINT_BYTES, fingerprint, on_host, open_checkpoint

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
OFFLINE_TOKENS_PER_SEQ = 4096    # default pool size offline: max_num_seqs requests of this many tokens


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str            # "stop" (a stop token or string was produced) or "length"
    cumulative_logprob: float | None = None
    logprobs: list[dict] | None = None   # with SamplingParams(logprobs=n): per token, its logprob and the top n


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # with SamplingParams(prompt_logprobs=n): per prompt token, None for the first, else its logprob and the top n
    prompt_logprobs: list[dict | None] | None = None


def _resolve_dtype(dtype: str, cfg: FamilyConfig):
    name = cfg.dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


class LLM:
    """Loads a local Hugging Face checkpoint directory (with model=None, the one shipped in the package:
    hybrid_jax.default_model) and generates. Weight re-layout happens once, here. A block-quantized checkpoint (FP8,
    FP4 experts) is dequantized to `dtype` at load; quantization="fp8" keeps its linear weights in
    FP8 on the device instead. tensor_parallel_size / enable_expert_parallel (vLLM's names) split the
    parameters and the cache over that many of jax.devices() (hybrid_jax.parallel); the layout is
    checked against the model's head and expert counts before any weight is read."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", tokenizer: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 16, seed: int = 0,
                 impl: str = "auto", progress: bool | None = None, enable_prefix_caching: bool = False,
                 kv_cache_dir: str | None = None, engine_config: dict | None = None,
                 speculative_config: dict | None = None, quantization: str | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False):
        parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel)
        default = model is None       # the shipped checkpoint (hybrid_jax.default_model), loaded like any other
        model = os.fspath(checkpoint_dir(model))
        reader = open_checkpoint(model, quantization)   # checks the directory and the weight files first
        self.config = load_config(model)
        self.model_name = DEFAULT_MODEL_NAME if default else model
        self.checkpoint_dir = model       # where config, weights and tokenizer were read
        self.dtype = _resolve_dtype(dtype, self.config)
        layout = make_layout(parallel, self.config, get_model(self.config.model_type))   # before any weight
        n = len(reader.keys())
        show = reader.total_bytes >= LARGE_CHECKPOINT_BYTES if progress is None else progress
        family = get_model(self.config.model_type)
        read: set[str] = set()

        def get(name):
            read.add(name)
            return reader.get(name)
        # split over a mesh: converted on the host, each device then gets only its part (weights.on_host);
        # a family without sharding rules (data-parallel replicas of one device each) loads as usual
        by_parts = layout is not None and get_model(self.config.model_type).param_axes is not None
        host = on_host() if by_parts else contextlib.nullcontext()
        with tqdm(total=n, desc="loading weights", unit="tensor", disable=not show, file=sys.stderr) as bar, host:
            params = family.convert_hf_weights(self.config, get, reader.has, self.dtype,
                                               progress=lambda: bar.update(1))
        from hybrid_jax.speculative.mtp import check_all_read  # noqa: PLC0415
        check_all_read(family, self.config, reader.keys(), read)     # an MTP layout it does not know fails
        if tokenizer == "byte":
            self.tokenizer = ByteTokenizer()
        else:
            self.tokenizer = load_tokenizer(tokenizer or model)
        self._setup(params, layout, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed, impl=impl,
                    enable_prefix_caching=enable_prefix_caching, kv_cache_dir=kv_cache_dir,
                    engine_config=engine_config, speculative_config=speculative_config)
        if by_parts:   # read by parts (weights.on_host): what this process read
            self.checkpoint_read = {"bytes_read": reader.counter[0], "checkpoint_bytes": reader.total_bytes}

    @classmethod
    def from_params(cls, config: FamilyConfig, params: dict, *, dtype: str = "auto", tokenizer=None,
                    name: str = "params", **kw) -> "LLM":
        """An LLM over parameters already in this project's layout (`init_params` / `convert_hf_weights`
        output, e.g. built or edited in code for research); tokenizer: an object with encode / decode,
        or None (token-id prompts only). kw: the options of LLM()."""
        llm = cls.__new__(cls)
        llm.config, llm.model_name, llm.tokenizer = config, name, tokenizer
        llm.checkpoint_dir = None
        llm.dtype = _resolve_dtype(dtype, config)
        parallel = ParallelConfig(kw.pop("tensor_parallel_size", 1), kw.pop("data_parallel_size", 1),
                                  kw.pop("enable_expert_parallel", False))
        llm._setup(params, make_layout(parallel, config, get_model(config.model_type)), **kw)
        return llm

    def _setup(self, params, layout: Layout | None, *, max_model_len: int | None = None, max_num_seqs: int = 16, seed: int = 0,
               impl: str = "auto", enable_prefix_caching: bool = False, kv_cache_dir: str | None = None,
               engine_config: dict | None = None, speculative_config: dict | None = None):
        """The rest of construction, from parameters in this project's layout; `layout`: make_layout's
        result for this model (None: one device), built before any weight was read."""
        if max_num_seqs <= 0:
            raise InputError(f"max_num_seqs must be positive; got {max_num_seqs}")
        family = get_model(self.config.model_type)
        replicas = layout.replicas() if layout is not None else [None]
        self.layout = replicas[0]         # this LLM's own weights: the first data-parallel replica's
        self._fingerprint: str | None = None
        placed = [params]
        if layout is not None:            # every parameter onto its shards (hybrid_jax.parallel)
            # of the weights as loaded: a layout re-lays some (gate | up per device), and a cached prefix
            # must be found by its weights under any layout (the disk tier serves every layout)
            self._fingerprint = fingerprint(self.config, params)
            placed = [lay.place(family, params) for lay in replicas]
            params = placed[0]
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.generator = Generator(self.config, params, self.dtype, impl=impl)
        # data parallelism: the other replicas' layouts and generators (`replicas()`)
        self._others = [(lay, Generator(self.config, p, self.dtype, impl=impl))
                        for lay, p in zip(replicas[1:], placed[1:])]
        if speculative_config is not None:      # fail at construction, not at the first request
            from hybrid_jax.speculative.config import parse_speculative_config, resolve_rollback  # noqa: PLC0415
            from hybrid_jax.speculative.mtp import check_mtp  # noqa: PLC0415
            spec = parse_speculative_config(speculative_config)
            family = get_model(self.config.model_type)
            if spec.method == "mtp":
                check_mtp(family, self.config, params, self.model_name)
            resolve_rollback(spec, jax.eval_shape(lambda: family.new_cache(self.config, 1, 16, self.dtype)).groups)
        if kv_cache_dir is not None and not enable_prefix_caching:
            raise InputError("kv_cache_dir needs enable_prefix_caching=True")
        from hybrid_jax.engine import EngineConfig  # noqa: PLC0415
        opts = dict(max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, max_num_batched_tokens=2048,
                    enable_prefix_caching=enable_prefix_caching, run_to_completion=True,
                    kv_cache_dir=None if kv_cache_dir is None else os.fspath(kv_cache_dir),
                    speculative_config=speculative_config, compilation_cache_dir=None, warmup="none", seed=seed)
        opts.update(engine_config or {})
        if opts.get("kv_cache_bytes") is None:
            opts["kv_cache_bytes"] = self._default_cache_bytes(opts)
        self.engine_config = EngineConfig(**opts)      # a bad option fails here, naming it
        self._engine = None

    def _default_cache_bytes(self, opts: dict) -> int:
        """The pools' default size offline: max_num_seqs requests of up to OFFLINE_TOKENS_PER_SEQ tokens
        each (a request holds only the pages its tokens fill), and never less than one request of
        max_model_len (a model's max_position_embeddings can be 256k: rows of that, preallocated,
        would not fit). Pass engine_config={"kv_cache_bytes": ...} to size them yourself."""
        import jax  # noqa: PLC0415
        from hybrid_jax.engine.runner import default_budget  # noqa: PLC0415
        model = get_model(self.config.model_type)
        L = opts["max_model_len"]
        page = opts.get("prefix_block_size", 64)
        from hybrid_jax.parallel.context import active  # noqa: PLC0415
        with active(self.layout):
            abstract = jax.eval_shape(lambda: model.new_cache(self.config, 1, L, self.dtype, page_size=page))
        n = opts["max_num_seqs"]
        return max(default_budget(abstract, n, min(L, OFFLINE_TOKENS_PER_SEQ)), default_budget(abstract, n, 0)
                   + default_budget(abstract, 1, L))

    @property
    def engine(self):
        """The engine core this LLM generates through (built on first use: its pools take memory)."""
        if self._engine is None:
            self._engine = self.make_engine(self.engine_config)
        return self._engine

    def make_engine(self, config):
        """A new engine core over this model with EngineConfig `config`: an LLMEngine, or with
        data_parallel_size > 1 a DataParallelEngine of one LLMEngine per replica."""
        if not self._others:
            from hybrid_jax.engine import LLMEngine  # noqa: PLC0415
            return LLMEngine(self, config)
        from hybrid_jax.engine.data_parallel import DataParallelEngine  # noqa: PLC0415
        return DataParallelEngine(self.replicas(), config)

    def replicas(self) -> list[LLM]:
        """This model once per data-parallel replica, each on its own devices with its own copy of the
        weights ([self] without data parallelism). The others are views of this LLM (same config,
        tokenizer and options) that differ only in their layout and weights."""
        views = [self]
        for lay, gen in self._others:
            v = copy.copy(self)
            v.layout, v.generator, v._others, v._engine = lay, gen, [], None
            views.append(v)
        return views

    @property
    def params(self):
        return self.generator.params

    def loaded(self) -> LoadedModel:
        """What an engine needs of this model (hybrid_jax.engine.contracts.LoadedModel); the engine
        reads nothing else of this facade."""
        return LoadedModel(config=self.config, params=self.params, dtype=self.dtype, tokenizer=self.tokenizer,
                           name=self.model_name, max_model_len=self.max_model_len, eos_ids=self.eos_token_ids(),
                           fingerprint=self.fingerprint, impl=self.generator.impl, layout=self.layout)

    def fingerprint(self) -> str:
        """Hash of this model's config and weights (prefix-cache keys carry it)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.config, self.params)
        return self._fingerprint

    def cache_stats(self) -> dict:
        """Prefix-cache figures: hit_rate, validation_pass_rate, effective_reuse (their product),
        misses_by_reason, bytes_by_kind, bytes_by_group, ...; {"enabled": False} when it is off."""
        if not self.engine_config.enable_prefix_caching:
            return {"enabled": False}
        return self.engine.cache_stats()

    def get_tokenizer(self):
        return self.tokenizer

    # --- prompts -----------------------------------------------------------------------------------
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(tok_eos)
        return tuple(sorted(ids))

    def _encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        return encode_prompt(prompt, self.tokenizer, self.config.vocab_size)

    # --- generation --------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a {"prompt_token_ids": [...]} dict, or a list of them.
        Returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise InputError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sps = [sampling_params] * len(prompts)
        else:
            sps = list(sampling_params)
            if len(sps) != len(prompts):
                raise InputError(f"{len(sps)} sampling params for {len(prompts)} prompts")
        for sp in sps:
            if not isinstance(sp, SamplingParams):
                raise InputError(f"sampling_params must be SamplingParams; got {type(sp).__name__}")
            check_request(sp, self.config.vocab_size)     # the engine's admission limits, before any is queued
        encoded = [self._encode(p) for p in prompts]
        for (_, ids), sp in zip(encoded, sps):
            if len(ids) + sp.max_tokens > self.max_model_len:
                raise InputError(f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds "
                                 f"max_model_len {self.max_model_len}")
        eng = self.engine
        rids = [f"llm-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        final: dict[str, object] = {}
        prompt_lps: dict[str, list] = {}            # a prompt_logprobs request's come in its first output
        try:
            for rid, (text, ids), sp in zip(rids, encoded, sps):
                eng.add_request(rid, {"prompt_token_ids": ids, "prompt": text}, sp)
            with tqdm(total=len(rids), disable=not use_tqdm, desc="generating") as bar:
                while len(final) < len(rids):
                    for o in eng.step():
                        if o.prompt_logprobs is not None:
                            prompt_lps[o.request_id] = o.prompt_logprobs
                        if o.finished:
                            final[o.request_id] = o
                            bar.update(1)
            eng.flush_publishes()
        finally:                                    # an error (or ^C) leaves nothing running
            for rid in rids:
                if rid not in final:
                    eng.abort_request(rid)
        outs = []
        for i, ((text, ids), sp, rid) in enumerate(zip(encoded, sps, rids)):
            o = final[rid]
            lps = o.logprobs if sp.logprobs is not None else None
            cum = float(sum(x["logprob"] for x in lps)) if lps else None
            outs.append(RequestOutput(request_id=str(i), prompt=text, prompt_token_ids=ids,
                                      outputs=[CompletionOutput(0, o.text, list(o.token_ids), o.finish_reason, cum, lps)],
                                      prompt_logprobs=prompt_lps.get(rid)))
        return outs

    def spec_stats(self) -> dict:
        """Speculative decoding figures (acceptance rate, mean accepted length, draft and verify
        time, ...); {"enabled": False} without a speculative_config."""
        if self.engine_config.speculative_config is None:
            return {"enabled": False}
        return self.engine.spec_stats()

    # --- inspection --------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Prefill logits at every position of one prompt: [T, V] fp32."""
        _, ids = self._encode({"prompt_token_ids": list(token_ids)})
        return self.generator.logits(np.asarray(ids, np.int32))

    def new_cache(self, batch_size: int = 1, capacity: int = 256):
        """An empty cache pytree for this model (one group per layer type)."""
        return self.generator.new_cache(batch_size, capacity)


def build_engine(model: str | None, dtype: str, engine_config, parallel: dict | None = None, on_status=None):
    """An engine for a checkpoint directory (or the embedded default model, None): the model loaded,
    laid out over its devices (parallel: LLM's layout keywords, tensor_parallel_size,
    data_parallel_size, enable_expert_parallel), and the engine's step programs compiled as
    engine_config.warmup says. What `hybrid-jax serve` (every process of it, and the engine core
    process it spawns: `engine.core_process.start_core(build=build_engine)`) and `hybrid-jax bench` run.
    on_status(engine.startup_status.StartupStatus): once as the weights begin to load, then after each
    program of the warm-up (from the warm-up's threads, the background compiles' included), and once
    more when the engine is ready; the engine's `startup_status()` says the same afterwards."""
    from hybrid_jax.engine.startup_status import StartupClock, StartupStatus  # noqa: PLC0415
    clock = StartupClock()
    if on_status is not None:
        on_status(StartupStatus())
    engine = LLM(model=model, dtype=dtype, **(parallel or {})).make_engine(engine_config)
    clock.weights_loaded()
    engine.clock = clock

    def progress(_):
        clock.program_built()
        if on_status is not None:
            on_status(engine.startup_status())

    if on_status is not None:
        on_status(engine.startup_status())
    engine.warmup(on_progress=progress)
    clock.ready()
    if on_status is not None:
        on_status(engine.startup_status())
    return engine
