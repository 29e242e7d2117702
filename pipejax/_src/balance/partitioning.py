"""Cutting a sequence of layers into pipeline stages: :func:`partition` and :class:`Partition`.

A *layer* has the signature of a stage, ``layer(params, x, key) -> y`` (a stateful one
``layer(params, x, key, state, mask) -> (y, stats)``). :func:`partition` groups
contiguous layers into stage functions for :func:`pipejax.pipeline`, ``balance[s]`` layers in
stage ``s`` (torchgpipe's ``GPipe(module, balance=...)``). Inside a stage, layer ``j`` (counting
from 0 within the stage) receives ``jax.random.fold_in(stage_key, j)`` (:func:`layer_key`), or
``None`` when the stage gets ``None``.

Also the checks of the layers, of a balance (``_check_balance``, which the layer form of the
parameters uses too) and of the devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from pipejax._src import checks
from pipejax._src.keys import layer_key
from pipejax._src.params import placement
from pipejax._src.params.placement import StageParams

PyTree = Any
Layer = Callable[[PyTree, PyTree, Any], PyTree]  # layer(params, x, key) -> y


class Partition(NamedTuple):
    """Layers grouped into pipeline stages; see :func:`partition`."""

    stages: tuple[Callable[..., Any], ...]  # stage s applies layers offsets[s]:offsets[s + 1]
    balance: tuple[int, ...]  # layers per stage, all >= 1
    devices: tuple[Any, ...] | None  # the device of each stage, or None when not given
    stateful: bool = False  # stateful layers: a stage takes and returns the list of its layers' state

    def __repr__(self) -> str:
        return f"Partition(balance={self.balance}, devices={self.devices})"

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return len(self.balance)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each stage starts in the layer list, then the number of layers (``k + 1`` ints)."""
        return (0, *np.cumsum(self.balance).tolist())

    def group(self, layer_params: Sequence[PyTree]) -> list[list[PyTree]]:
        """Per-layer parameters -> per-stage parameters: stage ``s`` gets the list of its layers'.

        Raises:
          TypeError, ValueError: unless ``layer_params`` is a sequence with one entry per layer.
        """
        n = self.offsets[-1]
        checks.sequence(layer_params, "layer_params", f"one parameter pytree per layer ({n})")
        if len(layer_params) != n:
            raise ValueError(
                f"`layer_params` has {len(layer_params)} entries, but the partition has {n} layers "
                f"(balance {self.balance}); pass one parameter pytree per layer, in order."
            )
        o = self.offsets
        return [list(layer_params[o[s] : o[s + 1]]) for s in range(self.num_stages)]

    def ungroup(self, stage_params: Sequence[Sequence[PyTree]] | StageParams) -> list[PyTree]:
        """Per-stage parameters (what :meth:`group` returns, a trained copy of it, or a
        :class:`pipejax.StageParams` from ``Pipeline.place``) -> the flat per-layer list.

        Raises:
          TypeError, ValueError: unless there is one entry per stage, each with one entry per
            layer of that stage.
        """
        stage_params = placement.per_stage(stage_params)
        if isinstance(stage_params, (str, bytes)) or not isinstance(stage_params, Sequence):
            raise TypeError(
                f"`stage_params` must be a sequence with one entry per stage ({self.num_stages}), "
                f"or a StageParams, but got {type(stage_params).__name__}."
            )
        if len(stage_params) != self.num_stages:
            raise ValueError(
                f"`stage_params` has {len(stage_params)} entries, but the partition has "
                f"{self.num_stages} stages (balance {self.balance})."
            )
        layers = []
        for s, (params, count) in enumerate(zip(stage_params, self.balance, strict=True)):
            _check_stage_params(params, s, count, name=f"stage_params[{s}]")
            layers.extend(params)
        return layers

    def mesh(self, axis_name: str = "stage") -> Mesh:
        """A 1-D mesh whose axis ``axis_name`` holds the stages' devices, in stage order.

        The devices are ``devices`` as given to :func:`partition`, or the first ``num_stages`` of
        ``jax.devices()``. The axis is Explicit, like ``jax.make_mesh``'s default.

        Raises:
          TypeError: ``axis_name`` is not a str.
          ValueError: ``axis_name`` is empty; without ``devices``, if fewer than ``num_stages``
            devices exist.
        """
        checks.axis_name(axis_name)
        devices = self.devices
        if devices is None:
            available = jax.devices()
            if len(available) < self.num_stages:
                raise ValueError(
                    f"The partition has {self.num_stages} stages but only {len(available)} devices "
                    "exist; use fewer stages (a shorter `balance`)."
                )
            devices = tuple(available[: self.num_stages])
        return jax.make_mesh((self.num_stages,), (axis_name,), devices=list(devices))


