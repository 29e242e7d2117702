"""Schedules: which stage works on which micro-batch at which clock tick.

A schedule is a static table, ``table[t, s] = i`` when stage ``s`` processes micro-batch ``i`` at
tick ``t`` and ``-1`` when it idles (a bubble). The pipeline engine only reads the table, so new
schedules are new tables.

GPipe (fill-drain, Huang et al. 2019): stage ``s`` runs micro-batch ``i`` at tick ``i + s``. With
``n`` stages and ``m`` micro-batches there are ``m + n - 1`` ticks, each stage works ``m`` of
them, and the idle fraction is ``(n - 1) / (m + n - 1)``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Schedule(NamedTuple):
    """A static pipeline schedule."""

    table: np.ndarray  # int32[ticks, num_stages]: micro-batch index, or -1 for a bubble
    num_micro: int  # m
    fill_ticks: int  # ticks before the last micro-batch enters stage 0 (the "fill" phase)

    @property
    def num_ticks(self) -> int:
        return self.table.shape[0]

    @property
    def num_stages(self) -> int:
        return self.table.shape[1]

    def work_per_stage(self) -> np.ndarray:
        """int[num_stages]: ticks on which each stage has a micro-batch to process."""
        return (self.table >= 0).sum(axis=0)

    def bubble_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks."""
        return float((self.table < 0).mean())


def gpipe(num_stages: int, num_micro: int) -> Schedule:
    """The GPipe fill-drain schedule for ``num_stages`` stages and ``num_micro`` micro-batches."""
    ticks = np.arange(num_micro + num_stages - 1)[:, None]
    stages = np.arange(num_stages)[None, :]
    micro = ticks - stages
    table = np.where((micro >= 0) & (micro < num_micro), micro, -1).astype(np.int32)
    return Schedule(table=table, num_micro=num_micro, fill_ticks=num_micro - 1)


def gpipe_bubble_fraction(num_stages: int, num_micro: int) -> float:
    """GPipe's ideal bubble fraction, ``(n - 1) / (m + n - 1)``."""
    return (num_stages - 1) / (num_micro + num_stages - 1)
