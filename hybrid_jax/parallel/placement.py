"""Where each parameter and cache field lives on the mesh, from its logical axes and the rule table.

`Layout(pc, mesh)` holds a layout's mesh and rules:
  param_shardings(family, params)   a NamedSharding per parameter leaf, from the family's
                                    `param_axes` (pattern -> logical names; every leaf must match one)
  cache_shardings(cache)            a NamedSharding per cache leaf, from each group's `AXES`
                                    (undeclared fields, page tables, lengths: replicated)
  put(tree, shardings)              the tree on the mesh (jax.device_put)

An FP8 weight kept on the device (`layers.linear.Fp8Weight`) splits its codes and block scales alike:
a dimension is split only where each device's part is whole scale blocks (else it stays whole), and
`annotate(family, params)` records the axes on the weight so `layers.linear` runs it per device.
Routed experts in FP8 split whole (enable_expert_parallel): their grouped-matmul kernel cannot take an
expert's columns split with gate | up side by side.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from functools import cached_property

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax.errors import ConfigError
from hybrid_jax.layers.linear import ColumnConcat, Fp8Weight
from hybrid_jax.layers.mlp import interleave_gate_up
from hybrid_jax.lazy_weights import Lazy
from hybrid_jax.lazy_weights import concat as lazy_concat
from hybrid_jax.parallel.config import ParallelConfig
from hybrid_jax.parallel.rules import partition_spec, rules


def path_name(path) -> str:
    """A pytree key path as "layers/3/gdn/in_proj"."""
    out = []
    for k in path:
        out.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return "/".join(out)


def leaf_axes(name: str, table: dict[str, tuple]) -> tuple:
    """The logical axes of the parameter at path `name`: the first pattern of `table` that matches it."""
    for pattern, axes in table.items():
        if fnmatch.fnmatchcase(name, pattern):
            return axes
    raise ConfigError(f"parameter {name!r} has no logical axes (no pattern of the family's param_axes matches it)")


@dataclasses.dataclass(frozen=True)
class Layout:
    pc: ParallelConfig
    mesh: Mesh

    @cached_property
    def rules(self) -> dict[str, str | None]:
        return rules(self.pc)

    @property
    def key(self) -> str:
        """The layout as the prefix cache's key part."""
        return self.pc.describe()

    def spec(self, axes: tuple, shape, where: str) -> PartitionSpec:
        """The PartitionSpec of an array of `shape` whose dimensions have the logical names `axes`."""
        return partition_spec(axes, shape, self.rules, dict(self.mesh.shape), where)

    def _sharding(self, axes: tuple, shape, where: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape, where))

    def place(self, family, params):
        """The parameters on this layout's devices, each on its shards (`annotate`, then `put`). A family
        without sharding rules may still run on a one-device replica: every leaf whole there."""
        if family.param_axes is None and dict(self.mesh.shape).get("model", 1) == 1:
            return self.put(params, jax.tree.map(lambda _: self.replicated, params,
                                                 is_leaf=lambda x: isinstance(x, Lazy)))
        params = self.annotate(family, params)      # FP8 weights: how linear runs them per device
        return self.put(params, self.param_shardings(family, params))

    def replicas(self) -> list[Layout]:
        """One layout per data-parallel replica: its row of the [data, model] mesh (tensor_parallel_size
        devices) with data_parallel_size 1; [self] without data parallelism. Each replica holds its own
        copy of the weights and its own pools (`engine.data_parallel`)."""
        if self.pc.data_parallel_size == 1:
            return [self]
        pc = dataclasses.replace(self.pc, data_parallel_size=1)
        return [Layout(pc, Mesh(row[None, :], self.mesh.axis_names)) for row in self.mesh.devices]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def fp8_axes(self, axes: tuple, w: Fp8Weight, where: str) -> tuple:
        """`axes` of an FP8 weight with every split dimension kept only where each device's part is whole
        scale blocks (block = (bk, bn) over the last two dimensions), so codes and scales split alike."""
        spec = self.spec(axes, w.w.shape, where)
        mesh = dict(self.mesh.shape)
        blocks = (1,) * (w.w.ndim - 2) + tuple(w.block)
        out = list(axes)
        for d, (m, dim, b) in enumerate(zip(spec, w.w.shape, blocks)):
            part = dim // mesh[m] // (2 if axes[d] == "gate_up" else 1) if m is not None else 0
            if m is not None and part % b:                 # gate_up: each device holds part of each half
                out[d] = None
        if w.w.ndim == 3 and (spec[1] is not None or spec[2] is not None):
            raise ConfigError(f"{where}: routed experts kept in FP8 are split whole or not at all; set "
                              f"enable_expert_parallel (or load the checkpoint dequantized)")
        return tuple(out)

    def _node(self, name: str, leaf, axes: tuple, placed: bool):
        """One parameter node under `axes`: with placed, its shardings (an FP8 weight: an Fp8Weight of its
        codes' and scales' shardings, with its effective axes), else the node laid out (an FP8 weight
        with its effective axes; a split "gate_up" weight's columns per device; any other array, and any
        shape, unchanged). A ColumnConcat (a fused projection held as column ranges of different kinds)
        gives each range the projection's axes, "gate_up" aside (its ranges stay whole)."""
        if isinstance(leaf, ColumnConcat):        # its ranges are laid out whole (no gate | up interleaving)
            axes = tuple(None if a == "gate_up" else a for a in axes)
            return ColumnConcat(tuple(self._node(f"{name}/parts/{i}", p, axes, placed)
                                      for i, p in enumerate(leaf.parts)))
        if isinstance(leaf, Fp8Weight):
            ax = self.fp8_axes(axes, leaf, f"parameter {name}")
            if not placed:
                n = self._gate_up_devices(ax, leaf.w.shape, name)
                leaf = dataclasses.replace(leaf, w=_gate_up_laid_out(leaf.w, n), scale=_gate_up_laid_out(leaf.scale, n))
                return dataclasses.replace(leaf, axes=ax)
            return dataclasses.replace(leaf, w=self._sharding(ax, leaf.w.shape, f"parameter {name}"),
                                       scale=self._sharding(ax, leaf.scale.shape, f"parameter {name} (scales)"),
                                       axes=ax)
        if placed:
            return self._sharding(axes, leaf.shape, f"parameter {name}")
        return _gate_up_laid_out(leaf, self._gate_up_devices(axes, leaf.shape, name))

    def _gate_up_devices(self, axes: tuple, shape, name: str) -> int:
        """Devices a "gate_up" dimension (the last) is split over under this layout; 1 when whole."""
        if not axes or axes[-1] != "gate_up":
            return 1
        m = self.spec(axes, shape, f"parameter {name}")[-1]
        return dict(self.mesh.shape)[m] if m is not None else 1

    def _map(self, family, params, placed: bool):
        if family.param_axes is None:
            raise ConfigError(f"model family {family.name!r} declares no parameter axes: it runs on one device only")

        def one(path, leaf):
            name = path_name(path)
            return self._node(name, leaf, leaf_axes(name, family.param_axes), placed)
        return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, (Fp8Weight, ColumnConcat)))

    def annotate(self, family, params):
        """params laid out for this layout: every FP8 weight carrying its effective logical axes
        (`Fp8Weight.axes`, which `param_shardings` also returns on its FP8 nodes, so the two trees have
        one structure), and every split "gate_up" weight's columns per device [gate_d | up_d]
        (`layers.mlp.interleave_gate_up`; shapes, as in a plan, pass unchanged)."""
        return self._map(family, params, placed=False)

    def param_shardings(self, family, params):
        """NamedSharding per leaf of `params` (arrays or ShapeDtypeStructs), from family.param_axes; an FP8
        weight's node is an Fp8Weight of the shardings of its codes and scales, with its axes."""
        return self._map(family, params, placed=True)

    def cache_shardings(self, cache):
        """NamedSharding per leaf of a ModelCache (arrays or shapes), from its groups' AXES."""
        groups = {}
        for gname, g in cache.groups.items():
            upd = {}
            for f in dataclasses.fields(g):
                a = getattr(g, f.name)
                if not f.metadata.get("pytree_node", True) or a is None:
                    continue
                axes = type(g).AXES.get(f.name)
                upd[f.name] = (self._sharding(axes, a.shape, f"cache group {gname}.{f.name}") if axes
                               else self.replicated)
            groups[gname] = g.replace(**upd)
        return cache.replace(groups=groups, lengths=self.replicated, version=self.replicated)

    def pin(self, cache):
        """A cache (a step's view of the pools, a forward's output cache, the pools) held to this layout
        inside a traced step: left free, the partitioner may split a replicated pool the way a read
        wants it and gather it back whole at the step's end."""
        return jax.lax.with_sharding_constraint(cache, self.cache_shardings(cache))

    def put(self, tree, shardings):
        """tree on the mesh. A host leaf goes to each device as that device's slice only; one read by
        parts (`lazy_weights.Lazy`) reads only those slices, each once."""
        def one(x, sharding):
            if not isinstance(x, Lazy):
                return jax.device_put(x, sharding)
            parts = {}

            def part(index):
                key = tuple((s.start, s.stop) for s in index)
                if key not in parts:
                    parts[key] = x.read(index)
                return parts[key]
            return jax.make_array_from_callback(x.shape, sharding, part)
        return jax.tree.map(one, tree, shardings, is_leaf=lambda x: isinstance(x, Lazy))


