"""The variables of a :class:`~pipejax.flax.LinenPipeline`: their box, their checks, their conversions.

:class:`StagePartitioned` boxes the ``"stages"`` variables (a :class:`pipejax.StageParams`) with
their sharding metadata (:func:`stack_box`). The rest reads them back out of ``variables`` (a clear
error for a wrong form), checks the collections a layer creates, and converts the layers' own
trees (``nn.Sequential``'s ``layers_<l>`` entries, ``nn.scan`` stacks) for ``from_sequential``,
``from_stacked`` and ``to_stacked``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from flax.core import unfreeze

from pipejax._src.flax import batchnorm as flax_batchnorm
from pipejax._src.flax import common
from pipejax._src.params.forms import leaf_paths
from pipejax._src.params.placement import StageParams

_NAME = "LinenPipeline"


# Flax layers that always hold parameters: an absent entry for one of them is a mistake.
_PARAM_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Embed, nn.Einsum)


def _check_present(layers: Sequence[nn.Module], tree: Mapping[str, Any], names: list[str]) -> None:
    """Raises for a layer absent from the ``params`` of ``from_sequential`` that must have some.

    A layer needs an entry if it is a Flax layer that always has parameters (``nn.Dense``,
    ``nn.Conv``, ...), or if an equal layer (same class and configuration) has one. Other
    absent layers are taken to have no parameters (as ``nn.Sequential.init`` leaves them out);
    if they do, ``apply`` says which layer found none.
    """
    present = [name in tree and bool(jax.tree.leaves(tree[name])) for name in names]
    missing = [
        index
        for index, layer in enumerate(layers)
        if not present[index]
        and (
            isinstance(layer, _PARAM_LAYERS)
            or any(present[j] and other == layer for j, other in enumerate(layers) if j != index)
        )
    ]
    if missing:
        listing = ", ".join(f"layers_{i} ({type(layers[i]).__name__})" for i in missing)
        verb = "holds" if len(missing) == 1 else "hold"
        raise ValueError(
            f"`variables['params']` has no parameters for {listing}, which {verb} parameters: "
            "nn.Sequential(layers).init creates an entry 'layers_<l>' for every layer with parameters. "
            "Pass the variables of all of them (only layers without parameters may be absent)."
        )


def _check_alike(
    layers: Sequence[nn.Module], tree: Mapping[str, Any], names: list[str], collection: str
) -> None:
    """Raises where two equal layers (same class and configuration) have entries with different
    leaf names in ``variables[collection]`` of ``from_sequential``: a misspelt or extra leaf,
    which ``apply`` would carry along and never read. (Shapes may differ: an equal layer may
    read inputs of another width.)"""
    first: list[tuple[nn.Module, int]] = []  # one entry per kind of layer: (layer, its first index)
    for index, layer in enumerate(layers):
        if names[index] not in tree:
            continue
        paths = {"/".join(p) for p in leaf_paths(tree[names[index]])}
        j = next((j for other, j in first if other == layer), None)
        if j is None:
            first.append((layer, index))
            continue
        want = {"/".join(p) for p in leaf_paths(tree[names[j]])}
        if paths != want:
            differ = [
                f"{names[a]} has {sorted(pa - pb)} that {names[b]} has not"
                for a, b, pa, pb in ((index, j, paths, want), (j, index, want, paths))
                if pa - pb
            ]
            raise ValueError(
                f"`variables[{collection!r}]`: {names[j]} and {names[index]} are equal layers "
                f"({type(layer).__name__}), but their leaves differ: {'; '.join(differ)}. A misspelt "
                "or extra leaf would be carried along and never read; give equal layers the leaves "
                "their init creates."
            )


def _unstack_tree(tree: Any, num_layers: int, what: str) -> list[Any]:
    """Layer ``l``'s slice ``[l]`` of every leaf, for each layer of a stacked tree."""
    tree = unfreeze(tree)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != num_layers:
            raise ValueError(
                f"`variables[{what!r}]` must be a layer stack: every leaf stacked on a leading axis "
                f"of size {num_layers} (the number of layers), as nn.scan(..., variable_axes="
                f"{{{what!r}: 0}}, length={num_layers}) makes it, but "
                f"{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}."
            )
    return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(num_layers)]


def _stack_trees(trees: Sequence[Any], what: str) -> Any:
    """The trees of all layers stacked leaf by leaf on a new leading axis."""
    structures = {jax.tree.structure(t) for t in trees}
    if len(structures) != 1:
        raise ValueError(
            f"The layers' {what!r} have different structures, so they do not form a stack; "
            "to_stacked needs layers of one kind (as nn.scan makes them)."
        )
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _named(per_layer: Sequence[Any]) -> dict[str, Any]:
    """``{"layers_<l>": tree}`` for every layer with a non-empty tree (``nn.Sequential``'s names)."""
    return {f"layers_{index}": t for index, t in enumerate(per_layer) if jax.tree.leaves(t)}