def partition(
    layers: Sequence[Layer],
    balance: Sequence[int] | None = None,
    *,
    devices: int | Sequence[Any] | None = None,
    stateful: bool = False,
) -> Partition:
    """Groups contiguous layers into pipeline stages: ``balance[s]`` layers in stage ``s``.

    The pipejax form of torchgpipe's ``GPipe(module, balance=[...])``. A layer is a function
    ``layer(params, x, key) -> y``, like a stage. Stage ``s`` applies layers
    ``offsets[s] .. offsets[s + 1] - 1`` in order; its parameters are the list of those layers'
    parameters (:meth:`Partition.group` builds them, :meth:`Partition.ungroup` reads them back).
    Layer ``j`` of a stage (``j`` counting from 0 within the stage) receives
    ``jax.random.fold_in(stage_key, j)`` (:func:`layer_key`), or ``None`` when the stage gets
    ``None``; so with ``pj.pipeline`` layer ``j`` of stage ``s`` on micro-batch ``i`` draws from
    ``fold_in(pj.stage_key(key, i, s), j)``.

    Stateful layers (``stateful=True``, for ``pj.pipeline(..., stateful=True)``) are
    ``layer(params, x, key, state, mask) -> (y, stats)``; stage ``s`` is then
    ``stage(params, x, key, state, mask) -> (y, stats)`` with ``state`` the list of its layers'
    states (:meth:`Partition.group` groups them as it groups parameters) and ``stats`` the list
    of their statistics; every layer sees the micro-batch's row ``mask``.

    Args:
      layers: the layer functions, in order.
      balance: the number of layers in each stage; positive ints summing to ``len(layers)``.
        :func:`balance` computes one.
      devices: optional; the devices available to the pipeline, as a count (the first ``count``
        of ``jax.devices()``) or a sequence of distinct devices. There must be at least one per
        stage; stage ``s`` is given the ``s``-th (:meth:`Partition.mesh` builds the mesh).

    Returns:
      A :class:`Partition` with ``stages`` (pass them to :func:`pipejax.pipeline`), ``balance``,
      ``devices``, ``offsets``, ``group``, ``ungroup`` and ``mesh``.

    Raises:
      TypeError, ValueError: if ``layers`` is not a non-empty sequence of callables, a ``balance``
        entry is not a positive int, ``sum(balance) != len(layers)``, or there are fewer
        ``devices`` than stages.

    Examples:
      >>> import jax.numpy as jnp
      >>> import pipejax as pj
      >>> def scale(p, x, key):
      ...     return x * p
      >>> part = pj.partition([scale, scale, scale], [2, 1])
      >>> stage_params = part.group([2.0, 3.0, 5.0])
      >>> stage_params
      [[2.0, 3.0], [5.0]]
      >>> pj.pipeline(part.stages, chunks=2)(stage_params, jnp.ones(4)).tolist()
      [30.0, 30.0, 30.0, 30.0]
      >>> part.ungroup(stage_params)
      [2.0, 3.0, 5.0]

    References:
      Kim et al., "torchgpipe: On-the-fly Pipeline Parallelism for Training Giant Models", 2020.
    """
    layers = _check_layers(layers, balance)
    balance = _check_balance(balance, len(layers))
    stage_devices = _check_devices(devices, len(balance))
    offsets = (0, *np.cumsum(balance).tolist())
    if not isinstance(stateful, bool):
        raise TypeError(f"`stateful` must be a bool, but got {type(stateful).__name__} {stateful!r}.")
    make = _make_stateful_stage if stateful else _make_stage
    stages = tuple(make(layers[offsets[s] : offsets[s + 1]], s) for s in range(len(balance)))
    return Partition(stages=stages, balance=balance, devices=stage_devices, stateful=stateful)


def _make_stage(layers: Sequence[Layer], s: int) -> Callable[..., Any]:
    def stage(params, x, key):
        _check_stage_params(params, s, len(layers), name=f"the params of stage {s}")
        for j, (layer, p) in enumerate(zip(layers, params, strict=True)):
            x = layer(p, x, layer_key(key, j))
        return x

    stage.__name__ = stage.__qualname__ = f"stage_{s}"
    stage.__doc__ = f"Stage {s}: {len(layers)} layers applied in turn; layer j gets fold_in(key, j)."
    return stage


def _make_stateful_stage(layers: Sequence[Layer], s: int) -> Callable[..., Any]:
    def stage(params, x, key, state, mask):
        _check_stage_params(params, s, len(layers), name=f"the params of stage {s}")
        if state is None:
            state = [None] * len(layers)
        _check_stage_params(state, s, len(layers), name=f"the state of stage {s}")
        stats = []
        for j, (layer, p, st) in enumerate(zip(layers, params, state, strict=True)):
            x, stat = layer(p, x, layer_key(key, j), st, mask)
            stats.append(stat)
        return x, stats

    stage.__name__ = stage.__qualname__ = f"stage_{s}"
    stage.__doc__ = (
        f"Stage {s}: {len(layers)} stateful layers applied in turn, each with its own state and the "
        "row mask; layer j gets fold_in(key, j). Returns (y, the list of the layers' stats)."
    )
    return stage


