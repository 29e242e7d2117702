"""A training table written as a list of actions (:func:`from_actions`): each action one slot,
``(device, tick, kind, micro, chunk)``, placed in a :class:`~pipejax._src.schedules.table.Schedule`
and checked by the rules every table keeps."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from pipejax._src import checks
from pipejax._src.schedules.table import SLOT_KINDS, Schedule


class Action(NamedTuple):
    """One slot of a table written as an action: device ``device`` runs a ``kind`` slot ("F",
    "B" or "W") of micro-batch ``micro`` at tick ``tick``, on its chunk ``chunk`` (stage ``chunk *
    num_devices + device``)."""

    device: int
    tick: int
    kind: str
    micro: int
    chunk: int = 0


def from_actions(
    actions: Iterable,
    *,
    num_devices: int,
    num_micro: int,
    repeats: int = 1,
    name: str = "custom",
    hop: int = 1,
    placement: str = "ring",
) -> Schedule:
    """A training table from a list of actions: ``(device, tick, kind, micro, chunk)`` each
    (:class:`Action`, or a tuple in that order; ``chunk`` may be left out for 0), ``kind`` one of
    "F", "B" and "W". Device ``d``'s chunk ``c`` is stage ``c * num_devices + d`` (``placement=
    "v"``, a V-shaped table with ``repeats=2``: chunk 1 is stage ``2 num_devices - 1 - d``). Idle
    slots name the device's chunk 0. ``hop``: the ticks a message takes to the next device, 1,
    or 2 for a table run with ``overlap=True`` (sends that overlap compute). The table is
    checked as every built-in one is (see the module).

    Examples:
      >>> t = from_actions(
      ...     [(0, 0, "F", 0), (1, 1, "F", 0), (1, 1, "B", 0), (0, 2, "B", 0)],
      ...     num_devices=2, num_micro=1)
      >>> print(t.render())
      device 0 | F0 .  | .  .  | .  B0 |
      device 1 | .  .  | F0 B0 | .  .  |
    """
    n = checks.count(num_devices, "num_devices", what="the devices along the stage axis")
    m = checks.count(num_micro, "num_micro", what="the number of micro-batches")
    v = checks.count(repeats, "repeats", what="the chunks (stages) each device holds")
    rows = [_action(a, j, n, m, v) for j, a in enumerate(actions)]
    kinds = [k for k in SLOT_KINDS if any(a.kind == k for a in rows)]
    if "F" not in kinds or "B" not in kinds:
        raise ValueError(
            f"`actions` must hold F and B slots (a training table; W optional), but got the kinds "
            f"{kinds or 'none'}. GPipe-like forward tables come from `pj.gpipe_schedule` and "
            "`pj.circular_schedule`; autodiff runs them backwards."
        )
    ticks = max(a.tick for a in rows) + 1
    micro = {k: np.full((ticks, n), -1, np.int32) for k in kinds}
    stage = {k: np.broadcast_to(np.arange(n, dtype=np.int32), (ticks, n)).copy() for k in kinds}
    seen: dict[tuple[int, int, str], int] = {}
    for j, a in enumerate(rows):
        cell = (a.tick, a.device, a.kind)
        if cell in seen:
            raise ValueError(
                f"`actions[{j}]` {tuple(a)} gives device {a.device} a second {a.kind} slot at tick "
                f"{a.tick} (`actions[{seen[cell]}]` {tuple(rows[seen[cell]])} is the first); a device "
                "runs at most one F, one B and one W slot per tick. Move one to another tick."
            )
        seen[cell] = j
        micro[a.kind][a.tick, a.device] = a.micro
        v_up = placement == "v" and a.chunk == 1  # the V's way up: device d holds 2 n - 1 - d
        stage[a.kind][a.tick, a.device] = 2 * n - 1 - a.device if v_up else a.chunk * n + a.device
    return Schedule(name, micro, stage, m, v, hop, placement)


def _action(a, j: int, n: int, m: int, v: int) -> Action:
    """Action ``j`` of :func:`from_actions`, checked: each field named with what it takes."""
    if not isinstance(a, tuple) or len(a) not in (4, 5):
        raise TypeError(
            f"`actions[{j}]` must be a tuple (device, tick, kind, micro[, chunk]), e.g. (0, 3, 'F', "
            f"1), but got {type(a).__name__} {a!r:.80}."
        )
    device, tick, kind, micro, *chunk = a
    if kind not in SLOT_KINDS:
        raise ValueError(f"`actions[{j}]` {a!r}: the kind must be 'F', 'B' or 'W', but got {kind!r}.")
    fields = {"device": (device, n, "num_devices"), "micro": (micro, m, "num_micro")}
    fields["chunk"] = (chunk[0] if chunk else 0, v, "repeats")
    fields["tick"] = (tick, None, None)
    out = {}
    for field, (value, bound, by) in fields.items():
        i = checks.integer(value)
        if i is None or i < 0 or (bound is not None and i >= bound):
            rule = f"an int in 0 .. {bound - 1} (`{by}={bound}`)" if bound else "an int >= 0"
            raise ValueError(f"`actions[{j}]` {a!r}: the {field} must be {rule}, but got {value!r}.")
        out[field] = i
    return Action(out["device"], out["tick"], kind, out["micro"], out["chunk"])
