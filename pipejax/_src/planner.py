"""A planner: which schedule, ``chunks``, checkpoint mode (and ``overlap``) and balance to train
a list of layers with on a mesh, within a memory budget per device (:func:`plan_pipeline`);
stateful layers and a data axis included.

It sweeps every candidate and predicts, for each:

* **the step time**, from the layers' costs (:func:`pipejax.layer_costs`, XLA's flop counts by
  default) run through the candidate's own table in lockstep (:meth:`Schedule.tick_times`), with
  the recomputation its checkpoint mode implies, an optional fixed cost per tick and, given the
  links, each tick's messages;
* **the temp bytes per device**: XLA's compiled memory analysis of the candidate's training step
  (``memory="compiled"``, exact for the platform it compiles for), or
  :func:`pipejax.memory_estimate` (``"estimate"``: nothing compiled; on
  ``benchmarks/planner.py``'s models it reads 0.93-1.32 of XLA's bytes for the training tables
  and 0.69-1.08 for GPipe and circular, ``benchmarks/RESULTS.md``).

and returns the fastest candidate that fits, with the runner-up and the whole sweep. Steps are
cheap (a table and some sums) and bytes are not (a compile each), so only the bytes the choice
depends on are measured: candidates in order of their step until two fit (and any tied with the
second), unless ``exhaustive=True``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from pipejax._src import checks, microbatch
from pipejax._src.balance.costs import layer_costs, output_bytes
from pipejax._src.balance.partitioning import partition
from pipejax._src.balance.solver import balance_costs
from pipejax._src.memory import memory_estimate
from pipejax._src.pipeline import pipeline
from pipejax._src.schedules.kinds import SCHEDULES as KINDS

SCHEDULES = tuple(KINDS)  # every built-in schedule
CHECKPOINTS = ("always", "never", "except_last")


class Candidate(NamedTuple):
    """One row of the planner's sweep."""

    schedule: str
    repeats: int
    chunks: int
    checkpoint: str
    balance: tuple[int, ...]  # layers per stage
    step: float  # the predicted step, in the cost unit (flops, or seconds with `by="time"`)
    # temp bytes per device: XLA's (memory="compiled") or pj.memory_estimate's; None: not measured
    # (a candidate slower than the two fastest that fit: the choice does not depend on it)
    temp_bytes: int | None
    fits: bool | None  # temp_bytes * headroom <= memory_per_device; None: not measured
    overlap: bool = False  # sends that overlap compute (pj.pipeline's overlap=)

    def options(self) -> dict[str, Any]:
        """The candidate as options of :func:`pipejax.pipeline` (with ``partition(layers,
        balance).stages`` as the stages; stateful layers: ``partition(layers, balance,
        stateful=True)`` and ``stateful=True``)."""
        return {
            "schedule": self.schedule,
            "repeats": self.repeats,
            "chunks": self.chunks,
            "checkpoint": self.checkpoint,
            "overlap": self.overlap,
        }

    @property
    def _key(self) -> tuple:  # what names a candidate within one sweep (its balance follows)
        return (self.schedule, self.repeats, self.chunks, self.checkpoint, self.overlap)


class _Chosen(NamedTuple):
    best: Candidate | None
    runner_up: Candidate | None
    sweep: tuple[Candidate, ...]