def _check_stage_params(params, s, count, *, name):
    if isinstance(params, (list, tuple)) and len(params) == count:
        return
    if isinstance(params, (list, tuple)):
        got = f"a {type(params).__name__} of {len(params)}"
    else:
        got = type(params).__name__
    raise ValueError(
        f"Stage {s} holds {count} layers, so {name} must be a list of {count} per-layer parameter "
        f"pytrees, but got {got}. Build the per-stage parameters with `partition.group(layer_params)`."
    )


def _check_layers(layers, balance=None) -> tuple[Layer, ...]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(
            "`layers` must be a sequence of layer functions `layer(params, x, key) -> y`, but got "
            f"{type(layers).__name__}."
        )
    if len(layers) == 0:
        msg = "`layers` is empty; pass at least one layer function `layer(params, x, key) -> y`"
        if isinstance(balance, (list, tuple)) and balance:  # pj.partition(layers, balance)
            msg += (
                f", and a `balance` whose entries add up to the number of layers (`balance` "
                f"{list(balance)} asks for {sum(checks.integer(b) or 0 for b in balance)}). " + _AUTO
            )
        raise ValueError(msg if msg.endswith(".") else msg + ".")
    for i, layer in enumerate(layers):
        if not callable(layer):
            raise TypeError(
                f"`layers[{i}]` must be a callable `layer(params, x, key) -> y`, but got "
                f"{type(layer).__name__} {layer!r}."
            )
    return tuple(layers)


_AUTO = (
    "To balance automatically, let `pj.balance(layers, layer_params, sample_x, num_stages)` compute "
    "one from measured costs (flops, time or memory) and pass the result as `balance`."
)


def _check_balance(balance, num_layers) -> tuple[int, ...]:
    if balance is None:
        raise TypeError(
            f"`pj.partition` needs `balance`, the number of layers in each stage (e.g. [2, 3, 1] for "
            f"{num_layers} layers in 3 stages). " + _AUTO
        )
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(
            "`balance` must be a sequence of positive ints, the number of layers in each stage "
            f"(e.g. [2, 3, 1]), but got {type(balance).__name__} {balance!r}."
        )
    if len(balance) == 0:
        raise ValueError("`balance` is empty; give the number of layers of at least one stage.")
    for s, b in enumerate(balance):
        if checks.integer(b) is None:
            raise TypeError(
                f"`balance[{s}]` is {b!r} ({type(b).__name__}); every entry must be a positive int, "
                "the number of layers in that stage."
            )
        if b < 1:
            raise ValueError(
                f"`balance[{s}]` is {b}; every entry must be a positive int (a stage needs at least "
                f"one layer). Got balance {list(balance)}: merge the empty stage into a neighbour. " + _AUTO
            )
    total = sum(int(b) for b in balance)
    if total != num_layers:
        raise ValueError(
            f"`balance` {list(balance)} sums to {total} layers, but `layers` has {num_layers}; the "
            "entries must add up to the number of layers. " + _AUTO
        )
    return tuple(int(b) for b in balance)


def _check_devices(devices, num_stages) -> tuple[Any, ...] | None:
    if devices is None:
        return None
    if isinstance(devices, Mesh):
        raise TypeError(
            "`devices` must be a count or a sequence of devices, not a Mesh: pass "
            "`list(mesh.devices.flat)` or the mesh to `pj.pipeline(..., mesh=mesh)` directly."
        )
    if checks.integer(devices) is not None:
        devices = checks.integer(devices)
        available = jax.devices()
        if devices < 1:
            raise ValueError(
                f"`devices` of partition must be a positive count (the first `devices` of "
                f"`jax.devices()`) or a sequence of devices, but got {devices}; pass at least "
                f"{num_stages}, one device per stage, e.g. `devices={num_stages}`."
            )
        if devices > len(available):
            raise ValueError(
                f"`devices` is {devices}, but only {len(available)} devices exist "
                "(`jax.device_count()`); pass at most that many."
            )
        devices = available[: int(devices)]
    elif isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"`devices` must be a count (int) or a sequence of devices, but got {type(devices).__name__}."
        )
    else:
        for i, d in enumerate(devices):
            if not isinstance(d, jax.Device):
                raise TypeError(f"`devices[{i}]` must be a jax.Device, but got {type(d).__name__} {d!r}.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"`devices` lists a device more than once: {list(devices)}.")
    if len(devices) < num_stages:
        raise ValueError(
            f"There are {len(devices)} devices but {num_stages} stages; a pipeline needs at least "
            "one device per stage. Use more devices or fewer stages (a shorter `balance`)."
        )
    return tuple(devices[:num_stages])
