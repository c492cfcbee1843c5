"""The one table of request fields /v1/completions and /v1/chat/completions know: every field of
OpenAI's Create completion / Create chat completion and of vLLM's CompletionRequest /
ChatCompletionRequest, each either honoured (and what reads it) or refused with a 400 that names it
and says why. A field the table does not list gets OpenAI's own answer ("Unrecognized request
argument supplied: NAME"). Nothing else decides whether a field is accepted: the parsers read only
honoured fields, and the README's list is generated from this table (`markdown()`, checked by a test).

A refused field may still be sent with its inert value (null, or the value that means "off", e.g.
`use_beam_search: false`, `skip_special_tokens: true`): clients that send every default work."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from hybrid_jax.errors import InputError


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"


C, H = frozenset({Endpoint.COMPLETIONS}), frozenset({Endpoint.CHAT})
T, D = frozenset({Endpoint.TOKENIZE}), frozenset({Endpoint.DETOKENIZE})
BOTH = C | H


class Status(enum.Enum):
    HONOURED = "honoured"
    NOT_SUPPORTED = "not supported"
    NOT_YET = "not supported yet"


@dataclasses.dataclass(frozen=True)
class Field:
    """One request field: where it is known, whether it is honoured, and the note the README (for an
    honoured field: what reads it) or the 400 (for a refused one: why) gives."""
    name: str
    endpoints: frozenset
    status: Status
    note: str
    inert: tuple = ()          # refused fields: values accepted because they ask for nothing (null always)

    def refuses(self, value: Any) -> bool:
        if self.status is Status.HONOURED or value is None:
            return False
        return not any(value == v and type(value) is type(v) for v in self.inert)


_S, _N, _Y = Status.HONOURED, Status.NOT_SUPPORTED, Status.NOT_YET
_ENGINE = "SamplingParams (checked there and in engine/limits.py)"

FIELDS: tuple[Field, ...] = (
    # --- the request itself -------------------------------------------------------------------------
    Field("model", BOTH | T | D, _S, "must be the served model's name (else 404)"),
    Field("prompt", C, _S, "a string, a list of token ids, or a list of either (one or more choices per prompt)"),
    Field("prompt", T, _S, "a string to tokenize"),
    Field("messages", H | T, _S, "the chat template (server/chat_template.py)"),
    Field("tokens", D, _S, "token ids to decode"),
    Field("return_token_strs", T, _S, "each token's text beside its id"),
    Field("stream", BOTH, _S, "server-sent events"),
    Field("stream_options", BOTH, _S, "include_usage (a last chunk with `choices: []` and the usage), "
          "continuous_usage_stats (usage on every chunk); only with stream"),
    Field("n", BOTH, _S, "n engine requests per prompt, choice index prompt x n + i"),
    Field("best_of", BOTH, _S, "equal to n (or absent): a larger best_of, ranked by log-probability, is not "
          "supported"),
    Field("user", BOTH, _S, "the admission's per-client share (server/admission.py)"),
    Field("safety_identifier", H, _S, "the admission's per-client share, where `user` is absent"),
    Field("request_id", BOTH, _S, "the response's id (after its cmpl- / chatcmpl- prefix)"),
    # --- sampling -----------------------------------------------------------------------------------
    Field("max_tokens", BOTH, _S, "SamplingParams.max_tokens; absent: the rest of the context (max_model_len - "
          "prompt tokens, at most --max-tokens-limit); 0 only with echo"),
    Field("max_completion_tokens", H, _S, "SamplingParams.max_tokens (the newer name; wins over max_tokens)"),
    Field("temperature", BOTH, _S, "SamplingParams"),
    Field("top_p", BOTH, _S, "SamplingParams"),
    Field("top_k", BOTH, _S, "SamplingParams"),
    Field("min_p", BOTH, _S, _ENGINE),
    Field("seed", BOTH, _S, "SamplingParams; choice i of n gets seed + i (vLLM's parallel sampling)"),
    Field("stop", BOTH, _S, "SamplingParams"),
    Field("stop_token_ids", BOTH, _S, "SamplingParams"),
    Field("ignore_eos", BOTH, _S, "SamplingParams"),
    Field("presence_penalty", BOTH, _S, _ENGINE),
    Field("frequency_penalty", BOTH, _S, _ENGINE),
    Field("repetition_penalty", BOTH, _S, _ENGINE),
    Field("min_tokens", BOTH, _S, _ENGINE),
    Field("logit_bias", BOTH, _S, _ENGINE),
    Field("include_stop_str_in_output", BOTH, _S, _ENGINE),
    Field("prompt_logprobs", BOTH, _S, _ENGINE),
    Field("logprobs", BOTH, _S, "completions: an integer 0..20; chat: true / false (with top_logprobs)"),
    Field("top_logprobs", H, _S, "the chat logprobs' top_logprobs, 0..20"),
    Field("echo", C, _S, "the prompt's text (and with logprobs its log-probabilities) before each choice's own"),
    Field("return_tokens_as_token_ids", BOTH, _S, "logprobs name tokens as `token_id:N`"),
    Field("response_format", BOTH, _S, "text, json_object, json_schema (its schema): a structured output "
          "(server/structured_fields.py)"),
    Field("structured_outputs", BOTH, _S, "vLLM's: json, regex, choice, grammar (Lark or GBNF), json_object, "
          "whitespace_pattern"),
    Field("guided_json", BOTH, _S, "vLLM's older spelling of structured_outputs.json"),
    Field("guided_regex", BOTH, _S, "vLLM's older spelling of structured_outputs.regex"),
    Field("guided_choice", BOTH, _S, "vLLM's older spelling of structured_outputs.choice"),
    Field("guided_grammar", BOTH, _S, "vLLM's older spelling of structured_outputs.grammar"),
    Field("guided_whitespace_pattern", BOTH, _S, "with guided_json: the whitespace JSON may hold"),
    Field("guided_decoding_backend", BOTH, _S, "auto, llguidance or guidance (this server's grammars); another is "
          "a 400"),
    # --- chat templates (server/chat_template.py) ---------------------------------------------------
    Field("chat_template", H | T, _S, "the chat template"),
    Field("chat_template_kwargs", H | T, _S, "the chat template"),
    Field("add_generation_prompt", H | T, _S, "the chat template"),
    Field("continue_final_message", H | T, _S, "the chat template"),
    Field("tools", H | T, _S, "the chat template; with tool_choice auto, calls are parsed out of the output "
          "in the model family's format (server/tool_parsers/)"),
    Field("tool_choice", H, _S, "auto (default with tools): calls parsed into `message.tool_calls`; none: text "
          "only; required / a named function: enforced by the family's tool-call grammar"),
    Field("parallel_tool_calls", H, _S, "false: one call (required / named: the grammar allows one; auto: the "
          "first parsed is kept)"),
    Field("include_reasoning", H, _S, "false: the reasoning (`reasoning_content`) is dropped from the response"),
    Field("documents", H | T, _S, "the chat template"),
    Field("add_special_tokens", C | T, _S, "the prompt's tokenization (default true: the tokenizer's BOS); "
          "/tokenize with messages: as on chat"),
    # --- refused --------------------------------------------------------------------------------------
    Field("add_special_tokens", H, _Y, "the chat template decides the special tokens", (False,)),
    Field("suffix", C, _N, "this server serves no fill-in-the-middle models", ("",)),
    Field("prompt_embeds", C, _N, "prompts are text or token ids"),
    Field("echo", H, _N, "vLLM's chat echo (the last message prepended) is not implemented", (False,)),
    Field("use_beam_search", BOTH, _N, "beam search is not implemented", (False,)),
    Field("length_penalty", BOTH, _N, "it applies to beam search only", (1, 1.0)),
    Field("skip_special_tokens", BOTH, _Y, "the output text always skips special tokens", (True,)),
    Field("spaces_between_special_tokens", BOTH, _Y, "the output text always skips special tokens", (True,)),
    Field("truncate_prompt_tokens", BOTH, _Y, "prompts are never truncated"),
    Field("allowed_token_ids", BOTH, _Y, "no allowed-token mask yet"),
    Field("bad_words", H, _Y, "no bad-words filter yet", ([],)),
    Field("logits_processors", BOTH, _N, "no user code runs in the engine"),
    Field("structural_tag", H, _Y, "xgrammar's structural tags: send a grammar, or tools with tool_choice"),
    Field("priority", BOTH, _N, "the engine schedules first come, first served", (0,)),
    Field("cache_salt", BOTH, _Y, "the prefix cache has no per-request salt"),
    Field("kv_transfer_params", BOTH, _N, "vLLM's connector parameters: disaggregation here follows the SGLang "
          "gateway's `bootstrap_room` (`--disaggregation-mode`)"),
    Field("vllm_xargs", BOTH, _N, "no custom extensions"),
    Field("mm_processor_kwargs", H | T, _N, "this server serves text-only models"),
    Field("reasoning_effort", H, _N, "send the model's own switch in chat_template_kwargs (e.g. enable_thinking)"),
    Field("functions", H, _N, "deprecated by OpenAI: use tools"),
    Field("function_call", H, _N, "deprecated by OpenAI: use tool_choice"),
    Field("audio", H, _N, "this server serves text-only models"),
    Field("modalities", H, _N, "this server serves text-only models", (["text"],)),
    Field("prediction", H, _N, "predicted outputs are not implemented"),
    Field("store", H, _N, "this server stores no completions", (False,)),
    Field("metadata", H, _N, "this server stores no completions", ({},)),
    Field("service_tier", H, _N, "one tier", ("auto", "default")),
    Field("web_search_options", H, _N, "no web search"),
    Field("verbosity", H, _N, "no verbosity control"),
    Field("moderation", H, _N, "no moderation"),
    Field("prompt_cache_key", H, _N, "the prefix cache is automatic and needs no key"),
    Field("prompt_cache_retention", H, _N, "the prefix cache's retention is the server's"),
    Field("prompt_cache_options", H, _N, "the prefix cache's retention is the server's"),
    # --- SGLang's extensions, which the SGLang Model Gateway writes into every request it forwards -----
    Field("no_stop_trim", BOTH, _Y, "a stop string is always trimmed from the output", (False,)),
    Field("return_hidden_states", BOTH, _N, "hidden states are not returned", (False,)),
    Field("separate_reasoning", H, _Y, "with a reasoning parser the reasoning is always separated (drop it with "
          "include_reasoning: false)", (True,)),
    Field("stream_reasoning", H, _Y, "the reasoning streams as it is generated", (True,)),
    Field("bootstrap_room", BOTH, _S, "prefill/decode disaggregation (`--disaggregation-mode`): the room a "
          "prefill server hands the prompt's cache to and its decode server takes it from (server/disaggregation.py)"),
    Field("bootstrap_host", BOTH, _S, "prefill/decode disaggregation: the prefill server's address; accepted and "
          "not used (the cache goes through the shared `--kv-cache-dir`)"),
    Field("bootstrap_port", BOTH, _S, "prefill/decode disaggregation: the prefill server's bootstrap port; "
          "accepted and not used"),
)

_BY_ENDPOINT: dict[Endpoint, dict[str, Field]] = {
    e: {f.name: f for f in FIELDS if e in f.endpoints} for e in Endpoint}


def field(endpoint: Endpoint, name: str) -> Field | None:
    return _BY_ENDPOINT[endpoint].get(name)


def check_fields(data: dict[str, Any], endpoint: Endpoint):
    """InputError for the first field the table does not know on this endpoint, or refuses."""
    known = _BY_ENDPOINT[endpoint]
    for name, value in data.items():
        f = known.get(name)
        if f is None:
            raise InputError(f"Unrecognized request argument supplied: {name}")
        if f.refuses(value):
            raise InputError(f"'{name}' is {f.status.value} on {endpoint.value}: {f.note}")


def markdown(indent: str = "") -> str:
    """The README's table of request fields (README.md, "Request fields", indented by two spaces
    there), made from FIELDS."""
    rows = ["| field | " + " | ".join(e.value for e in Endpoint) + " | notes |", "|---" * (len(Endpoint) + 2) + "|"]
    names = list(dict.fromkeys(f.name for f in FIELDS))
    for name in names:
        cells = []
        for e in Endpoint:
            f = field(e, name)
            cells.append("-" if f is None else f.status.value)
        notes = list(dict.fromkeys(f.note for e in Endpoint if (f := field(e, name)) is not None))
        rows.append(f"| `{name}` | {' | '.join(cells)} | {'; '.join(notes)} |")
    return "\n".join(indent + r for r in rows)
