"""What a router or an orchestrator learns about this server, on the paths they ask.

- `/server_info` and `/model_info` (and SGLang's older `/get_server_info`, `/get_model_info`): the SGLang
  Model Gateway (`sglang-router`) reads them when a worker registers, to label it with its model, its
  tokenizer and its sizes; without them it registers the worker as model "unknown" with no tokenizer.
  The fields are the ones the gateway parses (model_path, served_model_name, tp_size, dp_size,
  disaggregation_mode; tokenizer_path, is_generation, model_type, architectures) plus the engine's
  sizes under SGLang's names (max_total_tokens, max_prefill_tokens, max_running_requests).
- `/liveness` (200 while this process answers HTTP, loading included) and `/readiness` (the same as
  `/health`: 200 once the model is loaded and warm and the engine answers, else 503 with the reason):
  the two probes an orchestrator sets apart, so a long load is not taken for a hung server.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from hybrid_jax.tokenizer import ByteTokenizer


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What the served checkpoint is, read once at start-up: its directory (None: the shipped default
    model), config.json's model_type and architectures, and the layout's sizes."""
    model_path: str | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    @classmethod
    def read(cls, model: str | None, parallel: dict | None = None) -> ModelIdentity:
        """From a checkpoint directory's config.json (absent or unreadable: no type, no architectures)."""
        from hybrid_jax.default_model import checkpoint_dir  # noqa: PLC0415
        path = os.path.join(checkpoint_dir(model), "config.json")
        cfg = {}
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        cfg = cfg if isinstance(cfg, dict) else {}
        arch = cfg.get("architectures")
        p = parallel or {}
        return cls(model_path=checkpoint_dir(model), model_type=cfg.get("model_type"),
                   architectures=tuple(a for a in arch if isinstance(a, str)) if isinstance(arch, list) else (),
                   tensor_parallel_size=p.get("tensor_parallel_size") or 1,
                   data_parallel_size=p.get("data_parallel_size") or 1)


def server_info(state) -> dict:
    """The /server_info body: the configuration's identity, and the engine's sizes once it is loaded."""
    ident, name = state.config.identity, state.config.model_name
    out = {"model_path": ident.model_path or name, "served_model_name": name, "tp_size": ident.tensor_parallel_size,
           "dp_size": ident.data_parallel_size, "version": _version()}
    pd = state.config.disaggregation
    out["disaggregation_mode"] = pd.mode
    if pd.bootstrap_port is not None:
        out["disaggregation_bootstrap_port"] = pd.bootstrap_port
    card = state.engine.model_card() if state.engine is not None else {}
    for ours, theirs in (("max_total_tokens", "max_total_tokens"), ("max_num_batched_tokens", "max_prefill_tokens"),
                         ("max_num_seqs", "max_running_requests"), ("max_model_len", "context_length"),
                         ("kv_block_size", "page_size")):
        if ours in card:
            out[theirs] = card[ours]
    return out


def model_info(state) -> dict:
    """The /model_info body. tokenizer_path is the checkpoint's directory when the server tokenizes with
    the checkpoint's tokenizer (a router loads tokenizer.json from there), else absent."""
    ident = state.config.identity
    out = {"model_path": ident.model_path or state.config.model_name, "is_generation": True,
           "model_type": ident.model_type, "architectures": list(ident.architectures)}
    tok = state.engine.tokenizer if state.engine is not None else None
    if tok is not None and not isinstance(tok, ByteTokenizer) and ident.model_path is not None:
        out["tokenizer_path"] = ident.model_path
    return out


@functools.cache
def _version() -> str:
    """The installed package's version (looked up once: it reads the installed metadata from disk)."""
    try:
        return importlib.metadata.version("hybrid-jax")
    except importlib.metadata.PackageNotFoundError:     # run from a source tree that was not installed
        return "unknown"


def add_routes(app: FastAPI, state, readiness):
    """The routes above; readiness: /health's handler (/readiness answers the same)."""
    @app.get("/server_info")
    @app.get("/get_server_info")
    async def _server_info():
        return server_info(state)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def _model_info():
        return model_info(state)

    @app.get("/liveness")
    async def _liveness():
        return PlainTextResponse("alive")

    app.get("/readiness")(readiness)
