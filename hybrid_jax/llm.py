"""The offline API in vLLM's shape: `LLM(model=PATH).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hybrid_jax.config import ModelConfig, load_config
from hybrid_jax.default_model import DEFAULT_MODEL_NAME, DEFAULT_SEED, default_config
from hybrid_jax.errors import ConfigError, InputError
from hybrid_jax.generate import Generator, make_batch
from hybrid_jax.models import get_model
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.tokenizer import ByteTokenizer, load_tokenizer
from hybrid_jax.weights import LARGE_CHECKPOINT_BYTES, fingerprint, open_checkpoint

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str            # "stop" (a stop token was produced) or "length"
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def _resolve_dtype(dtype: str, cfg: ModelConfig):
    name = cfg.dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


class LLM:
    """Loads a local Hugging Face checkpoint directory (or, with model=None, the embedded untrained
    default) and generates. Weight re-layout happens once, here. A block-quantized checkpoint (FP8,
    FP4 experts) is dequantized to `dtype` at load; quantization="fp8" keeps its linear weights in
    FP8 on the device instead."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", tokenizer: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 16, seed: int = 0,
                 impl: str = "auto", progress: bool | None = None, enable_prefix_caching: bool = False,
                 kv_cache_dir: str | None = None, engine_config: dict | None = None,
                 speculative_config: dict | None = None, quantization: str | None = None):
        if model is None:
            if quantization is not None:
                raise ConfigError("quantization applies to a checkpoint's quantized weights; the embedded default "
                                  "has none")
            self.config = default_config()
            self.model_name = DEFAULT_MODEL_NAME
            self.dtype = _resolve_dtype(dtype, self.config)
            params = get_model(self.config.model_type).init_params(self.config, seed=DEFAULT_SEED, dtype=self.dtype)
            self.tokenizer = ByteTokenizer()
        else:
            model = os.fspath(model)
            reader = open_checkpoint(model, quantization)   # checks the directory and the weight files first
            self.config = load_config(model)
            self.model_name = model
            self.dtype = _resolve_dtype(dtype, self.config)
            n = len(reader.keys())
            show = reader.total_bytes >= LARGE_CHECKPOINT_BYTES if progress is None else progress
            with tqdm(total=n, desc="loading weights", unit="tensor", disable=not show, file=sys.stderr) as bar:
                params = get_model(self.config.model_type).convert_hf_weights(self.config, reader.get, reader.has, self.dtype,
                                                       progress=lambda: bar.update(1))
            if tokenizer == "byte":
                self.tokenizer = ByteTokenizer()
            else:
                self.tokenizer = load_tokenizer(tokenizer or model)
        if max_num_seqs <= 0:
            raise InputError(f"max_num_seqs must be positive; got {max_num_seqs}")
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self._rng = np.random.default_rng(seed)   # seeds for requests that bring none
        self.generator = Generator(self.config, params, self.dtype, impl=impl)
        self._fingerprint: str | None = None
        self._engine = None
        self._spec = None
        if speculative_config is not None and not enable_prefix_caching:
            from hybrid_jax.speculative import SpeculativeDecoder  # noqa: PLC0415
            self._spec = SpeculativeDecoder(self.config, params, self.dtype, speculative_config, impl=impl,
                                            max_num_seqs=max_num_seqs)
        if kv_cache_dir is not None and not enable_prefix_caching:
            raise InputError("kv_cache_dir needs enable_prefix_caching=True")
        if enable_prefix_caching:
            # Prefix reuse lives in the continuous-batching engine: generate() runs through it.
            from hybrid_jax.engine import EngineConfig, LLMEngine  # noqa: PLC0415
            opts = dict(max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, enable_prefix_caching=True,
                        kv_cache_dir=None if kv_cache_dir is None else os.fspath(kv_cache_dir),
                        speculative_config=speculative_config)   # the engine speculates with n-gram drafts
            opts.update(engine_config or {})
            self._engine = LLMEngine(self, EngineConfig(**opts))
        elif engine_config:
            raise InputError("engine_config is only used with enable_prefix_caching=True")

    @property
    def params(self):
        return self.generator.params

    def fingerprint(self) -> str:
        """Hash of this model's config and weights (prefix-cache keys carry it)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.config, self.params)
        return self._fingerprint

    def cache_stats(self) -> dict:
        """Prefix-cache figures: hit_rate, validation_pass_rate, effective_reuse (their product),
        misses_by_reason, bytes_by_kind, bytes_by_group, ...; {"enabled": False} when it is off."""
        return self._engine.cache_stats() if self._engine is not None else {"enabled": False}

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
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this checkpoint has no tokenizer.json: pass {'prompt_token_ids': [...]} "
                                 "instead of a string, or LLM(..., tokenizer=PATH)")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self._encode(prompt["prompt"])
        else:
            raise InputError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}")
        ids = list(ids) if not isinstance(ids, np.ndarray) else ids.tolist()
        if not ids:
            raise InputError("empty prompt: it has no tokens")
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise InputError(f"token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}")
        return text, [int(t) for t in ids]

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
            sp.validate()
        encoded = [self._encode(p) for p in prompts]
        for (_, ids), sp in zip(encoded, sps):
            if len(ids) + sp.max_tokens > self.max_model_len:
                raise InputError(f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds "
                                 f"max_model_len {self.max_model_len}")
        if self._engine is not None:
            return self._generate_with_engine(prompts, encoded, sps)
        if self._spec is not None:
            return self._generate_speculative(encoded, sps)
        eos = self.eos_token_ids()
        results: list[RequestOutput] = []
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i][1]))   # similar lengths batch well
        done: dict[int, RequestOutput] = {}
        for start in tqdm(range(0, len(order), self.max_num_seqs), disable=not use_tqdm, desc="generating"):
            idx = order[start:start + self.max_num_seqs]
            batch = make_batch([encoded[i][1] for i in idx], [sps[i] for i in idx], eos,
                               self._rng.integers(0, 2**32, len(idx)).tolist())
            out, n_out = self.generator.run(batch)
            for row, i in enumerate(idx):
                toks = out[row, :n_out[row]].tolist()
                stops = set(sps[i].stop_token_ids) | (set() if sps[i].ignore_eos else set(eos))
                reason = "stop" if toks and toks[-1] in stops else "length"
                text = self.tokenizer.decode(toks) if self.tokenizer is not None else ""
                done[i] = RequestOutput(request_id=str(i), prompt=encoded[i][0], prompt_token_ids=encoded[i][1],
                                        outputs=[CompletionOutput(0, text, toks, reason)])
        results = [done[i] for i in range(len(prompts))]
        return results

    def _generate_with_engine(self, prompts, encoded, sps) -> list[RequestOutput]:
        outs = self._engine.generate([{"prompt_token_ids": ids, "prompt": text} for text, ids in encoded], list(sps))
        return [RequestOutput(request_id=str(i), prompt=encoded[i][0], prompt_token_ids=encoded[i][1],
                              outputs=[CompletionOutput(0, o.text, list(o.token_ids), o.finish_reason)])
                for i, o in enumerate(outs)]

    def _generate_speculative(self, encoded, sps) -> list[RequestOutput]:
        seeds = self._rng.integers(0, 2**32, len(encoded)).tolist()
        res = self._spec.generate([ids for _, ids in encoded], list(sps), self.eos_token_ids(), seeds=seeds)
        return [RequestOutput(request_id=str(i), prompt=encoded[i][0], prompt_token_ids=encoded[i][1],
                              outputs=[CompletionOutput(0, self.tokenizer.decode(toks) if self.tokenizer else "",
                                                        list(toks), reason)])
                for i, (toks, reason) in enumerate(res)]

    def spec_stats(self) -> dict:
        """Speculative decoding figures (acceptance rate, mean accepted length, draft and verify
        time, ...); {"enabled": False} without a speculative_config."""
        if self._engine is not None:
            return self._engine.spec_stats()
        return {"enabled": True, **self._spec.stats()} if self._spec is not None else {"enabled": False}

    # --- inspection --------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Prefill logits at every position of one prompt: [T, V] fp32."""
        _, ids = self._encode({"prompt_token_ids": list(token_ids)})
        return self.generator.logits(np.asarray(ids, np.int32))

    def new_cache(self, batch_size: int = 1, capacity: int = 256):
        """An empty cache pytree for this model (one group per layer type)."""
        return self.generator.new_cache(batch_size, capacity)
