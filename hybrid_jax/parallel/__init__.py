"""Many devices: the mesh, the logical-axis rule table and the placement of parameters and cache.

  config.ParallelConfig     the layout options in vLLM's names (tensor_parallel_size,
                            data_parallel_size, enable_expert_parallel), checked against the devices
                            and the model's head / expert counts before any weight is read
  mesh.build_mesh           the jax.sharding.Mesh of a layout: axes ("data", "model")
  rules                     logical axis names (vocab, embed, heads, kv_heads, mlp, experts, ...) and
                            the one table that maps them to mesh axes
  placement                 each parameter's and cache field's NamedSharding from its family's
                            logical axes; params and pools put onto the mesh

The models themselves stay single-program code: XLA's SPMD partitioner splits each jitted step by
the shardings of its inputs (the parameters and the cache pools), inserting the collectives.
"""
from hybrid_jax.parallel.config import ParallelConfig
from hybrid_jax.parallel.mesh import build_mesh
from hybrid_jax.parallel.placement import Layout

__all__ = ["Layout", "ParallelConfig", "build_mesh"]
