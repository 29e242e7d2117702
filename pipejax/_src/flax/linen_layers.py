"""Each layer of a :class:`~pipejax.flax.LinenPipeline` as a pure function, with deferred BatchNorm.

``_LinenLayers`` is the Linen adapter's :class:`~pipejax._src.flax.stages.RunLayer`: layer ``l``
run by ``layer.apply`` with its key as the ``rng_collection`` rng, returning what it sowed. Every
``nn.BatchNorm`` call inside it goes through ``_batch_norm_interceptor``, which runs it as deferred
batch norm and records its micro-batch's moments (see :mod:`pipejax._src.flax.linen`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.errors
import flax.linen as nn
import jax
from flax.core import unfreeze

from pipejax._src.flax import batchnorm as flax_batchnorm
from pipejax._src.flax.linen_variables import _NAME


@dataclasses.dataclass(frozen=True)
class _LinenLayers:
    """Layer ``index`` as a pure function: ``layer.apply`` with its key as the ``rng_collection`` rng.

    A :class:`~pipejax._src.flax.stages.RunLayer` equal by value (equal unbound layers, as Linen
    modules compare by their attributes), so equal modules share one cached pipeline.
    """

    layers: tuple[nn.Module, ...]  # unbound copies (``LinenPipeline._layers``)
    rng_collection: str
    deferred: bool

    def __call__(self, index, variables, x, key, mask, kwargs):
        layers = self.layers
        rngs = {} if key is None else {self.rng_collection: key}
        if not jax.tree.leaves(variables.get("batch_stats")):
            variables = {"params": variables["params"]}
        variables = _unboxed(variables)  # the layers' own sharding boxes: constraints do not apply here
        records: dict[tuple[str, ...], flax_batchnorm.SownMoments] = {}
        try:
            with nn.intercept_methods(_batch_norm_interceptor(mask, self.deferred, index, records)):
                y, sown = layers[index].apply(variables, x, rngs=rngs, mutable=["intermediates"], **kwargs)
        except (flax.errors.ScopeCollectionNotFound, flax.errors.ScopeParamNotFoundError) as err:
            err.add_note(
                f"pipejax.flax.LinenPipeline: layer {index} ({type(layers[index]).__name__}) has no such "
                f"variable in the pipeline's variables: was 'layers_{index}' missing from the variables "
                "given to from_sequential / from_stacked? Convert the variables of every layer with "
                "parameters."
            )
            raise
        except flax.errors.ScopeParamShapeError as err:
            err.add_note(
                f"pipejax.flax.LinenPipeline: in layer {index} ({type(layers[index]).__name__}), whose "
                f"parameters are 'layers_{index}' of the variables given to from_sequential / "
                "from_stacked: give that layer parameters of the shapes it creates (those of "
                "`nn.Sequential(layers).init(key, x)`)."
            )
            raise
        return y, records, unfreeze(sown).get("intermediates", {})


def _unboxed(tree: Any) -> Any:
    """``tree`` with every ``nn.Partitioned``-style box replaced by its value (no constraint)."""
    is_box = lambda t: isinstance(t, nn.meta.AxisMetadata)
    return jax.tree.map(lambda t: t.unbox(apply_constraint=False) if is_box(t) else t, tree, is_leaf=is_box)


def _batch_norm_interceptor(row_mask: jax.Array | None, deferred: bool, index: int, records: dict):
    """A Linen method interceptor that runs every ``nn.BatchNorm`` call as deferred batch norm.

    Evaluation calls run unchanged. A training call normalises the micro-batch with its own
    statistics over the real rows (``row_mask``), through a separate pure ``apply`` of the layer
    whose update of the running statistics is dropped, and records the micro-batch's moments
    under the BatchNorm's path.
    """
    busy = []  # set while the interceptor runs the BatchNorm itself, which it must not intercept

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if busy or context.method_name != "__call__" or not isinstance(module, nn.BatchNorm):
            return next_fun(*args, **kwargs)
        where = f"Layer {index}'s {type(module).__name__} (at {'/'.join(module.path) or 'the layer itself'})"
        if not deferred:
            raise ValueError(flax_batchnorm.needs_flag(f"{where} is an nn.BatchNorm", _NAME))
        if "batch_stats" not in module.variables:
            raise ValueError(
                f"{where} has no 'batch_stats'. Pass the LinenPipeline's batch_stats with its "
                "params, as `init` returns them: apply({'params': ..., 'batch_stats': ...}, x)."
            )
        x = args[0] if args else kwargs["x"]
        use_running_average = args[1] if len(args) > 1 else kwargs.get("use_running_average")
        if nn.merge_param("use_running_average", module.use_running_average, use_running_average):
            return next_fun(*args, **kwargs)
        path = tuple(module.path)
        flax_batchnorm.check_training_call(where, kwargs.get("mask"), module.axis_name, path, records)
        clone = module.copy(parent=None, name=None, use_running_average=False)
        busy.append(True)
        try:
            y, _ = clone.apply(
                dict(module.variables),
                x,
                mask=flax_batchnorm.row_mask_for(row_mask, x),
                mutable=["batch_stats"],
            )
        finally:
            busy.pop()
        records[path] = flax_batchnorm.batch_norm_moments(x, row_mask, module.axis, module.momentum)
        return y

    return intercept
