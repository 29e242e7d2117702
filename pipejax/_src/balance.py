"""Cutting a sequence of layers into pipeline stages: ``partition`` and ``balance``.

A *layer* has the signature of a stage, ``layer(params, x, key) -> y``. :func:`partition` groups
contiguous layers into stage functions for :func:`pipejax.pipeline`, ``balance[s]`` layers in
stage ``s`` (torchgpipe's ``GPipe(module, balance=...)``). :func:`balance` chooses the balance:
it measures a cost per layer (:func:`layer_costs`: XLA's flop count, wall time, or memory) and
:func:`balance_costs` finds the contiguous cut into ``k`` stages whose most expensive stage is as
cheap as possible, exactly.

Inside a stage, layer ``j`` (counting from 0 within the stage) receives
``jax.random.fold_in(stage_key, j)`` (:func:`layer_key`), or ``None`` when the stage gets
``None``.
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import Mesh

from pipejax._src import checks
from pipejax._src.keys import layer_key
from pipejax._src.params.placement import StageParams

PyTree = Any
Layer = Callable[[PyTree, PyTree, Any], PyTree]  # layer(params, x, key) -> y

COST_MODELS = ("flops", "time", "memory")


# --- keys ----------------------------------------------------------------------------------------


# --- partition -----------------------------------------------------------------------------------


class Partition(NamedTuple):
    """Layers grouped into pipeline stages; see :func:`partition`."""

    stages: tuple[Callable[..., Any], ...]  # stage s applies layers offsets[s]:offsets[s + 1]
    balance: tuple[int, ...]  # layers per stage, all >= 1
    devices: tuple[Any, ...] | None  # the device of each stage, or None when not given

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
        if isinstance(stage_params, StageParams):
            stage_params = stage_params.unpack()
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
    stages = tuple(_make_stage(layers[offsets[s] : offsets[s + 1]], s) for s in range(len(balance)))
    return Partition(stages=stages, balance=balance, devices=stage_devices)


def _make_stage(layers: Sequence[Layer], s: int) -> Callable[..., Any]:
    def stage(params, x, key):
        _check_stage_params(params, s, len(layers), name=f"the params of stage {s}")
        for j, (layer, p) in enumerate(zip(layers, params, strict=True)):
            x = layer(p, x, layer_key(key, j))
        return x

    stage.__name__ = stage.__qualname__ = f"stage_{s}"
    stage.__doc__ = f"Stage {s}: {len(layers)} layers applied in turn; layer j gets fold_in(key, j)."
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


# --- the solver ----------------------------------------------------------------------------------


class Balance(tuple):
    """Layers per stage (a tuple of ints), with the per-layer costs it was chosen for.

    It is a tuple, so it goes wherever a balance does (``pj.partition(layers, b)``, ``b == (2,
    1)``); ``costs``, ``stage_costs`` and :meth:`table` tell how it was chosen.
    """

    costs: tuple[float, ...]  # one cost per layer
    by: str  # the cost model: "flops", "time", "memory" or "costs" (given by the caller)

    def __new__(cls, balance: Sequence[int], costs: Sequence[float], by: str):
        self = super().__new__(cls, tuple(int(b) for b in balance))
        self.costs = tuple(float(c) for c in costs)
        self.by = by
        return self

    def __getnewargs__(self):
        return tuple(self), self.costs, self.by

    def __repr__(self) -> str:
        return f"Balance({tuple(self)}, by={self.by!r}, max_stage_cost={self.max_stage_cost:.4g})"

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """The cost of each stage: the sum of its layers' costs."""
        o = (0, *np.cumsum(self).tolist())
        return tuple(math.fsum(self.costs[o[s] : o[s + 1]]) for s in range(len(self)))

    @property
    def max_stage_cost(self) -> float:
        """The cost of the most expensive stage, which the balance minimises."""
        return max(self.stage_costs)

    def table(self) -> str:
        """A per-stage table: layers, cost, share of the total, and the layers' own costs."""
        unit = {"flops": "flops", "time": "s", "memory": "bytes"}.get(self.by, "")
        total = math.fsum(self.costs) or 1.0
        o = (0, *np.cumsum(self).tolist())
        lines = [f"stage  layers    cost ({self.by})  share  per-layer costs ({unit or 'as given'})"]
        for s, cost in enumerate(self.stage_costs):
            layers = f"{o[s]}-{o[s + 1] - 1}" if self[s] > 1 else f"{o[s]}"
            per_layer = " ".join(f"{c:.3g}" for c in self.costs[o[s] : o[s + 1]])
            lines.append(f"{s:>5}  {layers:<8}  {cost:>12.4g}  {cost / total:>5.0%}  {per_layer}")
        return "\n".join(lines)


