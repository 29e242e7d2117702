"""The pipeline's options, each checked once, at construction, with a message that names the
argument, the value received, the rule and the fix; and the static checks of ``params`` and
``state`` that need no tracing (:func:`check_params_shape`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from pipejax._src import checkpoint as ckpt
from pipejax._src import checks, compat
from pipejax._src.params import placement
from pipejax._src.schedules.kinds import SCHEDULES, table_schedule

PyTree = Any


# --- validation ------------------------------------------------------------------------------


def check_stages(stages, num_stages) -> tuple[bool, tuple[Callable[..., Any], ...]]:
    if callable(stages) and not isinstance(stages, Sequence):
        if num_stages is None:
            raise TypeError(
                "`stages` is a single function, so the pipeline is homogeneous and needs "
                "`num_stages` (e.g. `pipeline(stage, num_stages=4)`). For different stages pass "
                "a sequence of functions instead."
            )
        count = checks.count(num_stages, "num_stages", what="the number of stages the function makes")
        return True, (stages,) * count
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
        raise TypeError(
            "`stages` must be a sequence of stage functions `stage(params, x, key) -> y`, or one "
            f"such function with `num_stages`; got {type(stages).__name__}."
        )
    if len(stages) == 0:
        raise ValueError(
            "`stages` is empty; a pipeline needs at least one stage function `stage(params, x, key) -> y`."
        )
    for s, stage in enumerate(stages):
        if not callable(stage):
            raise TypeError(
                f"`stages[{s}]` must be a callable `stage(params, x, key) -> y`, but got "
                f"{type(stage).__name__} {stage!r}."
            )
    if num_stages is not None and num_stages != len(stages):
        raise ValueError(
            f"`num_stages` is {num_stages} but {len(stages)} stage functions were given; drop "
            "`num_stages` (it is only needed for a single homogeneous stage function)."
        )
    return False, tuple(stages)


def check_chunks(chunks) -> int:
    return checks.count(chunks, "chunks", what="the number of micro-batches per mini-batch")


def check_schedule(schedule, repeats, num_stages):
    """Validates the schedule (a name, or a user's table builder) and ``repeats``; returns
    ``(the schedule object, repeats as an int)``."""
    kinds = ", ".join(repr(k) for k in SCHEDULES)
    if callable(schedule) and not isinstance(schedule, str):
        kind = table_schedule(schedule)
    elif not isinstance(schedule, str):
        raise TypeError(
            f"`schedule` must be one of {kinds}, or a function `(num_devices, num_micro) -> "
            f"pj.Schedule` (a table you write), but got {type(schedule).__name__} {schedule!r}."
        )
    elif schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {kinds}, but got {schedule!r}.")
    else:
        kind = SCHEDULES[schedule]
    repeats = kind.resolve_repeats(
        checks.count(repeats, "repeats", what="the number of stages each device holds")
    )
    if not kind.takes_repeats and repeats != 1 and not kind.v_shape:
        raise ValueError(
            f"`repeats={repeats}` needs `schedule='circular'` or `'interleaved-1f1b'`: the "
            f"{schedule!r} schedule runs one stage per device. Pass one of those or drop `repeats`."
        )
    if num_stages % repeats:
        raise ValueError(
            f"The {kind.name!r} schedule with `repeats={repeats}` needs a number of stages that is a "
            f"multiple of {repeats} (each device holds {repeats} stages), but the pipeline has "
            f"{num_stages} stages. Use {repeats * max(1, round(num_stages / repeats))} stages or "
            "change `repeats`."
        )
    return kind, repeats


def check_checkpoint(checkpoint, kind):
    """The checkpoint mode, ``None`` resolved to the schedule's default (``"except_last"`` for the
    forward schedules, ``"always"`` for those that own the backward pass), and checked against
    the rule of the schedule ``kind`` (:mod:`pipejax._src.schedules.kinds`)."""
    if checkpoint is None:
        return kind.default_checkpoint
    ckpt.check_mode(checkpoint)
    return kind.check_checkpoint(checkpoint)


def check_mesh(mesh, axis_name, num_devices, repeats=1) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh or None, but got {type(mesh).__name__}. Make one "
            f"with `jax.make_mesh(({num_devices},), ({axis_name!r},))`."
        )
    checks.mesh_axis(mesh, axis_name, "axis_name", f"jax.make_mesh(({num_devices},), ({axis_name!r},))")
    check_not_manual(mesh, axis_name, "axis_name")
    size = mesh.shape[axis_name]
    if size != num_devices and repeats > 1:
        raise ValueError(
            f"`mesh` axis {axis_name!r} has size {size}, but the circular pipeline has "
            f"{num_devices * repeats} stages with `repeats={repeats}`, which need {num_devices} "
            f"devices ({repeats} stages each). Use `jax.make_mesh(({num_devices},), "
            f"({axis_name!r},))` or change `repeats`."
        )
    if size != num_devices:
        raise ValueError(
            f"`mesh` axis {axis_name!r} has size {size}, but the pipeline has {num_devices} stages; "
            "each device along the stage axis runs one stage, so the sizes must be equal. Use "
            f"`jax.make_mesh(({num_devices},), ({axis_name!r},))` or change the number of stages "
            "(or hold several stages per device with `schedule='circular', repeats=...`)."
        )


def check_no_mesh(data_axis_name, param_specs, axis_name) -> None:
    """Without a mesh: neither a data axis nor ``param_specs``, which name mesh axes."""
    if data_axis_name is not None:
        checks.axis_name(data_axis_name, "data_axis_name", or_none=True)
        raise ValueError(
            f"`data_axis_name={data_axis_name!r}` needs a mesh with that axis, but `mesh` is None. "
            f"Pass e.g. `mesh=jax.make_mesh((2, n), ({data_axis_name!r}, {axis_name!r}))`, or drop "
            "`data_axis_name`."
        )
    if param_specs is not None:
        raise ValueError(
            "`param_specs` shards parameters over mesh axes inside their stage, but `mesh` is "
            "None. Give a mesh with the axes the specs name, or drop `param_specs`."
        )


def check_not_manual(mesh, name, arg) -> None:
    if compat.is_manual(mesh, name):
        shape = tuple(mesh.shape.values())
        raise ValueError(
            f"`mesh` axis {name!r} (`{arg}`) has type AxisType.Manual, but the pipeline runs its "
            "own `shard_map` over its stage and data axes, so they must be Explicit (the default "
            "of `jax.make_mesh`) or Auto. Build the mesh with `jax.make_mesh("
            f"{shape}, {tuple(mesh.axis_names)})`, and call the pipeline outside any `shard_map` "
            "over these axes."
        )


def check_data_axis(data_axis_name, mesh, axis_name) -> int:
    """Validates the data axis; returns its size (1 without one)."""
    if data_axis_name is None:
        return 1
    checks.axis_name(data_axis_name, "data_axis_name", or_none=True)
    if data_axis_name == axis_name:
        raise ValueError(
            f"`data_axis_name` and `axis_name` are both {axis_name!r}; the data axis must be another "
            "axis of the mesh than the stage axis."
        )
    example = f"jax.make_mesh((2, {mesh.shape[axis_name]}), ({data_axis_name!r}, {axis_name!r}))"
    checks.mesh_axis(mesh, data_axis_name, "data_axis_name", example)
    check_not_manual(mesh, data_axis_name, "data_axis_name")
    if compat.is_explicit(mesh, data_axis_name) != compat.is_explicit(mesh, axis_name):
        raise ValueError(
            f"The data axis {data_axis_name!r} and the stage axis {axis_name!r} of `mesh` have "
            "different axis types (one Explicit, one Auto); give both the same type in "
            "`jax.make_mesh(..., axis_types=...)`."
        )
    return mesh.shape[data_axis_name]


def check_params_shape(params, pipe: Any, name: str = "params") -> None:
    """Static checks on ``params`` (or ``state``, which takes the same forms) that need no tracing."""
    pipe.kind.check_params(params, pipe, name)


def is_concrete(a) -> bool:
    return isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)


def check_tied(tied, num_stages) -> tuple[tuple[tuple[int, tuple[str, ...]], ...], ...]:
    """``tied`` as groups of ``(stage, path)`` members, a path as a tuple of its keys as strings.

    The structure is checked here, at construction; that each path names an array leaf of the
    stage's parameters, and that a group's leaves agree in shape and dtype, is checked when the
    parameters are seen (:func:`pipejax._src.params.forms.tie`).
    """
    if tied is None:
        return ()
    example = '`tied=[[(0, "embed"), (3, "unembed")]]`'
    if isinstance(tied, (str, bytes)) or not isinstance(tied, Sequence):
        raise TypeError(
            "`tied` must be a list of groups, each a list of `(stage, path)` pairs naming the "
            f"copies of one weight (e.g. {example}), but got {type(tied).__name__} {tied!r}."
        )
    groups, seen = [], {}
    for g, group in enumerate(tied):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or len(group) < 2:
            raise ValueError(
                f"`tied[{g}]` must be a list of at least two `(stage, path)` pairs, the copies of one "
                f"weight on different stages (e.g. {example}), but got {group!r}."
            )
        members = []
        for i, member in enumerate(group):
            where = f"`tied[{g}][{i}]`"
            if isinstance(member, (str, bytes)) or not isinstance(member, Sequence) or len(member) != 2:
                raise ValueError(
                    f"{where} must be a pair `(stage, path)`, the stage's index and the path of the "
                    f"copy in that stage's parameters (e.g. {example}), but got {member!r}."
                )
            stage = placement.stage_index(member[0], num_stages, name=f"tied[{g}][{i}][0]")
            path = tied_path(member[1], where)
            if stage in [s for s, _ in members]:
                raise ValueError(
                    f"{where} names stage {stage} again: the copies of one tied weight live on "
                    f"different stages (a stage holds one copy), but `tied[{g}]` is {group!r}. "
                    "Keep one member per stage."
                )
            if (stage, path) in seen:
                raise ValueError(
                    f"{where} names the leaf {'/'.join(path)!r} of stage {stage}, which `tied"
                    f"[{seen[stage, path]}]` names too; a leaf belongs to one group. Merge the two "
                    "groups into one."
                )
            seen[stage, path] = g
            members.append((stage, path))
        groups.append(tuple(members))
    return tuple(groups)


def tied_path(path, where) -> tuple[str, ...]:
    """A tied leaf's path in its stage's parameters, as its keys (dict keys, sequence indices,
    attribute names), each as a string: from a ``'/'``-separated string or a tuple of keys."""
    if isinstance(path, str):
        keys = tuple(path.split("/"))
    elif isinstance(path, (tuple, list)) and all(isinstance(k, (str, int)) for k in path):
        keys = tuple(str(k) for k in path)
    else:
        keys = ()
    if not keys or "" in keys:
        raise ValueError(
            f"{where}: the path of a tied leaf must be a '/'-separated string of its keys in the "
            "stage's parameters (e.g. `'embed/table'`, `'layers/0/w'`) or a tuple of its keys "
            f"(e.g. `('embed', 'table')`, `('layers', 0, 'w')`), but got {path!r}."
        )
    return keys


def check_not_abstract(tree, name: str = "params") -> None:
    """A call computes on arrays: a ``jax.ShapeDtypeStruct`` leaf (shapes only) is refused."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"`{name}` leaf {jax.tree_util.keystr(path) or '<root>'} is a jax.ShapeDtypeStruct "
                f"({leaf.dtype}{list(leaf.shape)}), which has a shape but no values, and the pipeline "
                "computes on values. Pass arrays; for shapes alone use `jax.eval_shape(pipe, params, "
                "x)`, and for memory `pj.memory_estimate`."
            )
