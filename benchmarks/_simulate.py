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

References: Huang et al., "GPipe", NeurIPS 2019 (the bubble ``(n - 1) / (m + n - 1)``);
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (the interleaved schedule and its bubble).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

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
