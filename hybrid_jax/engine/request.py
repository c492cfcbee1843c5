"""A request's life on the host: tokens known, tokens already in the cache, what was streamed.

With overlapped stepping a request may have tokens in flight (`num_inflight`): sampled by a step the
engine dispatched and has not read back yet. They count as computed and as output for scheduling
(`num_output`, `remaining_tokens`, `num_uncomputed`) though their ids are not in `output_ids` yet."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
import time

from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.structured.grammars import RequestGrammar


@dataclasses.dataclass(frozen=True)
class ForkGroup:
    """The engine's whole contract for `n` > 1: requests that share one prompt and form one group (the
    front end fans a request with n = k out into k requests, index 0 .. k - 1, and names each
    `<group_id>#<index>/<size>`: `from_request_id`). The group's leader (index 0) prefills the prompt
    once; every other member is forked from it (engine/fork.py). group_id: the group's name (unique
    among the engine's groups); index: this request's place in it; size: k."""
    group_id: str
    index: int
    size: int

    def __post_init__(self):
        if not isinstance(self.group_id, str) or not self.group_id:
            raise InputError("group: group_id must be a non-empty string")
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise InputError(f"group: size must be an integer >= 1, got {self.size!r}")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or not 0 <= self.index < self.size:
            raise InputError(f"group: index must be an integer in [0, {self.size}), got {self.index!r}")

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def request_id(self) -> str:
        """The engine request id that names this place in the group (`from_request_id` reads it)."""
        return f"{self.group_id}#{self.index}/{self.size}"

    @staticmethod
    def from_request_id(request_id: str) -> ForkGroup | None:
        """The group a request id names, as `request_id` writes it (the server's fan-out names its
        requests so: `<group id>#<index>/<size>`, e.g. `cmpl-7-p0#2/4`), or None when it names none (another
        shape, a size below 2, an index outside the group): those ids are ordinary requests."""
        m = _TAG.match(request_id)
        if m is None:
            return None
        index, size = int(m["index"]), int(m["size"])
        return ForkGroup(m["group"], index, size) if size >= 2 and index < size else None


_TAG = re.compile(r"^(?P<group>.+)#(?P<index>\d+)/(?P<size>\d+)$")


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # holds a cache slot
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclasses.dataclass(eq=False)          # an entity: equal only to itself (the scheduler's `in` tests)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    prompt_text: str | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    num_computed: int = 0                  # tokens of prompt + output already written to the cache
    slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    text: str = ""
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0             # prompt tokens the last admission took from the prefix cache
    scheduled_time: float | None = None    # first admission into a row (queue time ends here)
    strikes: int = 0                       # unattributable step failures this request was part of
    num_inflight: int = 0                  # tokens a dispatched, unread step samples for it (engine overlap)
    row_consts: tuple | None = None        # its step inputs that never change (StepInputs.row_consts)
    group: ForkGroup | None = None         # the n > 1 group it belongs to (engine/fork.py), or None
    grammar: RequestGrammar | None = None  # its structured output's matcher (hybrid_jax/structured), or None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_uncomputed(self) -> int:
        """Known tokens not yet in the cache: the prompt (or its rest) at first, then the last sample."""
        return len(self.prompt_ids) + self.num_output - self.num_computed

    @property
    def masked(self) -> bool:
        """Its next token is held to its structured output's grammar (it has one, past its gate)."""
        return self.grammar is not None and self.grammar.active

    @property
    def num_output(self) -> int:
        """Output tokens sampled so far: those read back and those in flight."""
        return len(self.output_ids) + self.num_inflight

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output


@dataclasses.dataclass
class EngineOutput:
    """What one engine step reports about one request: the new tokens since the last report (the LLM
    facade's user-facing result is `hybrid_jax.RequestOutput`)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_token_ids: list[int]
    new_logprobs: list[dict]
    logprobs: list[dict] = dataclasses.field(default_factory=list)   # every token's so far (logprobs requests)
    error: str | None = None        # finish_reason "error": why this request failed (the others go on)
    prompt_logprobs: list[dict | None] | None = None   # prompt_logprobs requests, in their first output: per prompt token, None for the first, else a `logprobs` entry


class RequestFailed(RuntimeError):
    """A failure inside a step that belongs to one request: only that request fails."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id!r}: {type(cause).__name__}: {cause}")
        self.request_id, self.cause = request_id, cause


@contextlib.contextmanager
def attributed(req: "Request"):
    """Host work on one request's row: an exception in it is that request's failure."""
    try:
        yield
    except RequestFailed:
        raise
    except Exception as e:  # noqa: BLE001
        raise RequestFailed(req.request_id, e) from e