class PipelinePlan(_Chosen):
    """What :func:`plan_pipeline` chose: ``best`` (``None`` when nothing fits), the
    ``runner_up`` and the whole ``sweep``: the measured candidates that fit, fastest first
    (ties: the smaller first), then those that do not, then those not measured (``temp_bytes``
    and ``fits`` ``None``), each group fastest first.

    A plan keeps what it needs to measure the candidates it has not (the layers, their
    parameters and the batch), for :meth:`under`."""

    def under(self, memory_per_device: float, headroom: float = 1.0) -> PipelinePlan:
        """The same sweep chosen again under another budget. Bytes measured before are not
        measured again; a candidate the new choice depends on that was not measured is (a
        tighter budget can need slower candidates' bytes)."""
        budget, headroom = _positive(memory_per_device, "memory_per_device"), _positive(headroom, "headroom")
        return _choose(self.sweep, budget, headroom, getattr(self, "_measure", None))

    def table(self) -> str:
        """The sweep as a markdown table, the choice marked ("-": not measured)."""
        lines = [
            "| schedule | v | chunks | checkpoint | overlap | balance | step | temp KiB | fits |",
            "|:--|--:|--:|:--|:--|:--|--:|--:|:--|",
        ]
        for c in self.sweep:
            mark = " **chosen**" if c == self.best else (" runner-up" if c == self.runner_up else "")
            kib = "-" if c.temp_bytes is None else f"{c.temp_bytes / 1024:,.1f}"
            fits = "-" if c.fits is None else c.fits
            lines.append(
                f"| {c.schedule}{mark} | {c.repeats} | {c.chunks} | {c.checkpoint} | {c.overlap} | "
                f"{list(c.balance)} | {c.step:.4g} | {kib} | {fits} |"
            )
        return "\n".join(lines)


def _choose(sweep, budget, headroom, measure=None, exhaustive=False) -> PipelinePlan:
    """The fastest candidate of ``sweep`` that fits (ties: the smaller) and the runner-up.
    Walks the candidates in order of their step, measuring (``measure(candidate) -> bytes``)
    those without bytes, until two fit and the next is slower than the second: no candidate
    left unmeasured can rank among the two. ``exhaustive``: measures every candidate."""
    rows = list(sweep)
    order = sorted(range(len(rows)), key=lambda i: rows[i].step)
    fitting = []  # the steps of the candidates that fit, in walking order
    for i in order:
        c = rows[i]
        if not exhaustive and len(fitting) >= 2 and c.step > fitting[1]:
            break
        if c.temp_bytes is None:
            if measure is None:
                raise ValueError(
                    f"{c.schedule} (chunks={c.chunks}, {c.checkpoint}) was not measured and this plan "
                    "cannot measure it (it was not made by pj.plan_pipeline). Plan again with "
                    "`exhaustive=True`."
                )
            c = c._replace(temp_bytes=int(measure(c)))
        rows[i] = c = c._replace(fits=c.temp_bytes * headroom <= budget)
        if c.fits:
            fitting.append(c.step)
    rows = [c if c.temp_bytes is None else c._replace(fits=c.temp_bytes * headroom <= budget) for c in rows]
    measured = sorted(
        (c for c in rows if c.temp_bytes is not None), key=lambda c: (not c.fits, c.step, c.temp_bytes)
    )
    rest = sorted((c._replace(fits=None) for c in rows if c.temp_bytes is None), key=lambda c: c.step)
    ok = [c for c in measured if c.fits]
    plan = PipelinePlan(ok[0] if ok else None, ok[1] if len(ok) > 1 else None, tuple(measured + rest))
    if measure is not None:
        plan._measure = measure
    return plan


