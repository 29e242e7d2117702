"""Schedules: which device works on which (micro-batch, stage) at which clock tick.

A schedule is a static table over ``D`` devices (the positions of the mesh's stage axis):
``table[t, d] = i`` when device ``d`` processes micro-batch ``i`` at tick ``t`` and ``-1`` when it
idles (a bubble), and ``stage_table[t, d] = s``, the stage it runs. On a bubble tick
``stage_table`` names the stage the device would run if it computed anyway: the last one it
worked on (its first one before it has started), so that an engine that re-runs a stage on a
bubble tick feeds it the type of value it was written for. The pipeline engine only reads the
tables, so new schedules are new tables.

GPipe (fill-drain, Huang et al. 2019): ``D = n`` stages, device ``s`` runs stage ``s``, on
micro-batch ``i`` at tick ``i + s``. With ``m`` micro-batches there are ``m + n - 1`` ticks, each
device works ``m`` of them, and the idle fraction is ``(n - 1) / (m + n - 1)``.

Circular (interleaved, ``repeats = v``): ``S = v n`` stages on ``D = n`` devices; device ``d``
holds the ``v`` non-adjacent stages ``d, d + n, ..., d + (v - 1) n``, and every micro-batch goes
round the ring of devices ``v`` times. With ``m' = max(m, n)`` micro-batch slots, device ``d``
runs stage ``r n + d`` on micro-batch ``i`` at tick ``r m' + i + d`` (slots ``i >= m`` are
bubbles). A micro-batch leaves the last device at tick ``r m' + i + n - 1`` and re-enters device
0 for its next round ``m' - n + 1 >= 1`` ticks later, so device 0 keeps it until then. There are
``v m' + n - 1`` ticks, each device works ``v m`` of them, and for ``m >= n`` the idle fraction
is ``(n - 1) / (v m + n - 1)``: each stage is ``1 / v`` of a device's share of the model, so the
``n - 1`` fill and drain ticks cost ``v`` times less (the schedule of MaxText and praxis; the
"interleaved" schedule of Megatron-LM groups micro-batches differently but has the same bubble).
With ``v = 1`` the circular table is GPipe's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

KINDS = ("gpipe", "circular")


class Schedule(NamedTuple):
    """A static pipeline schedule."""

    table: np.ndarray  # int32[ticks, num_devices]: micro-batch index, or -1 for a bubble
    num_micro: int  # m
    fill_ticks: int  # ticks before the last micro-batch enters stage 0 (the "fill" phase)
    stage_table: np.ndarray | None = None  # int32[ticks, num_devices]: the stage each device runs
    repeats: int = 1  # v: stages per device; each micro-batch goes round the devices v times

    @property
    def num_ticks(self) -> int:
        return self.table.shape[0]

    @property
    def num_devices(self) -> int:
        """``D``: the devices along the stage axis (GPipe: the number of stages)."""
        return self.table.shape[1]

    @property
    def num_stages(self) -> int:
        """``S = repeats * num_devices``: the stages of the model."""
        return self.repeats * self.num_devices

    def stages(self) -> np.ndarray:
        """int32[ticks, num_devices]: the stage each device runs at each tick (see the module)."""
        if self.stage_table is not None:
            return self.stage_table
        return np.broadcast_to(np.arange(self.num_devices, dtype=np.int32), self.table.shape)

    def work_per_stage(self) -> np.ndarray:
        """int[num_stages]: ticks on which each stage has a micro-batch to process."""
        work = self.table >= 0
        return np.bincount(self.stages()[work], minlength=self.num_stages)

    def work_per_device(self) -> np.ndarray:
        """int[num_devices]: ticks on which each device has a micro-batch to process."""
        return (self.table >= 0).sum(axis=0)

    def bubble_fraction(self) -> float:
        """Idle device-ticks over all device-ticks."""
        return float((self.table < 0).mean())


def gpipe(num_stages: int, num_micro: int) -> Schedule:
    """The GPipe fill-drain schedule for ``num_stages`` stages and ``num_micro`` micro-batches."""
    return circular(num_stages, num_micro, 1)


def circular(num_devices: int, num_micro: int, repeats: int) -> Schedule:
    """The circular (interleaved) schedule: ``repeats * num_devices`` stages on ``num_devices``.

    Device ``d`` runs stage ``r * num_devices + d`` on micro-batch ``i`` at tick
    ``r * m' + i + d``, with ``m' = max(num_micro, num_devices)`` slots per round (``m' =
    num_micro`` when ``repeats == 1``, which is GPipe's schedule).

    Examples:
      >>> s = circular(2, 2, 2)  # 4 stages on 2 devices, 2 micro-batches
      >>> s.table.T.tolist()  # micro-batch of each device at each tick
      [[0, 1, 0, 1, -1], [-1, 0, 1, 0, 1]]
      >>> s.stage_table.T.tolist()  # device 0 holds stages 0 and 2, device 1 stages 1 and 3
      [[0, 0, 2, 2, 2], [1, 1, 1, 3, 3]]
      >>> s.bubble_fraction(), circular_bubble_fraction(2, 2, 2)
      (0.2, 0.2)
    """
    n, m, v = num_devices, num_micro, repeats
    slots = m if v == 1 else max(m, n)
    ticks = np.arange(v * slots + n - 1)[:, None]
    devices = np.arange(n)[None, :]
    k = ticks - devices  # position of the device's work item at this tick
    r, i = np.divmod(np.clip(k, 0, v * slots - 1), slots)
    working = (k >= 0) & (k < v * slots) & (i < m)
    table = np.where(working, i, -1).astype(np.int32)
    stage_table = (r * n + devices).astype(np.int32)  # before: first stage; after: last stage
    return Schedule(table=table, num_micro=m, fill_ticks=m - 1, stage_table=stage_table, repeats=v)


def sequential(num_stages: int, num_micro: int) -> Schedule:
    """Every stage on micro-batch ``t`` at tick ``t``: the table of one device running the stages
    in turn, whose columns hand their output to the next column within the tick (``mesh=None``).

    No bubble; ``m`` ticks. (On a mesh a message takes a tick to travel, hence GPipe's skew.)

    >>> s = sequential(3, 2)
    >>> s.table.T.tolist(), s.stages().T.tolist(), s.bubble_fraction()
    ([[0, 1], [0, 1], [0, 1]], [[0, 0], [1, 1], [2, 2]], 0.0)
    """
    table = np.broadcast_to(np.arange(num_micro, dtype=np.int32)[:, None], (num_micro, num_stages))
    return Schedule(table=np.array(table), num_micro=num_micro, fill_ticks=0)


def gpipe_bubble_fraction(num_stages: int, num_micro: int) -> float:
    """GPipe's ideal bubble fraction, ``(n - 1) / (m + n - 1)``."""
    return (num_stages - 1) / (num_micro + num_stages - 1)


def circular_bubble_fraction(num_devices: int, num_micro: int, repeats: int) -> float:
    """The circular schedule's bubble fraction, ``(n - 1) / (v m + n - 1)`` (for ``m >= n``).

    With fewer micro-batches than devices the schedule runs ``n`` slots per round, so its
    bubble is ``1 - v m / (v n + n - 1)`` instead; :meth:`Schedule.bubble_fraction` gives the
    exact value of any table.
    """
    n, m, v = num_devices, num_micro, repeats
    return (n - 1) / (v * m + n - 1)