def lazy_gate_up(a: Lazy, n: int) -> Lazy:
    """`layers.mlp.interleave_gate_up` of a weight read by parts, still read by parts: its columns
    [gate | up] as n device blocks [gate_d | up_d]."""
    per = a.shape[-1] // 2 // n
    half = a.shape[-1] // 2
    return lazy_concat([a[..., lo:lo + per] for d in range(n) for lo in (d * per, half + d * per)], -1)


def entry_copies(logical, placed) -> tuple[tuple[str, str, int, int], ...]:
    """(group, field, axis, r) for each field of cache `placed` (shapes under a layout) that holds r
    copies of each entry of the same field of `logical` (the shapes with no layout) along `axis`
    (KV heads kept once per device, `context.kv_replicas`). A field that differs otherwise is an error."""
    out = []
    for gname, g in logical.groups.items():
        h = placed.groups[gname]
        for f in dataclasses.fields(g):
            a, b = getattr(g, f.name), getattr(h, f.name)
            if not f.metadata.get("pytree_node", True) or a is None or a.shape == b.shape:
                continue
            diff = [d for d, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
            if a.ndim != b.ndim or len(diff) != 1 or b.shape[diff[0]] % a.shape[diff[0]]:
                raise ValueError(f"cache group {gname}.{f.name}: {b.shape} under the layout is not copies of "
                                 f"{a.shape} along one axis")
            out.append((gname, f.name, diff[0], b.shape[diff[0]] // a.shape[diff[0]]))
    return tuple(out)


def make_layout(pc: ParallelConfig, cfg, family, devices=None) -> Layout | None:
    """The Layout for `pc` over the first pc.world_size of `devices` (default jax.devices()), checked
    against the model config before any weight is read; None on one device (nothing to place)."""
    from hybrid_jax.parallel.mesh import build_mesh  # noqa: PLC0415
    devices = list(jax.devices() if devices is None else devices)
    if pc.world_size > len(devices):
        raise ConfigError(
            f"data_parallel_size x tensor_parallel_size = {pc.data_parallel_size} x {pc.tensor_parallel_size} = "
            f"{pc.world_size} devices, but JAX sees {len(devices)} ({devices[0].platform})")
    if jax.process_count() > 1 and pc.world_size != len(devices):
        raise ConfigError(
            f"{jax.process_count()} processes share {len(devices)} devices: data_parallel_size x "
            f"tensor_parallel_size must use all of them (got {pc.world_size}), every process running its part")
    if jax.process_count() > 1 and pc.data_parallel_size > 1:
        raise ConfigError("data_parallel_size > 1 with several processes is not supported yet: run one "
                          "multi-process server per replica")
    pc.check(cfg, pc.world_size)
    if pc.single_device:
        return None
    if family.param_axes is None and pc.tensor_parallel_size > 1:
        raise ConfigError(f"model family {family.name!r} has no sharding rules yet: it runs with "
                          f"tensor_parallel_size 1 only")
    return Layout(pc, build_mesh(pc, devices[:pc.world_size]))


def _gate_up_laid_out(x, n: int):
    """A "gate_up" array's columns in n device blocks [gate_d | up_d]: a Lazy one re-ordered as it is read,
    an array now; an abstract shape (a plan's ShapeDtypeStruct) keeps its shape, which the order does not
    change; n == 1 leaves any unchanged."""
    if n == 1:
        return x
    if isinstance(x, Lazy):
        return lazy_gate_up(x, n)
    return interleave_gate_up(x, n) if isinstance(x, (jax.Array, np.ndarray)) else x
