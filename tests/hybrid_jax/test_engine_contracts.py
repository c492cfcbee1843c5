"""The engine's rooms keep their typed contracts (engine/contracts.py): both engine cores offer what
every client steps, both engine clients what the API server reads, and an engine reads nothing of
the LLM facade but the LoadedModel it hands over."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.async_engine import AsyncEngine
from hybrid_jax.engine.contracts import EngineClient, EngineCore, LoadedModel, protocol_members
from hybrid_jax.engine.core_client import EngineCoreClient
from hybrid_jax.engine.data_parallel import DataParallelEngine


@pytest.mark.parametrize("proto,classes", [(EngineCore, (LLMEngine, DataParallelEngine)),
                                           (EngineClient, (AsyncEngine, EngineCoreClient))])
def test_implementations_offer_the_whole_protocol(proto, classes):
    members = protocol_members(proto)
    assert len(members) >= 7, members
    for cls in classes:
        init = inspect.getsource(cls.__init__)       # attributes (pulse, error) are set there
        missing = [m for m in sorted(members) if not hasattr(cls, m) and f"self.{m} =" not in init
                   and f"self.{m}:" not in init]
        assert not missing, f"{cls.__name__} lacks {missing} of {proto.__name__}"


def test_an_engine_serves_a_loaded_model_as_it_serves_the_facade(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint)
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, warmup="none",
                       compilation_cache_dir=None)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    loaded = llm.loaded()
    assert isinstance(loaded, LoadedModel) and loaded.fingerprint() == llm.fingerprint()
    # a LoadedModel of its own: the engine needs no attribute of the facade
    bare = dataclasses.replace(loaded, fingerprint=lambda: "fp-" + loaded.fingerprint())
    want = [o.token_ids for o in LLMEngine(llm, cfg).generate([{"prompt_token_ids": [1, 2, 3, 4]}], sp)]
    assert [o.token_ids for o in LLMEngine(bare, cfg).generate([{"prompt_token_ids": [1, 2, 3, 4]}], sp)] == want


def test_an_engine_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="LoadedModel"):
        LLMEngine(object(), EngineConfig(warmup="none", compilation_cache_dir=None))
