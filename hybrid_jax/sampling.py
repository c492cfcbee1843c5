"""Sampling parameters (vLLM's shape) and on-device sampling.

Per-row temperature, top-k, top-p and seed are arrays, so one compiled step serves a batch whose
requests sample differently. `temperature == 0` is greedy. Which filters run at all (top-k, top-p)
is a static switch decided on the host from the batch, so a greedy batch never sorts the vocab.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cache.handoff import KVTransfer
from hybrid_jax.errors import InputError
from hybrid_jax.logits_processors import apply_min_p
from hybrid_jax.structured.params import StructuredOutputsParams


MAX_LOGIT_BIAS = 300      # entries of one request's logit_bias (OpenAI's limit)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


@dataclasses.dataclass
class SamplingParams:
    """vLLM's sampling parameters. `logprobs=n` returns the sampled token's log-probability and the
    n most likely ones at each step (of the model's distribution, before temperature and filters);
    `logprobs=-1` returns the whole vocabulary's, most likely first (as vLLM: `hybrid-jax eval` reads
    next-token distributions so)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1               # -1 or 0: no top-k filter
    seed: int | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    # logits processors (applied on the device before temperature and the filters; `logprobs` stays the
    # model's own distribution): penalties on tokens already generated (presence: once, frequency: per
    # occurrence; OpenAI's) and on tokens of the prompt or the output (repetition: logits > 0 divided by
    # it, < 0 multiplied; 1 = off; the CTRL paper's, as vLLM and transformers apply it)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0            # drop tokens whose probability is under min_p x the most likely's
    min_tokens: int = 0           # no stop token id (nor EOS) and no stop string before this many tokens
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100]
    include_stop_str_in_output: bool = False     # a stop string that ends the output stays in its text
    prompt_logprobs: int | None = None   # per prompt token (after the first): its logprob and the top n
    # the output held to a grammar (a JSON schema, any JSON object, a regex, a choice, a Lark / GBNF grammar):
    # hybrid_jax/structured; a dict is read as StructuredOutputsParams(**it)
    structured_outputs: StructuredOutputsParams | None = None
    # special tokens (by their text) the output text keeps although special tokens are skipped: the
    # markers the chat endpoint's tool-call / reasoning parser reads (server/chat_output.py)
    keep_special_tokens: tuple[str, ...] = ()
    # prefill/decode disaggregation (vLLM's kv_transfer_params): this request hands its prompt's cache
    # over ("send") or takes one ("receive"); cache/handoff.py. Set by the server, not by clients.
    kv_transfer: KVTransfer | None = None

    def __post_init__(self):
        self.validate()

    def validate(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InputError(f"max_tokens must be a positive integer; got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise InputError(f"temperature must be a finite number >= 0; got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InputError(f"top_k must be -1 (off), 0 (off) or a positive integer; got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InputError(f"seed must be a non-negative integer; got {self.seed!r}")
        if self.stop is None:                      # vLLM's Optional spelling of "none"
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise InputError(f"stop must be a list of non-empty strings; got {self.stop!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not -1 <= self.logprobs <= 20):
            raise InputError(f"logprobs must be an integer in [0, 20], or -1 for the whole vocabulary; got "
                             f"{self.logprobs!r}")
        if not isinstance(self.keep_special_tokens, (tuple, list)) or not all(
                isinstance(t, str) and t for t in self.keep_special_tokens):
            raise InputError(f"keep_special_tokens must be a list of token strings; got {self.keep_special_tokens!r}")
        self.keep_special_tokens = tuple(self.keep_special_tokens)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InputError(f"stop_token_ids must be a list of non-negative integers; got {self.stop_token_ids!r}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise InputError(f"stop_token_ids must be non-negative integers; got {bad}")
        self._validate_processors()
        if isinstance(self.kv_transfer, dict):       # as dataclasses.asdict wrote it (parallel/hosts.py)
            self.kv_transfer = KVTransfer(**self.kv_transfer)
        if self.kv_transfer is not None and not isinstance(self.kv_transfer, KVTransfer):
            raise InputError(f"kv_transfer must be a KVTransfer; got {type(self.kv_transfer).__name__}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InputError(f"structured_outputs must be StructuredOutputsParams or a dict; got "
                             f"{type(self.structured_outputs).__name__}")

    def _validate_processors(self):
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _real(v) or not -2.0 <= v <= 2.0:
                raise InputError(f"{name} must be a number in [-2, 2]; got {v!r}")
        if not _real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise InputError(f"repetition_penalty must be a number in (0, 100] (1 is off); got "
                             f"{self.repetition_penalty!r}")
        if not _real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min_p must be a number in [0, 1]; got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}]; got "
                             f"{self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InputError(f"logit_bias must map token ids to numbers; got {self.logit_bias!r}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InputError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:                      # JSON keys are strings: "50256": -100
                    t = int(k)
                except (TypeError, ValueError):
                    raise InputError(f"logit_bias keys must be token ids; got {k!r}") from None
                if t < 0 or not _real(v) or not -100.0 <= v <= 100.0:
                    raise InputError(f"logit_bias[{k!r}] must be a number in [-100, 100] for a token id >= 0; "
                                     f"got {v!r}")
                bias[t] = float(v)
            self.logit_bias = bias or None
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InputError(f"include_stop_str_in_output must be true or false; got "
                             f"{self.include_stop_str_in_output!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or
                                                 isinstance(self.prompt_logprobs, bool) or
                                                 not -1 <= self.prompt_logprobs <= 20):
            raise InputError(f"prompt_logprobs must be an integer in [0, 20], or -1 for the whole vocabulary; "
                             f"got {self.prompt_logprobs!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor is on (penalties, min_p, min_tokens, logit_bias)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_p > 0 or self.min_tokens > 0 or bool(self.logit_bias))


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static facts of a batch: which code paths the compiled sampler needs."""
    any_random: bool
    use_top_k: bool
    use_top_p: bool

    @staticmethod
    def of(params: list[SamplingParams]) -> "SamplerFlags":
        rnd = [p for p in params if p.temperature > 0]
        return SamplerFlags(any_random=bool(rnd), use_top_k=any(p.top_k > 0 for p in rnd),
                            use_top_p=any(p.top_p < 1.0 for p in rnd))


# The engine's sampler: one program serves every mix of greedy / temperature / top-k / top-p rows, so
# a request's sampling parameters never cause a compile.
FULL_SAMPLER = SamplerFlags(any_random=True, use_top_k=True, use_top_p=True)


def _filter(x: jax.Array, top_k: jax.Array, top_p: jax.Array, flags: SamplerFlags) -> jax.Array:
    """Masks logits outside each row's top-k set and top-p nucleus to -inf. x: [B, V]."""
    V = x.shape[-1]
    sorted_x = -jnp.sort(-x, axis=-1)                                   # descending
    if flags.use_top_k:
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
        kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
        x = jnp.where(x < kth, -jnp.inf, x)
        sorted_x = jnp.where(jnp.arange(V)[None] < k[:, None], sorted_x, -jnp.inf)
    if flags.use_top_p:
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                    # mass strictly above each entry
        keep = before < top_p[:, None]                                  # always keeps the top entry
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """jnp.argmax(logits, axis=-1) as int32 (the first maximum; the first NaN where there is one),
    computed as a max and then a min over the positions that reach it: two plain reductions, which
    XLA:CPU vectorises, where argmax's (value, index) reduction runs element by element. Batch-8
    decode step over 2048 logits: 26 against 117 us; a [8, 33, 2048] verify window: 312 against
    1242 us. logits: [..., V] -> [...] int32."""
    V = logits.shape[-1]
    m = jnp.max(logits, axis=-1, keepdims=True)
    pos = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where((logits == m) | jnp.isnan(logits), pos, V), axis=-1)


def sample(logits: jax.Array, keys: jax.Array, step: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, flags: SamplerFlags, min_p: jax.Array | None = None) -> jax.Array:
    """logits: [B, V] fp32; keys: [B] typed PRNG keys; step: int, scalar or [B] (the row's count of
    generated tokens, so a row draws the same numbers however it is batched); temperature, top_p: [B] f32;
    top_k: [B] int32 (<= 0 means off); min_p: [B] f32 (0 off; None: no row has it), applied after the
    temperature and before top-k / top-p, as vLLM. Returns token ids [B] int32.

    `flags` says which paths exist in the program; inside it, run-time conds skip the vocabulary
    sort when no row filters and the draw when every row is greedy, so one compiled sampler serves
    any mix of requests at the cost of what the batch actually asks for."""
    greedy = greedy_tokens(logits)
    if not flags.any_random:
        return greedy

    def draw(logits):
        t = jnp.where(temperature > 0, temperature, 1.0)
        x = logits / t[:, None]
        if min_p is not None:
            x = jax.lax.cond(jnp.any((temperature > 0) & (min_p > 0)), lambda x: apply_min_p(x, min_p), lambda x: x, x)
        if flags.use_top_k or flags.use_top_p:
            filtering = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1.0)))
            x = jax.lax.cond(filtering, lambda x: _filter(x, top_k, top_p, flags), lambda x: x, x)
        steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys.shape)
        step_keys = jax.vmap(jax.random.fold_in)(keys, steps)
        return jax.vmap(jax.random.categorical)(step_keys, x).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, logits)
    return jnp.where(temperature > 0, drawn, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int, want: jax.Array | None = None):
    """Log-probabilities of the model's distribution. logits: [B, V]; tokens: [B]; want [B] bool: the
    rows that asked for their top log-probabilities (a runtime input: the top-n is computed only when
    any did, zeros otherwise; None: always). Returns (sampled [B], top values [B, top_n], top ids
    [B, top_n])."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    B = logits.shape[0]
    if top_n == 0:
        return chosen, jnp.zeros((B, 0), jnp.float32), jnp.zeros((B, 0), jnp.int32)

    def top(x):
        vals, ids = jax.lax.top_k(x, top_n)
        return vals, ids.astype(jnp.int32)

    if want is None:
        return (chosen, *top(lp))
    vals, ids = jax.lax.cond(jnp.any(want), top,
                             lambda x: (jnp.zeros((B, top_n), jnp.float32), jnp.zeros((B, top_n), jnp.int32)), lp)
    return chosen, vals, ids
