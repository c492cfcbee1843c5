"""Shared fixtures: tiny random Qwen3-Next checkpoints written with transformers' save_pretrained.

Nothing is downloaded: HF_HUB_OFFLINE=1 is set before transformers is imported.
"""
from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The TPU compiler (libtpu, the `tpu-aot` extra) may be installed for the AOT compile tests. Without a
# TPU, JAX would still probe for one in every process that touches a device (noise on stderr, and a
# /tmp lock file that libtpu takes per process): the suite runs on the CPU and reaches the TPU compiler
# only through jax.experimental.topologies, which works with JAX_PLATFORMS=cpu. The lock must not stop
# two test workers (or another job on the machine) from compiling for a TPU at the same time.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The suite's time is mostly XLA compiling tiny models (about 2 s a program at the default level,
# the programs themselves run in milliseconds). Codegen without LLVM's expensive passes computes
# the same values and compiles about a third faster; XLA:CPU's older loop emitters (instead of the
# MLIR fusion emitters) compile the same programs 2.5x faster again (an engine's 35 step programs:
# 7.6 s against 19.6 s, the same tokens). Subprocesses and notebook kernels inherit the flags.
_FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()

# Most of the suite's programs are compiled again and again: every test builds its own engine, whose
# jitted functions are new objects, and the server, notebook kernels and child processes start cold.
# One persistent compilation cache for the whole run (created by the first process, inherited by
# pytest-xdist workers and every subprocess through the environment) compiles each distinct program
# once; a hit loads the same executable, so no result changes. A cache the caller set up is kept
# (.ci/run gives both tiers one, so the slow tier loads what the README's command compiled).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybrid_jax_tests_xla_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Programs that compile in under half a second are not worth a write (the kernel tests compile
# hundreds of them: caching every one made those tests half again slower).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A size limit turns on JAX's file lock around reads and writes: the workers share the directory.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import gc  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# XLA:CPU maps every compiled kernel into the process as its own small code / data / read-only
# regions (about 3 memory maps per fusion, 60 for a 20-layer program), and the kernel's maps live
# as long as the executable. Jitted module-level functions (the verify step, the device loop, the
# offline forward) keep one executable per static argument set -- every tiny config a test builds --
# until the process ends. In one test worker the count reached 46,782 maps after three test files;
# past the kernel's limit (vm.max_map_count, 65,530 by default) the next mmap fails inside LLVM and
# the worker dies of a segmentation fault in whatever it was compiling. Each test file therefore
# starts from an empty set of compiled programs, and the report header names the limit.
_MAP_LIMIT_FILE = "/proc/sys/vm/max_map_count"


