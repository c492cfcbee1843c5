"""The engine's step programs compiled for a TPU device at real sizes, and their costs scaled by layer.

Two programs are compiled, as the engine runs them (`engine/runner.py`), with the pools donated:

  decode        [Bb] last tokens, one forward over the pools' view (take_view -> forward -> put_view),
                then the engine's full sampler (temperature, top-k, top-p) on the [Bb, V] logits
  prefill chunk [1, T] tokens of one request (a chunk of the mixed step), same path, no sampling

The sampler is compiled on its own and its cost added to the decode step's (its compile at a real
vocabulary is as long as a layer's, and it does not depend on the layers). Compiler temporaries of the
two parts are not added: the larger one is taken, since they are not live at the same time.

Layer scaling (`layers="reduced"`): compiling a real model whole needs minutes and gigabytes on a small
host, so the model is compiled with one layer of each signature (mixer, feed-forward kind), and once more
per signature with a second layer of it. The difference is that signature's per-layer cost; the
model's cost is base + sum over signatures of (count - 1) * per-layer cost. FLOPs and bytes accessed
are linear in the layer counts (each layer is its own code); temporaries are extrapolated the same way,
an approximation (a buffer the layers reuse is not repeated). `layers="full"` compiles the whole model
once; tests/hybrid_jax/test_plan.py checks the two agree on a tiny model.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cache.pools import put_view, take_view
from hybrid_jax.models import get_model
from hybrid_jax.plan.shapes import (
    abstract_layout,
    abstract_params,
    abstract_pools,
    first_of_each,
    layer_counts,
    select_layers,
)
from hybrid_jax.sampling import SamplerFlags, sample
from pallas_kernels.aot import cost_of, on_device

FULL_SAMPLER = SamplerFlags(any_random=True, use_top_k=True, use_top_p=True)   # the engine's sampler


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What the compiler reports for one program (or a sum / extrapolation of programs)."""
    flops: float
    bytes_accessed: float
    transcendentals: float
    temp_bytes: float
    # run-time loops (HLO while) in the program: XLA's cost analysis counts ONE iteration of a loop body,
    # so whatever a loop reads per iteration is under-counted (Qwen3-Next's paged attention read walks the
    # KV pages in a loop: its KV read is almost absent from bytes_accessed). Sums and differences keep the
    # larger count.
    loops: int = 0

    def __add__(self, o: StepCost) -> StepCost:
        return StepCost(self.flops + o.flops, self.bytes_accessed + o.bytes_accessed,
                        self.transcendentals + o.transcendentals, self.temp_bytes + o.temp_bytes,
                        max(self.loops, o.loops))

    def __sub__(self, o: StepCost) -> StepCost:
        return self + o.scaled(-1)

    def scaled(self, k: float) -> StepCost:
        return StepCost(self.flops * k, self.bytes_accessed * k, self.transcendentals * k, self.temp_bytes * k,
                        self.loops)


def _cost(compiled) -> StepCost:
    c = cost_of(compiled)
    return StepCost(c.flops, c.bytes_accessed, c.transcendentals, float(c.temp_bytes),
                    compiled.as_text().count(" while("))


def _decode_step(model, cfg, impl):
    def step(params, pools, rows, tables, lengths, tokens, active):
        sub = take_view(pools, rows, tables, lengths)
        out = model.forward(cfg, params, sub, tokens[:, None], active.astype(jnp.int32), impl=impl)
        return out.logits, put_view(pools, rows, out.cache)
    return step


def _prefill_step(model, cfg, impl):
    def step(params, pools, rows, tables, lengths, tokens, n_new):
        sub = take_view(pools, rows, tables, lengths, reset=lengths == 0)
        out = model.forward(cfg, params, sub, tokens, n_new, impl=impl)
        return out.logits, put_view(pools, rows, out.cache)
    return step


def _sampler(logits, seeds, steps, temperature, top_k, top_p):
    keys = jax.vmap(jax.random.key)(seeds)
    return sample(logits, keys, steps, temperature, top_k, top_p, FULL_SAMPLER)


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


