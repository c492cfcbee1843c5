"""The engine's step programs compiled for a TPU device at real sizes, and their costs scaled by layer.

Two programs are compiled from the engine's own step bodies (`engine/steps.py`), with the pools donated:

  decode        [Bb] last tokens, one forward over the pools' view (take_view in place -> forward -> put_view),
                then the engine's full sampler (temperature, top-k, top-p) on the [Bb, V] logits
  prefill chunk [1, T] tokens of one request (a chunk of the mixed step), same path, no sampling

The sampler is compiled on its own and its cost added to the decode step's (its compile at a real
vocabulary is as long as a layer's, and it does not depend on the layers). Compiler temporaries of the
two parts are not added: the larger one is taken, since they are not live at the same time.

With a `Layout` (tensor / expert parallelism, `hybrid_jax.parallel`) the programs are compiled for the
layout's devices of the slice, the parameters and pools split by the rule table and traced with the
layout current (so the Pallas kernels run per device under shard_map, as in the engine); XLA's cost and
memory analyses then describe ONE device's partitioned program: every figure is per chip.

Layer scaling (`layers="reduced"`): compiling a real model whole needs minutes and gigabytes on a small
host, so the model is compiled with one layer of each signature (mixer, feed-forward kind), and once more
per signature with a second layer of it. The difference is that signature's per-layer cost; the
model's cost is base + sum over signatures of (count - 1) * per-layer cost. FLOPs and bytes accessed
are linear in the layer counts (each layer is its own code); temporaries are extrapolated the same way,
an approximation (a buffer the layers reuse is not repeated). `layers="full"` compiles the whole model
once; tests/hybrid_jax/test_plan.py checks the two agree on a tiny model. Every program is compiled with
`PLAN_COMPILER_OPTIONS` (no VMEM prefetching: why beside it).
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp

from hybrid_jax.engine.step_inputs import StepRows
from hybrid_jax.engine.steps import StepContext, chunk_forward, decode_forward, draw_tokens
from hybrid_jax.models import get_model
from hybrid_jax.parallel.context import active
from hybrid_jax.parallel.placement import Layout
from hybrid_jax.plan.shapes import (
    abstract_layout,
    abstract_params,
    abstract_pools,
    first_of_each,
    layer_counts,
    select_layers,
)
from hybrid_jax.sampling import FULL_SAMPLER
from pallas_kernels import tuning
from pallas_kernels.aot import cost_of, on_device



@dataclasses.dataclass(frozen=True)
class StepCost:
    """What the compiler reports for one program (or a sum / extrapolation of programs)."""
    flops: float
    bytes_accessed: float
    transcendentals: float
    temp_bytes: float
    # run-time loops (HLO while) in the program: XLA's cost analysis counts ONE iteration of a loop body,
    # so whatever a loop reads per iteration is under-counted (the paged XLA attention read walks the KV
    # pages in a loop; on a TPU a decode step reads them through the ragged kernel instead, which reports
    # its own cost). Sums and differences keep the larger count.
    loops: int = 0
    # collectives of a program split over devices (all-reduce, all-gather, ...; start ops of async
    # pairs counted once) and the bytes of their results
    collectives: float = 0.0
    collective_bytes: float = 0.0

    def __add__(self, o: StepCost) -> StepCost:
        return StepCost(self.flops + o.flops, self.bytes_accessed + o.bytes_accessed,
                        self.transcendentals + o.transcendentals, self.temp_bytes + o.temp_bytes,
                        max(self.loops, o.loops), self.collectives + o.collectives,
                        self.collective_bytes + o.collective_bytes)

    def __sub__(self, o: StepCost) -> StepCost:
        return self + o.scaled(-1)

    def scaled(self, k: float) -> StepCost:
        return StepCost(self.flops * k, self.bytes_accessed * k, self.transcendentals * k, self.temp_bytes * k,
                        self.loops, self.collectives * k, self.collective_bytes * k)


_COLLECTIVE = re.compile(r"= ([^=]*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1}


def collectives_of(hlo: str) -> tuple[int, int]:
    """(count, result bytes) of the collectives in a compiled program's HLO text."""
    n = nbytes = 0
    for m in _COLLECTIVE.finditer(hlo):
        n += 1
        for dt, dims in _ARRAY.findall(m.group(1)):
            size = _ITEMSIZE.get(dt) or int(dt[1:]) // 8
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            nbytes += size * count
    return n, nbytes


def _cost(compiled) -> StepCost:
    c = cost_of(compiled)
    text = compiled.as_text()
    n, nbytes = collectives_of(text)
    return StepCost(c.flops, c.bytes_accessed, c.transcendentals, float(c.temp_bytes), text.count(" while("),
                    float(n), float(nbytes))