def _map_limit() -> int | None:
    try:
        with open(_MAP_LIMIT_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def pytest_report_header(config):
    limit = _map_limit()
    return None if limit is None else f"vm.max_map_count: {limit} (XLA:CPU takes ~3 maps per compiled kernel)"


# The files that take a test worker longest (seconds of one worker in a full run on 2 cores: 100-400 s each),
# collected first: `-n 2 --dist loadfile` hands out files in collection order as workers free up, so the
# long ones start early and the short ones fill in, rather than one long file running alone at the end.
LONGEST_FIRST = ("hybrid_jax/test_parallel_models.py", "hybrid_jax/test_glm_moe_dsa.py", "hybrid_jax/test_mtp.py",
                 "hybrid_jax/test_model_baselines.py", "hybrid_jax/test_kimi_linear.py",
                 "hybrid_jax/test_prefix_traffic.py", "hybrid_jax/test_parallel.py", "hybrid_jax/test_plan.py",
                 "hybrid_jax/test_startup.py", "hybrid_jax/test_speculative.py",
                 "hybrid_jax/test_v4_prefix_caching.py", "hybrid_jax/test_nemotron_h.py",
                 "pallas_kernels/test_kda_pallas.py", "pallas_kernels/test_tpu_compile.py",
                 "hybrid_jax/test_reserve_before_schedule.py", "hybrid_jax/test_structured.py",
                 "hybrid_jax/test_eval.py", "hybrid_jax/test_qwen4_exp.py")

# The slow tier (`-m slow`, about 2,600 worker-seconds): multi-device and multi-process workers, TPU compiles
# and their cost baselines, speculative-decoding and traffic matrices over every family, the CLI's eval.
# The README's test command leaves it out (`-m "not slow"`: under 30 minutes on 2 cores); CI runs both.
SLOW_FILES = frozenset({
    "hybrid_jax/test_parallel_models.py", "hybrid_jax/test_parallel.py", "hybrid_jax/test_parallel_ops.py",
    "hybrid_jax/test_data_parallel.py", "hybrid_jax/test_many_hosts.py", "hybrid_jax/test_mtp.py",
    "hybrid_jax/test_speculative.py", "hybrid_jax/test_model_baselines.py", "hybrid_jax/test_plan.py",
    "pallas_kernels/test_tpu_compile.py", "pallas_kernels/test_tpu_compile_f32.py", "pallas_kernels/test_kda_pallas.py",
    "hybrid_jax/test_prefix_traffic.py", "hybrid_jax/test_v4_prefix_caching.py",
    "hybrid_jax/test_reserve_before_schedule.py", "hybrid_jax/test_pool_state_machine.py", "hybrid_jax/test_eval.py",
    "hybrid_jax/test_sglang_gateway.py", "hybrid_jax/test_pd_gateway.py", "hybrid_jax/test_qwen4_exp_plan.py",
    "hybrid_jax/test_handoff.py", "hybrid_jax/test_qwen4_exp_long_context.py",
})


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier (tests/conftest.py SLOW_FILES); CI runs it after the "
                                       "README's command")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def path(item):
        return item.nodeid.split("::")[0].removeprefix("tests/")
    for item in items:
        if path(item) in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: rank.get(path(item), len(rank)))   # stable: the others keep their order


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test file: drop every jit cache (and the executables, with their memory maps)."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=1024,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)

# Tiny configs covering the axes: all-linear and mixed layer patterns, GQA ratios,
# HV != H and HV == H, MoE and dense MLP layers, tied embeddings.
CONFIGS = {
    "mixed_moe_gqa2_hv2": dict(layer_types=["linear_attention", "linear_attention", "linear_attention",
                                            "full_attention"], mlp_only_layers=[1]),
    "all_linear_dense": dict(layer_types=["linear_attention"] * 3, num_hidden_layers=3, num_experts=0,
                             linear_num_key_heads=2, linear_num_value_heads=2),
    "attn_first_gqa4_tied": dict(layer_types=["full_attention", "linear_attention", "full_attention"],
                                 num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                 linear_num_key_heads=1, linear_num_value_heads=4, decoder_sparse_step=2,
                                 tie_word_embeddings=True),
}


def save_random_checkpoint(model_cls, config, path, seed: int = 0, biases: bool = True) -> str:
    """A transformers model of `config`, random (torch seed `seed`), with its norm weights (and, with
    `biases`, its biases and buffers ending in "bias", e.g. a router's correction bias) moved off their
    initial values, so that a wrong norm or bias formula shows up; saved with save_pretrained."""
    import torch  # noqa: PLC0415
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + (list(model.named_buffers()) if biases else []):
            if "norm" in name or (biases and name.endswith("bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


def make_checkpoint(path, seed: int = 0, **overrides):
    """Writes a random Qwen3-Next checkpoint with transformers; returns the path."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: PLC0415
    return save_random_checkpoint(Qwen3NextForCausalLM, Qwen3NextConfig(**{**BASE, **overrides}), path, seed,
                                  biases=False)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> checkpoint directory, for every config in CONFIGS."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(root / name, seed=i, **kw) for i, (name, kw) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoints):
    return checkpoints["mixed_moe_gqa2_hv2"]


def hf_model(path):
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly from [0, vocab) with numpy seed `seed`."""
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def rel_rms(got, ref) -> float:
    """Relative RMS error of got against ref."""
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))


