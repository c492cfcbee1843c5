"""What routers and orchestrators read from a server (server/worker_info.py, engine/metrics.py): the SGLang
Model Gateway's worker discovery (/server_info, /model_info and their /get_* aliases), the Gateway API
Inference Extension's gauges under vLLM's names beside this project's own, and the liveness / readiness
probes, on an in-process app over a real engine on the tiny checkpoint."""
from __future__ import annotations

import os
import re
import shutil

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models

from hybrid_jax import LLM
from hybrid_jax.engine import EngineConfig
from hybrid_jax.engine.metrics import ROUTER_GAUGES, EngineMetrics
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.server.worker_info import ModelIdentity
from in_process import serving

KEY = "k"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("worker_info") / "ckpt")
    shutil.copytree(tiny_checkpoint, path)          # with a tokenizer of its own, as a release has
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "hi"])}, unk_token="[UNK]")).save(
        os.path.join(path, "tokenizer.json"))
    ident = ModelIdentity.read(path, {"tensor_parallel_size": 1, "data_parallel_size": 1})
    with serving(LLM(model=path), EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                               compilation_cache_dir=None, warmup="none"),
                 ServerConfig(model_name="tiny", api_key=KEY, identity=ident), H) as (c, app, state):
        yield c, state, path


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_server_and_model_info_name_the_checkpoint_its_tokenizer_and_sizes(served):
    c, state, path = served
    info = c.get("/server_info").json()
    assert c.get("/get_server_info").json() == info
    assert info["model_path"] == path and info["served_model_name"] == "tiny"
    assert (info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (1, 1, "null")
    assert (info["max_running_requests"], info["max_prefill_tokens"], info["context_length"]) == (4, 32, 128)
    runner = state.engine.engine.engine.runner
    pages = [g.page_tokens * g.num_units for g in runner.geometry() if g.paged]
    assert info["page_size"] == 64 and info["max_total_tokens"] == min(pages) // 64 * 64 > 0
    model = c.get("/model_info").json()
    assert c.get("/get_model_info").json() == model
    assert model == {"model_path": path, "tokenizer_path": path, "is_generation": True, "model_type": "qwen3_next",
                     "architectures": ["Qwen3NextForCausalLM"]}


def test_info_paths_are_behind_the_api_key(served):
    c, _, _ = served
    with TestClient(c.app) as bare:
        for p in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            assert bare.get(p).status_code == 401, p
        assert bare.get("/liveness").status_code == 200 and bare.get("/readiness").status_code == 200


def test_router_gauges_carry_this_projects_figures_under_vllms_names(served):
    c, state, _ = served
    text = c.get("/metrics").text
    for ours, theirs in (("hybrid_jax_num_requests_waiting", ROUTER_GAUGES["waiting"]),
                         ("hybrid_jax_num_requests_running", ROUTER_GAUGES["running"]),
                         ("hybrid_jax_kv_cache_usage_ratio", ROUTER_GAUGES["kv_usage"])):
        assert _gauge(text, theirs) == _gauge(text, ours)
    info = c.get("/server_info").json()
    assert (f'vllm:cache_config_info{{block_size="64",num_gpu_blocks="{info["max_total_tokens"] // 64}"}} 1.0'
            in text)


def test_kv_usage_is_the_fullest_paged_group_not_a_recurrent_slot_group():
    m = EngineMetrics()
    m.bind(lambda: {"waiting": 3, "running": 2, "cache_usage": {"full_attention": 0.25, "linear_attention": 0.9},
                    "paged_groups": {"full_attention"}, "cache_config": (64, 10)})
    text = m.render().decode()
    assert _gauge(text, "vllm:num_requests_waiting") == 3 and _gauge(text, "vllm:num_requests_running") == 2
    assert _gauge(text, "vllm:kv_cache_usage_perc") == 0.25
    assert 'vllm:cache_config_info{block_size="64",num_gpu_blocks="10"} 1.0' in text


def test_liveness_answers_while_loading_and_readiness_is_health(tiny_checkpoint):
    state = ServerState(ServerConfig(model_name="tiny", identity=ModelIdentity.read(tiny_checkpoint)))
    with TestClient(build_app(state)) as c:         # no engine yet: the model is loading
        assert c.get("/liveness").status_code == 200
        r, h = c.get("/readiness"), c.get("/health")
        assert r.status_code == h.status_code == 503 and r.text.startswith("loading")
        info = c.get("/server_info").json()       # the identity is known before the engine
        assert info["model_path"] == tiny_checkpoint and "max_total_tokens" not in info
        assert "tokenizer_path" not in c.get("/model_info").json()      # not loaded yet
        state.draining = True
        assert c.get("/readiness").status_code == 503 and c.get("/liveness").status_code == 200
