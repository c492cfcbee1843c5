"""A request's tokens turned into what its client sees: stop token ids, max_tokens, stop strings,
incremental text and log-probabilities, and the per-step `EngineOutput`.

The scheduler calls `OutputProcessor.append` for each request a step sampled tokens for
(`Scheduler.update_from_output`), finishes the request when `append` set its finish reason, then
asks `output` for what the step reports about it. A stop string ends the output at the token that
completes it, however the steps cut the tokens (text cut before it), so outputs do not depend on
batching. Latency figures (TTFT, ITL) and the generated-token count are recorded here, where the
tokens become the request's.
"""
from __future__ import annotations

from hybrid_jax.engine.detokenize import IncrementalDetokenizer, detokenize_with_stops
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.prompt_logprobs import PromptLogprobsBook
from hybrid_jax.engine.request import EngineOutput, Request


class OutputProcessor:
    """tokenizer: the model's (None: token ids only); detokenize: text for every request (False: only
    for requests with stop strings, which must be checked here; an API front end detokenizes the
    rest); eos_ids: the model's end-of-sequence ids."""

    def __init__(self, tokenizer, detokenize: bool, eos_ids, metrics: EngineMetrics):
        self.tokenizer, self.detokenize, self.metrics = tokenizer, detokenize, metrics
        self.eos_ids = frozenset(eos_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.prompt = PromptLogprobsBook()      # prompt_logprobs requests' entries, until their first output

    def add(self, q: Request):
        if self.tokenizer is not None and (self.detokenize or q.params.stop):
            self._detok[q.request_id] = IncrementalDetokenizer(self.tokenizer, q.params.keep_special_tokens)
        self.prompt.add(q)

    def forget(self, request_id: str):
        self._detok.pop(request_id, None)
        self.prompt.forget(request_id)

    def stop_set(self, q: Request) -> set[int]:
        """The token ids that end the request: its stop_token_ids and, unless ignore_eos, the model's EOS."""
        return set(q.params.stop_token_ids) | (set() if q.params.ignore_eos else set(self.eos_ids))

    def append(self, q: Request, new: list[int], lps, now: float) -> tuple[list[int], str, list[dict]]:
        """Adds a step's sampled tokens to the request, up to the first that ends it (a stop id, its
        max_tokens, a stop string: `q.finish_reason` is then set). lps: the step's (chosen [T], top
        values [T, W], top ids [T, W]) for this row. Returns (tokens kept, text they add, their logprobs).
        Before min_tokens tokens nothing stops the request but max_tokens (as vLLM: the device masks its
        stop ids and EOS until then, and stop strings are not looked for)."""
        stops = self.stop_set(q)
        accepted = []
        for t in new:
            accepted.append(t)
            if t in stops and len(q.output_ids) + len(accepted) >= q.params.min_tokens:
                q.finish_reason = "stop"
                break
            if len(q.output_ids) + len(accepted) >= q.params.max_tokens:
                q.finish_reason = "length"
                break
        old_text = q.text
        detok = self._detok.get(q.request_id)
        if detok is not None:
            accepted = detokenize_with_stops(q, detok, accepted, old_text,
                                             skip=max(0, q.params.min_tokens - len(q.output_ids) - 1))
        if q.first_token_time is None:
            self.metrics.ttft.observe(now - q.arrival)
        elif accepted:
            self.metrics.itl.observe((now - q.last_token_time) / len(accepted))
        q.first_token_time = q.first_token_time or now
        q.last_token_time = now
        new_lps = []
        if q.params.logprobs is not None:
            c, v, ids = lps
            n = q.params.logprobs if q.params.logprobs >= 0 else ids.shape[1]    # -1: the whole vocabulary
            new_lps = [{"token_id": t, "logprob": float(c[j]),
                        "top": list(zip(ids[j, :n].tolist(), v[j, :n].tolist()))}
                       for j, t in enumerate(accepted)]
            q.logprobs += new_lps
        q.output_ids += accepted
        self.metrics.generation_tokens.inc(len(accepted))
        if q.finish_reason is not None:
            self._detok.pop(q.request_id, None)
        new_text = q.text[len(old_text):] if q.text.startswith(old_text) else q.text
        return accepted, new_text, new_lps

    def output(self, q: Request, accepted: list[int], new_text: str, new_lps: list[dict]) -> EngineOutput:
        """What the step reports about the request (after it was finished, if it ended); its first
        carries its prompt_logprobs entries."""
        return EngineOutput(q.request_id, accepted, new_text, list(q.output_ids), q.text, q.finished,
                            q.finish_reason, q.prompt_ids, new_lps, list(q.logprobs) if q.finished else [],
                            prompt_logprobs=self.prompt.take(q))

    @staticmethod
    def failed(q: Request, message: str) -> EngineOutput:
        """The output of a request that failed (finish_reason "error"; the others go on)."""
        return EngineOutput(q.request_id, [], "", list(q.output_ids), q.text, True, "error", q.prompt_ids, [],
                            error=message)
