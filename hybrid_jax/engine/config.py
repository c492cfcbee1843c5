"""Engine configuration: one frozen dataclass, every knob with its default."""
from __future__ import annotations

import dataclasses
import math
import os

from hybrid_jax.engine.kv_event_publisher import KVEventsConfig
from hybrid_jax.errors import InputError


def default_compilation_cache_dir() -> str:
    """A per-user directory for JAX's persistent compilation cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hybrid_jax", "jax_compilation_cache")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8               # requests running at once (cache rows)
    max_num_batched_tokens: int = 256   # tokens per step, prefill chunks and decodes together
    max_model_len: int = 2048           # prompt + output tokens per request
    decode_steps: int = 4               # decode iterations per device call when no prefill is pending
    kv_cache_bytes: int | None = None   # bytes of the cache pools (None: max_num_seqs requests of max_model_len)
    max_stop_ids: int = 8               # stop token ids per request, as a static width
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    warmup: str = "minimal"             # "none" | "minimal" (decode buckets) | "all" (every bucket)
    enable_prefix_caching: bool = False  # reuse validated cached prefixes across requests
    prefix_block_size: int = 64          # tokens per full-KV page (a prefix-cache block) / checkpoint grid
    prefix_checkpoint_interval: int = 8  # keep a recurrent checkpoint every interval x LCM tokens (+ the last)
    prefix_checkpoint_grid: int | None = None  # a finer grid (a divisor of prefix_block_size) for checkpoints,
                                               # on which hits resume inside full-KV / MLA pages (None: the
                                               # GCD of prefix_block_size and 16; docs/architecture.md)
    prefix_cache_bytes: int | None = None  # the prefix store's cap (None: kv_cache_bytes)
    prefix_publish_chunk_ends: bool = False  # also publish, as spares, the LCM points inside a prompt where a
                                             # prefill chunk ends anyway (a branching prompt resumes there)
    kv_cache_dir: str | None = None      # on-disk prefix tier (needs enable_prefix_caching)
    kv_cache_dir_bytes: int = 8 << 30    # the disk tier's own cap
    prefetch_policy: str = "wait"        # disk prefetch at admission: "best_effort" | "wait" | "timeout"
    prefetch_timeout_s: float = 1.0
    speculative_config: dict | None = None  # vLLM's shape, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    kv_events_config: dict | None = None  # vLLM's --kv-events-config: the prefix cache's blocks, published
                                          # to routers (engine/kv_event_publisher.py; prefix caching on)
    run_to_completion: bool = False      # offline: a decode step takes every decoding row to its end (LLM.generate)
    async_scheduling: bool = True        # enqueue the next step before reading this one's tokens (no speculation)
    detokenize: bool = True              # False: only requests with stop strings (an API front end does the rest)
    seed: int = 0                        # seeds of requests that bring none are drawn from this

    @property
    def checkpoint_grid(self) -> int:
        """The prefix store's checkpoint grid (prefix_checkpoint_grid, or its default)."""
        return self.prefix_checkpoint_grid or math.gcd(self.prefix_block_size, 16)

    def __post_init__(self):
        for f in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_steps", "prefix_block_size",
                  "prefix_checkpoint_interval"):
            if getattr(self, f) <= 0:
                raise InputError(f"{f} must be positive; got {getattr(self, f)}")
        if self.warmup not in ("none", "minimal", "all"):
            raise InputError(f"warmup must be 'none', 'minimal' or 'all'; got {self.warmup!r}")
        g = self.prefix_checkpoint_grid
        if g is not None and (g <= 0 or self.prefix_block_size % g):
            raise InputError(f"prefix_checkpoint_grid must be a positive divisor of prefix_block_size "
                             f"{self.prefix_block_size}; got {g}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise InputError(f"kv_cache_bytes must be positive; got {self.kv_cache_bytes}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes <= 0:
            raise InputError(f"prefix_cache_bytes must be positive; got {self.prefix_cache_bytes}")
        if KVEventsConfig.parse(self.kv_events_config) is not None and not self.enable_prefix_caching:
            raise InputError("kv_events_config needs enable_prefix_caching=True (the events are the prefix "
                             "cache's blocks)")
        if self.kv_cache_dir is not None and not self.enable_prefix_caching:
            raise InputError("kv_cache_dir needs enable_prefix_caching=True (the disk tier holds cached prefixes)")
        if self.prefetch_policy not in ("best_effort", "wait", "timeout"):
            raise InputError(f"prefetch_policy must be 'best_effort', 'wait' or 'timeout'; got {self.prefetch_policy!r}")
        if self.kv_cache_dir_bytes <= 0 or self.prefetch_timeout_s <= 0:
            raise InputError("kv_cache_dir_bytes and prefetch_timeout_s must be positive")
        if self.speculative_config is not None:
            from hybrid_jax.speculative.config import parse_speculative_config  # noqa: PLC0415
            parse_speculative_config(self.speculative_config)      # a bad config fails here, naming the key
