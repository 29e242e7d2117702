"""Flax train states that move between layouts: the adapters' stage parameters in layer form.

:class:`~pipejax.flax.NNXPipeline` and :class:`~pipejax.flax.LinenPipeline` keep their layers'
parameters as a :class:`pipejax.StageParams` in :func:`pipejax.partition`'s form (each stage a
tuple of layer pytrees, packed per dtype, one row per stage). Its layer form is the flat list of
the layers' pytrees (:func:`pipejax.to_layers` of the adapter's placement pipeline), which does
not depend on the layout: the number of stages, ``balance``, the mesh, the layers' sharding
inside a stage. So a train state saved in layer form restores into an adapter built with another
layout, each layer read by the devices of its new stage only:

* :func:`to_layers` (layout A): every stage-parameter entry of a train state (the model's
  parameters, BatchNorm statistics, an optax state's moments) becomes its list of layers,
  unpacked on each stage's own devices;
* :func:`layers_target` (layout B): an orbax restore target of that form with the shardings
  :func:`from_layers` reads without moving anything;
* :func:`from_layers` (layout B): the lists packed into B's stages, on each stage's own devices.

Where the entries are. NNX: ``nnx.state`` of the model (or of ``(model, optimizer)``, or of a
bigger model holding the pipeline) has the packed parameters under a key ``packed`` (an
``nnx.List`` of one ``nnx.Param`` per dtype) and the statistics under ``packed_batch_stats``; an
``nnx.Optimizer``'s moments mirror the parameters, so they have ``packed`` entries too. Every
entry so named whose arrays have the shapes of the pipeline's buffers is converted; its layer
form is a list of per-layer states of plain arrays (no ``Variable`` boxes: the moments are no
``Param``), and :func:`from_layers` gives plain arrays back, which ``nnx.update`` and
``nnx.merge`` take. Linen: every :class:`pipejax.StageParams` (boxed in a
:class:`~pipejax.flax.StagePartitioned` or not) is converted; :func:`from_layers` puts the
packed result in the box of the corresponding entry of ``like``.

The grouping into stages is the one difference between the two forms of a stage: ``pj.partition``
(and so :func:`pipejax.from_layers`) groups a stage's layers in a list, the adapters in a tuple;
:func:`_in_module_layouts` bridges it, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pipejax._src.flax import common
from pipejax._src.flax import sharding as flax_sharding
from pipejax._src.params import forms as stage_forms
from pipejax._src.params import layer_form
from pipejax._src.params.placement import StageParams
from pipejax._src.pipeline import pipeline

PyTree = Any

# The keys under which an NNXPipeline's state holds its packed stage variables.
_NNX_KEYS = ("packed", "packed_batch_stats")


def to_layers(pipe: Any, tree: PyTree) -> PyTree:
    """A Flax train state with the pipeline's stage parameters in the layout-independent layer form.

    Args:
      pipe: the :class:`~pipejax.flax.NNXPipeline` (the model's pipeline module) or
        :class:`~pipejax.flax.LinenPipeline` the state was made for.
      tree: the state: NNX, ``nnx.state(model)``, ``nnx.state((model, optimizer))`` (the model
        may hold ``pipe`` as a submodule); Linen, a pytree holding the module's variables (and
        an optax state of its ``params``).

    Returns:
      ``tree`` with each of ``pipe``'s stage entries (parameters, moments, BatchNorm statistics)
      a list with one pytree of arrays per layer, each on the devices of its stage only. Save it
      with orbax; restore it with :func:`layers_target` and :func:`from_layers`.

    Raises:
      ValueError: ``tree`` holds no stage entry of ``pipe``.
    """
    if _is_nnx(pipe):
        return _nnx_map(pipe, tree, lambda key, t: _nnx_to_layers(pipe, key, t), "to_layers")
    stack = _linen_stack(pipe, "to_layers")
    found = []

    def convert(t):
        found.append(t)
        return _strip(layer_form.to_layers(stack.placer, _unboxed(t)))

    out = jax.tree.map(lambda t: convert(t) if _is_packed(t) else t, tree, is_leaf=_is_packed)
    _check_found(found, pipe, tree, "to_layers", "a StageParams (the module's variables)")
    return out


def layers_target(pipe: Any, like: PyTree) -> PyTree:
    """An orbax restore target for a layer-form state, laid out for ``pipe``'s layout.

    Args:
      pipe: the adapter to restore into (layout B): an :class:`~pipejax.flax.NNXPipeline`
        (built, or abstract from ``nnx.eval_shape``) or a :class:`~pipejax.flax.LinenPipeline`.
      like: the state in ``pipe``'s own form, arrays or ``jax.ShapeDtypeStruct`` (NNX:
        ``nnx.state`` of the abstract ``(model, optimizer)``; Linen: ``jax.eval_shape`` of the
        module's ``init`` and the optimizer's ``init``).

    Returns:
      ``like`` in layer form, every leaf a ``jax.ShapeDtypeStruct`` with a sharding: each layer
      on the devices of its stage in ``pipe``'s layout (split inside the stage as the module
      splits it), the other leaves with their own ``PartitionSpec`` on the mesh (replicated when
      they have none), as :func:`~pipejax.flax.restore_target` gives them; without a mesh, on
      the first device.

    Raises:
      ValueError: ``like`` holds no stage entry of ``pipe``.
    """
    plan = _stack(pipe).placer.plan
    other = lambda a: plan.structs(a, lambda: flax_sharding.restore_specs(a, plan.mesh))

    if _is_nnx(pipe):

        def target(key, t):
            return _layer_target(pipe, _nnx_entry(pipe, key)[1])

        return _nnx_map(pipe, like, target, "layers_target", other=other)
    found = []

    def convert(t):
        found.append(t)
        packed = _unboxed(t)
        _check_stage_count(pipe, packed, "like")
        return _layer_target(pipe, packed.layouts)

    out = jax.tree.map(lambda t: convert(t) if _is_packed(t) else other(t), like, is_leaf=_is_packed)
    _check_found(found, pipe, like, "layers_target", "a StageParams (`jax.eval_shape` of the module's init)")
    return out


def from_layers(pipe: Any, tree: PyTree, like: PyTree = None) -> PyTree:
    """A layer-form state (restored with :func:`layers_target`) laid out for ``pipe``.

    Each stage is packed on its own devices from the shards its layers were restored to
    (nothing moves between devices when they were restored with :func:`layers_target`).

    Args:
      pipe: the adapter the state is for (layout B).
      tree: the layer-form state.
      like: Linen only (required): the state in the module's own form, as given to
        :func:`layers_target`; its stage entries give the result's stage layout and box. NNX:
        not needed (the module holds its layout).

    Returns:
      NNX: ``tree`` with each stage entry the module's packed buffers (plain arrays), for
      ``nnx.update((model, optimizer), state)`` or ``nnx.merge(graphdef, state)``. Linen:
      ``tree`` in the form of ``like``, each stage entry a ``StageParams`` in ``like``'s box.

    Raises:
      ValueError: the layer form holds another number of layers than ``pipe`` (a checkpoint of
        another model), or layers of other shapes or dtypes; ``tree`` holds no layer list.
      TypeError: ``like`` missing for a ``LinenPipeline``.
    """
    if _is_nnx(pipe):

        def convert(key, layers):
            _, layouts = _nnx_entry(pipe, key)
            packed = _pack(pipe, layers, layouts, key)
            return {i: b for i, b in enumerate(packed.buffers)}

        return _nnx_map(pipe, tree, convert, "from_layers", layer_form_in=True)
    _linen_stack(pipe, "from_layers")
    if like is None:
        raise TypeError(
            "`like` of from_layers is None, but a LinenPipeline does not know the shapes of its "
            "layers' parameters: pass the state in the module's own form, the one given to "
            "`layers_target` (e.g. `like=jax.eval_shape(init_state)`)."
        )
    found = []

    def convert(t, layers):
        found.append(t)
        packed = _unboxed(t)
        _check_stage_count(pipe, packed, "like")
        out = _pack(pipe, layers, packed.layouts, "stages")
        return t.replace_boxed(out) if _is_box(t) else out

    out = jax.tree.map(lambda t, u: convert(t, u) if _is_packed(t) else u, like, tree, is_leaf=_is_packed)
    _check_found(found, pipe, like, "from_layers", "a StageParams (the module's own form)")
    return out


# --- both adapters ------------------------------------------------------------------------------


def _is_nnx(pipe: Any) -> bool:
    from pipejax._src.flax.nnx import NNXPipeline

    return isinstance(pipe, NNXPipeline)


def _stack(pipe: Any) -> common.Stack:
    return pipe._stack if _is_nnx(pipe) else _linen_stack(pipe, "layers_target")


def _linen_stack(pipe: Any, fn: str) -> common.Stack:
    from pipejax._src.flax.linen import LinenPipeline

    if not isinstance(pipe, LinenPipeline):
        raise TypeError(
            f"`pipe` of {fn} must be an NNXPipeline or a LinenPipeline (the pipeline module of "
            f"the model, e.g. `model.blocks`), but got {type(pipe).__name__}."
        )
    return pipe._stack()


def _is_box(t: Any) -> bool:
    from flax import linen as nn

    return isinstance(t, nn.meta.AxisMetadata)


def _is_packed(t: Any) -> bool:
    from flax import linen as nn

    if isinstance(t, nn.meta.AxisMetadata):
        return isinstance(t.unbox(apply_constraint=False), StageParams)
    return isinstance(t, StageParams)


def _unboxed(t: Any) -> StageParams:
    from flax import linen as nn

    return t.unbox(apply_constraint=False) if isinstance(t, nn.meta.AxisMetadata) else t


def _strip(tree: PyTree) -> PyTree:
    """``tree`` without NNX ``Variable`` boxes (plain arrays at the leaves)."""
    from flax import nnx

    is_var = lambda v: isinstance(v, nnx.Variable)
    return jax.tree.map(lambda v: v.get_value() if is_var(v) else v, tree, is_leaf=is_var)


def _placer(pipe: Any, layouts: Sequence[Any]):
    """The pipeline that lays the module's stages out: its placement pipeline, with the splits
    its stages carry (the layers' own sharding metadata) as ``param_specs``."""
    stack = _stack(pipe)
    if not any(any(lay.leaf_splits()) for lay in layouts):  # (splits need a mesh)
        return stack.placer
    specs = []
    for lay in layouts:
        layers = _strip(list(lay.structs()))
        entries = [
            PartitionSpec(*stage_forms.split_spec(split, len(shape)))
            for shape, split in zip(lay.shapes, lay.leaf_splits(), strict=True)
        ]
        specs.append(jax.tree.unflatten(jax.tree.structure(layers), entries))
    options = dict(stack.options, param_specs=specs)
    return pipeline([common._no_stage] * len(stack.sizes), stateful=stack.deferred, **options)


def _layer_structs(layouts: Sequence[Any]) -> list[PyTree]:
    return [_strip(layer) for lay in layouts for layer in lay.structs()]


def _layer_target(pipe: Any, layouts: Sequence[Any]) -> list[PyTree]:
    stack = _stack(pipe)
    return layer_form.layers_target(_placer(pipe, layouts), _layer_structs(layouts), balance=stack.sizes)


def _pack(pipe: Any, layers: Any, layouts: Sequence[Any], where: str) -> StageParams:
    """``layers`` packed into the module's stages (``layouts``): :func:`pipejax.from_layers`,
    checked against the module's layers and given the module's layouts."""
    stack = _stack(pipe)
    expected = _layer_structs(layouts)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ValueError(
            f"The layer form of {_name(pipe)}'s {where!r} entry must be a list with one pytree per "
            f"layer ({stack.num_layers}), but got {type(layers).__name__}. Pass a state made by "
            "`to_layers` (restored with `layers_target`)."
        )
    if len(layers) != stack.num_layers:
        raise ValueError(
            f"The layer form of {_name(pipe)}'s {where!r} entry holds {len(layers)} layers, but the "
            f"module has {stack.num_layers} (stages of {list(stack.sizes)} layers). A layout change "
            "keeps the layers and cuts them differently: build the module with the saved model's "
            f"{len(layers)} layers, and choose its `balance`/`num_stages`/mesh freely."
        )
    for index, (got, want) in enumerate(zip(layers, expected, strict=True)):
        shapes = lambda t: jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.result_type(a).name), t)
        if jax.tree.structure(got) != jax.tree.structure(want) or shapes(got) != shapes(want):
            raise ValueError(
                f"Layer {index} of {_name(pipe)}'s {where!r} entry in layer form does not match the "
                f"module's layer {index}: got {shapes(got)}, expected {shapes(want)}. The layer "
                "form restores into a module with the same layers (any layout); restore with "
                "`layers_target(pipe, like)` of this module to get its structure."
            )
    placer = _placer(pipe, layouts)
    placed = layer_form.from_layers(placer, list(layers), balance=stack.sizes)
    if not isinstance(placed, StageParams):  # no mesh: the stages' lists, placed on one device
        placed = placer.place([tuple(stage) for stage in placed])
    return StageParams(placed.buffers, placed.container, _in_module_layouts(placed, layouts))