def plan_pipeline(
    layers: Sequence[Any],
    layer_params: Sequence[Any],
    x: Any,
    *,
    mesh: jax.sharding.Mesh,
    memory_per_device: float,
    axis_name: str = "stage",
    data_axis_name: str | None = None,
    layer_state: Sequence[Any] | None = None,
    schedules: Sequence[str] | None = None,
    chunks: Sequence[int] | None = None,
    checkpoints: Sequence[str] = CHECKPOINTS,
    repeats: int = 2,
    by: str = "flops",
    tick_cost: float = 0.0,
    bandwidth: float | None = None,
    latency: float = 0.0,
    overlaps: Sequence[bool] = (False,),
    memory: str = "compiled",
    loss_fn: Any = None,
    headroom: float = 1.0,
    exhaustive: bool = False,
) -> PipelinePlan:
    """Chooses how to pipeline ``layers`` on ``mesh``'s stage axis within ``memory_per_device``.

    A sweep over every candidate of ``schedules`` x ``chunks`` x ``checkpoints`` (``"except_last"``
    for the forward schedules only; the circular and interleaved 1F1B schedules with ``repeats``
    stages per device). A candidate its schedule cannot run is left out of the sweep: more
    stages than layers, or interleaved 1F1B with a number of micro-batches that is not a
    multiple of the devices.
    Each candidate's layers are balanced into its stages by their forward-and-backward cost
    (:func:`pipejax.balance_costs`), so a heavy embedding or head gets a stage of its own when
    that is cheapest. Its step is predicted in lockstep from its table: the layers' forward
    cost ``f`` and backward cost ``b`` per micro-batch (the costs of a batch over the number of
    micro-batches: flops are linear in the rows), ZB-H1's backward split evenly between its B
    and W slots, a recomputed forward (``"always"``; ``"except_last"`` outside the drain) added
    to the backward, and ``tick_cost`` per tick (the fixed cost of a tick: kernel launches and
    the loop's own work; ``benchmarks/gpu.py``'s step / scan column measures it). Every tick
    of the SPMD loop also sends, bubble or not, its table's
    :attr:`~pipejax.Schedule.sends_per_tick` messages (one for a forward table, two for a
    training table), one after the other, each the largest
    activation that crosses one of the candidate's stage boundaries, for one micro-batch, over
    ``bandwidth``, plus ``latency``. Without overlap a tick lasts its compute and then its
    sends; with ``overlap=True`` (swept by ``overlaps``, on the candidate's ``hop=2`` table) the
    longer of the two. Its bytes are the temp bytes per device of its training step
    (``memory``); a candidate fits when ``headroom`` times them is at most
    ``memory_per_device``. Every candidate's step is predicted, but bytes are measured only where
    the choice depends on them: in order of the step, until two candidates fit and the next is
    slower than the second (with ``memory="compiled"``, a compile each; on the three models of
    ``benchmarks/planner.py``, 2-3 of 26 candidates under a loose budget, 9-14 under a tight
    one). The choice is the one an exhaustive sweep makes.

    Args:
      layers, layer_params: the layers (``layer(params, x, key)``) and their parameters, as for
        :func:`pipejax.partition`.
      x: a mini-batch (arrays; its leading axis is the batch).
      mesh, axis_name: the mesh and its stage axis (``n`` devices).
      data_axis_name: a second axis of ``mesh`` that splits the micro-batches (data x pipeline
        parallelism, as :func:`pipejax.pipeline`'s): each candidate's table is then a data
        shard's, whose ``m / data`` micro-batches it times, and its ``chunks`` a multiple of the
        axis size; the all-reduce of the gradients over the data axis is not counted.
        ``memory="compiled"`` only.
      memory_per_device: the budget of temp bytes per device.
      layer_state: stateful layers (BatchNorm's running statistics): one state pytree per layer
        (``None`` for a layer without), the layers then ``layer(params, x, key, state, mask) ->
        (y, stats)``; each candidate is a ``stateful=True`` pipeline of
        ``pj.partition(layers, balance, stateful=True)``'s stages (state grouped as parameters).
        Its costs are the layers' on ``x`` with every row real; ``memory="compiled"`` only.
      schedules: the schedules to sweep, among ``"gpipe"``, ``"circular"``, ``"1f1b"``,
        ``"zb-h1"``, ``"zb-floor"``, ``"interleaved-1f1b"``, ``"v-half"`` and ``"zb-v"``; default
        all of them.
      chunks: the ``chunks`` to sweep; default the powers of two up to the batch (at most 64).
      checkpoints: the modes to sweep, among ``"always"``, ``"never"`` and ``"except_last"``.
      repeats: the stages per device of the circular and interleaved 1F1B schedules.
      by: the layers' cost model, ``"flops"`` or ``"time"`` (:func:`pipejax.layer_costs`).
      tick_cost: a fixed cost per tick, in the unit of ``by``.
      bandwidth: bytes a link carries per unit of ``by`` (with ``by="flops"``: bytes per
        second over the flop/s a device achieves); ``None`` (default): messages take no time.
      latency: the fixed time of a message, in the unit of ``by``.
      overlaps: the values of ``overlap=`` to sweep (sends that overlap compute).
      memory: ``"compiled"`` (each candidate's step compiled, XLA's ``temp_size_in_bytes``) or
        ``"estimate"`` (:func:`pipejax.memory_estimate`, nothing compiled).
      loss_fn: the per-example loss of the compiled step, ``loss_fn(y, targets)`` with targets
        of ``y``'s type; default the sum of squares of ``y`` along its last axis.
      headroom: the factor on the bytes before they are compared with the budget.
      exhaustive: measure every candidate's bytes, not only those the choice needs (for a table
        of the whole sweep; the choice is the same).

    Returns:
      A :class:`PipelinePlan`: ``best`` (the fastest candidate that fits; ties: the smaller),
      ``runner_up`` and ``sweep`` (``temp_bytes`` and ``fits`` ``None`` where not measured);
      ``under(budget)`` chooses again under another budget, measuring only what it then needs.

    Raises:
      TypeError, ValueError: for an argument outside what it takes (each named).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> mesh = jax.make_mesh((2,), ("stage",))
      >>> layer = lambda p, x, key: jnp.tanh(x @ p)
      >>> ws = [jnp.eye(8)] * 4
      >>> p = pj.plan_pipeline([layer] * 4, ws, jnp.ones((16, 8)), mesh=mesh, memory_per_device=1e6,
      ...                      schedules=("gpipe", "1f1b"), chunks=(2, 8), checkpoints=("always",),
      ...                      memory="estimate")
      >>> p.best.schedule, p.best.chunks, p.best.balance
      ('1f1b', 8, (2, 2))
    """
    layers = list(layers)
    n = _mesh_size(mesh, axis_name)
    if data_axis_name is not None:
        if data_axis_name == axis_name:
            raise ValueError(f"`data_axis_name` must differ from `axis_name`, but both are {axis_name!r}.")
        _mesh_size(mesh, data_axis_name, "data_axis_name")
        if memory == "estimate":
            raise ValueError(
                f'`memory="estimate"` does not model a data axis (`data_axis_name={data_axis_name!r}`): '
                'pj.memory_estimate refuses one. Use `memory="compiled"`.'
            )
    budget = _positive(memory_per_device, "memory_per_device")
    headroom = _positive(headroom, "headroom")
    tick_cost = _nonnegative(tick_cost, "tick_cost")
    latency = _nonnegative(latency, "latency")
    if bandwidth is not None:
        bandwidth = _positive(bandwidth, "bandwidth")
    overlaps = _seq(overlaps, "overlaps")
    if not all(isinstance(o, bool) for o in overlaps):
        raise TypeError(f"`overlaps` must hold bools (values of `overlap=`), but got {overlaps!r}.")
    exhaustive = checks.check_bool(exhaustive, "exhaustive")
    if by not in ("flops", "time"):
        raise ValueError(f"`by` must be 'flops' or 'time' (a step time), but got {by!r}.")
    if memory not in ("compiled", "estimate"):
        raise ValueError(f"`memory` must be 'compiled' or 'estimate', but got {memory!r}.")
    if loss_fn is None:
        loss_fn = _squares
    else:
        checks.check_callable(loss_fn, "loss_fn", "(y, targets) -> per-example losses")
    if schedules is None:
        schedules = SCHEDULES
    schedules = _among(schedules, SCHEDULES, "schedules")
    stateful = layer_state is not None
    if stateful:
        layer_state = list(
            checks.sequence(layer_state, "layer_state", f"one state pytree per layer ({len(layers)})")
        )
        if len(layer_state) != len(layers):
            raise ValueError(
                f"`layer_state` has {len(layer_state)} entries, but there are {len(layers)} layers; "
                "pass one state pytree per layer (None for a layer without state)."
            )
        if memory == "estimate":
            raise ValueError(
                '`memory="estimate"` does not model stateful layers (`layer_state` was given): '
                'pj.memory_estimate leaves stage state and statistics out. Use `memory="compiled"`.'
            )
    checkpoints = _among(checkpoints, CHECKPOINTS, "checkpoints")
    repeats = checks.count(repeats, "repeats", what="the stages per device of circular and interleaved 1F1B")
    batch = microbatch.batch_size(x)
    if chunks is None:
        chunks = [c for c in (2**k for k in range(7)) if c <= batch]
    chunks = sorted(
        {checks.count(c, "chunks", what="micro-batches to sweep") for c in _seq(chunks, "chunks")}
    )
    # per-layer costs of the whole batch: forward, and forward and backward
    costed, costed_params = (
        (layers, layer_params) if not stateful else _without_state(layers, layer_params, layer_state)
    )
    forward = np.array(layer_costs(costed, costed_params, x, by=by, backward=False))
    both = np.array(layer_costs(costed, costed_params, x, by=by, backward=True))
    row_bytes = None  # the bytes of one example of each layer's output
    if bandwidth is not None:
        row_bytes = np.array(output_bytes(costed, costed_params, x)) / batch
    sweep, measures = [], {}
    for name in schedules:
        kind = KINDS[name]
        v = repeats if kind.takes_repeats else kind.resolve_repeats(1)  # a V: 2
        S = n * v
        if S > len(layers):
            continue
        cut = balance_costs(both.tolist(), S)
        offsets = np.cumsum([0, *cut])
        f_stage = np.add.reduceat(forward, offsets[:-1])
        b_stage = np.add.reduceat(both, offsets[:-1]) - f_stage
        part = partition(layers, list(cut), stateful=stateful)
        params = part.group(list(layer_params))
        state = part.group(layer_state) if stateful else None
        for c, mode, overlap in itertools.product(chunks, checkpoints, overlaps):
            try:
                kind.check_checkpoint(mode)  # "except_last": the forward schedules' drain only
            except ValueError:
                continue
            micro = microbatch.plan(batch, c)
            m = micro.num_micro
            pipe = pipeline(part.stages, chunks=c, checkpoint=mode, mesh=mesh, axis_name=axis_name,
                            schedule=name, repeats=v, stateful=stateful, overlap=overlap,
                            data_axis_name=data_axis_name)  # fmt: skip
            try:
                table = pipe.schedule(batch)
            except ValueError:  # interleaved 1F1B: m not a multiple of n; m not split by the data axis
                continue
            message = latency  # the largest message: an activation at a stage boundary
            if row_bytes is not None:
                message += max(row_bytes[offsets[1:-1] - 1], default=0.0) * micro.micro_size / bandwidth
            step = _step(table, mode, f_stage / m, b_stage / m, tick_cost, table.sends_per_tick * message)
            candidate = Candidate(name, v, c, mode, tuple(cut), step, None, None, overlap)
            sweep.append(candidate)
            if memory == "estimate":
                measure = lambda pipe=pipe, params=params: memory_estimate(pipe, params, x).total
            else:
                measure = lambda pipe=pipe, params=params, state=state: _compiled_bytes(
                    pipe, params, x, loss_fn, state
                )
            measures[candidate._key] = measure
    once = functools.cache(lambda key: int(measures[key]()))  # each candidate measured once, when needed
    return _choose(sweep, budget, headroom, lambda candidate: once(candidate._key), exhaustive)