def hf_greedy(hf, prompt, n: int) -> list[int]:
    """transformers' n greedy tokens after `prompt` by full recompute (its no-cache forward, once per token)."""
    import torch  # noqa: PLC0415
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_logits_match_transformers(llm, hf, lengths, max_rel_rms: float, tol: float):
    """For random prompts of each length, the logits at every position (`llm.logits`) against the
    transformers model's within `max_rel_rms` relative RMS and `tol` max abs."""
    import torch  # noqa: PLC0415
    for n in lengths:
        ids = random_prompt(n, llm.config.vocab_size, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        got = llm.logits(ids)
        assert rel_rms(got, ref) < max_rel_rms, f"T={n}: relative RMS error {rel_rms(got, ref):.3e}"
        assert np.max(np.abs(got - ref)) < tol, f"T={n}: max abs logit error {np.max(np.abs(got - ref)):.3e}"


def assert_decode_and_chunks_equal_recompute(llm, ids: list[int], tol: float):
    """A 90-token prompt stepped as the engine steps it, each step's logits against full recompute
    (`llm.logits`) within `tol`: ids[:40] in a 64-token bucket, ids[40:70] as one chunk in a 32-token
    bucket (logits at every position), then one-token decodes to the end."""
    import jax.numpy as jnp  # noqa: PLC0415
    gen = llm.generator
    full = llm.logits(ids)
    tok = np.zeros((1, 64), np.int32)
    tok[0, :40] = ids[:40]
    out = gen._forward(gen.params, gen.new_cache(1, 128), jnp.asarray(tok), jnp.asarray([40], jnp.int32))
    np.testing.assert_allclose(np.asarray(out.logits[0]), full[39], atol=tol, rtol=0)
    tok = np.zeros((1, 32), np.int32)
    tok[0, :30] = ids[40:70]
    out = gen._forward(gen.params, out.cache, jnp.asarray(tok), jnp.asarray([30], jnp.int32), logits_at="all")
    np.testing.assert_allclose(np.asarray(out.logits[0, :30]), full[40:70], atol=tol, rtol=0)
    cache = out.cache
    for i in range(70, 90):
        out = gen._forward(gen.params, cache, jnp.asarray([[ids[i]]], jnp.int32), jnp.asarray([1], jnp.int32))
        cache = out.cache
        np.testing.assert_allclose(np.asarray(out.logits[0]), full[i], atol=tol, rtol=0, err_msg=f"decode at {i}")
    assert int(cache.lengths[0]) == 90


def family_checkpoints(config_cls: str, model_cls: str, base: dict, configs: dict, tag: str, make=None):
    """What a family's test module against transformers starts from: (make_checkpoint, checkpoints,
    pair). make_checkpoint(path, seed, **overrides) writes a random transformers checkpoint of the
    family (`config_cls` / `model_cls`, names in transformers) from base + overrides
    (`save_random_checkpoint`; `make`, the same signature, writes it instead when a family needs its own
    initialisation); `checkpoints`, a module fixture, one per entry of `configs` (seed = its index);
    `pair`, a module fixture parametrised over `configs`: (LLM in float32, transformers model)."""
    def make_checkpoint(path, seed: int = 0, **overrides):
        if make is not None:
            return make(path, seed, **overrides)
        import transformers  # noqa: PLC0415
        config = getattr(transformers, config_cls)(**{**base, **overrides})
        return save_random_checkpoint(getattr(transformers, model_cls), config, path, seed)

    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory):
        root = tmp_path_factory.mktemp(tag)
        return {k: make_checkpoint(root / k, seed=i, **kw) for i, (k, kw) in enumerate(configs.items())}

    @pytest.fixture(scope="module", params=sorted(configs))
    def pair(request, checkpoints):
        from hybrid_jax import LLM  # noqa: PLC0415
        path = checkpoints[request.param]
        return LLM(model=path, dtype="float32"), hf_model(path)

    return make_checkpoint, checkpoints, pair


