"""The forms of stage parameters and state, and the one conversion into the engine's form.

Users pass stage parameters as a list of per-stage pytrees, a packed :class:`StageParams`, or
(homogeneous stages) pytrees stacked on a stage axis, stage-major ``(S, ...)`` or, as ``place``
lays them out for the circular schedule, device-major ``(v, n, ...)``. :func:`runner_form`
converts any of them into the one form the engine reads, at the entry points only, and
:func:`leaf_specs` gives each placed leaf its ``PartitionSpec``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pipejax._src import compat
from pipejax._src.placement import StageParams
from pipejax._src.placement import pack as pack_params

PyTree = Any


# --- stacked stage layouts ------------------------------------------------------------------------
# Stacked stages (homogeneous pytrees, StageParams buffers) come stage-major, ``(S, ...)``, or, for
# the circular schedule on n > 1 devices, device-major as ``place`` lays them out: ``(v, n, ...)``,
# entry [r, d] = stage r n + d, so that sharding axis 1 gives device d its v stages.


def is_device_major(pipe, tree) -> bool:
    """Whether stacked stages come as ``(repeats, n, ...)`` (never ambiguous: needs n > 1)."""
    if pipe.repeats == 1 or pipe.num_devices == 1 or tree is None:
        return False
    if isinstance(tree, StageParams):
        return bool(tree.buffers) and tree.device_major()[0]
    if not pipe.homogeneous:
        return False
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and jnp.ndim(leaves[0]) >= 1 and jnp.shape(leaves[0])[0] == pipe.repeats


def reshape_stacked(tree, lead, drop):
    """Every stacked leaf with its ``drop`` leading stage axes reshaped to ``lead``."""

    def fix(a):
        a = compat.replicate(jnp.asarray(a))  # Explicit sharding refuses reshapes of sharded axes
        return a.reshape((*lead, *a.shape[drop:]))

    if isinstance(tree, StageParams):
        return StageParams(tuple(fix(b) for b in tree.buffers), tree.container, tree.layouts)
    return jax.tree.map(fix, tree)


def device_major(pipe, tree):
    """Stacked stages as ``(repeats, n, ...)``; other trees (per-stage lists, None) unchanged."""
    stacked = pipe.homogeneous or isinstance(tree, StageParams)
    if tree is None or not stacked or is_device_major(pipe, tree):
        return tree
    return reshape_stacked(tree, (pipe.repeats, pipe.num_devices), 1)


def stage_major(pipe, tree):
    """Stacked stages as ``(S, ...)``; other trees unchanged."""
    if not is_device_major(pipe, tree):
        return tree
    return reshape_stacked(tree, (pipe.num_stages,), 2)


def runner_form(pipe, tree, splits=None):
    """``params``/``state`` in the one form the engine reads, converted once at the entry.

    Homogeneous stages: leaves stacked on the stage axis, ``(S, ...)`` (``(v, n, ...)`` on a
    circular mesh). Heterogeneous stages: a :class:`StageParams` on a mesh (laid out the same
    way), a list of per-stage pytrees without one (each virtual device calls its own stages).
    """
    if pipe.homogeneous:
        if pipe.mesh is None:
            return stage_major(pipe, tree)
        return device_major(pipe, tree) if pipe.repeats > 1 else tree
    if tree is None:
        tree = [None] * pipe.num_stages
    if pipe.mesh is None:
        return stage_major(pipe, tree).unpack() if isinstance(tree, StageParams) else list(tree)
    tree = tree if isinstance(tree, StageParams) else pack_params(tree, splits)
    return device_major(pipe, tree) if pipe.repeats > 1 else tree


def full_specs(pipe, params, splits):
    """The ``PartitionSpec`` of every leaf the engine reads of ``params`` (runner form, on a mesh),
    stage axis included; ``None`` without ``param_specs``."""
    return None if splits is None else leaf_specs(pipe, params, splits)


def leaf_specs(pipe, params, splits):
    """The ``PartitionSpec`` of every placed leaf of ``params`` (stacked leaves, or a
    ``StageParams``' buffers, one per slot): the stage axis (see :meth:`Pipeline._stage_lead`),
    then the leaf's ``splits`` over the other axes (``None``: none)."""
    lead = pipe._stage_lead()
    if isinstance(params, StageParams):
        return params.container.slot_specs(lead)
    leaves, treedef = jax.tree.flatten(params)
    per_leaf = splits if splits is not None else ((),) * len(leaves)
    return jax.tree.unflatten(
        treedef,
        [
            PartitionSpec(*lead, *split_spec(split, jnp.ndim(a) - len(lead)))
            for a, split in zip(leaves, per_leaf, strict=True)
        ],
    )


def split_spec(split, ndim: int) -> tuple[Any, ...]:
    """A leaf's ``PartitionSpec`` entries (one per dimension) from its split."""
    entries: list[Any] = [None] * ndim
    for dim, axes, _ in split:
        entries[dim] = axes[0] if len(axes) == 1 else axes
    while entries and entries[-1] is None:  # P("stage"), not P("stage", None, None)
        entries.pop()
    return tuple(entries)
