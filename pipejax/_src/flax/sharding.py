"""Where a Flax adapter's arrays live on a mesh: the layers' own sharding metadata as
``param_specs`` (:func:`layer_specs`), a train state moved onto the mesh before its first step
(:func:`on_mesh`), and an orbax restore target on a concrete mesh (:func:`restore_target`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any


def on_mesh(tree: PyTree, mesh: Mesh) -> PyTree:
    """``tree`` with every array that is not on ``mesh`` moved onto it, replicated.

    A jitted train step returns the arrays it does not shard replicated over the mesh. Arrays
    that start on one device (parameters loaded from elsewhere, the embedding and head of a model
    built outside ``jax.set_mesh``, ``optimizer.init`` run outside it) therefore come back with
    another sharding, and the second step compiles again. Put the train state through this once
    before the first step: arrays already on the mesh (the stage-sharded pipeline parameters)
    are left as they are, so the first step's shardings are the steady-state ones.

    Args:
      tree: a pytree of arrays (an ``nnx.State`` too; Python scalars and numpy arrays are left
        alone, they are not committed to a device).
      mesh: the pipeline's mesh.

    Returns:
      ``tree`` with the same structure.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh`` (e.g. an axis name).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.flax import on_mesh
      >>> mesh = jax.make_mesh((2,), ("stage",))
      >>> on_mesh({"w": jnp.ones(3)}, mesh)["w"].sharding.spec
      P()
    """
    if not isinstance(mesh, Mesh):
        named = isinstance(mesh, str)
        hint = " An axis name is not a mesh: pass the Mesh that axis belongs to." if named else ""
        raise TypeError(
            f"`mesh` of on_mesh must be a jax.sharding.Mesh (the pipeline's mesh, e.g. "
            f"`jax.make_mesh((2,), ('stage',))`), but got {type(mesh).__name__} {mesh!r}.{hint}"
        )
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())

    def put(a):
        if (
            isinstance(a, jax.Array)
            and not isinstance(a, jax.core.Tracer)
            and a.sharding.device_set != devices
        ):
            return jax.device_put(a, replicated)
        return a

    return jax.tree.map(put, tree)


def restore_target(tree: PyTree, mesh: Mesh) -> PyTree:
    """An orbax restore target on ``mesh`` for a train state's shapes: every leaf a
    ``jax.ShapeDtypeStruct`` with a ``NamedSharding`` of ``mesh``.

    The shapes of a model built for a mesh come from ``nnx.eval_shape`` (or ``jax.eval_shape``)
    without materialising it, but their shardings name an ``AbstractMesh``, which orbax cannot
    restore to (``_device_assignment is not implemented``), and leaves created outside any
    sharding rule (the optimizer's step count, rng counters) have none. This gives each leaf its
    own ``PartitionSpec`` on the concrete ``mesh`` (the stage-sharded pipeline parameters stay
    split over the stage axis), and replicates the leaves that have none. Each process then
    reads only the shards it holds. Concrete arrays are accepted too (their specs are kept).

    Args:
      tree: a pytree of ``jax.ShapeDtypeStruct`` or arrays: e.g. ``nnx.state((model,
        optimizer))`` of ``nnx.eval_shape(build)``, or ``jax.eval_shape`` of a Linen ``init``.
      mesh: the mesh to restore onto: the one the model is built for.

    Returns:
      ``tree`` with the same structure, each leaf a ``jax.ShapeDtypeStruct`` on ``mesh``.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: a leaf's ``PartitionSpec`` names an axis that ``mesh`` lacks (the state was
        built for another mesh).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from pipejax.flax import restore_target
      >>> mesh = jax.make_mesh((2,), ("stage",))
      >>> split = NamedSharding(mesh.abstract_mesh, P("stage"))  # as eval_shape gives it
      >>> shapes = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=split),
      ...           "step": jax.ShapeDtypeStruct((), jnp.int32)}
      >>> target = restore_target(shapes, mesh)
      >>> target["w"].sharding.spec, target["step"].sharding.spec
      (P('stage',), P())
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "`mesh` of restore_target must be a jax.sharding.Mesh (the mesh to restore onto, e.g. "
            f"`jax.make_mesh((4,), ('stage',))`), but got {type(mesh).__name__} {mesh!r}."
        )
    struct = lambda a, spec: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree.map(struct, tree, restore_specs(tree, mesh))


def restore_specs(tree: PyTree, mesh: Mesh) -> PyTree:
    """Each leaf's own ``PartitionSpec`` (``P()`` when it has none), checked against ``mesh``'s
    axes."""

    def one(path, a):
        sharding = getattr(a, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        named = {n for p in spec if p is not None for n in ((p,) if isinstance(p, str) else p)}
        missing = sorted(named - set(mesh.axis_names))
        if missing:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path) or '<root>'} of restore_target's `tree` is "
                f"sharded as {spec}, but `mesh` has no axis {', '.join(map(repr, missing))} (its "
                f"axes: {mesh.axis_names}). Build the abstract state for the mesh you restore onto "
                "(the same `mesh=`), or restore on the saved mesh and re-cut the stages "
                "(`to_sequential` / `from_sequential`)."
            )
        return spec

    return jax.tree_util.tree_map_with_path(one, tree)


def layer_specs(boxed: Sequence[PyTree], plan: Any) -> list[PyTree] | None:
    """Per layer, the ``PartitionSpec`` of each parameter leaf over the mesh's non-stage axes,
    from Linen's sharding metadata: ``nn.with_partitioning`` boxes name mesh axes,
    ``nn.with_logical_partitioning`` boxes logical axes that the rules in effect
    (``nn.logical_axis_rules(...)``, or the box's own ``rules``) map to mesh axes. ``None`` when
    no leaf is sharded over a mesh axis other than the stage axis (``plan.inner_axes``; none
    without a mesh)."""
    if not plan.inner_axes:
        return None
    from flax import linen as nn

    def spec_of(box):
        if isinstance(box, nn.LogicallyPartitioned):
            return nn.logical_to_mesh_axes(box.names, box.rules)
        if isinstance(box, nn.Partitioned):
            return PartitionSpec(*box.names)
        return None

    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    return split_specs([jax.tree.map(spec_of, layer, is_leaf=is_box) for layer in boxed], plan)


def split_specs(specs: Sequence[PyTree], plan: Any) -> list[PyTree] | None:
    """``specs`` (per layer, a ``PartitionSpec`` or ``None`` per parameter leaf) restricted to the
    mesh axes other than the stage axis (``plan.inner_axes``), or ``None`` when nothing is left to
    split (always without a mesh). Names that are not mesh axes (logical axes no rule mapped)
    split nothing."""
    keep = plan.inner_axes

    def restrict(spec):
        if not isinstance(spec, PartitionSpec):
            return None
        entries = []
        for p in spec:
            names = tuple(a for a in (() if p is None else (p,) if isinstance(p, str) else p) if a in keep)
            entries.append(None if not names else names[0] if len(names) == 1 else names)
        return PartitionSpec(*entries) if any(e is not None for e in entries) else None

    is_spec = lambda x: x is None or isinstance(x, PartitionSpec)
    restricted = [jax.tree.map(restrict, layer, is_leaf=is_spec) for layer in specs]
    split = any(
        isinstance(p, PartitionSpec) for layer in restricted for p in jax.tree.leaves(layer, is_leaf=is_spec)
    )
    return restricted if split else None
