"""A schedule table as the arrays the tick loop reads: a row of (micro-batch, stage) per tick, and
the loop-back delay of the circular schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src.schedules.table import Schedule

# The row's columns in order, each ``D`` wide (one per device) but the tick's (one): the one
# map that :func:`rows` writes and :func:`read_row` reads. Every table starts with ``PREFIX`` (a
# forward table with its first three); :func:`columns` says what follows.
PREFIX = ("F", "F stage", "tick", "B", "W", "B stage")


def columns(schedule: Schedule) -> tuple[str, ...]:
    """The names of ``schedule``'s columns in the rows of :func:`rows`: ``F``, ``B``, ``W``
    the micro-batch of each slot kind and ``F stage``, ``B stage`` (``W stage``) its stage; a V
    table's message sources (``F source``, ``B source``: :func:`_sources`); a pooled table's
    stash slots (``F pool``, ``B pool``, ``W pool``: ``Schedule.stash_pool``) and, with W
    slots, its cotangents' (``B cotangent``, ``W cotangent``: ``Schedule.cotangent_pool``)."""
    if not schedule.trains:
        return PREFIX[:3]
    names = PREFIX + (("F source", "B source") if schedule.placement == "v" else ())
    return names + pool_columns(schedule)


def pool_columns(schedule: Schedule) -> tuple[str, ...]:
    """The last columns of :func:`columns`: a pooled table's stash slots and, with W slots, W's
    stage and the cotangents' slots (none for a table without pools)."""
    if not schedule.pooled:
        return ()
    with_w = () if schedule.weight is None else ("W pool", "W stage", "B cotangent", "W cotangent")
    return ("F pool", "B pool", *with_w)


def rows(schedule):
    """The scan's per-tick input: one table ``int32[T, w]``, each row the columns of
    :func:`columns` for the tick (read with :func:`read_row`): a forward table's micro-batch and
    stage of every device and the tick itself, ``int32[T, 2 D + 1]``; a training table's also
    the micro-batches of its B and W slots and the stages of its B slots, and what its kind
    needs after them.

    One table, not a ``tick = arange(T)`` beside the others: XLA turns such a constant into an
    ``iota`` computed into a buffer of its own, kept through both loops; the table stays a
    constant of the program. A row is split where it is read, inside the checkpoints (the
    stage's, :func:`recomputed`): split outside, its pieces would be kept per tick for the
    backward pass."""
    tick = np.arange(schedule.num_ticks, dtype=np.int32)[:, None]
    if not schedule.trains:
        return table(schedule.table, schedule.stages(), tick)
    w = schedule.weight if schedule.weight is not None else np.full_like(schedule.forward, -1)
    values = {"F": schedule.forward, "F stage": schedule.stages("F"), "tick": tick, "W": w}
    values.update({"B": schedule.backward, "B stage": schedule.stages("B")})
    if schedule.placement == "v":
        values.update({"F source": _sources(schedule, "F"), "B source": _sources(schedule, "B")})
    if schedule.pooled:
        values.update({f"{k} pool": a for k, a in schedule.stash_pool()[1].items()})
        if schedule.weight is not None:
            values.update({f"{k} cotangent": a for k, a in schedule.cotangent_pool()[1].items()})
            values["W stage"] = schedule.stages("W")
    return table(*(values[name] for name in columns(schedule)))


def read_row(row, D: int, names, order=PREFIX):
    """The columns ``names`` of a row of :func:`rows` of ``D`` devices, in the order given: each
    ``[D]`` (the tick: a scalar). ``order`` is the table's :func:`columns`; the default, the
    columns every table starts with, reads those."""
    widths = [1 if name == "tick" else D for name in order]
    start = dict(zip(order, np.cumsum([0, *widths[:-1]]).tolist(), strict=True))
    return tuple(row[start[n]] if n == "tick" else row[start[n] : start[n] + D] for n in names)


def read_tick(row, D: int):
    """The tick of a row of :func:`rows` of ``D`` devices (a scalar)."""
    return read_row(row, D, ("tick",))[0]


LEFT, RIGHT, OWN = 0, 1, 2  # where a V table's message comes from: device d - 1, d + 1, or d


def _sources(schedule, kind: str) -> np.ndarray:
    """int32[T, D]: where the message read by device ``d``'s ``kind`` slot at tick ``t + 1``
    comes from (:data:`LEFT`, :data:`RIGHT` or :data:`OWN`, the V's turn), from the stage that
    sent it (``kind`` "F": the previous stage; "B": the next one). :data:`OWN` where the slot
    reads none (idle, stage 0's F, the last stage's B)."""
    micro, stage = schedule.micro[kind], schedule.stage[kind]
    S, D = schedule.num_stages, schedule.num_devices
    nxt_micro = np.concatenate([micro[1:], np.full_like(micro[:1], -1)])
    src = np.concatenate([stage[1:], stage[-1:]]) + (-1 if kind == "F" else 1)
    reads = (nxt_micro >= 0) & (src >= 0) & (src < S)
    device, d = schedule.device_of(np.clip(src, 0, S - 1)), np.arange(D)
    code = np.where(device == d - 1, LEFT, np.where(device == d + 1, RIGHT, OWN))
    return np.where(reads, code, OWN).astype(np.int32)


def table(*columns) -> jax.Array:
    """A schedule's integer columns ``[T, w]`` side by side: one ``int32[T, sum w]`` constant."""
    return jnp.asarray(np.concatenate(columns, axis=1).astype(np.int32))


def loop_delay(schedule: Schedule) -> int:
    """Ticks a micro-batch waits on device 0 between two rounds of the circular schedule.

    Device 0 starts stage ``s >= D`` of micro-batch ``i`` a fixed number of ticks after the
    last device's output of stage ``s - 1`` reached it (``hop`` ticks after it was sent):
    ``max(m, n) - n`` for :func:`~pipejax._src.schedules.tables.circular` (0 when ``m <= n``: it
    starts the tick it arrives; with ``hop = 2``, ``max(m, 2 n) - 2 n``).
    So the loop buffer is a delay line, not a slot per micro-batch: ``delay + 1`` slots; a tick
    writes what arrives into slot ``tick mod (delay + 1)`` and then reads slot ``(tick + 1) mod
    (delay + 1)``, written ``delay`` ticks before. (Reading before writing would need only
    ``delay`` slots, but XLA then copies the whole buffer every tick to keep the read's old
    value: 2,658.7 KiB against 2,322.9 KiB per device at m = 32 on
    ``benchmarks/maxtext_style.py``.) No buffer at all when the delay is 0.

    >>> from pipejax._src.schedules import tables
    >>> [loop_delay(tables.circular(4, m, 2)) for m in (2, 4, 8, 16)]
    [0, 0, 4, 12]
    """
    micro, stage = schedule.table, schedule.stages()
    D = schedule.num_devices
    done = {(int(micro[t, -1]), int(stage[t, -1])): t for t in range(len(micro)) if micro[t, -1] >= 0}
    delays = {
        t - done[int(micro[t, 0]), int(stage[t, 0]) - 1] - schedule.hop
        for t in range(len(micro))
        if micro[t, 0] >= 0 and stage[t, 0] >= D
    }
    assert len(delays) == 1 and min(delays) >= 0, f"not a delay line: {sorted(delays)}"
    return delays.pop()
