"""What the Linen and NNX adapters share: cutting layers into stages, keys per layer, flags.

A pipelined sequence of ``L`` layers is cut into ``n`` stages of consecutive layers. ``balance``
gives the number of layers of each stage (as in torchgpipe: ``balance=[2, 2]`` puts layers 0-1 on
stage 0 and layers 2-3 on stage 1); ``num_stages`` splits as evenly as possible, the first
``L mod n`` stages taking one layer more.

Randomness: stage ``s`` on micro-batch ``i`` receives ``pj.stage_key(key, i, s)`` from the
pipeline; layer ``j`` of that stage (``j`` counts from 0 inside the stage) draws from
:func:`layer_key` of it, ``jax.random.fold_in(stage_key, j)``. Every (micro-batch, stage, layer)
triple thus has its own key, and recomputing a checkpointed stage replays it.

Deferred BatchNorm (``deferred_batch_norm=True``): the adapters run the pipeline with stage state.
A stage holds its layers' running statistics as ``state``; a BatchNorm layer in training
normalises its micro-batch with that micro-batch's own statistics over its real rows (the
``mask`` the stage receives) and reports the micro-batch's :class:`~pipejax.Moments` as a
:class:`SownMoments`; after the call :func:`update_running` updates the running statistics once,
from the moments of all micro-batches merged (:func:`pipejax.batch_norm_update`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pipejax._src.batchnorm import BatchStats, Moments, batch_norm_update
from pipejax._src.batchnorm import moments as moments_of
from pipejax._src.keys import layer_key as layer_key
from pipejax._src.placement import StageParams


def stage_sizes(num_layers: int, balance: Sequence[int] | None, num_stages: int | None) -> tuple[int, ...]:
    """The number of layers of each stage, from ``balance`` or ``num_stages`` (exactly one of them).

    Raises:
      TypeError: if neither or both of ``balance`` and ``num_stages`` are given, or either has the
        wrong type.
      ValueError: if an entry of ``balance`` is not positive, if ``balance`` does not sum to the
        number of layers, or if ``num_stages`` is not in ``[1, num_layers]``.
    """
    if (balance is None) == (num_stages is None):
        given = "both" if balance is not None else "neither"
        raise TypeError(
            f"Pass exactly one of `balance` (layers per stage, e.g. balance=[2, 2]) and "
            f"`num_stages` (an even split), but {given} was given."
        )
    if num_stages is not None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int):
            raise TypeError(
                f"`num_stages` must be an int, but got {type(num_stages).__name__} {num_stages!r}."
            )
        if not 1 <= num_stages <= num_layers:
            raise ValueError(
                f"`num_stages` must be between 1 and the number of layers ({num_layers}), since "
                f"every stage needs at least one layer, but got {num_stages}."
            )
        base, extra = divmod(num_layers, num_stages)
        return tuple(base + (1 if s < extra else 0) for s in range(num_stages))
    if (
        isinstance(balance, (str, bytes))
        or not isinstance(balance, Sequence)
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in balance)
    ):
        raise TypeError(
            "`balance` must be a sequence of ints (layers per stage, e.g. balance=[2, 2]), but got "
            f"{balance!r}."
        )
    if len(balance) == 0 or any(b < 1 for b in balance):
        raise ValueError(
            f"`balance` gives the number of layers of each stage, so every entry must be >= 1 and "
            f"there must be at least one stage, but got balance={list(balance)}."
        )
    if sum(balance) != num_layers:
        raise ValueError(
            f"`balance` must sum to the number of layers: balance={list(balance)} sums to "
            f"{sum(balance)}, but there are {num_layers} layers. Change `balance` so that its "
            "entries add up to the number of layers."
        )
    return tuple(balance)


def group(items: Sequence[Any], sizes: Sequence[int]) -> list[tuple[Any, ...]]:
    """``items`` cut into consecutive groups of ``sizes``."""
    out, start = [], 0
    for size in sizes:
        out.append(tuple(items[start : start + size]))
        start += size
    assert start == len(items), (sizes, len(items))  # internal: sizes come from stage_sizes
    return out


def check_mesh(mesh: Mesh | None, axis_name: str, sizes: Sequence[int]) -> None:
    """Raises ``ValueError`` unless ``mesh`` is ``None`` or has an ``axis_name`` axis of ``len(sizes)``."""
    if mesh is None or not isinstance(mesh, Mesh) or not isinstance(axis_name, str):
        return  # the pipeline reports the wrong types
    n = len(sizes)
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`mesh` has no axis named {axis_name!r} (its axes are {tuple(mesh.axis_names)}); "
            f"the pipeline needs one device per stage along it. Use "
            f"`jax.make_mesh(({n},), ({axis_name!r},))` or pass `axis_name=`."
        )
    if mesh.shape[axis_name] != n:
        raise ValueError(
            f"`mesh` axis {axis_name!r} has size {mesh.shape[axis_name]}, but the layers are cut "
            f"into {n} stages (layers per stage: {list(sizes)}); each device along the stage axis "
            f"runs one stage, so the sizes must be equal. Use `jax.make_mesh(({n},), "
            f"({axis_name!r},))`, or change `balance`/`num_stages` to {mesh.shape[axis_name]} stages."
        )


def accepted_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``fn`` accepts as keyword arguments (all, with ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in kwargs.items() if k in names}


def route_kwargs(calls: Sequence[Callable[..., Any]], kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """For each layer's call, the keyword arguments it accepts, after checking ``kwargs``.

    Raises:
      TypeError: if a keyword argument is an array (per-example inputs belong in ``x``, where they
        are cut into micro-batches) or is accepted by none of the layers (a typo would otherwise
        be ignored silently).
    """
    for name, value in kwargs.items():
        if isinstance(value, jax.Array) or hasattr(value, "__jax_array__"):
            raise TypeError(
                f"Keyword argument `{name}` is an array. Keyword arguments reach every layer "
                "unchanged (whole, not cut into micro-batches), so they are for Python flags such "
                f"as `deterministic=True`; put per-example arrays into `x` (a pytree) instead."
            )
    routed = [accepted_kwargs(call, kwargs) for call in calls]
    unused = sorted(set(kwargs) - {k for r in routed for k in r})
    if unused:
        raise TypeError(
            f"Keyword argument(s) {unused} are accepted by none of the layers' `__call__`. Each "
            "keyword argument is passed to the layers whose `__call__` takes it; check the "
            "spelling, or remove it."
        )
    return routed


@jax.jit
def unpack(packed: StageParams) -> list[Any]:
    """``packed.unpack()`` as one compiled program (eagerly it would dispatch a slice per leaf)."""
    return packed.unpack()


# --- deferred BatchNorm ------------------------------------------------------------------------


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


def batch_norm_moments(x: jax.Array, row_mask: jax.Array, axis: Any, momentum: float) -> SownMoments:
    """The moments of a BatchNorm input ``x`` over the real rows of a micro-batch."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return SownMoments(moments_of(x, row_mask, axis=axes), momentum)


def row_mask_for(row_mask: jax.Array, x: jax.Array) -> jax.Array:
    """``bool[b]`` reshaped to broadcast against ``x`` (``(b, 1, ..., 1)``), as Flax's ``mask=``."""
    return jnp.reshape(row_mask, (x.shape[0],) + (1,) * (x.ndim - 1))


def update_running(mean: jax.Array, var: jax.Array, sown: SownMoments, unbiased: bool) -> BatchStats:
    """New running ``(mean, var)`` from the moments of every micro-batch (leading axis ``m``)."""
    return batch_norm_update(BatchStats(mean, var), sown.moments, momentum=sown.momentum, unbiased=unbiased)


def check_user_mask(mask: Any, layer: str) -> None:
    """Raises ``NotImplementedError`` for a BatchNorm ``mask=`` in training inside a pipeline."""
    if mask is not None:
        raise NotImplementedError(
            f"{layer} was called with `mask=` in training inside a pipeline. Deferred BatchNorm "
            "masks the padding rows of each micro-batch itself and supports no other mask; drop "
            "`mask=`, or evaluate with `use_running_average=True`."
        )