def _in_module_layouts(placed: StageParams, layouts: Sequence[Any]) -> tuple[Any, ...]:
    """The module's own layouts for ``placed`` (what ``pj.from_layers`` packed): the same leaves
    in the same order, grouped in a tuple per stage (``Stack.group``) where ``pj.partition``
    groups them in a list, and NNX's ``Param`` boxes that the layer form drops."""
    for got, want in zip(placed.layouts, layouts, strict=True):
        same = (got.shapes, got.dtypes, got.leaf_splits()) == (want.shapes, want.dtypes, want.leaf_splits())
        assert same, (got, want)  # internal: _pack checked the layers against `layouts`
    return tuple(layouts)


def _check_stage_count(pipe: Any, packed: StageParams, arg: str) -> None:
    sizes = _stack(pipe).sizes
    if packed.num_stages != len(sizes):
        raise ValueError(
            f"`{arg}` holds a StageParams of {packed.num_stages} stages, but {_name(pipe)} has "
            f"{len(sizes)} (layers per stage: {list(sizes)}): `{arg}` must be the state of this "
            "module's layout (e.g. `jax.eval_shape` of its init), not the saved one's."
        )


def _check_found(found: list, pipe: Any, tree: PyTree, fn: str, what: str) -> None:
    if not found:
        shapes = jax.tree.map(lambda a: getattr(a, "shape", a), tree)
        raise ValueError(
            f"{fn} found no stage entry of the {_name(pipe)} in its tree ({what}), got "
            f"{_short(shapes)}. Pass the state that holds the module's variables (NNX: "
            "`nnx.state((model, optimizer))`; Linen: `{'params': variables['params'], "
            "'opt_state': opt_state}`), or in layer form for from_layers."
        )


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 300 else text[:300] + " ..."


