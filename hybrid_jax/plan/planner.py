"""`plan()`: a model's per-chip HBM, capacity and roofline on a TPU topology, from the TPU compiler.

Every figure is per chip, for one replica of the model spread over `split` chips
(`--tensor-parallel-size`, default 1; `--enable-expert-parallel` splits routed experts whole). A split
over N > 1 chips is compiled for N devices of the slice with the engine's real layout
(`hybrid_jax.parallel`: the rule table's shardings of every parameter and pool, the Pallas kernels per
device): weights and cache per chip are the shards' bytes (replicated leaves in full), FLOPs, bytes
and temporaries those of one device's partitioned program, and the collectives it runs are counted.
A model the layout cannot split yet (a family without sharding rules) falls back to an *ideal
split*: compiled for one device, every byte and FLOP divided evenly by N, no replication and no
collectives, and says so in its notes. Speeds are roofline estimates from the
chip's published peaks (`chips.py`), not measurements, and leave out the collectives' time.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import jax.numpy as jnp

from hybrid_jax.models.config_common import config_from_hf_dict, load_config
from hybrid_jax.errors import ConfigError, HybridJaxError
from hybrid_jax.generate import bucket
from hybrid_jax.plan.chips import Chip, PlanError, topology
from hybrid_jax.models import get_model
from hybrid_jax.parallel import Layout, ParallelConfig, build_mesh
from hybrid_jax.parallel.context import active
from hybrid_jax.plan.compile import (
    ModelCosts,
    Shapes,
    StepCost,
    compile_sampler,
    model_costs,
)
from hybrid_jax.plan.shapes import (
    KIND_LABELS,
    abstract_layout,
    abstract_params,
    abstract_pools,
    bytes_by_kind,
    layer_counts,
    pool_pages,
    request_bytes,
    tree_nbytes,
)
from pallas_kernels import tuning

PUBLISHED = pathlib.Path(__file__).parents[1] / "published_configs"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Memory:
    """HBM of one chip, bytes."""
    capacity: int
    weights: float
    cache_by_kind: dict[str, float]      # kind -> bytes (shapes.KIND_LABELS names them)
    temporaries: float                   # compiler temporaries (the larger of decode and prefill)

    @property
    def cache(self) -> float:
        return sum(self.cache_by_kind.values())

    @property
    def free(self) -> float:
        return self.capacity - self.weights - self.cache - self.temporaries


@dataclasses.dataclass(frozen=True)
class Capacity:
    """How many requests fit beside the weights and temporaries (the pools resized to what is left)."""
    context: int                         # max_model_len
    batch_at_context: int                # requests of `context` tokens that fit
    batch: int                           # max_num_seqs
    context_at_batch: int                # tokens each of `batch` requests can hold


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Per decode step and prefill chunk: compiler costs, minimum bytes, and estimated speeds per chip."""
    decode_flops: float                  # per step and chip
    decode_bytes: float                  # HBM bytes accessed per step and chip (compiler cost analysis)
    min_decode_bytes: float              # per chip: its weights + its part of the batch's cache at
                                         # max_model_len, each read once
    decode_tok_s: float                  # estimate per chip, from the compiled bytes and FLOPs
    decode_tok_s_at_min: float           # estimate per chip, if the step read only the minimum bytes
    decode_bound: str                    # "memory" or "compute"
    prefill_flops: float                 # per chunk and chip
    prefill_bytes: float
    prefill_tok_s: float                 # estimate per chip
    prefill_bound: str
    decode_collectives: float = 0.0      # collectives per decode step (split programs)
    decode_collective_bytes: float = 0.0  # their result bytes per chip

    @property
    def bytes_over_min(self) -> float:
        return self.decode_bytes / self.min_decode_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    model_type: str
    topology: str
    chip: Chip
    num_chips: int
    split: int
    sharded: bool                        # compiled with the real layout (False: one chip, or an ideal split)
    expert_parallel: bool
    dtype: str
    quantization: str | None
    max_num_seqs: int
    max_model_len: int
    decode_batch: int
    chunk: int
    num_params: int
    costs: ModelCosts
    sampler: StepCost
    memory: Memory
    capacity: Capacity
    roofline: Roofline
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.memory.free >= 0