_COMPILED: dict[tuple, tuple[StepCost, StepCost]] = {}


def compile_model(cfg, sh: Shapes, device, impl: str = "auto") -> tuple[StepCost, StepCost]:
    """(decode, prefill chunk) costs of cfg's model part (no sampler), each compiled once for `device`
    (remembered per process: plans of the same model at other splits compile nothing again)."""
    key = (repr(cfg), repr(sh), str(device), impl)
    if key not in _COMPILED:
        _COMPILED[key] = _compile_model(cfg, sh, device, impl)
    return _COMPILED[key]


def _compile_model(cfg, sh: Shapes, device, impl: str) -> tuple[StepCost, StepCost]:
    model = get_model(cfg.model_type)
    params = abstract_params(cfg, sh.dtype, sh.quantization)
    layout = abstract_layout(cfg, sh.dtype, sh.max_model_len, sh.page_size)
    pools = abstract_pools(layout, sh.rows, dict(sh.pages))
    S = jax.ShapeDtypeStruct
    out = []
    for step, Bb, extra in ((_decode_step, sh.decode_batch, (S((sh.decode_batch,), jnp.int32),
                                                              S((sh.decode_batch,), jnp.bool_))),
                            (_prefill_step, 1, (S((1, sh.chunk), jnp.int32), S((1,), jnp.int32)))):
        args = (params, pools, *_row_args(layout, Bb), *extra)
        compiled = jax.jit(step(model, cfg, impl), donate_argnums=(1,)).lower(*on_device(args, device)).compile()
        out.append(_cost(compiled))
    return out[0], out[1]


@functools.lru_cache(maxsize=16)
def compile_sampler(batch: int, vocab: int, device) -> StepCost:
    """The engine's full sampler on [batch, vocab] float32 logits."""
    S = jax.ShapeDtypeStruct
    args = (S((batch, vocab), jnp.float32), S((batch,), jnp.uint32), S((batch,), jnp.int32),
            S((batch,), jnp.float32), S((batch,), jnp.int32), S((batch,), jnp.float32))
    return _cost(jax.jit(_sampler).lower(*on_device(args, device)).compile())


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """Decode and prefill-chunk costs of the whole model, and how they were obtained."""
    decode: StepCost
    prefill: StepCost
    layers: str                          # "full" or "reduced"
    compiled_layers: tuple[int, ...]     # layers of each compiled program
    per_layer: dict                      # signature -> (decode, prefill) StepCost of one layer (reduced only)


def model_costs(cfg, sh: Shapes, device, layers: str = "auto", impl: str = "auto") -> ModelCosts:
    """The model part's costs, by a full compile or by layer scaling (module docstring)."""
    counts = layer_counts(cfg)
    if layers == "auto":
        layers = "full" if cfg.num_hidden_layers <= 2 * len(counts) + 2 else "reduced"
    if layers == "full":
        d, p = compile_model(cfg, sh, device, impl)
        return ModelCosts(d, p, "full", (cfg.num_hidden_layers,), {})
    if layers != "reduced":
        raise ValueError(f"layers must be 'auto', 'full' or 'reduced'; got {layers!r}")
    first = first_of_each(cfg)
    base_idx = list(first.values())
    base = compile_model(select_layers(cfg, base_idx), sh, device, impl)
    decode, prefill = base
    per_layer, sizes = {}, [len(base_idx)]
    for sig, i in first.items():
        more = compile_model(select_layers(cfg, base_idx + [i]), sh, device, impl)
        sizes.append(len(base_idx) + 1)
        dl, pl = more[0] - base[0], more[1] - base[1]
        per_layer[sig] = (dl, pl)
        decode, prefill = decode + dl.scaled(counts[sig] - 1), prefill + pl.scaled(counts[sig] - 1)
    clamp = lambda c: dataclasses.replace(c, temp_bytes=max(c.temp_bytes, 0.0))  # noqa: E731
    return ModelCosts(clamp(decode), clamp(prefill), "reduced", tuple(sizes), per_layer)
