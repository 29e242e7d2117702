"""The entry of the tick loop: :func:`run` a schedule on its devices with its stages."""

from __future__ import annotations

from pipejax._src.engine.config import Config, Inputs
from pipejax._src.engine.tick import ForwardSlots, _Ctx
from pipejax._src.schedules.table import Schedule


def run(cfg: Config, devices, stages, schedule: Schedule, inputs: Inputs):
    """Runs ``schedule`` (the plan's table, :meth:`~pipejax._src.plan.Plan.table`) on
    ``devices`` with ``stages``: ``(outputs (m, ...), stats per stage)``."""
    ctx = _Ctx(len(cfg.stages), schedule.num_devices, schedule.repeats, schedule.num_micro, stages)
    return devices.run(ctx, schedule, devices.phases(cfg.checkpoint, schedule), inputs, ForwardSlots())