def resolve_model(spec: str):
    """A config.json file, a checkpoint directory, or a published config's name (a file stem in
    hybrid_jax/published_configs, case and '-' / '.' / '_' ignored) -> (label, config)."""
    if os.path.exists(spec):
        return spec, load_config(spec)
    key = _norm(spec.split("/")[-1])
    names = {_norm(p.stem): p for p in PUBLISHED.glob("*.json")}
    hits = [p for k, p in names.items() if k == key] or [p for k, p in names.items() if k.startswith(key)]
    if len(hits) != 1:
        raise ConfigError(f"--model {spec!r} is neither a path nor {'a unique' if hits else 'a'} published config; "
                          f"published: {sorted(p.stem for p in PUBLISHED.glob('*.json'))}")
    import json  # noqa: PLC0415
    return hits[0].stem, config_from_hf_dict(json.loads(hits[0].read_text()))


def _norm(s: str) -> str:
    return re.sub(r"[-._]", "", s.lower())


def _time(flops: float, nbytes: float, chip: Chip) -> tuple[float, str]:
    """Roofline time of one chip's part of a step."""
    tc, tm = flops / chip.peak_bf16_flops, nbytes / chip.hbm_bandwidth
    return max(tc, tm), "compute" if tc > tm else "memory"


def _local(tree, shardings):
    """`tree`'s leaves as the shapes one device holds under `shardings` (a pytree of NamedShardings)."""
    import jax  # noqa: PLC0415
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(s.shard_shape(a.shape), a.dtype), tree, shardings)


def row_table_bytes(family, params) -> int:
    """Bytes of the family's row tables among `params` (shapes): parameters a step gathers a few rows of
    (`ModelFamily.row_tables`), which the minimum decode bytes leave out (the rows a decode step reads, a
    few KiB per token, are not added back)."""
    import fnmatch  # noqa: PLC0415

    import jax  # noqa: PLC0415

    from hybrid_jax.parallel.placement import path_name  # noqa: PLC0415
    return sum(tree_nbytes(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if any(fnmatch.fnmatchcase(path_name(path), pat) for pat in family.row_tables))


def _mesh_layout(cfg, topo, n: int, ep: bool, quantization) -> tuple[Layout | None, str | None]:
    """The layout a split over n chips compiles with, or (None, why an ideal split is used instead)."""
    if n == 1:
        return None, None
    pc = ParallelConfig(tensor_parallel_size=n, enable_expert_parallel=ep)
    pc.check(cfg, n)                       # heads / experts the split cannot divide: a ConfigError naming them
    if get_model(cfg.model_type).param_axes is None:
        return None, f"the {cfg.model_type} family has no sharding rules yet"
    if topo.num_devices != topo.num_chips:
        return None, f"libtpu lists {topo.num_devices} devices for the {topo.num_chips} chips of {topo.name}"
    return Layout(pc, build_mesh(pc, topo.devices[:n])), None


def _check_args(max_num_seqs, max_model_len, chunk, tensor_parallel_size, page_size, dtype, quantization):
    """PlanError for a size that is not positive, or a dtype or quantization plan cannot compile."""
    for name, v in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len), ("chunk", chunk),
                    ("tensor_parallel_size", tensor_parallel_size), ("page_size", page_size)):
        if int(v) <= 0:
            raise PlanError(f"{name} must be positive; got {v}")
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    if quantization not in (None, "fp8"):
        raise PlanError(f"quantization {quantization!r} is not supported by plan; known: fp8")


def _compile(cfg, sh, target, layers, impl, label, topology_name, n, chip, mesh_layout, max_num_seqs, max_model_len):
    """The model's compiled step costs; a compiler failure becomes a PlanError saying what was compiled
    (RESOURCE_EXHAUSTED: the model does not fit)."""
    try:
        return model_costs(cfg, sh, target, layers=layers, impl=impl)
    except HybridJaxError:
        raise
    except Exception as e:  # noqa: BLE001  (compiler errors: say what was being compiled)
        msg = str(e).splitlines()[0]
        if "RESOURCE_EXHAUSTED" in msg:
            what = ("the compiled programs (one layer of each kind, and one more)" if layers == "reduced"
                    else "the model")
            where = f"{n} {chip.name} chips" if mesh_layout is not None else f"one {chip.name} chip"
            raise PlanError(f"{label} does not fit {where} at max_num_seqs {max_num_seqs} x max_model_len "
                            f"{max_model_len}: {what} must fit, and the TPU compiler says: {msg}") from None
        raise PlanError(f"the TPU compiler failed on {label} for {topology_name}: {msg}") from e