def zero_stored_objects(engine):
    """Zeroes, in the engine's pools, every page and checkpoint unit its prefix store holds (versions
    untouched): a negative control showing that a hit really reads what was stored."""
    import jax.numpy as jnp  # noqa: PLC0415
    from cache.prefix_store import stored_fields  # noqa: PLC0415
    units: dict[str, list[int]] = {}
    for g, u in engine.prefix.store.units.values():
        units.setdefault(g, []).append(u)
    cache = engine.runner.cache
    groups = dict(cache.groups)
    for g, ids in units.items():
        grp = groups[g]
        upd = {f: getattr(grp, f).at[(slice(None),) * ax + (jnp.asarray(ids),)].set(0)
               for f, ax in stored_fields(grp).items()}
        groups[g] = grp.replace(**upd)
    engine.runner.cache = cache.replace(groups=groups)


def greedy_reference(llm, prompt, n: int, stop_ids=()) -> list[int]:
    """Greedy continuation by full recomputation, one forward over the whole sequence per token (no
    cache, pages, batching or chunking): what the engine's greedy outputs are held to."""
    import numpy as np  # noqa: PLC0415
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(np.argmax(llm.logits(ids)[-1]))
        out.append(t)
        ids.append(t)
        if t in stop_ids:
            break
    return out


def stop_process(proc, timeout: float = 20.0) -> None:
    """SIGTERM a server the test started (it drains), then SIGKILL if it is still up after `timeout`."""
    import subprocess  # noqa: PLC0415
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def check_cost_baselines(path, measured: dict, about: str, tolerance: float = 1.05) -> None:
    """Compiled costs held to their record: measured {case: {"flops", "bytes_accessed"}} may not rise more
    than `tolerance` over the JSON file at `path`, and every case needs a record. With UPDATE_TPU_BASELINES=1
    the file is rewritten from `measured` first (after a deliberate change; commit it with the change)."""
    import json  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import libtpu  # noqa: PLC0415
    path = pathlib.Path(path)
    if os.environ.get("UPDATE_TPU_BASELINES"):
        path.write_text(json.dumps({
            "about": about, "jax": jax.__version__, "libtpu": getattr(libtpu, "__version__", "unknown"),
            "cases": {k: {"flops": v["flops"], "bytes_accessed": v["bytes_accessed"]} for k, v in measured.items()},
        }, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(path.read_text())["cases"]
    missing = sorted(set(measured) - set(recorded))
    assert not missing, f"cases without a baseline (regenerate {path.name}): {missing}"
    worse = {k: {m: (recorded[k][m], measured[k][m]) for m in ("flops", "bytes_accessed")
                 if measured[k][m] > tolerance * recorded[k][m]} for k in measured}
    worse = {k: v for k, v in worse.items() if v}
    assert not worse, f"compiled cost rose more than {tolerance - 1:.0%} over {path.name} (recorded, now): {worse}"


def released_config(path, **overrides) -> dict:
    """A published config (hybrid_jax/published_configs/*.json) as a dict, less its `_sources`, with overrides."""
    import json  # noqa: PLC0415
    import pathlib  # noqa: PLC0415
    d = json.loads(pathlib.Path(path).read_text())
    d.pop("_sources", None)
    return {**d, **overrides}


def step_temp_bytes(fam, cfg, params, capacity: int, ragged: bool, prompt: int) -> int:
    """The compiled step's temporaries (memory_analysis) for a `prompt`-token prompt on one row of `capacity`
    tokens: the padded forward, or the ragged one (a 512-token tile). Nothing runs: params may be shapes."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from hybrid_jax.models.ragged import pack  # noqa: PLC0415
    cache = jax.eval_shape(lambda: fam.new_cache(cfg, 1, capacity, jnp.float32))
    if ragged:
        b = pack([list(range(prompt))], [0], 512, 1)
        batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), b)
        step = jax.jit(lambda p, c, b: fam.forward_ragged(cfg, p, c, b), donate_argnums=1)
        lowered = step.lower(params, cache, batch)
    else:
        tok, n = jax.ShapeDtypeStruct((1, prompt), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
        step = jax.jit(lambda p, c, t, n: fam.forward(cfg, p, c, t, n), donate_argnums=1)
        lowered = step.lower(params, cache, tok, n)
    return lowered.compile().memory_analysis().temp_size_in_bytes
