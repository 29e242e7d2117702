"""The layout-independent form of stage parameters: the model's layers.

A pipeline layout (the number of stages, the balance, the mesh, ``param_specs``) is a way of
cutting the model's *layers* into stages and sharding them. The layers themselves do not depend
on it, so a checkpoint saved in layer form restores into any layout:

- **homogeneous stages** hold their layers stacked on the axis after the stage axis, each leaf
  ``(S, k, ...)`` (``(v, n, k, ...)`` as ``place`` lays out the circular schedule); the layer
  form merges the two axes, ``(L, ...)`` with ``L = S k``, layer ``s k + j`` being layer ``j`` of
  stage ``s``. On a mesh it is sharded over the stage axis in blocks of ``k`` layers (and over
  the other axes as ``param_specs`` says), so converting either way is a reshape of each
  device's own shard: nothing moves between devices.
- **heterogeneous stages** in :func:`pipejax.partition`'s form hold a sequence of per-layer
  pytrees each; the layer form is the flat list of those (:meth:`pipejax.Partition.ungroup`), and
  ``balance`` groups it again. On a mesh each layer's leaves live on the devices of its stage
  only (a mesh with the stage axis cut to that one stage), sharded as ``param_specs`` says, and
  every stage is packed or unpacked on its own devices.

Orbax (tensorstore) restores a saved global array into any target sharding, each process
reading only the chunks its devices hold; :func:`layers_target` gives that target for a
layout. So: ``to_layers`` -> save; restore with ``layers_target`` -> ``from_layers``. Optax
states mirror the parameters, so every subtree of a train state with the parameters' structure
(the moments) is converted the same way; the rest (step counts) is left as it is.

The conversions are eager steps between a training loop and a checkpoint: they work inside or
outside ``jax.set_mesh`` alike (the result has the shardings the layout gives, whatever mesh the
context holds), and, on a mesh, take concrete arrays, not values traced by ``jax.jit``.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from pipejax._src import checks, compat, options
from pipejax._src.balance import _check_balance
from pipejax._src.params import forms as stage_forms
from pipejax._src.params.placement import StageParams
from pipejax._src.pipeline import Pipeline

PyTree = Any


def to_layers(pipe: Pipeline, tree: PyTree, *, params: PyTree = None) -> PyTree:
    """Stage parameters (or a train state holding them) in the layout-independent layer form.

    Homogeneous stages: every leaf ``(S, k, ...)`` (or ``(v, n, k, ...)``) becomes ``(L, ...)``,
    sharded over the stage axis in blocks of ``k`` layers, so each device reshapes its own shard
    (the circular layout's stages are not contiguous per device: XLA moves them, device to
    device). Heterogeneous stages in :func:`pipejax.partition`'s form (a list of per-stage
    sequences of layer pytrees, or the :class:`pipejax.StageParams` that ``place`` made of it)
    become the flat list of layer pytrees, each unpacked on its own stage's devices. Nothing is
    gathered on one device. (With several processes, orbax refuses to save an array held by
    one process's devices only, as a listed layer of a one-process stage is; the stacked form
    has no such arrays.)

    Args:
      pipe: the :class:`pipejax.Pipeline` the parameters are laid out for.
      tree: the parameters, or a pytree holding them (``{"params": p, "opt_state": s}``).
      params: the parameters inside ``tree``: every subtree of ``tree`` with their structure
        and leaf shapes (the parameters, an optimizer's moments) is converted, the rest left
        as it is. ``None``: ``tree`` is the parameters.

    Returns:
      ``tree`` with the parameters (and their likes) in layer form.

    Raises:
      TypeError: ``pipe`` is not a :class:`pipejax.Pipeline`; a leaf is not an array; on a mesh,
        ``tree`` is traced (a call inside ``jax.jit``: the conversion moves each device's own
        shards, so it needs concrete arrays); a heterogeneous stage's parameters are not a
        sequence of layers.
      ValueError: the parameters do not have the pipeline's stages (a homogeneous leaf without
        the stage axis or the layer axis after it, another number of heterogeneous stages);
        ``param_specs`` shards the layer axis; ``params`` matches no subtree of ``tree``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import pipejax as pj
      >>> def stage(p, x, key):  # two layers per stage, stacked on axis 0 of p
      ...     return x * p[0] * p[1]
      >>> pipe = pj.pipeline(stage, num_stages=2)
      >>> pj.to_layers(pipe, jnp.array([[1.0, 2.0], [3.0, 4.0]])).tolist()
      [1.0, 2.0, 3.0, 4.0]
    """
    _check_pipe(pipe, tree, "to_layers")
    with _eager(pipe, tree, "to_layers"):
        return _map(tree, params, lambda p, name: _to_layers(pipe, p, name), "to_layers")


def from_layers(
    pipe: Pipeline, tree: PyTree, *, params: PyTree = None, balance: Sequence[int] | None = None
) -> PyTree:
    """Layer-form parameters (or a train state holding them) laid out for ``pipe``.

    The inverse of :func:`to_layers` for any layout: ``(L, ...)`` leaves become ``(S, L / S,
    ...)`` (homogeneous stages; ``(v, n, k, ...)`` for the circular schedule on a mesh), a list
    of layer pytrees becomes ``balance``'s per-stage lists (heterogeneous stages; a
    :class:`pipejax.StageParams` on a mesh, packed on each stage's own devices). On a mesh the
    result is what ``pipe.place`` would give, ``param_specs`` included. Layers already sharded
    as :func:`layers_target` says (restored with it) are reshaped in place; others are first
    moved there with ``jax.device_put``.

    Args:
      pipe: the :class:`pipejax.Pipeline` to lay the parameters out for.
      tree: layer-form parameters, or a pytree holding them.
      params: the layer-form parameters inside ``tree`` (see :func:`to_layers`); ``None``:
        ``tree`` is the parameters.
      balance: heterogeneous stages: the number of layers in each stage (as for
        :func:`pipejax.partition`). Homogeneous stages share the layers equally: ``None``, or
        that equal share (``[L / S] * S``).

    Returns:
      ``tree`` with the parameters (and their likes) in ``pipe``'s form.

    Raises:
      TypeError: ``pipe`` is not a :class:`pipejax.Pipeline`; a leaf is not an array; on a mesh,
        ``tree`` is traced (see :func:`to_layers`); heterogeneous stages without ``balance``.
      ValueError: the layer count does not fit the layout (``S`` does not divide ``L``;
        ``balance`` not summing to ``L``, or uneven for homogeneous stages); ``params`` matches
        no subtree of ``tree``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import pipejax as pj
      >>> def stage(p, x, key):
      ...     return x * jnp.prod(p)
      >>> layers = jnp.array([1.0, 2.0, 3.0, 4.0])
      >>> pj.from_layers(pj.pipeline(stage, num_stages=2), layers).tolist()
      [[1.0, 2.0], [3.0, 4.0]]
      >>> pj.from_layers(pj.pipeline(stage, num_stages=4), layers).tolist()
      [[1.0], [2.0], [3.0], [4.0]]
    """
    _check_pipe(pipe, tree, "from_layers")
    with _eager(pipe, tree, "from_layers"):
        return _map(tree, params, lambda p, name: _from_layers(pipe, p, balance, name), "from_layers")


def layers_target(
    pipe: Pipeline, tree: PyTree, *, params: PyTree = None, balance: Sequence[int] | None = None
) -> PyTree:
    """An orbax restore target: layer-form shapes with the shardings ``pipe``'s layout gives them.

    Each leaf becomes a ``jax.ShapeDtypeStruct`` whose sharding is where :func:`from_layers`
    reads that leaf without moving it: the stage axis in blocks of ``L / S`` layers
    (homogeneous), or the devices of the layer's stage (heterogeneous), with ``param_specs`` on
    the other axes. Restoring into it, each process reads only the chunks its devices hold.
    Leaves other than the parameters and their likes (step counts) are replicated on the mesh.
    Without a mesh, everything goes to the first device.

    Args:
      pipe: the :class:`pipejax.Pipeline` to restore for.
      tree: the layer form's shapes (``jax.ShapeDtypeStruct`` or arrays), e.g. ``jax.eval_shape``
        of the function that initialises the layers (and the optimizer state of them): the layer
        form does not depend on the layout.
      params, balance: as for :func:`from_layers`.

    Returns:
      ``tree`` with every leaf a ``jax.ShapeDtypeStruct`` with a sharding.

    Raises:
      TypeError, ValueError: as :func:`from_layers`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> mesh = jax.make_mesh((2,), ("stage",))
      >>> pipe = pj.pipeline(lambda p, x, key: x, num_stages=2, mesh=mesh)
      >>> shapes = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
      >>> pj.layers_target(pipe, shapes)["w"].sharding.spec
      P('stage',)
    """
    _check_pipe(pipe, tree, "layers_target")
    target = lambda p, name: _target(pipe, p, balance, name)
    return _map(tree, params, target, "layers_target", other=pipe.plan.structs)


def _map(tree, params, convert, where, other=lambda a: a):
    """``convert`` applied to every subtree of ``tree`` shaped like ``params`` (with the name a
    message gives it); ``other`` to the remaining leaves. A ``params`` that matches nothing is
    refused: the tree would come back unconverted."""
    if params is None:
        return convert(tree, "tree")
    if not jax.tree.leaves(params):
        raise ValueError(
            f"`params` of {where} holds no arrays (got {_shown(params)}). Pass the parameters as "
            f"`tree` holds them (e.g. `params=tree['params']`), or `params=None` when `tree` is the "
            "parameters."
        )
    treedef = jax.tree.structure(params)
    shapes = [jnp.shape(a) for a in jax.tree.leaves(params)]

    def like(t):
        if jax.tree.structure(t) != treedef:
            return False
        return [jnp.shape(a) for a in jax.tree.leaves(t)] == shapes

    marked = jax.tree.map(lambda t: _Mark(t) if like(t) else t, tree, is_leaf=like)
    is_mark = lambda t: isinstance(t, _Mark)
    if not any(is_mark(t) for t in jax.tree.leaves(marked, is_leaf=is_mark)):
        raise ValueError(
            f"`params` of {where} matches no subtree of `tree`, so nothing would be converted: "
            f"`params` is {checks.types_text(params, 300)}, and `tree` holds "
            f"{checks.types_text(tree, 300)}. `params` names "
            "the parameters inside `tree` by their structure and leaf shapes: pass them as `tree` "
            "holds them (e.g. `params=tree['params']`; for from_layers and layers_target, in the "
            "layer form), or `params=None` when `tree` is the parameters."
        )
    return jax.tree.map(
        lambda t: convert(t.tree, "params") if is_mark(t) else other(t), marked, is_leaf=is_mark
    )


class _Mark:
    """A parameters-shaped subtree, held as one leaf while the rest of the tree is mapped."""

    def __init__(self, tree):
        self.tree = tree


def _check_pipe(pipe, tree, where):
    """``pipe`` must be the :class:`Pipeline` the parameters are laid out for."""
    if isinstance(pipe, Pipeline):
        return
    if isinstance(tree, Pipeline):
        fix = f"The arguments are swapped: `pj.{where}(pipe, tree)` takes the pipeline first."
    else:
        fix = (
            f"Pass the pipeline first: `pj.{where}(pipe, tree)`. For a Flax adapter's module "
            f"(`pipejax.flax.NNXPipeline`, `LinenPipeline`), use `pipejax.flax.{where}`."
        )
    raise TypeError(
        f"`pipe` of {where} must be the pj.Pipeline the parameters are laid out for (made by "
        f"`pj.pipeline(...)`), but got {type(pipe).__name__} {_shown(pipe)}. {fix}"
    )


def _check_leaves(tree, name, where, pipe):
    """The converted parameters: every leaf an array (or a number, or a ``jax.ShapeDtypeStruct``),
    and (homogeneous stages, whose layers are the leaves' leading axis) at least one."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves and pipe.homogeneous:
        raise ValueError(
            f"`{name}` of {where} holds no arrays (got {_shown(tree)}). Pass the stage parameters "
            "(or, for from_layers and layers_target, their layer form), or a train state holding "
            "them with `params=`."
        )
    for path, a in leaves:
        if not checks.array_like(a):
            raise TypeError(
                f"`{name}` of {where} has leaf {jax.tree_util.keystr(path) or '<root>'} of type "
                f"{type(a).__name__} ({_shown(a)}); every leaf of the parameters must be an array "
                "(or a `jax.ShapeDtypeStruct`, for layers_target). Leave other values out of "
                "`params=` (they stay as they are), or convert them to arrays."
            )


@contextlib.contextmanager
def _eager(pipe, tree, where) -> Iterator[None]:
    """Converting concrete arrays: outside any ``jax.set_mesh`` context. The conversion reshapes
    each device's own shard and packs each stage on its own devices, eagerly and with explicit
    shardings; a context mesh would make JAX refuse those single-device steps (their devices are
    not the context's). Traced values (under ``jax.jit``) are converted with ``jnp.reshape``
    without a mesh, and refused on one, whose conversion needs each device's shard."""
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(tree)):
        if pipe.mesh is not None:
            raise TypeError(
                f"`tree` of {where} is traced (a call inside `jax.jit` or another transformation), "
                f"but the pipeline runs on a mesh, where {where} moves each device's own shard of "
                "concrete arrays. Call it outside `jax.jit`, on the arrays a step returns (as for "
                "saving a checkpoint); inside a step, keep the parameters in the pipeline's form."
            )
        yield
        return
    if not compat.mesh_context_set():
        yield
        return
    with jax.set_mesh(None):
        yield


