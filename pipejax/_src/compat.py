"""The one place that knows about JAX-version details of sharding types.

JAX 0.10 tracks, for every value inside ``jax.shard_map``, the set of mesh axes along which it
varies ("vma"). Scan carries and ``lax.cond`` branches must agree on it, so values that start out
replicated have to be cast to "varying" explicitly. Everything pipejax needs of that machinery is
here, so a change in JAX touches one file.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Mesh axes along which ``x`` varies, inside ``shard_map`` (empty outside it)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # older spelling


def to_varying(tree: Any, axis_names: str | tuple[str, ...]) -> Any:
    """Casts every leaf of ``tree`` to vary along ``axis_names`` (one name or several).

    Leaves are cast only along the axes they do not vary along yet. On a mesh with several axes
    (data x stage) cast along all of them: scan carries and cond branches compare the full set.
    Never call this inside a ``lax.cond``/``lax.switch`` branch: the transpose of the cast is a
    ``psum``, and a collective that only some devices reach deadlocks the backward pass.
    """
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)

    def cast(x):
        missing = tuple(a for a in names if a not in varying_axes(x))
        if not missing:
            return x
        return lax.pcast(x, missing, to="varying")

    return jax.tree.map(cast, tree)


def is_manual(mesh: Mesh, axis_name: str) -> bool:
    """Whether ``axis_name`` of ``mesh`` is a Manual axis (one a ``shard_map`` already controls)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return types[axis_name] == AxisType.Manual


def is_explicit(mesh: Mesh, axis_name: str) -> bool:
    """Whether ``axis_name`` of ``mesh`` is an Explicit (sharding-in-types) axis."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return types[axis_name] == AxisType.Explicit


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis Auto (the same devices and names): programs that reshape
    dimensions sharded over Explicit axes run there, XLA choosing the communication."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def constrain(tree: Any, mesh: Mesh, spec: PartitionSpec, axis_name: str) -> Any:
    """Gives every leaf of ``tree`` the sharding ``NamedSharding(mesh, spec)`` inside ``jit``.

    Explicit axes need ``jax.reshard`` (``with_sharding_constraint`` only asserts there); Auto axes
    take a sharding constraint. Leaves whose type already carries the sharding are left alone.
    """
    sharding = NamedSharding(mesh, spec)
    if is_explicit(mesh, axis_name):

        def put(x):
            current = getattr(jax.typeof(x), "sharding", None)
            if (
                isinstance(current, NamedSharding)
                and current.mesh == mesh.abstract_mesh
                and _padded(current.spec, x.ndim) == _padded(spec, x.ndim)
            ):
                return x
            return jax.reshard(x, sharding)

        return jax.tree.map(put, tree)
    return jax.tree.map(lambda x: lax.with_sharding_constraint(x, sharding), tree)


def replicate(tree: Any, keep: PartitionSpec | None = None) -> Any:
    """Reshards leaves typed with Explicit mesh axes to replicated, on their own mesh.

    Values typed with Explicit axes refuse reshapes and slices across a sharded dimension, which
    micro-batching and parameter unpacking need. Other leaves are returned unchanged, and so are
    leaves sharded exactly as ``keep`` (e.g. a batch already split over a data axis, which
    splits into micro-batches in place).
    """

    def put(x):
        sharding = getattr(jax.typeof(x), "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
            return x
        if all(p is None for p in sharding.spec):
            return x
        if keep is not None and _padded(sharding.spec, x.ndim) == _padded(keep, x.ndim):
            return x
        return jax.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))

    return jax.tree.map(put, tree)


def like(x: jax.Array, template: jax.Array) -> jax.Array:
    """``x`` resharded to ``template``'s sharding type where an Explicit axis types them
    differently (values are unchanged); ``x`` itself otherwise."""
    want = getattr(jax.typeof(template), "sharding", None)
    have = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(want, NamedSharding) or want.mesh.empty or have is None:
        return x
    if _padded(want.spec, x.ndim) == _padded(have.spec, x.ndim):
        return x
    return jax.reshard(x, want.spec)


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` with a weak type (the type of a Python scalar), values and dtype unchanged.

    Packing a stage's parameters or activations into a typed buffer makes them strong; unpacking
    gives a weakly typed leaf its weak type back, so ``x * p`` with a Python-float ``p`` keeps
    ``x``'s dtype as it does outside the pipeline. JAX has no public spelling of this cast.
    """
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, x.dtype, weak_type=True)


def eager_autodiff(tree: Any) -> bool:
    """Whether a leaf of ``tree`` is being differentiated outside ``jit`` (a JVP/linearize
    tracer whose primal is a concrete array)."""
    for leaf in jax.tree.leaves(tree):
        depth = 0
        while isinstance(leaf, jax.core.Tracer) and hasattr(leaf, "primal"):
            leaf, depth = leaf.primal, depth + 1
        if depth and isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return True
    return False


def mesh_context_set() -> bool:
    """Whether a mesh context (``jax.set_mesh``) is active."""
    return not jax.sharding.get_abstract_mesh().empty


def saved_residuals(fn: Any, *args: Any) -> list[tuple[Any, str]]:
    """``(aval, description)`` of every value reverse-mode autodiff of ``fn`` saves for backward.

    JAX exposes this only as ``jax.ad_checkpoint.print_saved_residuals``; the list form lives in
    ``jax._src``, so it is imported here, the one module allowed to know JAX internals.
    """
    from jax._src import ad_checkpoint

    return ad_checkpoint.saved_residuals(fn, *args)


def in_forward_mode(tree: Any) -> bool:
    """Whether a leaf of ``tree`` carries a tangent of pure forward-mode autodiff (``jax.jvp``,
    ``jax.jacfwd``), which a ``jax.custom_vjp`` cannot take.

    With JAX's direct linearisation (the default in 0.10) reverse mode traces with
    ``LinearizeTracer`` and pure forward mode with ``JVPTracer``, so the two can be told apart
    at trace time; without it reverse mode also uses ``JVPTracer``, and this answers ``False``.
    """
    if not jax.config.jax_use_direct_linearize:
        return False
    from jax._src.interpreters import ad

    leaves = jax.tree.leaves(tree)
    return any(isinstance(leaf, ad.JVPTracer) and not isinstance(leaf.tangent, ad.Zero) for leaf in leaves)