def _view_rows(rows, tables, lengths) -> StepRows:
    """The StepRows of a plan's program: the rows' cache rows, block tables and lengths (what the
    model part reads); the sampling fields stay None."""
    return StepRows(rows=rows, tables=tables, lengths=lengths, steps=None, seeds=None, temperature=None,
                    top_k=None, top_p=None, from_dev=None)


def _decode_step(ctx: StepContext):
    """The engine's decode iteration, model part (`engine.steps.decode_forward`)."""
    def step(params, pools, rows, tables, lengths, tokens, active):
        return decode_forward(ctx, params, pools, _view_rows(rows, tables, lengths), tokens, active.astype(jnp.int32))
    return step


def _prefill_step(ctx: StepContext):
    """The engine's mixed step, model part, over one request's chunk (`engine.steps.chunk_forward`)."""
    def step(params, pools, rows, tables, lengths, tokens, n_new):
        out, pools = chunk_forward(ctx, params, pools, _view_rows(rows, tables, lengths), tokens, n_new, lengths == 0)
        return out.logits, pools
    return step


def _sampler(logits, seeds, steps, temperature, top_k, top_p):
    """The engine's sampler (`engine.steps.draw_tokens`)."""
    r = StepRows(rows=None, tables=None, lengths=None, steps=steps, seeds=seeds, temperature=temperature,
                 top_k=top_k, top_p=top_p, from_dev=None)
    return draw_tokens(logits, r, FULL_SAMPLER)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The static shapes of the plan's programs."""
    dtype: object
    quantization: str | None
    rows: int                  # engine rows (max_num_seqs + the null row)
    pages: tuple               # (paged group, pages in its pool) pairs
    max_model_len: int
    page_size: int
    decode_batch: int          # Bb of the decode step
    chunk: int                 # T of the prefill chunk


def _row_args(layout, Bb: int):
    S = jax.ShapeDtypeStruct
    tables = {n: S((Bb, g.page_table.shape[1]), jnp.int32) for n, g in layout.groups.items() if g.paged}
    return S((Bb,), jnp.int32), tables, S((Bb,), jnp.int32)


_COMPILED: dict[tuple, tuple[tuple[StepCost, StepCost], tuple]] = {}


def _target_key(target) -> str:
    if isinstance(target, Layout):
        return f"{target.key}@{[d.id for d in target.mesh.devices.flat]}"
    return str(target)


