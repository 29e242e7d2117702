"""Deferred BatchNorm in the Flax adapters (``deferred_batch_norm=True``).

The pipeline runs with stage state: a stage holds its layers' running statistics; a BatchNorm
layer in training normalises its micro-batch with that micro-batch's own statistics over its
real rows and records the micro-batch's :class:`~pipejax.Moments` as a :class:`SownMoments`;
after the call the running statistics are updated once, from the moments of all micro-batches
merged (:func:`updated`, :func:`pipejax.batch_norm_update`). Each adapter intercepts its own
BatchNorm class and calls the helpers here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pipejax._src.batchnorm import BatchStats, Moments, batch_norm_update
from pipejax._src.batchnorm import moments as moments_of

PyTree = Any


@jax.tree_util.register_pytree_node_class
class SownMoments:
    """One BatchNorm call's :class:`~pipejax.Moments`, with the layer's momentum (static).

    The momentum travels in the pytree structure, not as an array, so the stats a pipeline stacks
    over the micro-batches still say how to update the layer they came from.
    """

    def __init__(self, moments: Moments, momentum: float):
        self.moments = moments
        self.momentum = momentum

    def tree_flatten(self):
        return (self.moments,), self.momentum

    @classmethod
    def tree_unflatten(cls, momentum, children):
        return cls(children[0], momentum)

    def __repr__(self) -> str:
        return f"SownMoments({self.moments!r}, momentum={self.momentum!r})"


def is_sown(t) -> bool:
    return isinstance(t, SownMoments)


def batch_norm_moments(x: jax.Array, row_mask: jax.Array, axis: Any, momentum: float) -> SownMoments:
    """The moments of a BatchNorm input ``x`` over the real rows of a micro-batch."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return SownMoments(moments_of(x, row_mask, axis=axes), momentum)


def row_mask_for(row_mask: jax.Array, x: jax.Array) -> jax.Array:
    """``bool[b]`` reshaped to broadcast against ``x`` (``(b, 1, ..., 1)``), as Flax's ``mask=``."""
    return jnp.reshape(row_mask, (x.shape[0],) + (1,) * (x.ndim - 1))


def check_training_call(
    where: str, mask: Any, axis_name: Any, path: tuple[str, ...], records: Mapping
) -> None:
    """Raises for what deferred BatchNorm does not support in a training call.

    Raises:
      NotImplementedError: for a ``mask=`` of the user's, a BatchNorm ``axis_name``, or a second
        call of the same BatchNorm module in one call of the layer.
    """
    if mask is not None:
        raise NotImplementedError(
            f"{where} was called with `mask=` in training inside a pipeline. Deferred BatchNorm "
            "masks the padding rows of each micro-batch itself and supports no other mask; drop "
            "`mask=`, or evaluate with `use_running_average=True`."
        )
    if axis_name is not None:
        raise NotImplementedError(
            f"{where} has axis_name={axis_name!r}: statistics synchronised over a device axis are "
            "not supported inside a pipeline; set axis_name=None."
        )
    if path in records:
        raise NotImplementedError(
            f"{where} was called twice in one call of the layer; deferred batch norm supports one "
            "call per BatchNorm module per layer call."
        )


def needs_flag(what: str, adapter: str) -> str:
    """The message for BatchNorm statistics in an adapter built without ``deferred_batch_norm``."""
    return (
        f"{what}, but this {adapter} was built without `deferred_batch_norm=True`. A pipeline "
        "normalises each micro-batch separately and must not update the running statistics once "
        f"per micro-batch; build it with `{adapter}(..., deferred_batch_norm=True)`, which updates "
        "them once per mini-batch."
    )


def _dict_path(path) -> tuple[str, ...]:
    """The mapping keys of a pytree key path (NNX Variables add a ``.value`` attribute key)."""
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def updated(batch_stats: PyTree, records: Mapping[tuple[str, ...], SownMoments] | None, unbiased: bool):
    """A layer's statistics with ``mean``/``var`` of every BatchNorm that recorded moments updated.

    ``batch_stats`` is the layer's statistics tree (a Linen dict or an ``nnx.State``): a BatchNorm
    at path ``p`` keeps its running statistics at ``p + ("mean",)`` and ``p + ("var",)``.
    """
    if not records:
        return batch_stats
    leaves = {_dict_path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(batch_stats)[0]}
    new = {}
    for path, sown in records.items():
        running = BatchStats(leaves[(*path, "mean")], leaves[(*path, "var")])
        stats = batch_norm_update(running, sown.moments, momentum=sown.momentum, unbiased=unbiased)
        new[(*path, "mean")], new[(*path, "var")] = stats.mean, stats.var
    return jax.tree_util.tree_map_with_path(lambda p, a: new.get(_dict_path(p), a), batch_stats)
