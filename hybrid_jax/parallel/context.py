"""The layout a step is traced under, and the ops that run per device inside it (`jax.shard_map`).

Most of a model is single-program code that XLA's SPMD partitioner splits by the shardings of the
parameters and the pools. A Pallas kernel cannot be split that way: the partitioner sees an opaque
custom call and gathers its operands whole onto every device (every head's state, every expert's
weights). Those ops run under `shard_map` instead, each device on the heads or experts it holds:

  with active(layout): jitted(...)     traces the step with `layout` as the current one (the runner
                                       and `hybrid-jax plan` wrap their jitted steps in `Traced`)
  kv_replicas(Hkv)                     copies of each KV head the cache holds (fewer KV heads
                                       than devices: one per device, as vLLM lays them out)
  constrain(x, axes)                   x pinned to its logical axes' sharding (a pool after a write)
  per_device(fn, in_axes, out_axes)    fn on each device's part of its inputs, each input and output
                                       named by logical axes (the rule table of `rules.py` turns them
                                       into PartitionSpecs: nothing here names a mesh axis but the
                                       tensor axis fn may reduce over, `MODEL`)

With no layout (one device) or a one-device tensor axis, `per_device(fn, ...)` is fn itself.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax

MODEL = "model"             # the tensor axis, for collectives inside a per-device function

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hybrid_jax_layout", default=None)


@contextlib.contextmanager
def active(layout):
    """Make `layout` (a placement.Layout, or None) the current one while the block runs."""
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)


def current():
    """The Layout being traced under, or None (one device)."""
    return _ACTIVE.get()


def tensor_size() -> int:
    """Devices of the current layout's tensor axis (1 without a layout)."""
    lay = current()
    return 1 if lay is None else dict(lay.mesh.shape).get(MODEL, 1)


def kv_replicas(num_kv_heads: int) -> int:
    """Copies of each KV head the cache holds under the current layout. With fewer KV heads than
    devices on the tensor axis and the tensor size a multiple of them, tp // Hkv: the cache stores
    Hkv * r heads (head j a copy of KV head j // r), split over the devices, so each device holds
    exactly the one KV head its query heads read (vLLM's layout), instead of every KV head whole
    on every device and a slice of it taken per step. 1 otherwise (one device, or KV heads split)."""
    tp = tensor_size()
    return tp // num_kv_heads if tp > num_kv_heads and tp % num_kv_heads == 0 else 1


def constrain(x, axes: tuple):
    """x held to the sharding its logical `axes` give under the current layout (x itself without one).
    A cache pool updated inside a step is pinned this way right after the write: left free, the
    partitioner may split a replicated pool the way a later read wants it and gather it back whole
    (for a 32k-token KV pool, gigabytes per layer and step)."""
    lay = current()
    if lay is None or tensor_size() == 1:
        return x
    sharding = jax.sharding.NamedSharding(lay.mesh, lay.spec(axes, x.shape, "a constrained value"))
    return jax.lax.with_sharding_constraint(x, sharding)


class Traced:
    """A jitted function that is traced (called or lowered) with `layout` current: its per-device ops
    see the mesh. Calls pass straight through when layout is None."""

    def __init__(self, layout, jitted):
        self.layout, self.jitted = layout, jitted

    def __call__(self, *args, **kwargs):
        with active(self.layout):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with active(self.layout):
            return self.jitted.lower(*args, **kwargs)

    def __getattr__(self, name):      # the jitted function's other attributes (e.g. _cache_size)
        return getattr(self.jitted, name)


def _spec(lay, axes, leaf):
    if axes is None:
        return jax.sharding.PartitionSpec()
    return lay.spec(axes, leaf.shape, "a per-device op's operand")


def _specs(lay, tree, axes):
    """A PartitionSpec per leaf of `tree`, every leaf named by the same logical `axes` (None: replicated)."""
    return jax.tree.map(lambda leaf: _spec(lay, axes, leaf), tree)


def per_device(fn, in_axes: tuple, out_axes, out_like=None):
    """fn run on each device's part of its arguments under the current layout's mesh.
    in_axes: per positional argument, the logical axes of every leaf of it (None: replicated);
    out_axes: the same for fn's output (a tuple per output when fn returns a tuple, or one entry);
    None: the output is the same on every device (fn reduced it over MODEL itself); out_like: arrays
    (or shapes) with the outputs' global shapes, when fn cannot be traced outside the mesh (it reads
    `jax.lax.axis_index`); by default fn's output shapes at the global inputs.
    The arguments' global shapes decide which named axes are split (an axis the rules replicate when
    indivisible, e.g. kv_heads, stays whole), so fn must read its local shapes, not assume a split.
    Without a layout, or with one device on the tensor axis, returns fn unchanged."""
    lay = current()
    if lay is None or tensor_size() == 1:
        return fn

    def run(*args):
        if len(args) != len(in_axes):
            raise TypeError(f"per_device: {len(args)} arguments for {len(in_axes)} axes entries")
        in_specs = tuple(_specs(lay, a, ax) for a, ax in zip(args, in_axes))
        if out_axes is None:              # replicated output (e.g. summed over the tensor axis by fn)
            out_specs = jax.sharding.PartitionSpec()
        else:
            out = jax.eval_shape(fn, *args) if out_like is None else out_like
            out_specs = (tuple(_specs(lay, o, ax) for o, ax in zip(out, out_axes)) if isinstance(out, tuple)
                         else _specs(lay, out, out_axes))
        return jax.shard_map(fn, mesh=lay.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    return run