def _on(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves, each with its sharding (a pytree of shardings, or one)."""
    S = jax.ShapeDtypeStruct
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda a: S(a.shape, a.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda a, s: S(a.shape, a.dtype, sharding=s), tree, shardings)


NOTHING = StepCost(0.0, 0.0, 0.0, 0.0)

# The plan's programs are compiled without XLA's memory-space assignment (MSA: copies of chosen HBM buffers
# into the TPU's on-chip VMEM ahead of their use). The compiler's cost analysis counts such a prefetch on top
# of the reads it serves (the copy out of HBM, its write to VMEM, then every read of the VMEM copy), and MSA
# chooses what to prefetch for the program as a whole: the layer-scaled programs below picked different
# buffers (one program the Mamba2 state pool, the next the 84 MiB LM head, Nemotron-3-Nano at tp 8), and the
# difference was scaled by the layer count (+15 GiB a decode step). Without it each op's HBM operands are
# counted once, the figure the roofline divides by the HBM bandwidth, and layer scaling agrees with a
# compile of the whole model (Nemotron-3-Nano, tp 8: 18.68 GiB scaled, 18.56 GiB whole).
PLAN_COMPILER_OPTIONS = {"xla_msa_enable": False}


def compile_model(cfg, sh: Shapes, target, impl: str = "auto", prefill: bool = True) -> tuple[StepCost, StepCost]:
    """(decode, prefill chunk) costs of cfg's model part (no sampler), each compiled once for `target`
    (one device, or a Layout over devices of the slice: per-device costs), remembered per process:
    plans of the same model at other splits compile nothing again. prefill=False compiles the decode
    step alone (the prefill chunk's cost comes back as NOTHING)."""
    key = (repr(cfg), repr(sh), _target_key(target), impl, prefill)
    if key not in _COMPILED:
        with tuning.recording() as seen:
            costs = _compile_model(cfg, sh, target, impl, prefill)
        _COMPILED[key] = costs, tuple(seen)
    costs, seen = _COMPILED[key]
    tuning.replay(seen)             # the kernels' table lookups, for the plan's note (a reused compile too)
    return costs


def _compile_model(cfg, sh: Shapes, target, impl: str, prefill: bool = True) -> tuple[StepCost, StepCost]:
    mesh_layout = target if isinstance(target, Layout) else None
    device = target if mesh_layout is None else next(iter(mesh_layout.mesh.devices.flat))
    with tuning.target_chip(tuning.chip_of(device)):     # the kernels read the tuned tables of this chip
        return _compile_steps(cfg, sh, target, mesh_layout, impl, prefill)


def _compile_steps(cfg, sh: Shapes, target, mesh_layout, impl: str, prefill: bool) -> tuple[StepCost, StepCost]:
    model = get_model(cfg.model_type)
    params = abstract_params(cfg, sh.dtype, sh.quantization)
    with active(mesh_layout):      # the cache's shapes may follow the layout (parallel.kv_replicas)
        layout = abstract_layout(cfg, sh.dtype, sh.max_model_len, sh.page_size)
    pools = abstract_pools(layout, sh.rows, dict(sh.pages))
    if mesh_layout is not None:
        params = _on(mesh_layout.annotate(model, params), mesh_layout.param_shardings(model, params))
        pools = _on(pools, mesh_layout.cache_shardings(pools))
    S = jax.ShapeDtypeStruct
    out = []
    steps = ((_decode_step, sh.decode_batch, (S((sh.decode_batch,), jnp.int32), S((sh.decode_batch,), jnp.bool_))),
             (_prefill_step, 1, (S((1, sh.chunk), jnp.int32), S((1,), jnp.int32))))
    for step, Bb, extra in steps[:2 if prefill else 1]:
        rest = (*_row_args(layout, Bb), *extra)
        if mesh_layout is None:
            args = on_device((params, pools, *rest), target)
        else:
            args = (params, pools, *_on(rest, mesh_layout.replicated))
        with active(mesh_layout):
            lowered = jax.jit(step(StepContext(model, cfg, impl, mesh_layout)), donate_argnums=(1,)).lower(*args)
        out.append(_cost(lowered.compile(compiler_options=PLAN_COMPILER_OPTIONS)))
    return out[0], out[1] if prefill else NOTHING


@functools.lru_cache(maxsize=16)
def compile_sampler(batch: int, vocab: int, target) -> StepCost:
    """The engine's full sampler on [batch, vocab] float32 logits (on a Layout: split over the vocabulary
    as the LM head leaves them)."""
    S = jax.ShapeDtypeStruct
    args = (S((batch, vocab), jnp.float32), S((batch,), jnp.uint32), S((batch,), jnp.int32),
            S((batch,), jnp.float32), S((batch,), jnp.int32), S((batch,), jnp.float32))
    if isinstance(target, Layout):
        logits = jax.sharding.NamedSharding(target.mesh, target.spec((None, "vocab"), (batch, vocab), "logits"))
        args = (_on(args[0], logits), *_on(args[1:], target.replicated))
    else:
        args = on_device(args, target)
    return _cost(jax.jit(_sampler).lower(*args).compile(compiler_options=PLAN_COMPILER_OPTIONS))


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """Decode and prefill-chunk costs of the whole model, and how they were obtained."""
    decode: StepCost
    prefill: StepCost
    layers: str                          # "full" or "reduced"
    compiled_layers: tuple[int, ...]     # layers of each compiled program
    per_layer: dict                      # signature -> (decode, prefill) StepCost of one layer (reduced only)


def model_costs(cfg, sh: Shapes, target, layers: str = "auto", impl: str = "auto",
                with_prefill: bool = True) -> ModelCosts:
    """The model part's costs, by a full compile or by layer scaling (module docstring). with_prefill=False:
    the decode step's alone (the prefill figures are NOTHING)."""
    counts = layer_counts(cfg)
    if layers == "auto":
        layers = "full" if cfg.num_hidden_layers <= 2 * len(counts) + 2 else "reduced"
    if layers == "full":
        d, p = compile_model(cfg, sh, target, impl, with_prefill)
        return ModelCosts(d, p, "full", (cfg.num_hidden_layers,), {})
    if layers != "reduced":
        raise ValueError(f"layers must be 'auto', 'full' or 'reduced'; got {layers!r}")
    first = first_of_each(cfg)
    base_idx = list(first.values())
    base = compile_model(select_layers(cfg, base_idx), sh, target, impl, with_prefill)
    decode, prefill = base
    per_layer, sizes = {}, [len(base_idx)]
    for sig, i in first.items():
        more = compile_model(select_layers(cfg, base_idx + [i]), sh, target, impl, with_prefill)
        sizes.append(len(base_idx) + 1)
        dl, pl = more[0] - base[0], more[1] - base[1]
        per_layer[sig] = (dl, pl)
        decode, prefill = decode + dl.scaled(counts[sig] - 1), prefill + pl.scaled(counts[sig] - 1)
    clamp = lambda c: dataclasses.replace(c, temp_bytes=max(c.temp_bytes, 0.0))  # noqa: E731
    return ModelCosts(clamp(decode), clamp(prefill), "reduced", tuple(sizes), per_layer)