def _check_collections(index: int, layer: nn.Module, variables: Mapping[str, Any], deferred: bool) -> None:
    if "batch_stats" in variables and not deferred:
        raise ValueError(
            flax_batchnorm.needs_flag(
                f"Layer {index} ({type(layer).__name__}) creates 'batch_stats' (BatchNorm statistics)", _NAME
            )
        )
    extra = sorted(set(variables) - {"params", "batch_stats"})
    if extra:
        raise NotImplementedError(
            f"Layer {index} ({type(layer).__name__}) creates the variable collection(s) {extra} "
            "besides 'params' and 'batch_stats'. LinenPipeline supports parameters and "
            "BatchNorm statistics only (caches and other mutable state are not supported)."
        )


@flax.struct.dataclass
class StagePartitioned(nn.Partitioned):
    """The box of a :class:`~pipejax.flax.LinenPipeline`'s ``"stages"`` variables: its sharding metadata.

    ``value`` is the :class:`pipejax.StageParams`; ``names`` the partition of each of its buffers,
    ``("stage", None)`` (``(None, "stage", None)`` for the circular schedule; ``(None, None)``
    without a mesh). So ``nn.get_partition_spec(variables)`` reports ``P("stage", None)`` for the
    packed stages (a prefix of the buffers), and Flax's usual recipe (abstract variables ->
    ``get_partition_spec`` -> shardings -> ``jax.jit(init, out_shardings=...)``) keeps each stage
    on its device instead of replicating it. Unboxing (``nn.unbox``, ``self.param``) returns the
    value without a sharding constraint: the pipeline places its parameters itself.
    """

    def unbox(self, apply_constraint: bool = True) -> Any:
        return self.value


def stack_box(stack: common.Stack, packed: StageParams) -> StagePartitioned:
    """``packed`` boxed with the partition of its buffers.

    One ``names`` tuple serves every buffer (Flax applies it as a prefix), so when buffers are
    split differently inside their stages (``param_specs``, the layers' sharding metadata) it is
    their common prefix, the stage axis, and the buffers' own shardings say the rest.
    """
    ndim = packed.buffers[0].ndim if packed.buffers else 2
    spec = stack.placer.plan.buffer_spec(ndim)
    names = tuple(spec) + (None,) * (ndim - len(spec))
    if packed.container.splits is not None:  # (only on a mesh: `param_specs` need one)
        lead = stack.placer.plan.stage_lead()
        specs = {tuple(sp) for sp in packed.container.slot_specs(lead)}
        names = next(iter(specs)) if len(specs) == 1 else lead
    return StagePartitioned(packed, names=names)


def _check_packed(value: Any, collection: str) -> StageParams:
    """``value`` (the ``"stages"`` variable) as a :class:`~pipejax.StageParams`, or a clear error."""
    if isinstance(value, nn.meta.AxisMetadata):
        value = value.unbox(apply_constraint=False)
    if isinstance(value, StageParams):
        return value
    raise ValueError(
        f"The LinenPipeline's {collection!r} entry 'stages' must be a pipejax.StageParams (what `init` "
        f"and `from_sequential` return), but got {type(value).__name__}: "
        f"{jax.tree.map(lambda a: getattr(a, 'shape', a), value)!r}. A checkpoint restored without a "
        "target comes back as plain dicts and lists; restore with a target of the saved structure, "
        "e.g. orbax's `restore(path, target)` with `target = jax.tree.map(ocp.utils.to_shape_dtype_struct, "
        "state)` (see docs/flax_checkpoints.md, 'Checkpoints with orbax')."
    )


def _batch_stats_of(variables: Any) -> StageParams | None:
    try:
        state = variables["batch_stats"]["stages"]
    except (KeyError, TypeError, IndexError):
        return None
    return _check_packed(state, "batch_stats")


def _stage_params_of(variables: Any) -> StageParams:
    try:
        packed = variables["params"]["stages"]
    except (KeyError, TypeError, IndexError):
        raise ValueError(
            "`variables` must be this LinenPipeline's own variables, {'params': {'stages': "
            "StageParams}} (inside a bigger model, pass its subtree, e.g. "
            "{'params': variables['params']['LinenPipeline_0']}), but got "
            f"{jax.tree.map(lambda a: getattr(a, 'shape', a), variables)!r}."
        ) from None
    return _check_packed(packed, "params")