def _shown(value):
    return reprlib.repr(value)


def _to_layers(pipe, params, name):
    _check_leaves(params, name, "to_layers", pipe)
    if not pipe.homogeneous:
        return _unstage(pipe, params, name)
    options.check_params_shape(params, pipe, name)  # the stage axis, as a call checks it
    lead = len(stage_forms.stage_lead(pipe, params))
    _check_layer_axis(params, lead)
    shape = lambda a: (math.prod(jnp.shape(a)[: lead + 1]), *jnp.shape(a)[lead + 1 :])
    return pipe.plan.relayout(params, shape, lambda: _specs(pipe, params, lead), lead)


def _from_layers(pipe, layers, balance, name):
    _check_leaves(layers, name, "from_layers", pipe)
    if not pipe.homogeneous:
        return _restage(pipe, layers, balance, name)
    shape, staged, lead = _staged(pipe, layers, balance)
    specs = lambda: _specs(pipe, staged, lead)[::-1]  # from the layer form to the stage form
    return pipe.plan.relayout(layers, shape, specs, lead)


def _target(pipe, layers, balance, name):
    _check_leaves(layers, name, "layers_target", pipe)
    if not pipe.homogeneous:
        return _hetero_target(pipe, layers, balance, name)
    _, staged, lead = _staged(pipe, layers, balance)
    return pipe.plan.structs(layers, lambda: _specs(pipe, staged, lead)[1])


