"""Bad input gets a clear error naming the problem, never a traceback from inside jax."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from hybrid_jax import LLM, CheckpointError, ConfigError, InputError, SamplingParams
from hybrid_jax.models.config_common import config_from_hf_dict


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, dtype="float32")


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_missing_weights(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no weights"):
        LLM(model=str(d))


def test_missing_config(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path)
    os.remove(d / "config.json")
    with pytest.raises(ConfigError, match="config.json"):
        LLM(model=str(d))


def test_corrupt_weights(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path)
    with open(d / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        LLM(model=str(d))


def test_truncated_weights(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path)
    size = os.path.getsize(d / "model.safetensors")
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError):
        LLM(model=str(d))


def test_corrupt_config_json(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(model=str(d))


def test_config_disagreeing_with_weights(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has shape"):
        LLM(model=str(d))


def test_unknown_model_type():
    with pytest.raises(ConfigError, match="unknown model_type 'llama_x'"):
        config_from_hf_dict({"model_type": "llama_x"})


def test_unknown_layer_type(tiny_checkpoint):
    cfg = json.loads(open(os.path.join(tiny_checkpoint, "config.json")).read())
    cfg["num_hidden_layers"] = 2
    cfg["layer_types"] = ["linear_attention", "banana_attention"]
    with pytest.raises(ConfigError, match="banana_attention"):
        config_from_hf_dict(cfg)
    cfg["layer_types"] = ["linear_attention", "sliding_attention"]
    with pytest.raises(ConfigError, match=r"\['sliding_attention'\] are not supported yet"):
        config_from_hf_dict(cfg)


def test_missing_config_field():
    with pytest.raises(ConfigError, match="'hidden_size'"):
        config_from_hf_dict({"model_type": "qwen3_next", "num_hidden_layers": 1, "vocab_size": 10,
                             "num_attention_heads": 1})


@pytest.mark.parametrize("ids", [[211], [-1], [3, 5000]])
def test_token_ids_outside_vocabulary(llm, ids):
    with pytest.raises(InputError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2))


def test_empty_prompt(llm):
    with pytest.raises(InputError, match="empty prompt"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=2))
    with pytest.raises(InputError, match="no prompts"):
        llm.generate([], SamplingParams(max_tokens=2))


def test_empty_text_prompt_on_default_model_is_an_empty_prompt():
    # The default model's tokenizer adds no BOS, so "" encodes to no tokens at all.
    with pytest.raises(InputError, match="empty prompt"):
        LLM().generate("", SamplingParams(max_tokens=2, temperature=0))


@pytest.mark.parametrize("kw,msg", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"), (dict(stop_token_ids=[-4]), "stop_token_ids"),
    (dict(logprobs=-2), "logprobs"), (dict(logprobs=21), "logprobs"), (dict(stop=3), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={i: 1 for i in range(301)}), "logit_bias"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output")])
def test_bad_sampling_params(kw, msg):
    with pytest.raises(InputError, match=msg):
        SamplingParams(**kw)


def test_logit_bias_keys_may_be_json_strings():
    assert SamplingParams(logit_bias={"7": -100, 9: 2}).logit_bias == {7: -100.0, 9: 2.0}


def test_none_means_no_stops_as_in_vllm():
    sp = SamplingParams(stop=None, stop_token_ids=None)
    assert sp.stop == [] and sp.stop_token_ids == []


def test_prompt_longer_than_max_model_len(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint, max_model_len=32)
    with pytest.raises(InputError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 30}, SamplingParams(max_tokens=8))


def test_bad_prompt_type(llm):
    with pytest.raises(InputError, match="prompt must be"):
        llm.generate([42], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("kw,msg", [(dict(stop_token_ids=[10**12]), "outside the vocabulary"),
                                    (dict(stop=["s"] * 1000), "at most"), (dict(top_p=1e-46), "rounds to 0"),
                                    (dict(logit_bias={10**9: 1.0}), "outside the vocabulary")])
def test_generate_checks_the_engine_limits_before_queuing(llm, kw, msg):
    with pytest.raises(InputError, match=msg):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}],
                     [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, **kw)])
    assert not llm.engine.has_unfinished()


def test_top_k_past_the_vocabulary_means_all(llm):
    outs = [llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=6, temperature=1.0, top_k=k,
                                                                      seed=2, ignore_eos=True))[0].outputs[0].token_ids
            for k in (-1, 10**12)]
    assert outs[0] == outs[1]
