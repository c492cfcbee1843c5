"""Parsed `hybrid-jax` flags turned into what the commands pass on: the EngineConfig, LLM(...)'s
layout keywords, the server's admission, supervision and disaggregation configs, the API key, the
checkpoint's model type and --tokens' ids. A flag value out of range is an error naming the flag."""
from __future__ import annotations

import os

from hybrid_jax.errors import HybridJaxError, InputError


def parallel_options(args) -> dict:
    """LLM(...)'s layout keywords from parsed arguments."""
    return dict(tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                enable_expert_parallel=args.enable_expert_parallel)


def _parse_tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise HybridJaxError(f"--tokens must be comma-separated integers; got {s!r}") from None


def _engine_config(args):
    from hybrid_jax.engine import EngineConfig  # noqa: PLC0415
    from hybrid_jax.engine.config import default_compilation_cache_dir  # noqa: PLC0415
    ccd = args.compilation_cache_dir
    ccd = None if ccd == "none" else (ccd or default_compilation_cache_dir())
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, decode_steps=args.decode_steps,
                        kv_cache_bytes=args.kv_cache_bytes, warmup=args.warmup, compilation_cache_dir=ccd,
                        enable_prefix_caching=args.enable_prefix_caching, prefix_block_size=args.prefix_block_size,
                        prefix_checkpoint_interval=args.prefix_checkpoint_interval,
                        prefix_cache_bytes=args.prefix_cache_bytes, kv_cache_dir=args.kv_cache_dir,
                        kv_cache_dir_bytes=args.kv_cache_dir_bytes, prefetch_policy=args.prefetch_policy,
                        speculative_config=args.speculative_config, async_scheduling=args.async_scheduling,
                        kv_events_config=args.kv_events_config)


def _disaggregation(args):
    from hybrid_jax.server.disaggregation import DisaggregationConfig  # noqa: PLC0415
    if args.disaggregation_mode != "null" and not args.enable_prefix_caching:
        raise SystemExit("--disaggregation-mode needs --enable-prefix-caching (handoffs go through the prefix "
                         "cache's disk tier)")
    try:
        return DisaggregationConfig(mode=args.disaggregation_mode, directory=args.kv_cache_dir,
                                    timeout_s=args.disaggregation_timeout,
                                    bootstrap_port=args.disaggregation_bootstrap_port)
    except InputError as e:
        raise SystemExit(str(e)) from None


def _admission(args):
    from hybrid_jax.server.admission import AdmissionConfig  # noqa: PLC0415
    for flag in ("max_queued_requests", "max_queued_tokens"):
        v = getattr(args, flag)
        if v is not None and v < 0:
            raise HybridJaxError(f"--{flag.replace('_', '-')} must be >= 0; got {v}")
    if args.max_header_bytes < 1024:
        raise HybridJaxError(f"--max-header-bytes must be at least 1024; got {args.max_header_bytes}")
    return AdmissionConfig(max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens,
                           fair=args.fair_admission)


def _supervision(args):
    from hybrid_jax.server.supervisor import SupervisionConfig  # noqa: PLC0415
    hang = args.core_hang_timeout if args.core_hang_timeout is not None else (60.0 if args.warmup == "all" else 0.0)
    if args.core_restarts < 0:
        raise HybridJaxError("--core-restarts must be >= 0")
    if not 0 < args.core_unresponsive_timeout or hang < 0 or 0 < hang <= args.core_unresponsive_timeout:
        raise HybridJaxError("--core-unresponsive-timeout must be > 0, and --core-hang-timeout 0 (never) or longer")
    return SupervisionConfig(core_restarts=args.core_restarts, unresponsive_after_s=args.core_unresponsive_timeout,
                             hung_after_s=hang)


API_KEY_ENV = "HYBRID_JAX_API_KEY"


def _model_type(model: str | None) -> str | None:
    """The checkpoint's config.json model_type (None for the embedded default model, or none found):
    it picks the chat endpoint's tool-call and reasoning formats."""
    from hybrid_jax.server.worker_info import ModelIdentity  # noqa: PLC0415
    return ModelIdentity.read(model).model_type if model else None


def _api_key(args) -> str | None:
    """--api-key, else --api-key-file, else $HYBRID_JAX_API_KEY, else None (no key)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise HybridJaxError("give --api-key or --api-key-file, not both")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise HybridJaxError(f"--api-key-file: {e.strerror}: {args.api_key_file}") from None
    if key is None:
        key = os.environ.get(API_KEY_ENV) or None
    if key is not None and not key:
        raise HybridJaxError("the API key is empty")
    return key
