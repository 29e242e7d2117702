"""Choosing the balance: :func:`balance_costs`, the exact solver, and :func:`balance`.

:func:`balance_costs` finds the contiguous cut of layers into ``k`` stages whose most expensive
stage is as cheap as possible, exactly; :func:`balance` measures the costs first
(:func:`~pipejax._src.balance.costs.layer_costs`). Both return a :class:`Balance`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from pipejax._src import checks
from pipejax._src.balance.costs import layer_costs
from pipejax._src.balance.partitioning import Layer, PyTree, _check_layers


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