def _step(table, mode, f, b, tick_cost, link) -> float:
    """The lockstep step of a training step on ``table`` (per-stage costs ``f``, ``b`` of one
    micro-batch), with the recomputation of checkpoint ``mode``, ``tick_cost`` per tick and
    ``link`` for each tick's sends: after the tick's compute, or alongside it when the table's
    hop is 2 (sends that overlap compute)."""
    redo = f if mode in ("always", "except_last") else np.zeros_like(f)
    if table.trains:  # F, then B (and W) slots in the same ticks
        if "W" in table.kinds:  # ZB-H1: B the input cotangent, W the weight's; each recomputes F
            ticks = [table.tick_times(f, b / 2 + redo, b / 2 + redo)]
        else:
            ticks = [table.tick_times(f, b + redo, 0.0)]
    else:  # a forward table: its ticks, then autodiff runs them again backwards
        back = table.tick_times(b + redo)
        if mode == "except_last":  # the drain keeps its residuals
            back[-table.drain_ticks :] = table.tick_times(b)[-table.drain_ticks :]
        ticks = [table.tick_times(f), back]
    if table.hop == 2:
        return float(sum(np.maximum(t + tick_cost, link).sum() for t in ticks))
    return float(sum((t + tick_cost + link).sum() for t in ticks))