def balance_costs(costs: Sequence[float], num_stages: int) -> Balance:
    """The contiguous cut of layers with these costs into ``num_stages`` stages of least maximum.

    Among all ways to cut ``n`` layers into ``k`` non-empty contiguous stages, returns one whose
    most expensive stage (the pipeline's bottleneck) is as cheap as possible. The result is
    exact, not a heuristic: a dynamic program finds the optimal bottleneck ``B*``; a second one
    then chooses, among the cuts whose stages all cost at most ``B*``, the one with the smallest
    sum of squared stage costs (the most even), and among those the lexicographically smallest
    balance (the earliest cuts). Time ``O(n^2 k)``, memory ``O(n^2)``. Stage costs are sums
    accumulated left to right, so integer-valued costs are handled exactly.

    Args:
      costs: one finite, non-negative cost per layer (any unit: flops, seconds, bytes).
      num_stages: the number of stages ``k``, ``1 <= k <= len(costs)``.

    Returns:
      A :class:`Balance`: the layers per stage, with ``costs``, ``stage_costs`` and ``table()``.

    Raises:
      TypeError, ValueError: for costs that are not finite non-negative numbers, or a
        ``num_stages`` outside ``[1, len(costs)]``.

    Examples:
      >>> import pipejax as pj
      >>> b = pj.balance_costs([1, 1, 1, 6, 1, 2], 3)
      >>> b, b.stage_costs
      (Balance((3, 1, 2), by='costs', max_stage_cost=6), (3.0, 6.0, 3.0))
      >>> pj.balance_costs([1, 1, 1, 1], 2) == (2, 2)
      True
    """
    costs = _check_costs(costs)
    num_stages = _check_num_stages(num_stages, len(costs))
    return Balance(_solve(costs, num_stages), costs, "costs")


def _solve(costs: tuple[float, ...], k: int) -> tuple[int, ...]:
    n = len(costs)
    inf = math.inf
    # sums[i, j] = costs[i] + ... + costs[j - 1] (accumulated left to right), for i < j.
    sums = np.full((n + 1, n + 1), inf)
    c = np.asarray(costs, dtype=np.float64)
    for i in range(n):
        sums[i, i + 1 :] = np.cumsum(c[i:])
    # 1. best[t, j]: the least bottleneck of the first j layers cut into t stages.
    best = np.full((k + 1, n + 1), inf)
    best[0, 0] = 0.0
    for t in range(1, k + 1):
        for j in range(t, n - (k - t) + 1):
            i = np.arange(t - 1, j)
            best[t, j] = np.min(np.maximum(best[t - 1, i], sums[i, j]))
    bottleneck = best[k, n]
    # 2. even[t, i]: the least sum of squared stage costs of layers i.. cut into t stages, each
    # costing at most the bottleneck (exactly: the same sums, compared with <=).
    even = np.full((k + 1, n + 1), inf)
    even[0, n] = 0.0
    for t in range(1, k + 1):
        for i in range(n - t, -1, -1):
            j = np.arange(i + 1, n - t + 2)
            s = sums[i, j]
            even[t, i] = np.min(np.where(s <= bottleneck, s * s + even[t - 1, j], inf))
    # 3. Walk forward: the smallest first cut that attains the optimum (argmin takes the first).
    balance, i = [], 0
    for t in range(k, 0, -1):
        j = np.arange(i + 1, n - t + 2)
        s = sums[i, j]
        totals = np.where(s <= bottleneck, s * s + even[t - 1, j], inf)
        nxt = int(j[int(np.argmin(totals))])
        balance.append(nxt - i)
        i = nxt
    assert i == n and len(balance) == k  # internal invariant
    return tuple(balance)


