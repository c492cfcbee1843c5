"""What the engine's rooms promise each other, as types: the model an engine is handed, the engine
core every client steps, and the engine clients the API server talks to.

  LoadedModel    a model loaded and laid out, as an engine needs it (the LLM facade makes one:
                 `LLM.loaded()`; the engine never reads the facade itself)
  EngineCore     LLMEngine and DataParallelEngine: requests in, one step at a time, outputs out
  EngineClient   AsyncEngine (the core on a thread) and EngineCoreClient (the core in its own process):
                 what hybrid_jax/server reads, the same for both
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from hybrid_jax.models.config_common import FamilyConfig
from hybrid_jax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready for an engine. config: its family config; params: its weights in this project's
    layout, on their devices; dtype: the compute dtype; tokenizer: an object with encode / decode, or
    None (token-id prompts only); name: what it is served as; max_model_len: the longest request it
    takes; eos_ids: the token ids that end a generation (the config's and the tokenizer's); impl: the
    kernels' implementation ("auto", "pallas", "xla", "reference"); layout: its placement over a mesh
    (hybrid_jax.parallel.Layout) or None on one device; fingerprint: the hash of its config and
    weights (prefix-cache keys carry it), computed on first call."""
    config: FamilyConfig
    params: Any
    dtype: Any
    tokenizer: Any
    name: str
    max_model_len: int
    eos_ids: tuple[int, ...]
    fingerprint: Callable[[], str]
    impl: str = "auto"
    layout: Any = None


@runtime_checkable
class Loads(Protocol):
    """Anything that hands over a LoadedModel (the LLM facade)."""

    def loaded(self) -> LoadedModel: ...


def as_loaded(model: LoadedModel | Loads) -> LoadedModel:
    """The LoadedModel itself, or the one an LLM facade hands over."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, Loads):
        return model.loaded()
    raise TypeError(f"an engine needs a LoadedModel (or an LLM, which makes one); got {type(model).__name__}")


class EngineCore(Protocol):
    """The engine core (LLMEngine, DataParallelEngine): every client steps one of these."""

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival: float | None = None) -> Any: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def flush_publishes(self) -> None: ...

    def check(self, prompt: Any, params: SamplingParams) -> tuple[str | None, list[int]]: ...

    def startup_status(self) -> Any: ...     # engine/startup_status.StartupStatus, or None

    def close(self) -> None: ...


class EngineClient(Protocol):
    """What the API server reads from its engine (AsyncEngine in this process, EngineCoreClient for a
    core in its own), through server/supervisor.EngineSupervisor: requests in and outputs out, the
    heartbeat (`pulse`: engine/heartbeat.Pulse, with the engine's metrics) and whether the engine is
    still there. A core client also offers `kill`, `close`, `process` and `connection` (the owner of
    a core process restarts it; another API server reconnects)."""

    pulse: Any
    error: Any

    @property
    def tokenizer(self) -> Any: ...

    @property
    def alive(self) -> bool: ...

    def model_card(self) -> dict: ...

    def validate(self, prompt: Any, params: SamplingParams) -> list[int]: ...

    def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                 arrival: float | None = None) -> AsyncIterator: ...

    def render_metrics(self) -> bytes: ...

    def abandon(self, reason: str) -> None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...


def protocol_members(proto: type) -> set[str]:
    """The names a class must offer to satisfy `proto` (its methods, properties and attributes)."""
    names = {n for n in vars(proto) if not n.startswith("_")} | set(getattr(proto, "__annotations__", {}))
    return names - {"_is_protocol", "_is_runtime_protocol"}