def _notes(cfg, costs, decode, pools, memory, mesh_layout, why_ideal, n, topo, topology_name, quantization, dtype,
           chip) -> tuple[str, ...]:
    """What a reader of the plan must know about how its figures were made."""
    notes = []
    if costs.layers == "reduced":
        notes.append(f"compiled with one layer of each kind ({len(costs.per_layer)} kinds, programs of "
                     f"{', '.join(map(str, costs.compiled_layers))} layers) and scaled to {cfg.num_hidden_layers} "
                     f"layers by per-layer differences; temporaries extrapolated the same way")
    if mesh_layout is not None:
        notes.append(f"compiled for {n} devices of {topology_name} with the engine's layout "
                     f"({mesh_layout.key}: the rule table's shardings, Pallas kernels per device); per-chip "
                     f"figures are one device's program and shards; the roofline leaves out the "
                     f"{decode.collectives:.0f} collectives of a decode step")
        whole = [KIND_LABELS.get(k, k) for k, v in bytes_by_kind(pools).items()
                 if k != "row_metadata" and v and memory.cache_by_kind.get(k) == v]
        if whole:
            notes.append(f"whole on every chip (no head axis to split): {', '.join(whole)}; tensor parallelism "
                         f"does not divide this cache, only more chips holding fewer requests each would")
    elif n > 1:
        notes.append(f"ideal split ({why_ideal}): compiled for one device of {topology_name}; figures per chip "
                     f"assume an ideal split over {n} chips (bytes and FLOPs / {n}, no replication, no collectives)")
    elif topo.num_chips > 1:
        notes.append(f"figures are for one chip holding the whole model ({topo.num_chips} chips in the slice)")
    if quantization:
        notes.append("fp8: every linear weight of the layers in FP8 with 128x128 block scales (float32); "
                     "embeddings, norms and the LM head in " + dtype)
    if costs.decode.loops or costs.prefill.loops:
        notes.append(f"the programs run loops (decode {costs.decode.loops}, prefill chunk {costs.prefill.loops} HLO while "
                     f"loops; e.g. a paged attention read walking the KV pages): the compiler's cost analysis counts "
                     f"ONE iteration of each, so bytes and FLOPs above omit the other iterations' (for a KV read "
                     f"looped over the context, nearly all of it)")
    tables = get_model(cfg.model_type).row_tables
    if tables:
        notes.append(f"the minimum bytes leave out the tables a step reads a few rows of by id ({', '.join(tables)}): "
                     f"they are not read whole, and the few KiB of rows a decode step gathers are not added")
    notes.append("tok/s are roofline estimates from the chip's published peak bf16 FLOP/s and HBM bandwidth "
                 f"({chip.source}), not measurements")
    return tuple(notes)


def _block_size_notes(lookups, topology_name: str) -> tuple[str, ...]:
    """Which Pallas kernels ran tuned block sizes, and the command that tunes the others."""
    tuned = sorted({f"{x.kernel} {x.key}" for x in lookups if x.tuned})
    hand: dict[str, list[str]] = {}
    for x in lookups:
        if not x.tuned and x.key not in hand.get(x.kernel, []):
            hand.setdefault(x.kernel, []).append(x.key)
    notes = [f"block sizes from the tuned tables: {', '.join(tuned)}"] if tuned else []
    for kernel, keys in sorted(hand.items()):
        notes.append(f"hand-picked block sizes for {kernel} {', '.join(keys)} (no tuned entry for "
                     f"{lookups[0].chip}): `hybrid-jax tune --topology {topology_name} --kernel {kernel} "
                     + " ".join(f"--key {k}" for k in keys) + "` tunes them")
    return tuple(notes)