def _check_layer_axis(params, lead):
    first = None  # (path, layers per stage) of the first leaf: every leaf holds as many
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        where = jax.tree_util.keystr(path) or "<root>"
        if jnp.ndim(a) <= lead:
            raise ValueError(
                f"Leaf {where} of the stage parameters has shape "
                f"{jnp.shape(a)}: no layer axis after the stage axis. The layer form of homogeneous "
                "stages needs each stage's layers stacked on the axis after the stage axis, "
                "`(num_stages, layers_per_stage, ...)`; give a stage of one layer a layer axis of "
                "size 1 (`a[:, None]`)."
            )
        k = jnp.shape(a)[lead]
        if first is None:
            first = (where, k)
        elif k != first[1]:
            raise ValueError(
                f"Leaf {where} of the stage parameters holds {k} layers per stage (shape "
                f"{jnp.shape(a)}), but leaf {first[0]} holds {first[1]}: every leaf stacks the same "
                "layers, `(num_stages, layers_per_stage, ...)`, with one `layers_per_stage`."
            )


def _per_stage(pipe, layers, balance=None):
    """Layers per stage (homogeneous), checking that the stages share the layers equally (and
    that ``balance``, if given, says so)."""
    counts = {}
    for path, a in jax.tree_util.tree_flatten_with_path(layers)[0]:
        if jnp.ndim(a) == 0:
            raise ValueError(
                f"Layer-form leaf {jax.tree_util.keystr(path) or '<root>'} is a scalar; layer-form "
                "leaves of homogeneous stages have the layer axis first, `(num_layers, ...)`."
            )
        counts.setdefault(jnp.shape(a)[0], jax.tree_util.keystr(path) or "<root>")
    if len(counts) != 1:
        shown = ", ".join(f"{path}: {n}" for n, path in counts.items())
        raise ValueError(
            f"The layer-form leaves disagree on the number of layers (axis 0): {shown}. Every "
            "leaf of homogeneous layers has the layer axis first, one entry per layer."
        )
    (num_layers,) = counts
    if num_layers % pipe.num_stages:
        divisors = [s for s in range(1, num_layers + 1) if num_layers % s == 0]
        raise ValueError(
            f"The layers ({num_layers}, axis 0 of every layer-form leaf) do not divide among the "
            f"pipeline's {pipe.num_stages} homogeneous stages: each stage holds the same number of "
            f"layers. Use a number of stages that divides {num_layers} (one of {divisors}), or "
            "heterogeneous stages (`pj.partition(layers, balance)`) for an uneven cut."
        )
    per_stage = num_layers // pipe.num_stages
    if balance is not None:
        sizes = _check_balance(balance, num_layers)
        if sizes != (per_stage,) * pipe.num_stages:
            raise ValueError(
                f"`balance` {list(sizes)} does not share the {num_layers} layers equally among the "
                f"pipeline's {pipe.num_stages} homogeneous stages, which hold {per_stage} each "
                f"(`balance={[per_stage] * pipe.num_stages}`). Drop `balance` for homogeneous "
                "stages, or use heterogeneous stages (`pj.partition(layers, balance)`) for an "
                "uneven cut."
            )
    return per_stage