def _check_costs(costs) -> tuple[float, ...]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, (Sequence, np.ndarray, jax.Array)):
        raise TypeError(
            f"`costs` must be a sequence of numbers, one per layer, but got {type(costs).__name__}."
        )
    if np.ndim(costs) != 1 or len(costs) == 0:
        raise ValueError(f"`costs` must be a non-empty 1-D sequence, one cost per layer, but got {costs!r}.")
    out = []
    for i, c in enumerate(costs):
        if isinstance(c, (bool, np.bool_, str, bytes)) or np.ndim(c) != 0 or np.iscomplexobj(c):
            raise TypeError(f"`costs[{i}]` is {c!r}; every cost must be a real number.")
        try:
            c = float(c)
        except TypeError:  # None, an object without a number in it
            raise TypeError(f"`costs[{i}]` is {c!r}; every cost must be a real number.") from None
        if not math.isfinite(c) or c < 0:
            raise ValueError(
                f"`costs[{i}]` is {c}; every cost must be finite and >= 0 (a layer cannot cost "
                "less than nothing, and an infinite cost has no balance)."
            )
        out.append(c)
    return tuple(out)


def _check_num_stages(num_stages, num_layers) -> int:
    if checks.integer(num_stages) is None:
        raise TypeError(
            f"`num_stages` must be an int (the number of stages to cut the layers into), but got "
            f"{type(num_stages).__name__} {num_stages!r}."
        )
    num_stages = checks.integer(num_stages)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"`num_stages` is {num_stages}, but {num_layers} layers allow 1 to {num_layers} stages: "
            "every stage needs at least one layer."
        )
    return num_stages


# --- cost models ---------------------------------------------------------------------------------


def balance(
    layers: Sequence[Layer],
    layer_params: Sequence[PyTree],
    sample_x: PyTree,
    num_stages: int,
    *,
    by: str = "flops",
    key: jax.Array | None = None,
    backward: bool = True,
    param_scale: float = 2.0,
    activation_scale: float = 1.0,
    warmup: int = 1,
    repeats: int = 5,
) -> Balance:
    """Chooses a balance for :func:`partition`: measures every layer, then cuts optimally.

    ``balance(...)`` is ``balance_costs(layer_costs(...), num_stages)``: see :func:`layer_costs`
    for the cost models (``by="flops"``, ``"time"``, ``"memory"``) and :func:`balance_costs` for
    the exact solver. To bring your own cost model, call :func:`balance_costs` with your costs.

    Args:
      layers: the layer functions ``layer(params, x, key) -> y``, in order.
      layer_params: one parameter pytree per layer (arrays, or ``jax.ShapeDtypeStruct`` for
        ``"flops"`` and ``"memory"``, which never run the layers).
      sample_x: an input of the first layer, ideally one micro-batch as the pipeline will see it.
      num_stages: the number of stages, ``1 <= num_stages <= len(layers)``.
      by: the cost model, ``"flops"`` (default), ``"time"`` or ``"memory"``.
      key: optional PRNG key; layer ``l`` is measured with ``fold_in(key, l)`` (dropout on).
      backward: ``"flops"`` and ``"time"``: measure a training step's forward + backward (True)
        or the forward only (False, for inference).
      param_scale: ``"memory"``: parameter-sized buffers per parameter (2: params and grads;
        Adam: 4).
      activation_scale: ``"memory"``: micro-batches whose activations a device keeps at once.
      warmup: ``"time"``: untimed runs per layer before timing.
      repeats: ``"time"``: timed runs per layer; the median is used.

    Returns:
      A :class:`Balance` (a tuple of ints) with the per-layer ``costs``; print ``table()``.

    Raises:
      TypeError, ValueError: for bad arguments, or a layer that cannot take the previous
        layer's output.

    Examples:
      >>> import jax.numpy as jnp
      >>> import pipejax as pj
      >>> def block(p, x, key):  # 8 -> hidden -> 8
      ...     return jnp.tanh(x @ p) @ p.T
      >>> params = [jnp.ones((8, 8)), jnp.ones((8, 8)), jnp.ones((8, 512)), jnp.ones((8, 8))]
      >>> b = pj.balance([block] * 4, params, jnp.ones((16, 8)), 3)
      >>> b  # the wide block gets a stage of its own
      Balance((2, 1, 1), by='flops', max_stage_cost=...)
      >>> print(b.table())  # doctest: +SKIP
    """
    num_stages = _check_num_stages(num_stages, len(_check_layers(layers)))
    costs = layer_costs(
        layers,
        layer_params,
        sample_x,
        by=by,
        key=key,
        backward=backward,
        param_scale=param_scale,
        activation_scale=activation_scale,
        warmup=warmup,
        repeats=repeats,
    )
    return Balance(_solve(costs, num_stages), costs, by)