def plan(model: str, topology_name: str, *, max_num_seqs: int = 64, max_model_len: int = 32768,
         tensor_parallel_size: int = 1, enable_expert_parallel: bool = False, dtype: str = "bfloat16",
         quantization: str | None = None, chunk: int = 2048, page_size: int = 64, layers: str = "auto",
         impl: str = "auto", config=None) -> Plan:
    """Compiles the model's decode and prefill-chunk steps for `topology_name` (one device, or the
    split's devices with the engine's layout) with abstract weights and pools, and returns the per-chip
    figures (module docstring: what `split` means).
    config: a config object to plan instead of resolving `model` (tests). Raises PlanError / ConfigError
    for bad input; a model that does not fit comes back with `fits` False."""
    _check_args(max_num_seqs, max_model_len, chunk, tensor_parallel_size, page_size, dtype, quantization)
    topo = topology(topology_name)
    if tensor_parallel_size > topo.num_chips:
        raise PlanError(f"--tensor-parallel-size {tensor_parallel_size} exceeds the {topo.num_chips} chips of "
                        f"{topology_name}")
    label, cfg = (model, config) if config is not None else resolve_model(model)
    dt, n, chip = DTYPES[dtype], tensor_parallel_size, topo.chip

    mesh_layout, why_ideal = _mesh_layout(cfg, topo, n, enable_expert_parallel, quantization)
    target = mesh_layout if mesh_layout is not None else topo.device
    params = abstract_params(cfg, dt, quantization)
    weights = tree_nbytes(params)
    num_params = sum(x.size for x in _param_leaves(params))
    layout, pools, sh = _shapes(cfg, dt, quantization, mesh_layout, max_num_seqs, max_model_len, page_size, chunk)
    Bb = sh.decode_batch
    layers = costs_mode(layers, cfg, weights if mesh_layout is None else weights / n, chip)
    with tuning.recording() as lookups:
        costs = _compile(cfg, sh, target, layers, impl, label, topology_name, n, chip, mesh_layout, max_num_seqs,
                         max_model_len)
    sampler = compile_sampler(Bb, cfg.vocab_size, target)
    decode = costs.decode + dataclasses.replace(sampler, temp_bytes=0.0)
    prefill = costs.prefill
    temps = max(costs.decode.temp_bytes, sampler.temp_bytes, costs.prefill.temp_bytes)

    if mesh_layout is not None:     # per chip: the shards' bytes, one device's program
        fam = get_model(cfg.model_type)
        chip_params = _local(mesh_layout.annotate(fam, params), mesh_layout.param_shardings(fam, params))
        chip_weights = tree_nbytes(chip_params)
        chip_pools = _local(pools, mesh_layout.cache_shardings(pools))
        chip_layout = _local(layout, mesh_layout.cache_shardings(layout))
        memory = Memory(capacity=chip.hbm_bytes, weights=chip_weights, cache_by_kind=bytes_by_kind(chip_pools),
                        temporaries=temps)
        capacity = _capacity(chip_layout, chip_pools, chip.hbm_bytes - chip_weights - temps, max_num_seqs,
                             max_model_len)
        min_bytes = chip_weights - row_table_bytes(fam, chip_params) + max_num_seqs * request_bytes(chip_layout,
                                                                                                     max_model_len)
    else:                           # one chip, or an ideal split of one chip's program over n
        by_kind = bytes_by_kind(pools)
        memory = Memory(capacity=chip.hbm_bytes, weights=weights / n,
                        cache_by_kind={k: v / n for k, v in by_kind.items()}, temporaries=temps / n)
        capacity = _capacity(layout, pools, n * chip.hbm_bytes - weights - temps, max_num_seqs, max_model_len)
        min_bytes = (weights - row_table_bytes(get_model(cfg.model_type), params)
                     + max_num_seqs * request_bytes(layout, max_model_len)) / n
        decode, prefill = decode.scaled(1 / n), prefill.scaled(1 / n)

    t, bound = _time(decode.flops, decode.bytes_accessed, chip)
    t_min, _ = _time(decode.flops, min_bytes, chip)
    tp, pbound = _time(prefill.flops, prefill.bytes_accessed, chip)
    roof = Roofline(decode_flops=decode.flops, decode_bytes=decode.bytes_accessed, min_decode_bytes=min_bytes,
                    decode_tok_s=max_num_seqs / t / n, decode_tok_s_at_min=max_num_seqs / t_min / n,
                    decode_bound=bound, prefill_flops=prefill.flops, prefill_bytes=prefill.bytes_accessed,
                    prefill_tok_s=chunk / tp / n, prefill_bound=pbound, decode_collectives=decode.collectives,
                    decode_collective_bytes=decode.collective_bytes)

    notes = _notes(cfg, costs, decode, pools, memory, mesh_layout, why_ideal, n, topo, topology_name, quantization,
                   dtype, chip) + _block_size_notes(lookups, topology_name)
    return Plan(model=label, model_type=cfg.model_type, topology=topology_name, chip=chip, num_chips=topo.num_chips,
                split=n, sharded=mesh_layout is not None, expert_parallel=enable_expert_parallel, dtype=dtype, quantization=quantization, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, decode_batch=Bb, chunk=chunk, num_params=num_params, costs=costs,
                sampler=sampler, memory=memory, capacity=capacity, roofline=roof, notes=notes)


