"""Admission control of one API server process: a bound on the requests and prompt tokens waiting
for the engine, shared between clients; a request past it gets HTTP 429 with `Retry-After`.

What "waiting" means, and where it is counted. This process knows exactly what it has *in flight*:
a request is in flight from the moment it is admitted (validated, tokenized, within the bounds
below) until its response is over (finished, failed, aborted, or its client gone). The engine runs
at most `rows` requests at once (`max_num_seqs`, from the engine's model card, times its
data-parallel replicas) and takes new ones first come, first served. So this process models the
engine's queue: the `rows` oldest requests in flight are *running* and every later one is
*waiting*; when a running request ends, the oldest waiting one takes its row. The counts are exact
for what this process sent; the model is optimistic only when the cache runs out of pages before it
runs out of rows (or preempts), in which case more requests wait in the engine than counted here.
Either way this process never has more than rows + max_queued_requests requests in flight.

The rule, for a request of `p` prompt tokens from client `c` (in this order):

  1. a row is free (fewer than `rows` in flight): admitted;
  2. `max_queued_requests` requests wait already: refused (`too_many_waiting_requests`);
  3. some prompt tokens wait and their sum + p exceeds `max_queued_tokens`: refused
     (`too_many_waiting_tokens`) -- a prompt is always admitted when nothing waits, so no prompt that
     fits the context is refused for good;
  4. fairness (on by default): with k clients that would have requests waiting (c included), c may
     hold at most max(1, max_queued_requests // (k + 1)) waiting requests and, unless it has none
     waiting, max_queued_tokens // (k + 1) waiting prompt tokens: refused past that
     (`client_share_exceeded`). The "+ 1" keeps one share free for a client that has nothing
     waiting yet, so a flood from one client (which may fill half the waiting slots alone) cannot
     starve another; shares shrink as clients arrive, and a client over its new share is refused
     until its waiting requests drain below it.

Defaults: max_queued_requests = max(128, 4 x rows); max_queued_tokens = max_queued_requests x
max_model_len / 4 (short prompts meet the first bound, long ones the second).

A client is the request's `user` field when it sends one (OpenAI's end-user id), else the peer's
address. The server has a single API key, so the key tells clients apart no better than the
address. `user` is what the client says it is: a flooder that varies it gets more shares, but never
more than the bounds of rules 2 and 3; behind a proxy, clients without `user` are one client.

Several API server processes (`--api-server-count N`) feed one engine core without talking to each
other: each takes ceil(1/N) of the rows, of `max_queued_requests` and of `max_queued_tokens` (the
kernel spreads connections evenly over them, SO_REUSEPORT), so the engine's queue stays within the
bounds (plus rounding); when the load on the processes is uneven, one may refuse while another
still has room.

`Retry-After` (seconds, 1 to 60) is the time one waiting slot takes to free at the rate requests
ended over the last RATE_WINDOW_S seconds (UNKNOWN_RETRY_AFTER_S when none ended).

Counters (this process's own, on the registry it is given: /metrics serves them):

  hybrid_jax_requests_refused_total{reason}     429s, by the rule that refused
  hybrid_jax_api_requests_in_flight             admitted and not over
  hybrid_jax_api_requests_waiting               of those, waiting (the model above)
  hybrid_jax_api_prompt_tokens_waiting          their prompt tokens
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Hashable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from hybrid_jax.errors import InputError

QUEUED_REQUESTS_PER_ROW = 4       # default max_queued_requests: 4 x the engine's rows,
MIN_QUEUED_REQUESTS = 128         # and at least 128 (TGI's default bound on concurrent requests)
QUEUED_TOKENS_PER_REQUEST = 0.25  # default max_queued_tokens: a quarter of max_model_len per waiting slot
RATE_WINDOW_S = 30.0              # requests that ended this recently set Retry-After
UNKNOWN_RETRY_AFTER_S = 5         # when none did (a guess)
MAX_RETRY_AFTER_S = 60
REASONS = ("too_many_waiting_requests", "too_many_waiting_tokens", "client_share_exceeded")
MAX_USER_CHARS = 256              # of a `user` field kept as the client's name


@dataclasses.dataclass(frozen=True)
class ClientKey:
    """Who a request is from, for fair shares: its `user` field, else the peer's address."""
    kind: str          # "user" or "peer"
    name: str


