"""An event simulator of pipeline schedules: predicted time, throughput and bubble on n devices.

A planning tool, not library API: given the forward and backward time of every stage for one
micro-batch, the bytes that cross each stage boundary, and a link model (``bytes / bandwidth +
latency`` per message), it predicts how long a training step of ``m`` micro-batches takes on ``n``
devices, and which fraction of the devices' time is idle (the bubble).

Schedules (both run every forward, then every backward, as GPipe and autodiff of a scan do):

* **GPipe** (``repeats=1``): ``S = n`` stages, stage ``s`` on device ``s``. Stage ``s`` runs
  micro-batch ``i``'s forward at tick ``i + s``; the backward runs the ticks in reverse.
* **Circular** (interleaved, ``repeats=v``): ``S = v * n`` stages, stage ``j`` on device
  ``j % n``, so every micro-batch goes round the ring of devices ``v`` times. Micro-batches
  travel in groups of ``n``: device ``d`` runs the forward of stage ``r * n + d`` on micro-batch
  ``g * n + k`` at tick ``g * n * v + r * n + k + d``. Each stage is ``1/v`` of a device's work,
  so the ``n - 1`` fill and drain ticks are ``v`` times shorter.

Each device runs its tasks in tick order; a task starts when its device is free and its input
has arrived: the previous stage's forward output (plus the transfer, when that stage is on
another device), or the next stage's backward output. Links are directed and carry one message
at a time; with ``overlap=True`` (copy engines, torchgpipe's copy streams) a device computes
while it sends, with ``overlap=False`` it is busy until its message has left. With
``lockstep=True`` the devices also wait for each other after every tick, as in an SPMD program
whose ticks end with a collective (``ppermute``): a tick lasts as long as its slowest task plus
its slowest transfer. That is how pipejax's ``shard_map`` schedule runs.

With equal stages and free links the simulated bubble is exactly ``(n - 1) / (m + n - 1)``
(GPipe) and ``(n - 1) / (v m + n - 1)`` (circular, ``m`` a multiple of ``n``); ``Fraction``
inputs give exact ``Fraction`` results.

Every schedule of pipejax (:func:`ticks`): GPipe, circular, 1F1B, ZB-H1 and interleaved 1F1B,
from the tables pipejax builds (read through ``slot_fields()``), in lockstep ticks as its SPMD
loop runs them. A tick lasts as long as its busiest device, which runs its F, B and W slots one
after another (``f``, ``b``, ``w`` per slot; a table without W runs ``b + w`` in B, and a forward
table trains as its ticks and then the same ticks reversed with B slots), plus the time of the
tick's ``ppermute`` s (``bytes / bandwidth + latency`` each). With overlap of sends (a message
read one tick later) a tick lasts ``max(compute, messages)`` on the table re-timed so that every
hop takes two ticks (:func:`_retime`); :func:`overlap_wins` gives the message times for which
that is faster. With free links the lockstep step is the table's ``step_time(f, b, w)``.

References: Huang et al., "GPipe", NeurIPS 2019 (the bubble ``(n - 1) / (m + n - 1)``);
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (the interleaved schedule and its bubble); Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024 (ZB-H1).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

CHECKPOINTS = ("never", "always", "except_last")


class Task(NamedTuple):
    kind: str  # "F" (forward) or "B" (backward)
    stage: int  # 0 <= stage < S
    micro: int  # 0 <= micro < m
    device: int  # stage % n
    tick: int  # its tick in the nominal schedule (the device runs its tasks in tick order)


class Result(NamedTuple):
    """What one simulated training step costs. Times are in the unit of the inputs."""

    makespan: Any  # from the first forward's start to the last backward's end
    busy: tuple  # compute time of each device (recomputation included)
    bubble: Any  # 1 - sum(busy) / (n * makespan): the idle fraction of device time
    throughput: Any  # micro-batches per unit time: m / makespan
    serial: Any  # one device, no pipeline, no recomputation: m * sum(forward + backward)
    ticks: int  # forward ticks of the nominal schedule (GPipe: m + n - 1)

    @property
    def speedup(self):
        """Throughput over that of one device running the model without a pipeline."""
        return self.serial / self.makespan


def schedule(num_devices: int, num_micro: int, repeats: int = 1) -> list[Task]:
    """Every forward and backward task, sorted by tick: GPipe (``repeats=1``) or circular."""
    n, m, v = num_devices, num_micro, repeats
    forward = []
    for i in range(m):
        g, k = divmod(i, n)
        for j in range(n * v):
            r, d = divmod(j, n)
            forward.append(Task("F", j, i, d, g * n * v + r * n + k + d))  # v = 1: i + j
    last = max(t.tick for t in forward)
    backward = [t._replace(kind="B", tick=2 * last + 1 - t.tick) for t in forward]
    return sorted(forward + backward, key=lambda t: (t.tick, t.device))


def simulate(
    forward: Sequence[Any],
    *,
    num_devices: int | None = None,
    num_micro: int,
    backward: Sequence[Any] | None = None,
    checkpoint: str = "never",
    activation_bytes: Sequence[Any] | Any = 0,
    bandwidth: Any = math.inf,
    latency: Any = 0,
    overlap: bool = True,
    lockstep: bool = False,
) -> Result:
    """Simulates one training step (all forwards, then all backwards) of a pipeline.

    Args:
      forward: the forward time of each stage on one micro-batch; ``S`` stages.
      num_devices: ``n``; ``S`` must be a multiple of it, and ``v = S / n`` is the number of
        times each micro-batch goes round the devices (1: GPipe; default ``n = S``).
      num_micro: ``m``, micro-batches per step.
      backward: the backward time of each stage (default: twice its forward time).
      checkpoint: ``"never"``; ``"always"`` (every backward first recomputes its stage's forward);
        or ``"except_last"`` (all but the last micro-batch recompute, as torchgpipe does).
      activation_bytes: bytes stage ``j`` sends to stage ``j + 1`` per micro-batch (``S - 1``
        numbers, or one for all); the gradient sent back has the same size.
      bandwidth: bytes per unit time of every link (``math.inf``: free).
      latency: time added to every message between two devices.
      overlap: devices compute while they send (True) or wait until the message has left.
      lockstep: all devices wait for each other after every tick (an SPMD program).

    Returns:
      A :class:`Result`.
    """
    num_stages = len(forward)
    n = num_stages if num_devices is None else num_devices
    _check(forward, n, num_micro, checkpoint)
    v = num_stages // n
    backward = [2 * f for f in forward] if backward is None else list(backward)
    if len(backward) != num_stages:
        raise ValueError(f"`backward` has {len(backward)} entries but there are {num_stages} stages.")
    if not isinstance(activation_bytes, Sequence):
        activation_bytes = [activation_bytes] * (num_stages - 1)
    if len(activation_bytes) != num_stages - 1:
        raise ValueError(
            f"`activation_bytes` has {len(activation_bytes)} entries; it needs one per stage "
            f"boundary ({num_stages - 1}), or a single number."
        )

    def transfer(j):  # stage j <-> j + 1, when they are on different devices
        size = activation_bytes[j]
        return latency + (size / bandwidth if size and bandwidth != math.inf else 0)

    def duration(t):
        if t.kind == "F":
            return forward[t.stage]
        recompute = checkpoint == "always" or (checkpoint == "except_last" and t.micro < num_micro - 1)
        return backward[t.stage] + (forward[t.stage] if recompute else 0)

    tasks = schedule(n, num_micro, v)
    end: dict[tuple, Any] = {}  # (kind, stage, micro) -> when its output reaches the consumer
    done: dict[tuple, Any] = {}  # (kind, stage, micro) -> when it finished computing
    free = [0] * n  # when each device can start its next task
    link = {}  # (src, dst) -> when the link is free
    busy = [0] * n
    tick_start, tick_end, current = 0, 0, None
    for t in tasks:
        if lockstep and t.tick != current:
            tick_start, current = max(tick_start, tick_end), t.tick
        ready = 0
        if t.kind == "F" and t.stage > 0:
            ready = end["F", t.stage - 1, t.micro]
        elif t.kind == "B" and t.stage < num_stages - 1:
            ready = end["B", t.stage + 1, t.micro]
        elif t.kind == "B":  # the last stage's backward starts from its own forward
            ready = done["F", t.stage, t.micro]
        start = max(free[t.device], ready, tick_start if lockstep else 0)
        finish = start + duration(t)
        busy[t.device] += duration(t)
        done[t.kind, t.stage, t.micro] = finish
        # Where the output goes: F to stage + 1, B to stage - 1 (none past either end).
        to = t.stage + 1 if t.kind == "F" else t.stage - 1
        arrive = finish
        if 0 <= to < num_stages and to % n != t.device:
            key = (t.device, to % n)
            begin = max(finish, link.get(key, 0))
            arrive = begin + transfer(min(t.stage, to))
            link[key] = arrive
            if not overlap:
                free[t.device] = arrive
        end[t.kind, t.stage, t.micro] = arrive
        free[t.device] = max(free[t.device], finish)
        tick_end = max(tick_end, arrive if lockstep else finish)
    makespan = max(done.values())
    serial = num_micro * sum(f + b for f, b in zip(forward, backward, strict=True))
    total_busy = sum(busy)
    return Result(
        makespan=makespan,
        busy=tuple(busy),
        bubble=1 - total_busy / (n * makespan),
        throughput=num_micro / makespan,
        serial=serial,
        ticks=max(t.tick for t in tasks if t.kind == "F") + 1,
    )


def gpipe_bubble(n: int, m: int, v: int = 1):
    """GPipe's bubble theory: ``(n - 1) / (v m + n - 1)`` (``v = 1``: plain GPipe)."""
    from fractions import Fraction

    return Fraction(n - 1, v * m + n - 1)


def _check(forward, n, m, checkpoint) -> None:
    if not isinstance(forward, Sequence) or not forward:
        raise TypeError(f"`forward` must be a non-empty sequence of stage times, got {forward!r}.")
    for name, value in (("num_devices", n), ("num_micro", m)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1, but got {value!r}.")
    if len(forward) % n:
        raise ValueError(
            f"{len(forward)} stages cannot be spread evenly over {n} devices: the number of stages "
            "must be a multiple of `num_devices` (GPipe: equal; circular: v times as many)."
        )
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"`checkpoint` must be one of {CHECKPOINTS}, but got {checkpoint!r}.")


# --- pipelines in bigger meshes: tensor and data parallelism inside and beside the stages ----------


def ring_all_reduce(nbytes: Any, devices: int, bandwidth: Any = math.inf, latency: Any = 0) -> Any:
    """Time of a ring all-reduce of ``nbytes`` over ``devices``: ``2 (k - 1) / k`` of the bytes
    cross every link, in ``2 (k - 1)`` steps (reduce-scatter, then all-gather); 0 for one device."""
    if devices <= 1:
        return 0 * nbytes
    k = devices
    return 2 * (k - 1) * (nbytes / k / bandwidth + latency)


class Layout3D(NamedTuple):
    """One way to lay a model out on ``n x t x d`` devices, and what a training step costs."""

    stages: int  # n: devices along the stage axis
    tensor: int  # t: devices a stage's layers are split over (Megatron)
    data: int  # d: data-parallel replicas
    step: Any  # predicted time of one training step
    pipeline: Any  # of which: the pipeline (compute, tensor all-reduces, stage transfers, bubble)
    gradient_sync: Any  # of which: the data-parallel gradient all-reduce (not overlapped)
    bubble: Any


def plan_layout(
    *,
    stages: int,
    tensor: int,
    data: int,
    forward: Any,
    backward: Any,
    batch: int,
    chunks: int,
    activation_bytes: Any,
    param_bytes: Any,
    allreduces_per_forward: int = 48,
    bandwidth: Any = math.inf,
    latency: Any = 0,
    tensor_bandwidth: Any = None,
    checkpoint: str = "never",
) -> Layout3D:
    """Predicts a training step of a model of equal layers laid out as ``stages x tensor x data``.

    ``forward``/``backward``: the whole model's forward and backward time for one example on one
    device. ``activation_bytes``: the bytes of one example's activation at a stage boundary (and
    of every tensor-parallel all-reduce). ``param_bytes``: the whole model's parameter bytes.
    ``allreduces_per_forward``: tensor-parallel all-reduces in one forward of the whole model
    (Megatron: two per Transformer layer, after the row-parallel projections; the default is a
    24-layer model's). Each of the ``d`` replicas gets ``batch / d`` examples in ``chunks``
    micro-batches. Per micro-batch, a stage computes ``1 / (n t)`` of the model, plus its
    ``1 / n`` share of those ring all-reduces of the micro-batch's activation over the ``t``
    devices in its forward and as many in its backward, over links of ``tensor_bandwidth``
    (default ``bandwidth``; tensor groups usually sit inside one host's fast links). The
    pipeline itself is simulated (:func:`simulate`) in lockstep with those stage times; the step then
    ends with the ring all-reduce of a device's parameter shard (``param_bytes / (n t)``) over
    the ``d`` replicas. A planning tool: compare layouts on paper, then measure the chosen one
    (``benchmarks/mesh3d.py`` counts the collectives XLA emits).
    """
    for name, value in (("stages", stages), ("tensor", tensor), ("data", data), ("chunks", chunks)):
        if not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, but got {value!r}.")
    if batch % (data * chunks):
        raise ValueError(
            f"`batch` ({batch}) must be a multiple of `data` x `chunks` ({data} x {chunks}): every "
            "replica runs `chunks` equal micro-batches."
        )
    micro = batch // (data * chunks)
    link = bandwidth if tensor_bandwidth is None else tensor_bandwidth
    per_stage = allreduces_per_forward / stages if tensor > 1 else 0
    tp = per_stage * ring_all_reduce(micro * activation_bytes, tensor, link, latency)
    f = forward * micro / (stages * tensor) + tp
    b = backward * micro / (stages * tensor) + tp
    result = simulate(
        [f] * stages,
        backward=[b] * stages,
        num_micro=chunks,
        checkpoint=checkpoint,
        activation_bytes=micro * activation_bytes / tensor if stages > 1 else 0,
        bandwidth=bandwidth,
        latency=latency,
        lockstep=True,
    )
    sync = ring_all_reduce(param_bytes / (stages * tensor), data, bandwidth, latency)
    return Layout3D(stages, tensor, data, result.makespan + sync, result.makespan, sync, result.bubble)


# --- every schedule of pipejax, tick by tick, as its SPMD loop runs it ----------------------------


class Ticks(NamedTuple):
    """A training step of one of pipejax's schedule tables, tick by tick (see :func:`ticks`).

    Every tick lasts as long as its busiest device (which runs its F, B and W slots one after
    another) and its messages: ``compute[t] + messages[t] * message`` without overlap, or
    ``max(compute[t], messages[t] * message)`` with it (:meth:`step`).
    """

    compute: np.ndarray  # float64[T]: the busiest device's slot costs summed, per tick
    messages: np.ndarray  # int64[T]: the ppermutes each tick runs (one message time each)
    work: float  # every slot's cost summed: the step of one device that runs every slot
    num_devices: int  # n: the devices of the stage axis
    overlap: bool  # whether a tick's sends overlap the next tick's compute

    @property
    def ideal(self) -> float:
        """``work / n``: the step with no bubble and free links."""
        return self.work / self.num_devices

    def step(self, message: float = 0.0) -> float:
        """The predicted step when one message (one ``ppermute``) takes ``message``."""
        sends = self.messages * message
        per_tick = np.maximum(self.compute, sends) if self.overlap else self.compute + sends
        return float(per_tick.sum())


def message_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """``nbytes / bandwidth + latency``: the time of one message between neighbouring devices."""
    return nbytes / bandwidth + latency


class _Slot(NamedTuple):
    tick: int
    order: int  # its place within the tick: the order of ``slot_fields`` (F, then B, then W)
    kind: str  # "F", "B" or "W"
    device: int
    stage: int
    micro: int


def _slots(fields: dict) -> list[_Slot]:
    """Every non-idle slot of a table's ``slot_fields()``, in the order the devices run them."""
    out = []
    for order, (kind, (micro, stage)) in enumerate(fields.items()):
        for t, d in zip(*np.nonzero(micro >= 0), strict=True):
            out.append(_Slot(int(t), order, kind, int(d), int(stage[t, d]), int(micro[t, d])))
    return sorted(out)


def _reads(slot: _Slot, num_stages: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro-batch) of the slots whose outputs ``slot`` reads."""
    kind, s, i = slot.kind, slot.stage, slot.micro
    if kind == "F":  # the previous stage's activation
        return [("F", s - 1, i)] if s > 0 else []
    if kind == "B":  # its own F's stash, and the next stage's cotangent (the last: the loss)
        return [("F", s, i)] + ([("B", s + 1, i)] if s < num_stages - 1 else [])
    return [("B", s, i)]  # W: its B's output cotangent


def _retime(slots: list[_Slot], num_stages: int) -> list[int]:
    """The tick of every slot when a message is read one tick later than in the table (overlap).

    Each slot, in the table's order, goes to the earliest tick that is (1) no earlier than its
    tick in the table, (2) at least 2 ticks after any slot on another device whose output it
    reads (a hop: sent at the end of one tick, in flight during the next, read in the one
    after), (3) at least as many ticks after a slot of its own device whose output it reads as
    in the table (ZB-H1's W keeps its deferral), and (4) after the previous slot of its kind on
    its device (every device keeps its order, one slot of each kind per tick).
    """
    placed: dict[tuple[str, int, int], tuple[_Slot, int]] = {}
    last: dict[tuple[str, int], int] = {}  # (kind, device) -> its latest retimed tick
    out = []
    for x in slots:
        t = max(x.tick, last.get((x.kind, x.device), -1) + 1)
        for key in _reads(x, num_stages):
            y, ty = placed[key]
            t = max(t, ty + (2 if y.device != x.device else x.tick - y.tick))
        placed[x.kind, x.stage, x.micro] = (x, t)
        last[x.kind, x.device] = t
        out.append(t)
    return out


def _per_stage(cost, num_stages: int, name: str) -> np.ndarray:
    costs = np.broadcast_to(np.asarray(cost, np.float64), (num_stages,))
    if costs.ndim != 1 or (costs < 0).any():
        raise ValueError(f"`{name}` must be one cost >= 0 or {num_stages} (one per stage), got {cost!r}.")
    return costs


def ticks(schedule: Any, f: Any, b: Any, w: Any = 0.0, *, overlap: bool = False) -> Ticks:
    """A training step of a pipejax schedule table in lockstep ticks, as its SPMD loop runs it.

    Reads only ``schedule.slot_fields()`` (``{kind: (micro-batch table, stage table)}``,
    ``int[T, n]``, ``-1`` an idle slot), ``num_devices``, ``repeats`` (``S = n v`` stages) and
    ``sends_per_tick``.

    Slot costs, per stage (one number, or ``S``): ``f`` for an F slot, ``b`` for a B slot and
    ``w`` for a W slot; a table without W slots (1F1B, interleaved 1F1B) runs the whole backward
    ``b + w`` in B. A forward table (GPipe, circular: F slots only) trains by autodiff: its
    ticks, then the same ticks in reverse with B slots of ``b + w``; its stacked stages compute
    on bubbles, so a tick on which no device has a slot still lasts the largest F (B on the way
    back), as :meth:`pipejax.Schedule.step_time` counts it. Recomputation
    (``checkpoint="always"``) is ``f`` more in ``b``. ``work`` sums the slots, not bubbles.

    Messages: pipejax's loop runs its ``ppermute`` s on every tick, bubble or not (collectives
    stay outside branches): a forward table's tick sends one (activations one device on; its
    reversed ticks, cotangents one device back), a training table's tick two (activations on,
    cotangents back), taken to run one after the other. None on one device. Without overlap a
    tick computes, then sends, and the next tick waits for the message; XLA may start the send
    of an F output during the same tick's B and W slots, which this ignores.

    With ``overlap`` a message is read one tick after it arrives in the table, so it travels
    during the next tick's compute (a tick lasts ``max(compute, messages)``). A table built for
    it (``schedule.hop == 2``: pipejax's ``overlap=True``) is read as it is; a table with
    one-tick hops is re-timed by :func:`_retime`: every hop costs one more tick where the table
    has no slack to absorb it. GPipe's forward gets ``n - 1`` more ticks (its backward as many),
    the circular table as many when ``m >= 2 n`` (its loop-back's wait absorbs the rest), 1F1B
    and ZB-H1 ``2 (n - 1)`` (the same ticks as pipejax's ``hop=2`` tables); interleaved 1F1B,
    whose groups of ``n`` micro-batches fill the ring with no slack, waits at every round, where
    pipejax's ``hop=2`` table groups ``2 n`` instead.

    A prediction for a device that runs a slot in the time it is given, not a measurement.
    """
    fields = schedule.slot_fields()
    n, num_stages = schedule.num_devices, schedule.num_devices * schedule.repeats
    f, b, w = (_per_stage(c, num_stages, name) for c, name in ((f, "f"), (b, "b"), (w, "w")))
    cost = {"F": f, "B": b if "W" in fields else b + w, "W": w}
    slots = _slots(fields)
    hop = getattr(schedule, "hop", 1)
    if hop == 2 and not overlap:
        raise ValueError("A table with `hop=2` is built for overlap: pass `overlap=True`.")
    # a table with hop 1 is re-timed for overlap; one built with hop 2 (pipejax's overlap=True) is
    # already timed so
    when = _retime(slots, num_stages) if overlap and hop == 1 else [x.tick for x in slots]
    grid = np.zeros((max([schedule.num_ticks - 1, *when]) + 1, n))
    empty = np.ones(len(grid), bool)  # ticks on which no device has a slot
    for x, t in zip(slots, when, strict=True):
        grid[t, x.device] += cost[x.kind][x.stage]
        empty[t] = False
    work = float(grid.sum())
    compute = grid.max(axis=1)
    if set(fields) == {"F"}:  # a forward table: autodiff runs its ticks backwards, with B slots
        back = np.zeros_like(grid)
        for x, t in zip(slots, when, strict=True):
            back[t, x.device] += b[x.stage] + w[x.stage]
        work += float(back.sum())
        # stacked stages compute on bubbles too: a tick where no device works lasts a slot
        there = np.where(empty, f.max(), compute)
        compute = np.concatenate([there, np.where(empty, (b + w).max(), back.max(axis=1))[::-1]])
    messages = np.full(len(compute), schedule.sends_per_tick, np.int64)
    return Ticks(compute, messages, work, n, overlap)


def overlap_wins(plain: Ticks, overlapped: Ticks) -> tuple[float, float] | None:
    """The message times ``(lo, hi)`` for which ``overlapped`` gives the shorter step, or None.

    Exact: ``overlapped.step(x) - plain.step(x)`` is convex and piecewise linear in the message
    time ``x`` (a sum of ``max(c, k x)`` minus a line), with kinks at ``c / k``, so it is negative
    on one interval at most, found from its values at the kinks. ``hi`` is ``inf`` when the
    overlapped step stays shorter however slow the link.
    """
    assert not plain.overlap and overlapped.overlap
    sends = overlapped.messages > 0
    xs = sorted({0.0, *(overlapped.compute[sends] / overlapped.messages[sends]).tolist()})
    gs = [overlapped.step(x) - plain.step(x) for x in xs]
    slope = float(overlapped.messages.sum() - plain.messages.sum())  # of the line past the last kink
    lo = 0.0 if gs[0] < 0 else None
    for (x0, g0), (x1, g1) in itertools.pairwise(zip(xs, gs, strict=True)):
        root = x0 + (x1 - x0) * g0 / (g0 - g1) if g0 != g1 else x0
        if lo is None and g0 >= 0 > g1:
            lo = root
        elif lo is not None and g0 < 0 <= g1:
            return lo, root
    if lo is None:  # never negative up to the last kink: only the line past it can dip below 0
        return (xs[-1] - gs[-1] / slope, math.inf) if slope < 0 else None
    return lo, (xs[-1] - gs[-1] / slope if slope > 0 else math.inf)