def _shapes(cfg, dt, quantization, mesh_layout, max_num_seqs: int, max_model_len: int, page_size: int, chunk: int):
    """(one row's cache layout, the pools, the programs' Shapes) as the engine would size them."""
    with active(mesh_layout):      # the cache's shapes may follow the layout (parallel.kv_replicas)
        layout = abstract_layout(cfg, dt, max_model_len, page_size)
    rows, pages = max_num_seqs + 1, pool_pages(layout, max_num_seqs, max_model_len)
    sh = Shapes(dtype=dt, quantization=quantization, rows=rows, pages=tuple(sorted(pages.items())),
                max_model_len=max_model_len, page_size=page_size, decode_batch=bucket(max_num_seqs), chunk=chunk)
    return layout, abstract_pools(layout, rows, pages), sh


def decode_cost_per_token(model: str, chip: str, *, max_num_seqs: int = 8, max_model_len: int = 4096,
                          quantization: str | None = None, dtype: str = "bfloat16", page_size: int = 64,
                          layers: str = "reduced", config=None) -> dict[str, float]:
    """{"flops", "bytes_accessed"} per token of the model part's decode step (no sampler) on one `chip`
    device ("v5e", "v6e", "v5p"), compiled alone (no prefill program; `model` is not read when `config` is given): the step's compiler figures over
    its decode batch. The figures tests/hybrid_jax/test_model_baselines.py holds to their record."""
    from pallas_kernels.aot import tpu_device  # noqa: PLC0415
    cfg = config if config is not None else resolve_model(model)[1]
    _, _, sh = _shapes(cfg, DTYPES[dtype], quantization, None, max_num_seqs, max_model_len, page_size, 1)
    d = model_costs(cfg, sh, tpu_device(chip), layers=layers, with_prefill=False).decode
    return {"flops": d.flops / sh.decode_batch, "bytes_accessed": d.bytes_accessed / sh.decode_batch}


def costs_mode(layers: str, cfg, weights: int, chip: Chip) -> str:
    """'full' or 'reduced' for layers='auto': reduced when the weights exceed one chip's HBM (a whole model
    beyond it cannot be compiled for one chip) or when it saves programs (compile.model_costs)."""
    if layers != "auto":
        return layers
    if weights > chip.hbm_bytes:
        return "reduced"
    return "full" if cfg.num_hidden_layers <= 2 * len(layer_counts(cfg)) + 2 else "reduced"


def _param_leaves(params):
    import jax  # noqa: PLC0415

    from hybrid_jax.layers.linear import Fp8Weight  # noqa: PLC0415
    # an FP8 weight counts its codes, not its scales
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight))
    return [x.w if isinstance(x, Fp8Weight) else x for x in leaves]


def _capacity(layout, pools, budget: float, batch: int, context: int) -> Capacity:
    """Requests that fit in `budget` bytes of cache (all chips of the replica): each holds its row of fixed
    state, its pages and its page-table row; the engine's null row comes first."""
    meta = (bytes_by_kind(pools)["row_metadata"]) / pools.lengths.shape[0]        # per engine row
    left = budget - request_bytes(layout, 0) - meta                               # the null row

    def per_request(c):
        return request_bytes(layout, c) + meta

    at_context = max(int(left // per_request(context)), 0)
    lo, hi = 0, 1 << 26
    while lo < hi:                     # the longest context of which `batch` requests fit
        mid = (lo + hi + 1) // 2
        if batch * per_request(mid) <= left:
            lo = mid
        else:
            hi = mid - 1
    return Capacity(context=context, batch_at_context=at_context, batch=batch, context_at_batch=lo)