def client_key(user, peer: str | None) -> ClientKey:
    """The request's client (`user`: the body's field, `peer`: the connection's address); InputError
    for a `user` that is not a string."""
    if user is not None and not isinstance(user, str):
        raise InputError(f"'user' must be a string; got {type(user).__name__}")
    if user:
        return ClientKey("user", user[:MAX_USER_CHARS])
    return ClientKey("peer", peer or "unknown")


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    """The bounds as configured (`hybrid-jax serve --max-queued-requests / --max-queued-tokens
    / --no-fair-admission`), for the whole server."""
    max_queued_requests: int | None = None    # None: max(MIN_QUEUED_REQUESTS, QUEUED_REQUESTS_PER_ROW x rows)
    max_queued_tokens: int | None = None      # None: max_queued_requests x max_model_len / 4
    fair: bool = True                         # per-client shares of the waiting slots (rule 4)
    api_server_count: int = 1                 # processes sharing the bounds (each takes 1/N)

    def __post_init__(self):
        for name in ("max_queued_requests", "max_queued_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0; got {v!r}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1; got {self.api_server_count!r}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds this process enforces: its share of the engine's rows and of the waiting area."""
    rows: int
    queued_requests: int
    queued_tokens: int

    @classmethod
    def resolve(cls, config: AdmissionConfig, rows: int, max_model_len: int) -> Limits:
        n = config.api_server_count
        q = config.max_queued_requests
        if q is None:
            q = max(MIN_QUEUED_REQUESTS, QUEUED_REQUESTS_PER_ROW * rows)
        t = config.max_queued_tokens
        if t is None:                 # short prompts meet the request bound first, long ones this one
            t = max(max_model_len, int(q * max_model_len * QUEUED_TOKENS_PER_REQUEST))
        return cls(rows=max(1, math.ceil(rows / n)), queued_requests=math.ceil(q / n), queued_tokens=math.ceil(t / n))


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a request was refused (`reason`: one of REASONS, the error's `code`), for a 429."""
    reason: str
    message: str
    retry_after_s: int


class Refused(Exception):
    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclasses.dataclass(eq=False)
class Ticket:
    """One admitted request; `release()` (idempotent) when its response is over."""
    seq: int
    client: Hashable              # a ClientKey (any hashable name will do)
    tokens: int
    admission: Admission
    released: bool = False

    def release(self):
        if not self.released:
            self.released = True
            self.admission._release(self)


@dataclasses.dataclass(frozen=True)
class AdmissionState:
    """What this process has in flight, as the rule sees it."""
    in_flight: int
    running: int
    waiting: int
    waiting_tokens: int
    waiting_clients: int


class Admission:
    def __init__(self, config: AdmissionConfig = AdmissionConfig(), registry: CollectorRegistry | None = None):
        """registry: where the counters go (the API process's /metrics registry)."""
        self.config = config
        self.limits: Limits | None = None        # set by `bind` once the engine's size is known
        self._seq = 0
        self._running: dict[int, Ticket] = {}
        self._waiting: collections.OrderedDict[int, Ticket] = collections.OrderedDict()   # admission order
        self._waiting_tokens = 0
        self._client_waiting: dict[Hashable, int] = {}
        self._client_tokens: dict[Hashable, int] = {}
        self._ended: collections.deque[float] = collections.deque(maxlen=1024)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.refused = Counter("hybrid_jax_requests_refused", "Requests refused with 429 by this API server's "
                               "admission bounds, by reason", ["reason"], registry=self.registry)
        for r in REASONS:
            self.refused.labels(reason=r)
        self.registry.register(_Gauges(self))

    # --- configuration -------------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self.limits is not None

    def bind(self, rows: int, max_model_len: int):
        """The engine's rows (max_num_seqs x replicas) and max_model_len: the defaults derive from them."""
        self.limits = Limits.resolve(self.config, rows, max_model_len)

    # --- decisions -------------------------------------------------------------------------------------
    def state(self) -> AdmissionState:
        return AdmissionState(in_flight=len(self._running) + len(self._waiting), running=len(self._running),
                              waiting=len(self._waiting), waiting_tokens=self._waiting_tokens,
                              waiting_clients=len(self._client_waiting))

    def full(self) -> Refusal | None:
        """Rule 2 alone, before a request is parsed: under a flood the refusals cost nothing more."""
        lim = self.limits
        if len(self._running) >= lim.rows and len(self._waiting) >= lim.queued_requests:
            return self._refuse("too_many_waiting_requests", self._full_message())
        return None

    def admit(self, client: Hashable, prompt_tokens: int) -> Ticket:
        """A ticket for a request of `prompt_tokens` from `client`, or Refused (see the module doc)."""
        lim = self.limits
        self._seq += 1
        ticket = Ticket(self._seq, client, prompt_tokens, self)
        if len(self._running) < lim.rows:
            self._running[ticket.seq] = ticket
            return ticket
        if len(self._waiting) >= lim.queued_requests:
            raise Refused(self._refuse("too_many_waiting_requests", self._full_message()))
        if self._waiting_tokens and self._waiting_tokens + prompt_tokens > lim.queued_tokens:
            raise Refused(self._refuse(
                "too_many_waiting_tokens", f"the server is overloaded: {self._waiting_tokens} prompt tokens are "
                f"waiting, and this prompt's {prompt_tokens} would pass the limit of {lim.queued_tokens}; retry later"))
        if self.config.fair:
            mine = self._client_waiting.get(client, 0)
            k = len(self._client_waiting) + (0 if mine else 1)
            share = max(1, lim.queued_requests // (k + 1))
            share_tokens = lim.queued_tokens // (k + 1)
            mine_tokens = self._client_tokens.get(client, 0)
            if mine >= share or (mine_tokens and mine_tokens + prompt_tokens > share_tokens):
                raise Refused(self._refuse(
                    "client_share_exceeded", f"too many requests from this client are waiting ({mine} requests, "
                    f"{mine_tokens} prompt tokens; {k} clients share the waiting slots, {share} requests and "
                    f"{share_tokens} tokens each); retry later"))
        self._wait(ticket)
        return ticket

    # --- bookkeeping -----------------------------------------------------------------------------------
    def _wait(self, t: Ticket):
        self._waiting[t.seq] = t
        self._waiting_tokens += t.tokens
        self._client_waiting[t.client] = self._client_waiting.get(t.client, 0) + 1
        self._client_tokens[t.client] = self._client_tokens.get(t.client, 0) + t.tokens

    def _unwait(self, t: Ticket):
        del self._waiting[t.seq]
        self._waiting_tokens -= t.tokens
        n = self._client_waiting[t.client] - 1
        if n:
            self._client_waiting[t.client] = n
            self._client_tokens[t.client] -= t.tokens
        else:
            del self._client_waiting[t.client], self._client_tokens[t.client]

    def _release(self, t: Ticket):
        self._ended.append(time.monotonic())
        if self._running.pop(t.seq, None) is None:
            self._unwait(t)
            return
        if self._waiting:                       # the oldest waiting request takes the row (FCFS, as the engine)
            oldest = next(iter(self._waiting.values()))
            self._unwait(oldest)
            self._running[oldest.seq] = oldest

    def _full_message(self) -> str:
        lim = self.limits
        return (f"the server is overloaded: {len(self._waiting)} requests are waiting (the limit is "
                f"{lim.queued_requests}) behind {len(self._running)} running; retry later")

    def retry_after_s(self) -> int:
        """Seconds until a waiting slot is likely to free (see the module doc)."""
        now = time.monotonic()
        while self._ended and now - self._ended[0] > RATE_WINDOW_S:
            self._ended.popleft()
        if not self._ended:
            return UNKNOWN_RETRY_AFTER_S
        rate = len(self._ended) / max(1.0, now - self._ended[0])       # ends a second, over the window
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(1 / rate)))

    def _refuse(self, reason: str, message: str) -> Refusal:
        self.refused.labels(reason=reason).inc()
        return Refusal(reason, message, self.retry_after_s())


class _Gauges:
    """The present state, read at scrape time."""

    def __init__(self, admission: Admission):
        self.admission = admission

    def collect(self):
        s = self.admission.state()
        for name, doc, v in (
                ("api_requests_in_flight", "Requests this API server admitted whose response is not over", s.in_flight),
                ("api_requests_waiting", "Of those, the ones waiting for an engine row (the engine runs the "
                 "oldest max_num_seqs)", s.waiting),
                ("api_prompt_tokens_waiting", "Prompt tokens of the waiting requests", s.waiting_tokens)):
            g = GaugeMetricFamily("hybrid_jax_" + name, doc)
            g.add_metric([], v)
            yield g
