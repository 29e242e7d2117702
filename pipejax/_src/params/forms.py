"""The forms of stage parameters and state: their stage-major and device-major layouts.

Users pass stage parameters as a list of per-stage pytrees, a packed :class:`StageParams`, or
(homogeneous stages) pytrees stacked on a stage axis, stage-major ``(S, ...)`` or, as ``place``
lays them out for the circular schedule, device-major ``(v, n, ...)``. The plan
(:meth:`pipejax._src.plan.Plan.runner_form`, through the stage kind) converts any of them into
the one form the engine reads, at the entry points only, with the layouts here;
:func:`leaf_specs` gives each placed leaf its ``PartitionSpec``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from pipejax._src import compat
from pipejax._src.params.placement import StageParams

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
    if not pipe.kind.stacks(tree):
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
    if tree is None or not pipe.kind.stacks(tree) or is_device_major(pipe, tree):
        return tree
    return reshape_stacked(tree, (pipe.repeats, pipe.num_devices), 1)


def stage_major(pipe, tree):
    """Stacked stages as ``(S, ...)``; other trees unchanged."""
    if not is_device_major(pipe, tree):
        return tree
    return reshape_stacked(tree, (pipe.num_stages,), 2)


def stage_lead(pipe, tree) -> tuple[int, ...]:
    """The leading stage axes of stacked ``tree``: ``(repeats, n)`` device-major, else ``(S,)``."""
    return (pipe.repeats, pipe.num_devices) if is_device_major(pipe, tree) else (pipe.num_stages,)


def stage_at(pipe, tree, s: int) -> tuple[int, ...]:
    """The index of stage ``s`` on the leading stage axes of stacked ``tree``."""
    lead = stage_lead(pipe, tree)
    return divmod(s, lead[1]) if len(lead) == 2 else (s,)


def stage_spec(pipe, tree) -> tuple[Any, ...]:
    """``PartitionSpec`` entries of the leading stage axes of stacked ``tree`` over the stage axis
    (the stages of a device-major tree are its axis 1)."""
    return (None,) * (len(stage_lead(pipe, tree)) - 1) + (pipe.axis_name,)


def placed_layouts(pipe) -> str:
    """The layouts stacked stages may take, for messages: ``(S, ...)``, and ``(v, n, ...)`` as
    ``place`` lays them out on a circular mesh."""
    if places_device_major(pipe):
        return f" (or {pipe.repeats}, {pipe.num_devices} as `place` lays them out)"
    return ""


def placed(pipe, tree):
    """Stacked stages as ``place`` lays them out: device-major on a circular mesh of ``n > 1``
    devices (device ``d`` stores column ``d``), stage-major otherwise."""
    return device_major(pipe, tree) if places_device_major(pipe) else tree


def mesh_layout(pipe, tree):
    """Stacked stages as the engine reads them on a mesh: ``(v, n, ...)`` with several stages
    per device, ``(S, ...)`` with one."""
    return device_major(pipe, tree) if pipe.repeats > 1 else tree


def places_device_major(pipe) -> bool:
    """Whether ``place`` lays stacked stages out device-major: several stages on each of n > 1 devices."""
    return pipe.repeats > 1 and pipe.num_devices > 1


def full_specs(pipe, params, splits):
    """The ``PartitionSpec`` of every leaf the engine reads of ``params`` (runner form, on a mesh),
    stage axis included; ``None`` without ``param_specs``."""
    return None if splits is None else leaf_specs(pipe, params, splits)


def leaf_specs(pipe, params, splits):
    """The ``PartitionSpec`` of every placed leaf of ``params`` (stacked leaves, or a
    ``StageParams``' buffers, one per slot): the stage axis (see :meth:`~pipejax._src.plan.Plan.stage_lead`),
    then the leaf's ``splits`` over the other axes (``None``: none)."""
    lead = pipe.stage_lead()
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


# --- tied weights -----------------------------------------------------------------------------
# A weight shared by several stages (an embedding and the output head) is one copy per holding
# stage. `tie` makes every copy's derivative the sum over its group without changing any value:
# copy i becomes c_i - sum_{j != i} (stop_gradient(c_j) - c_j). Each term is exactly +0.0 for a
# finite c_j, and x - (+0.0) is x bitwise for every x (-0.0 included, where x + 0.0 would give
# +0.0), so the values are the user's bits; the map is linear, its derivative with respect to
# every copy is the identity on each copy of the group, so forward mode, reverse mode and every
# order of them see the copies as one weight.


def tie(pipe, params):
    """``params`` with the tied copies of ``pipe.tied`` made one weight for autodiff (see above).

    Raises:
      ValueError: if a tied path names no array leaf of its stage's parameters, or the copies of
        a group differ in shape or dtype.
    """
    if not pipe.tied or params is None:
        return params
    view = pipe.kind.tie_view(pipe, params)
    deltas = []
    for g, group in enumerate(pipe.tied):
        copies = [view.read(s, path, f"tied[{g}][{i}]") for i, (s, path) in enumerate(group)]
        _check_copies(group, copies, g)
        zeros = [lax.stop_gradient(c) - c for c in copies]  # each exactly +0.0, derivative -1
        for i, member in enumerate(group):
            deltas.append((member, sum(z for j, z in enumerate(zeros) if j != i)))
    return view.subtract(deltas)


def check_tied_equal(pipe, params) -> None:
    """Raises if the copies of a tied weight in ``params`` (concrete, laid out by
    :meth:`~pipejax.Pipeline.place`) differ: the pipeline keeps equal copies equal, it does not
    make them so. Skipped for traced values, arrays not all addressable by this process, and
    trees without the tied leaves (a stateful pipeline's ``state``)."""
    if not pipe.tied or params is None:
        return
    view = pipe.kind.tie_view(pipe, params)
    for g, group in enumerate(pipe.tied):
        try:
            copies = [view.read(s, path, f"tied[{g}][{i}]") for i, (s, path) in enumerate(group)]
        except ValueError:  # the tree has no such leaves: not the parameters
            return
        if any(isinstance(c, jax.core.Tracer) or not c.is_fully_addressable for c in copies):
            return  # traced (``place`` under ``jit``) or held by several processes
        _check_copies(group, copies, g)
        (s0, p0), first = group[0], np.asarray(copies[0])
        for (s, path), c in zip(group[1:], copies[1:], strict=True):
            c = np.asarray(c)
            if not np.array_equal(first, c, equal_nan=True):
                diff = np.abs(first.astype(np.float64) - c.astype(np.float64))
                raise ValueError(
                    f"`tied[{g}]` ties stage {s0}'s leaf {'/'.join(p0)!r} to stage {s}'s leaf "
                    f"{'/'.join(path)!r}, but the copies differ (in {int(np.sum(first != c))} of "
                    f"{first.size} entries, by up to {np.nanmax(diff):.3g}). Tied copies are one "
                    "weight: the pipeline sums their gradients and keeps equal copies equal, but "
                    f"does not make them equal. Before `place`, set stage {s}'s {'/'.join(path)!r} "
                    f"to stage {s0}'s {'/'.join(p0)!r} (the same array)."
                )


def _check_copies(group, copies, g) -> None:
    (s0, p0), c0 = group[0], copies[0]
    for (s, path), c in zip(group, copies, strict=True):
        if not jnp.issubdtype(c.dtype, jnp.inexact):
            raise ValueError(
                f"`tied[{g}]`: stage {s}'s leaf {'/'.join(path)!r} has dtype {c.dtype}; a tied weight "
                "is differentiated, so its copies must be floating point."
            )
        if (c.shape, c.dtype) != (c0.shape, c0.dtype):
            raise ValueError(
                f"`tied[{g}]` ties stage {s0}'s leaf {'/'.join(p0)!r} ({c0.dtype}{list(c0.shape)}) to "
                f"stage {s}'s leaf {'/'.join(path)!r} ({c.dtype}{list(c.shape)}), but the copies of "
                "one weight must have the same shape and dtype. Give every holding stage an exact "
                "copy of the weight (a transposed use, such as logits `x @ table.T`, belongs in "
                "the stage function)."
            )


def _key_name(entry) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_paths(tree) -> list[tuple[str, ...]]:
    """The path of every leaf of ``tree`` as a tuple of key names, in flattening order (a tied
    path's form: ``("head", "table")`` for ``'head/table'``)."""
    return [tuple(_key_name(e) for e in p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _find(tree, path, where, s):
    """The flat index of the leaf of ``tree`` at ``path``, or a ``ValueError`` naming the paths
    there are."""
    paths = leaf_paths(tree)
    if path in paths:
        return paths.index(path)
    shown = ", ".join(repr("/".join(p)) for p in paths[:8]) + (", ..." if len(paths) > 8 else "")
    below = [p for p in paths if p[: len(path)] == path]
    rule = "names a subtree, not one array leaf; tie each leaf of it" if below else "names no leaf"
    raise ValueError(
        f"`{where}` is stage {s}'s path {'/'.join(path)!r}, which {rule} of that stage's "
        f"parameters (its leaves: {shown or 'none'}). Give the path of one array leaf, as a "
        "'/'-separated string or a tuple of its keys."
    )


class _PerStage:
    """A list with one parameter pytree per stage."""

    def __init__(self, pipe, params):
        self.params = [jax.tree.map(jnp.asarray, p) for p in params]

    def read(self, s, path, where):
        return jax.tree.leaves(self.params[s])[_find(self.params[s], path, where, s)]

    def subtract(self, deltas):
        out = list(self.params)
        for (s, path), z in deltas:
            leaves, treedef = jax.tree.flatten(out[s])
            k = _find(out[s], path, "", s)
            leaves[k] = leaves[k] - z
            out[s] = jax.tree.unflatten(treedef, leaves)
        return out


class _Stacked:
    """Homogeneous stages: every leaf stacked on the stage axis, ``(S, ...)`` or ``(v, n, ...)``.

    A stage's row is read as a masked sum over the stage axis, not an index into it: on a mesh
    that is an all-reduce of one row (Megatron's embedding-group all-reduce), where an index
    would gather the whole leaf."""

    def __init__(self, pipe, params):
        self.params = params
        self.lead = stage_lead(pipe, params)
        self.one = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[len(self.lead) :], a.dtype), params
        )

    def _mask(self, s, ndim):
        rows = np.zeros(self.lead, bool)
        rows[(s,) if len(self.lead) == 1 else (s // self.lead[1], s % self.lead[1])] = True
        return jnp.asarray(rows.reshape(self.lead + (1,) * ndim))

    def read(self, s, path, where):
        a = jax.tree.leaves(self.params)[_find(self.one, path, where, s)]
        rest = jnp.ndim(a) - len(self.lead)
        return jnp.sum(jnp.where(self._mask(s, rest), a, 0), axis=tuple(range(len(self.lead))))

    def subtract(self, deltas):
        leaves, treedef = jax.tree.flatten(self.params)
        for (s, path), z in deltas:
            k = _find(self.one, path, "", s)
            lead_ones = (1,) * len(self.lead)
            leaves[k] = leaves[k] - jnp.where(self._mask(s, z.ndim), z.reshape(lead_ones + z.shape), 0)
        return jax.tree.unflatten(treedef, leaves)


class _Packed(_Stacked):
    """A :class:`StageParams`: a stage's leaf is a range of columns of its dtype's buffer,
    whose rows are stacked on the stage axis like a homogeneous stage's leaves."""

    def __init__(self, pipe, params):
        if params.container.splits is not None:
            raise ValueError(
                "`tied` with a StageParams whose leaves are sharded inside their stage "
                "(`param_specs`) is not supported: a tied copy is then cut into blocks across the "
                "buffer. Pass the parameters as a list with one pytree per stage (the pipeline "
                "packs them inside its program), or drop `param_specs` for these stages."
            )
        self.params = params
        self.lead = params.buffers[0].shape[:2] if any(params.device_major()) else (params.num_stages,)

    def _where(self, s, path, where):
        """``(buffer, first column, shape)`` of stage ``s``'s leaf at ``path``."""
        layout = self.params.layouts[s]
        k = _find(layout.structs(), path, where, s)
        dtype = (
            np.dtype(layout.dtypes[k])
            if not jax.dtypes.issubdtype(layout.dtypes[k], jax.dtypes.extended)
            else None
        )
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"`{where}`: stage {s}'s leaf {'/'.join(path)!r} has dtype {layout.dtypes[k]}; a tied "
                "weight is differentiated, so its copies must be floating point."
            )
        start = sum(
            int(np.prod(shape))
            for shape, d in zip(layout.shapes[:k], layout.dtypes[:k], strict=True)
            if not jax.dtypes.issubdtype(d, jax.dtypes.extended) and np.dtype(d) == dtype
        )
        return self.params.container._slot(dtype, ()), start, layout.shapes[k]

    def read(self, s, path, where):
        b, start, shape = self._where(s, path, where)
        cols = self.params.buffers[b][..., start : start + int(np.prod(shape))]
        return jnp.sum(jnp.where(self._mask(s, 1), cols, 0), axis=tuple(range(len(self.lead)))).reshape(shape)

    def subtract(self, deltas):
        buffers = list(self.params.buffers)
        for (s, path), z in deltas:
            b, start, _ = self._where(s, path, "")
            size = buffers[b].shape[-1]
            flat = jnp.pad(z.reshape(-1), (start, size - start - z.size))
            lead_ones = (1,) * len(self.lead)
            buffers[b] = buffers[b] - jnp.where(self._mask(s, 1), flat.reshape(lead_ones + flat.shape), 0)
        return StageParams(tuple(buffers), self.params.container, self.params.layouts)