def _staged(pipe, layers, balance):
    """The stage form of homogeneous ``layers``: each leaf's shape there, the leaves' structs,
    and how many leading stage axes ``place`` gives them."""
    per_stage = _per_stage(pipe, layers, balance)
    lead = pipe.plan.runner_stage_axes()
    if lead == 2 and pipe.num_devices == 1:
        raise NotImplementedError(
            f"The pipeline runs {pipe.repeats} circular repeats on a stage axis of one device; "
            "moving its parameters to and from the layer form is not supported. Run it without a "
            "mesh (`mesh=None`), or on a stage axis of several devices."
        )
    stage_lead = (pipe.repeats, pipe.num_devices) if lead == 2 else (pipe.num_stages,)
    shape = lambda a: (*stage_lead, per_stage, *jnp.shape(a)[1:])
    return shape, jax.tree.map(lambda a: jax.ShapeDtypeStruct(shape(a), jnp.result_type(a)), layers), lead


def _specs(pipe, staged, lead):
    """Per leaf: its ``PartitionSpec`` in stage form, and in layer form (the layer axis joins the
    stage axis, so its own entry must be ``None``)."""
    splits = pipe.plan.splits(staged)
    stage_specs = stage_forms.leaf_specs(pipe.plan, staged, splits)
    lead_entries = (pipe.axis_name,) if pipe.num_devices > 1 or lead == 1 else (None,)

    def layer_spec(path, a, spec):
        rest = tuple(spec)[lead:]
        if rest and rest[0] is not None:
            raise ValueError(
                f"`param_specs` shards the layer axis (dimension 0 of a stage's leaf "
                f"{jax.tree_util.keystr(path) or '<root>'}, spec {PartitionSpec(*rest)}) over "
                f"{rest[0]!r}; the layer form joins that axis to the stage axis, so it must be "
                "whole inside a stage. Shard another dimension."
            )
        return PartitionSpec(*lead_entries, *rest[1:])

    layer_specs = jax.tree_util.tree_map_with_path(layer_spec, staged, stage_specs)
    return stage_specs, layer_specs