def layer_costs(
    layers: Sequence[Layer],
    layer_params: Sequence[PyTree],
    sample_x: PyTree,
    *,
    by: str = "flops",
    key: jax.Array | None = None,
    backward: bool = True,
    param_scale: float = 2.0,
    activation_scale: float = 1.0,
    warmup: int = 1,
    repeats: int = 5,
) -> tuple[float, ...]:
    """The cost of every layer under a cost model; what :func:`balance` balances.

    ``sample_x`` is propagated through the layers with ``jax.eval_shape`` (``"time"`` runs them),
    so each layer is measured on the input type it will see. Layers with equal functions,
    parameter types and input types are compiled once.

    * ``by="flops"``: XLA's operation count of the compiled layer,
      ``jax.jit(f).lower(...).compile().cost_analysis()``, ``flops + transcendentals``. With
      ``backward=True`` (default) ``f`` is the layer's forward *and* backward (a ``jax.vjp``
      with a cotangent argument): what a training step executes. The backward is not a fixed
      multiple of the forward (twice it for a matmul, a scatter-add for an embedding's
      gather, nothing for a layer without inputs to differentiate), so forward flops alone would
      misrank layers. Deterministic, and needs no data: parameters may be ``ShapeDtypeStruct``.
      It counts arithmetic, not memory traffic, so it underrates memory-bound layers
      (elementwise ops, gathers).
    * ``by="time"``: wall-clock seconds of the same jitted program, the median of ``repeats``
      runs after ``warmup`` runs, each ended by ``block_until_ready``. It sees what flops miss,
      but it is **noisy** (other processes, frequency scaling, tiny layers near the launch
      overhead): two calls may return different balances. Abstract leaves run as zeros.
    * ``by="memory"``: bytes, ``param_scale * parameter bytes + activation_scale * activation
      bytes``. ``param_scale`` follows torchgpipe's ``balance_by_size``: how many
      parameter-sized buffers training allocates per parameter: 2 for parameters and their
      gradients (plain SGD), 3 for SGD with momentum, 4 for Adam (two moment estimates).
      Activation bytes are what reverse-mode autodiff saves for the layer's backward on one
      ``sample_x`` micro-batch (its saved residuals, the layer's input included when the backward
      needs it, the parameters excluded since they are counted above): the deterministic,
      compile-free counterpart of torchgpipe's measured CUDA allocation. A pipeline device keeps
      those of one micro-batch at a time under ``checkpoint="always"`` (``activation_scale=1``)
      and of up to ``chunks`` micro-batches under ``"never"``.

    Args:
      layers, layer_params, sample_x, by, key, backward, param_scale: as for :func:`balance`.
      activation_scale, warmup, repeats: as for :func:`balance`.

    Raises:
      TypeError, ValueError: as for :func:`balance`.

    Returns:
      One non-negative float per layer: flops, seconds or bytes.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> def dense(p, x, key):
      ...     return x @ p
      >>> w = jax.ShapeDtypeStruct((4, 2), jnp.float32)  # no data needed for flops
      >>> pj.layer_costs([dense], [w], jnp.ones((8, 4), jnp.float32), backward=False)
      (128.0,)
      >>> pj.layer_costs([dense], [w], jnp.ones((8, 4), jnp.float32), by="memory")  # 2 * 32 + 128
      (192.0,)
    """
    layers = _check_layers(layers)
    if isinstance(layer_params, (str, bytes)) or not isinstance(layer_params, Sequence):
        raise TypeError(
            f"`layer_params` must be a sequence with one parameter pytree per layer ({len(layers)}), "
            f"but got {type(layer_params).__name__}."
        )
    if len(layer_params) != len(layers):
        raise ValueError(
            f"`layer_params` has {len(layer_params)} entries but there are {len(layers)} layers; pass "
            "one parameter pytree per layer (None for a layer without parameters)."
        )
    if by not in COST_MODELS:
        raise ValueError(
            f"`by` must be one of {', '.join(repr(m) for m in COST_MODELS)}, but got {by!r}. For your "
            "own per-layer costs, call `pj.balance_costs(costs, num_stages)`."
        )
    _check_scale(param_scale, "param_scale")
    _check_scale(activation_scale, "activation_scale")
    _check_count(warmup, "warmup", 0)
    _check_count(repeats, "repeats", 1)
    if not isinstance(backward, bool):
        raise TypeError(f"`backward` must be a bool, but got {backward!r}.")
    checks.check_key(key)

    cache: dict[Any, Any] = {}
    costs = []
    x = sample_x if by == "time" else _structs(sample_x)
    if by == "time":
        x = _materialise(x)
    for idx, (layer, p) in enumerate(zip(layers, layer_params, strict=True)):
        k = None if key is None else jax.random.fold_in(key, idx)
        if by == "time":
            p = _materialise(p)
        else:
            p = _structs(p)
        y = _output_type(layer, p, x, k, idx)
        if by == "memory":
            cost = param_scale * _nbytes(p) + activation_scale * _activation_bytes(layer, p, x, k)
        else:
            program = _program(cache, layer, p, x, k, y, backward)
            if by == "flops":
                cost = _flops(program, idx)
            else:
                cost, y = _time(program, p, x, k, y, backward, warmup, repeats)
        costs.append(float(cost))
        x = y
    return tuple(costs)