def _name(pipe: Any) -> str:
    return type(pipe).__name__


# --- NNX ----------------------------------------------------------------------------------------


def _nnx_entry(pipe: Any, key: str) -> tuple[Any, tuple[Any, ...]]:
    """The container and layouts of the NNXPipeline's entry ``key``."""
    if key == "packed":
        return pipe.container, tuple(pipe.layouts)
    return pipe.stats_container, tuple(pipe.stats_layouts)


def _nnx_buffer_shapes(pipe: Any, key: str) -> list[tuple[int, ...]] | None:
    variables = pipe.packed if key == "packed" else pipe.packed_batch_stats
    shapes = [tuple(jnp.shape(_value(v))) for v in variables]
    return shapes or None


def _value(v: Any) -> Any:
    from flax import nnx

    return v.get_value() if isinstance(v, nnx.Variable) else v


def _nnx_to_layers(pipe: Any, key: str, t: Mapping) -> list[PyTree]:
    container, layouts = _nnx_entry(pipe, key)
    buffers = tuple(_value(t[i]) for i in range(len(t)))
    return _strip(layer_form.to_layers(pipe._stack.placer, StageParams(buffers, container, layouts)))


def _nnx_map(pipe, tree, convert, fn, other=lambda a: a, layer_form_in=False):
    """``convert(key, entry)`` for every entry of ``tree`` under a key of ``_NNX_KEYS`` that is
    ``pipe``'s (packed buffers of its shapes; with ``layer_form_in``, a list of layers);
    ``other`` for the remaining leaves."""
    wanted = {key: _nnx_buffer_shapes(pipe, key) for key in _NNX_KEYS}

    def candidate(t):
        if layer_form_in:
            return isinstance(t, list)
        if not isinstance(t, Mapping) or not t or set(t) != set(range(len(t))):
            return False
        return all(hasattr(_value(t[i]), "shape") for i in range(len(t)))

    found = []

    def one(path, t):
        if not candidate(t):
            return other(t)
        key = path[-1].key if path and isinstance(path[-1], jax.tree_util.DictKey) else None
        if key in wanted and wanted[key] is not None:
            if layer_form_in or [tuple(jnp.shape(_value(t[i]))) for i in range(len(t))] == wanted[key]:
                found.append(key)
                return convert(key, t)
        return jax.tree.map(other, t)

    out = jax.tree_util.tree_map_with_path(one, tree, is_leaf=candidate)
    what = "a list of layers under 'packed'" if layer_form_in else "'packed' buffers of its shapes"
    _check_found(found, pipe, tree, fn, what)
    return out