def _stage_lists(pipe, params, name):
    """The per-stage lists of heterogeneous ``params``; ``None`` for a :class:`StageParams`."""
    if isinstance(params, StageParams):
        options.check_params_shape(params, pipe, name)
        return None
    n = pipe.num_stages
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise TypeError(
            f"`{name}` of to_layers must hold heterogeneous stage parameters: a list with one entry "
            f"per stage ({n} stages), each a list of its layers' parameters, or the StageParams "
            f"`pipe.place` made of it; but got {type(params).__name__}."
        )
    if len(params) != n:
        raise ValueError(
            f"`{name}` of to_layers has {len(params)} stage entries, but the pipeline has {n} "
            "stages; pass one entry per stage, each a list of its layers' parameters "
            "(`part.group(layer_params)`)."
        )
    return list(params)


def _check_stage_layers(stage, s):
    if isinstance(stage, (str, bytes)) or not isinstance(stage, Sequence):
        raise TypeError(
            f"Stage {s}'s parameters are a {type(stage).__name__}, not a sequence of layer "
            "parameters. The layer form of heterogeneous stages needs `pj.partition`'s form: "
            "each stage's parameters a list (or tuple) of its layers' parameter pytrees "
            "(`part.group(layer_params)`)."
        )
    return list(stage)


