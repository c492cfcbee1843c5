"""What the API server serves from: its configuration (ServerConfig) and its live state (ServerState:
the engine once loaded, admission, worker threads, drain, the start-up's progress until then)."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from hybrid_jax.server.admission import Admission, AdmissionConfig
from hybrid_jax.server.api_metrics import ApiMetrics
from hybrid_jax.server.disaggregation import Disaggregation, DisaggregationConfig
from hybrid_jax.server.tool_parsers import family
from hybrid_jax.server.worker_info import ModelIdentity
from hybrid_jax.server.workers import Workers


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str = "hybrid-jax"
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    body_timeout_s: float = 30.0        # longest wait for the next piece of a request body (408 after)
    metrics_api_key: bool = False       # /metrics behind the API key too
    admission: AdmissionConfig = AdmissionConfig()   # bounds on waiting requests and tokens (server/admission.py)
    admission_workers: int | None = None  # threads that parse, template and tokenize (server/workers.py)
    model_type: str | None = None       # the checkpoint's (config.json): picks its tool-call / reasoning formats
    tool_call_parser: str | None = None  # --tool-call-parser: a format of server/tool_parsers/ ("none": off)
    reasoning_parser: str | None = None  # --reasoning-parser
    identity: ModelIdentity = ModelIdentity()   # the checkpoint and layout, for /server_info and /model_info
    disaggregation: DisaggregationConfig = DisaggregationConfig()   # prefill/decode mode (server/disaggregation.py)


class ServerState:
    """What the app serves from; `engine` is None until the model is loaded and warm."""

    def __init__(self, config: ServerConfig):
        self.config = config
        # the served family's output formats (server/tool_parsers/); a bad parser name fails here, at startup
        self.family = family(config.model_type, config.tool_call_parser, config.reasoning_parser)
        self.engine = None           # server/supervisor.EngineSupervisor (over the engine thread or core process)
        self.metrics = ApiMetrics()  # what this process counts itself (errors, restarts)
        self.admission = Admission(config.admission, self.metrics.registry)   # 429 past the waiting bounds
        self.disagg = (Disaggregation(config.disaggregation, self.metrics.registry)
                       if config.disaggregation.on else None)
        self.workers = Workers(config.admission_workers)     # parsing, templates, tokenization: off the loop
        self.load_error: str | None = None
        self.fatal_error: str | None = None    # the engine died and cannot come back: the server exits 1
        self.ready_note = "ok"       # /health's body once ready: what the warm-up compiled
        self.startup = None          # the load's last engine/startup_status.StartupStatus (/health while loading)
        self.loading_since = time.monotonic()
        self.draining = False
        self._deadline: asyncio.Future | None = None

    def deadline(self) -> asyncio.Future:
        """Resolves when a drain's deadline passes (never, unless the server is draining)."""
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().create_future()
        return self._deadline

    def begin_drain(self, timeout_s: float):
        """On the event loop: refuse new requests; at `timeout_s`, end the ones still open."""
        self.draining = True
        fut = self.deadline()
        asyncio.get_running_loop().call_later(timeout_s, lambda: fut.done() or fut.set_result(None))