def _squares(y, targets):
    return jax.numpy.sum((y - targets) ** 2, axis=-1)


def _compiled_bytes(pipe, params, x, loss_fn, state=None) -> int:
    """XLA's temp bytes per device of ``pipe``'s training step, ``pipe.value_and_grad`` (each
    schedule's own: autodiff of the forward call for GPipe and circular), compiled, not run;
    ``state``: a stateful pipeline's per-stage state."""
    placed = pipe.place(params)
    state = pipe.place(state) if pipe.stateful else None
    y = jax.eval_shape(lambda p, x, s: pipe(p, x, state=s), placed, x, state)
    y = y[0] if pipe.stateful else y
    targets = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), y)
    step = pipe.value_and_grad(loss_fn)
    compiled = jax.jit(lambda p, x, t, s: step(p, x, t, state=s)).lower(placed, x, targets, state).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _without_state(layers, layer_params, layer_state):
    """Stateful layers as ``layer(params, x, key) -> y`` for :func:`pipejax.layer_costs`, their
    parameters ``(params, state)``: the state read as a constant (no gradient), every row real.
    One wrapper per distinct layer function, so that equal layers are still costed once."""
    wrappers = {}

    def wrap(layer):
        def costed(ps, x, key):
            rows = jax.tree.leaves(x)[0].shape[0]
            mask = jax.numpy.ones((rows,), bool)
            return layer(ps[0], x, key, jax.lax.stop_gradient(ps[1]), mask)[0]

        return costed

    costed = [wrappers.setdefault(id(layer), wrap(layer)) for layer in layers]
    return costed, [(p, st) for p, st in zip(layer_params, layer_state, strict=True)]


def _mesh_size(mesh, axis_name, name="axis_name") -> int:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"`mesh` must be a jax.sharding.Mesh, but got {type(mesh).__name__} {mesh!r:.80}.")
    if axis_name not in mesh.shape:
        raise ValueError(f"`{name}={axis_name!r}` is not an axis of the mesh ({dict(mesh.shape)}).")
    return mesh.shape[axis_name]


def _positive(value, name) -> float:
    v = _nonnegative(value, name)
    if v <= 0:
        raise ValueError(f"`{name}` must be a number > 0, but got {value!r}.")
    return v


def _nonnegative(value, name) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"`{name}` must be a number, but got {type(value).__name__} {value!r:.80}.")
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}` must be a finite number >= 0, but got {value!r}.")
    return float(value)


def _seq(values, name) -> list:
    values = list(checks.sequence(values, name, "at least one entry"))
    if not values:
        raise TypeError(f"`{name}` must be a non-empty sequence, but got {values!r}.")
    return values


def _among(values, allowed, name) -> list[str]:
    values = _seq(values, name)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"`{name}` must be among {allowed}, but got {bad[0]!r}.")
    return values