def _unstage(pipe, params, name):
    lists = _stage_lists(pipe, params, name)
    stages = lists if lists is not None else pipe.plan.unstage(params)
    return [layer for s, stage in enumerate(stages) for layer in _check_stage_layers(stage, s)]


def _stages(pipe, layers, balance, name, where):
    """The list of layers cut into ``balance``'s per-stage lists (checked)."""
    layers = list(_check_layer_list(layers, name, where))
    offsets = np.cumsum((0, *_check_balance_for(pipe, balance, len(layers)))).tolist()
    return [list(layers[offsets[s] : offsets[s + 1]]) for s in range(len(offsets) - 1)]


def _restage(pipe, layers, balance, name):
    return pipe.plan.restage(_stages(pipe, layers, balance, name, "from_layers"))


def _hetero_target(pipe, layers, balance, name):
    return pipe.plan.layer_structs(_stages(pipe, layers, balance, name, "layers_target"))


def _check_layer_list(layers, name, where):
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(
            f"`{name}` of {where} must hold the layer form of heterogeneous stages, a list with one "
            f"parameter pytree per layer, but got {type(layers).__name__}. `pj.to_layers` gives it; "
            "`part.ungroup(stage_params)` too."
        )
    return layers


def _check_balance_for(pipe, balance, num_layers):
    if balance is None:
        raise TypeError(
            f"`balance` is None, but the pipeline's stages are heterogeneous: give the number of "
            f"layers in each of its {pipe.num_stages} stages, summing to the {num_layers} layers "
            f"(e.g. `balance={_even(num_layers, pipe.num_stages)}`), as for `pj.partition`."
        )
    sizes = _check_balance(balance, num_layers)
    if len(sizes) != pipe.num_stages:
        raise ValueError(
            f"`balance` {list(sizes)} has {len(sizes)} stages, but the pipeline has "
            f"{pipe.num_stages}; give one entry per stage (e.g. "
            f"`balance={_even(num_layers, pipe.num_stages)}`)."
        )
    return sizes


def _even(num_layers, num_stages):
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]
