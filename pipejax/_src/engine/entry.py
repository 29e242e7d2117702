"""The entry of the tick loop: :func:`run` a schedule on its devices with its stages."""

from __future__ import annotations

from pipejax._src import checkpoint as ckpt
from pipejax._src.engine.config import Config, Inputs
from pipejax._src.engine.local import LocalDevices
from pipejax._src.engine.tick import _Ctx
from pipejax._src.schedules.tables import Schedule


def run(cfg: Config, devices, stages, schedule: Schedule, inputs: Inputs):
    """Runs ``schedule`` on ``devices`` with ``stages``: ``(outputs (m, ...), stats per stage)``.

    Without a mesh the same work runs on one device, every stage in turn on each micro-batch
    (:func:`pipejax._src.schedules.tables.sequential`, or for stacked stages
    :func:`~pipejax._src.schedules.tables.one_device`): no bubble, no guard, no switch.
    """
    S = len(cfg.stages)
    if isinstance(devices, LocalDevices):
        schedule = devices.table(S, schedule.num_micro)
        phases = ckpt.sequential_phases(cfg.checkpoint, schedule)
    else:
        phases = ckpt.phases(cfg.checkpoint, schedule)
    ctx = _Ctx(S, schedule.num_devices, schedule.repeats, schedule.num_micro, stages)
    return devices.run(ctx, schedule, phases, inputs)