def _check_scale(value, name) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= value < math.inf):
        raise ValueError(f"`{name}` must be a finite number >= 0, but got {value!r}.")


def _check_count(value, name, least) -> None:
    checks.count(value, name, least=least)


def _struct(a) -> jax.ShapeDtypeStruct:
    if isinstance(a, jax.ShapeDtypeStruct):
        return a
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(jax.typeof(a), "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), weak_type=True)  # Python scalars


def _structs(tree: PyTree) -> PyTree:
    return jax.tree.map(_struct, tree)


def _materialise(tree: PyTree) -> PyTree:
    """Concrete arrays for timing: abstract leaves become zeros."""

    def zeros(a):
        return jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a

    return jax.tree.map(zeros, tree)


def _output_type(layer, p, x, k, idx) -> PyTree:
    """The layer's output type, or: JAX's own shape/dtype error as a ``ValueError`` naming the
    layer; any other exception (the user's own) with its type kept and the layer added as a note."""
    try:
        return jax.eval_shape(layer, p, x, k)
    except Exception as err:
        where = "`sample_x`" if idx == 0 else f"the output of layer {idx - 1}"
        fix = f"Make layer {idx} accept what {where} is (with its batch axis first), or check `layer_params`."
        types = checks.types_text(_structs(x))
        if type(err) in (TypeError, ValueError) and checks.raised_in_jax(err):
            raise ValueError(
                f"Layer {idx} could not be applied to {where}, whose type is {types}:\n"
                f"{type(err).__name__}: {err}\n{fix}"
            ) from err
        err.add_note(
            f"Layer {idx} failed on {where}, whose type is {types}, while pipejax measured its cost. {fix}"
        )
        raise


def _nbytes(tree: PyTree) -> int:
    return sum(math.prod(a.shape) * getattr(a.dtype, "itemsize", 0) for a in jax.tree.leaves(_structs(tree)))


def _inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _step(layer, backward):
    """The program whose cost is measured: the forward, or a forward + backward (a vjp)."""

    def forward(p, x, k, ct):
        return layer(p, x, k)

    def train(p, x, k, ct):
        y, vjp = jax.vjp(lambda p, x: layer(p, x, k), p, x)
        leaves, tree = jax.tree.flatten(y)
        given = iter(ct)  # cotangents of the float outputs; integer outputs take float0 zeros
        cts = [next(given) if _inexact(a) else np.zeros(a.shape, jax.dtypes.float0) for a in leaves]
        return y, vjp(jax.tree.unflatten(tree, cts))

    return train if backward else forward


def _signature(tree) -> Any:
    leaves, tree = jax.tree.flatten(_structs(tree))
    return tree, tuple((a.shape, a.dtype, a.weak_type) for a in leaves)


def _program(cache, layer, p, x, k, y, backward):
    """The compiled program of a layer, shared by layers with equal functions and types."""
    ct = [a for a in jax.tree.leaves(y) if _inexact(a)] if backward else []
    sig = (layer, backward, _signature(p), _signature(x), _signature(k), _signature(ct))
    if sig not in cache:
        cache[sig] = jax.jit(_step(layer, backward)).lower(p, x, k, _structs(ct)).compile()
    return cache[sig]


def _flops(program, idx) -> float:
    analysis = program.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis:
        raise ValueError(
            f"XLA reported no cost analysis for layer {idx} on this backend; use `by='time'` or "
            "`by='memory'`, or bring your own costs to `pj.balance_costs`."
        )
    # XLA leaves the "flops" key out of a program that does none (a reshape, an identity)
    flops = float(analysis.get("flops", 0.0))
    return max(0.0, flops) + max(0.0, float(analysis.get("transcendentals", 0.0)))


def _time(program, p, x, k, y, backward, warmup, repeats):
    ct = [jnp.ones(a.shape, a.dtype) for a in jax.tree.leaves(y) if _inexact(a)] if backward else []
    for _ in range(warmup):
        jax.block_until_ready(program(p, x, k, ct))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(program(p, x, k, ct))
        times.append(time.perf_counter() - start)
    y = out[0] if backward else out
    return statistics.median(times), y


def _activation_bytes(layer, p, x, k) -> int:
    """Bytes reverse-mode autodiff saves for the layer's backward, its parameters excluded.

    The residuals are the leaves of the function ``jax.vjp`` returns; in the jaxpr of
    ``(p, x) -> vjp_fn`` they are the outputs. Outputs that are parameter inputs, closed-over
    constants or literals are not activations; the layer's own input ``x`` is, when it is saved.
    """

    def residuals(p, x):
        return jax.vjp(lambda p, x: layer(p, x, k), p, x)[1]

    closed = jax.make_jaxpr(residuals)(p, x)
    jaxpr = closed.jaxpr
    num_params = len(jax.tree.leaves(p))
    not_activations = {id(v) for v in jaxpr.invars[:num_params]} | {id(v) for v in jaxpr.constvars}
    seen: set[int] = set()
    total = 0
    for v in jaxpr.outvars:
        if isinstance(v, jex_core.Literal) or id(v) in not_activations or id(v) in seen:
            continue
        seen.add(id(v))
        aval = v.aval
        total += math.prod(aval.shape) * getattr(aval.dtype, "itemsize", 0)
    return total
