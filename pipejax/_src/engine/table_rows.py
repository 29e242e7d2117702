"""A schedule table as the arrays the tick loop reads: a row of (micro-batch, stage) per tick, and
the loop-back delay of the circular schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src.schedules.table import Schedule


def rows(schedule):
    """The scan's per-tick input: one table ``int32[T, 2 D + 1]``, each row the tick's micro-batch
    and stage of every device and the tick itself (split by :func:`split_row`); a training table
    (one with B slots) has its F slots there and, after them,
    the micro-batches of its B and W slots and the stages of its B slots (:func:`back_row`):
    ``int32[T, 5 D + 1]``.

    One table, not a ``tick = arange(T)`` beside the others: XLA turns such a constant into an
    ``iota`` computed into a buffer of its own, kept through both loops; the table stays a
    constant of the program. A row is split where it is read, inside the checkpoints (the
    stage's, :func:`recomputed`): split outside, its pieces would be kept per tick for the
    backward pass."""
    tick = np.arange(schedule.num_ticks, dtype=np.int32)[:, None]
    if schedule.trains:
        w = schedule.weight if schedule.weight is not None else np.full_like(schedule.forward, -1)
        columns = [schedule.forward, schedule.stages("F"), tick, schedule.backward, w, schedule.stages("B")]
        if schedule.placement == "v":  # a V's sources (`v_row`)
            columns += [_sources(schedule, "F"), _sources(schedule, "B")]
        if schedule.pooled:  # and a pooled table's slots (`pool_row`)
            _, pool = schedule.stash_pool()
            columns += [pool["F"], pool["B"]]
            if schedule.weight is not None:  # W: its stash slot and stage, its cotangent's slots
                _, cot = schedule.cotangent_pool()
                columns += [pool["W"], schedule.stages("W"), cot["B"], cot["W"]]
        return table(*columns)
    return table(schedule.table, schedule.stages(), tick)


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


def split_row(row, D: int):
    """A row of :func:`rows` as ``(micro[D], stage[D], tick)`` (a training table: of F slots)."""
    return row[:D], row[D : 2 * D], row[2 * D]


def back_row(row, D: int):
    """A training table's row of :func:`rows` as ``(B micro[D], W micro[D], B stage[D])``."""
    return row[2 * D + 1 : 3 * D + 1], row[3 * D + 1 : 4 * D + 1], row[4 * D + 1 : 5 * D + 1]


def pool_row(row, schedule):
    """A pooled table's row of :func:`rows` (:attr:`~pipejax._src.schedules.table.Schedule.pooled`)
    as ``(F stash slot[D], B stash slot[D])``, the pool slot F writes and B reads
    (:meth:`~pipejax._src.schedules.table.Schedule.stash_pool`); with W slots also ``(W stash
    slot[D], W stage[D], B cotangent slot[D], W cotangent slot[D])``, the slots of
    :meth:`~pipejax._src.schedules.table.Schedule.cotangent_pool`. A V's come after its
    sources (:func:`v_row`)."""
    D = schedule.num_devices
    start = 5 * D + 1 + (2 * D if schedule.placement == "v" else 0)
    return tuple(row[start + j * D : start + (j + 1) * D] for j in range(2 if schedule.weight is None else 6))


def v_row(row, D: int):
    """A V table's row of :func:`rows` as ``(F source[D], B source[D])``: where the next tick's F
    and B read their messages from (:data:`LEFT`, :data:`RIGHT`, :data:`OWN`)."""
    return row[5 * D + 1 : 6 * D + 1], row[6 * D + 1 : 7 * D + 1]


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
