"""Schedule tables as timelines: one row per device, one column per tick, a cell per slot.

People read a pipeline schedule faster as a picture than as a table. Any table works, since every
schedule is one (:mod:`pipejax._src.schedules.tables`): a forward table (:class:`Schedule`: GPipe,
circular) has one slot per tick, F; a training table (B slots too: 1F1B, ZB-H1,
interleaved 1F1B) runs its F, B (and W) slots of a tick side by side, in lockstep. A cell names
the slot's kind and micro-batch (``F3``: the forward of micro-batch 3), its colour is the
micro-batch's, and an empty cell is a bubble.

:func:`render` draws the timeline as text (no dependency); :func:`plot` with matplotlib, which is
optional (``pip install matplotlib``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from pipejax._src import checks


class Slot(NamedTuple):
    """One slot of one device at one tick."""

    kind: str  # "F", "B" or "W"
    micro: int  # the micro-batch, or -1 for an idle slot (a bubble)
    stage: int  # the stage the slot belongs to


def kinds(schedule) -> tuple[str, ...]:
    """The slot kinds of a tick, in the order a device runs them: ``("F",)`` for a forward
    table, ``("F", "B")`` for 1F1B, ``("F", "B", "W")`` for ZB-H1."""
    if not callable(getattr(schedule, "slot_fields", None)):
        raise TypeError(
            "`schedule` must be a pipejax schedule table (`pj.gpipe_schedule(...)`, "
            "`pj.circular_schedule(...)`, `pj.one_f_one_b_schedule(...)`, `pj.zb_h1_schedule(...)`, "
            "or `pipe.schedule(batch)`), "
            f"but got {type(schedule).__name__}."
        )
    return tuple(schedule.slot_fields())


def slots(schedule) -> np.ndarray:
    """``Slot`` fields as arrays: int32[3, ticks, devices, k], the micro-batch, the stage and a
    kind index into :func:`kinds` for each of the ``k`` slots of each tick and device."""
    kinds(schedule)  # the type check
    fields = schedule.slot_fields()
    micro = [m for m, _ in fields.values()]
    stage = [s for _, s in fields.values()]
    kind = [np.full(micro[0].shape, j) for j in range(len(fields))]
    return np.stack([np.stack(micro, -1), np.stack(stage, -1), np.stack(kind, -1)]).astype(np.int32)


def render(schedule) -> str:
    """The timeline as text: a line per device, a ``|``-separated column per tick, ``.`` for an
    idle slot.

    Examples:
      >>> import pipejax as pj
      >>> print(render(pj.gpipe_schedule(3, 4)))
      device 0 | F0 | F1 | F2 | F3 | .  | .  |
      device 1 | .  | F0 | F1 | F2 | F3 | .  |
      device 2 | .  | .  | F0 | F1 | F2 | F3 |
      >>> print(render(pj.one_f_one_b_schedule(2, 3)))
      device 0 | F0 .  | F1 .  | F2 B0 | .  B1 | .  B2 |
      device 1 | .  .  | F0 B0 | F1 B1 | F2 B2 | .  .  |
      >>> print(render(pj.circular_schedule(2, 2, 2)))  # micro-batch and stage
      device 0 | F0s0 | F1s0 | F0s2 | F1s2 | .    |
      device 1 | .    | F0s1 | F1s1 | F0s3 | F1s3 |
    """
    micro, stage, kind = (a.transpose(1, 0, 2) for a in slots(schedule))  # [devices, ticks, k]
    devices, ticks, k = micro.shape
    names = kinds(schedule)
    # One pass over plain Python values, linear in the table (a numpy scalar per cell is slow).
    work = micro.ravel().tolist()
    labels = [
        _label(names[c], i, s, schedule.repeats) if i >= 0 else "."
        for i, s, c in zip(work, stage.ravel().tolist(), kind.ravel().tolist(), strict=True)
    ]
    width = max([len(text) for text, i in zip(labels, work, strict=True) if i >= 0] or [1])
    labels = [text.ljust(width) for text in labels]
    cells = [" ".join(labels[at : at + k]) for at in range(0, len(labels), k)]
    return "\n".join(
        f"device {d} | " + " | ".join(cells[d * ticks : (d + 1) * ticks]) + " |" for d in range(devices)
    )


def inputs_held(schedule) -> np.ndarray:
    """int[devices]: the most stage inputs each device keeps for the backward pass at once, with
    ``checkpoint="always"`` (what a device stores besides its parameters, in units of one
    stage input of one micro-batch).

    A forward table differentiated by autodiff keeps the input of every tick until the backward
    pass starts: all ``ticks`` of them, bubbles included (``m + n - 1`` for GPipe). A training
    table keeps a micro-batch's input from its F to its last B or W: the most in flight.

    Examples:
      >>> import pipejax as pj
      >>> inputs_held(pj.gpipe_schedule(4, 8)).tolist()
      [11, 11, 11, 11]
      >>> inputs_held(pj.one_f_one_b_schedule(4, 8)).tolist()
      [7, 5, 3, 1]
    """
    if kinds(schedule) == ("F",):  # a forward table keeps every input it received
        return np.full(schedule.num_devices, schedule.num_ticks)
    return schedule.in_flight().max(axis=0)


def _check_plot(schedule, ax, title, notes, labels, axes_type) -> dict[int, str]:
    """Checks :func:`plot`'s arguments, each naming the argument, what it got and what it takes;
    returns ``notes`` as ``{device: text}`` (``{}`` for ``None``)."""
    where = f"{type(schedule).__name__}.plot"
    if ax is not None and not isinstance(ax, axes_type):
        raise TypeError(
            f"`ax` of {where} must be a matplotlib Axes to draw in, or None for a new figure, but got "
            f"{type(ax).__name__} {ax!r:.80}. Pass e.g. `fig, ax = plt.subplots()` and then `ax=ax` "
            "(for a grid of plots, one of its Axes: `ax=axs[0, 1]`)."
        )
    if title is not None and not isinstance(title, str):
        raise TypeError(
            f"`title` of {where} must be a string, or None for the schedule's own, but got "
            f"{type(title).__name__} {title!r:.80}; e.g. title='1F1B on 4 devices'."
        )
    if labels is not None and not isinstance(labels, bool | np.bool_):
        raise TypeError(
            f"`labels` of {where} must be True, False, or None (label the cells when they are wide "
            f"enough), but got {type(labels).__name__} {labels!r:.80}."
        )
    if notes is None:
        return {}
    n = schedule.num_devices
    devices = f"the devices 0 .. {n - 1}" if n > 1 else "device 0"
    if not isinstance(notes, Mapping):
        raise TypeError(
            f"`notes` of {where} must be a dict from device to text, e.g. {{0: '1.2 GiB'}}, or None, but "
            f"got {type(notes).__name__} {notes!r:.80}; the table has {devices}."
        )
    out = {}
    for d, text in notes.items():
        device = checks.integer(d)
        if device is None or not 0 <= device < n:
            raise ValueError(
                f"`notes` of {where} has a note for device {d!r}, but the table has {devices}; "
                "key each note by one of them."
            )
        if not isinstance(text, str):
            raise TypeError(
                f"`notes` of {where} must map each device to a string, but the note for device "
                f"{device} is {type(text).__name__} {text!r:.80}; format it first, e.g. "
                f"{{{device}: f'{{value:.1f}} GiB'}}."
            )
        out[device] = text
    return out


def _label(kind: str, micro: int, stage: int, repeats: int) -> str:
    """``F3``: the forward of micro-batch 3; ``F3s5``: of micro-batch 3 on stage 5, where a
    device holds several stages (``repeats > 1``)."""
    return f"{kind}{micro}" + (f"s{stage}" if repeats > 1 else "")


def plot(
    schedule,
    *,
    ax: Any = None,
    title: str | None = None,
    notes: dict[int, str] | None = None,
    labels: bool | None = None,
) -> Any:
    """Draws the timeline with matplotlib and returns the ``Axes``.

    Rows are devices (device 0 on top), columns ticks; within a tick a training table's F, B
    and W slots sit side by side. A slot's colour is its micro-batch's; B slots are hatched
    ``//`` and W slots ``..``, so the kinds read apart in print too. Bubbles stay white.

    Args:
      schedule: a schedule table.
      ax: the matplotlib ``Axes`` to draw in; ``None`` makes a figure sized to the table.
      title: the title; ``None``: the schedule's kind, ``m``, ``n`` and its bubble fraction.
      notes: text per device, written at the right end of its row (e.g. the per-device memory
        of ``pj.memory_report`` or of the docs' formula).
      labels: write ``F3``-style labels in the cells; ``None``: when the cells are wide enough.

    Returns:
      The ``Axes``; ``ax.figure.savefig(path)`` writes the picture.

    Raises:
      ImportError: without matplotlib, saying how to install it.
      TypeError: ``schedule`` is not a table; ``ax`` not an ``Axes``; ``title`` not a string;
        ``notes`` not a dict or a note not a string; ``labels`` not a bool.
      ValueError: a key of ``notes`` that is not a device of the table.
    """
    try:
        import matplotlib.pyplot as plt
        from matplotlib.axes import Axes
        from matplotlib.patches import Rectangle
    except ImportError as err:  # pragma: no cover - matplotlib is a dev dependency
        raise ImportError(
            "Schedule pictures need matplotlib, an optional dependency: `pip install matplotlib` "
            "(or `pip install pipejax[examples]`). `schedule.render()` needs nothing."
        ) from err
    names = kinds(schedule)  # the type check of `schedule`, before any other
    notes = _check_plot(schedule, ax, title, notes, labels, Axes)
    micro, stage, kind = slots(schedule)
    ticks, devices, k = micro.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.0 + 0.32 * ticks * k, 18.0), 0.9 + 0.5 * devices))
    m = max(int(micro.max()) + 1, 1)
    cmap = plt.get_cmap("tab20" if m > 10 else "tab10")
    hatch = {"F": None, "B": "//", "W": ".."}
    if labels is None:
        labels = ticks * k <= 48
    for t in range(ticks):
        for d in range(devices):
            for j in range(k):
                i = int(micro[t, d, j])
                x, y = t + j / k, devices - 1 - d
                if i < 0:
                    ax.add_patch(Rectangle((x, y), 1 / k, 1, facecolor="white", edgecolor="0.85", lw=0.5))
                    continue
                name = names[kind[t, d, j]]
                colour = cmap(i % cmap.N)
                cell = Rectangle(
                    (x, y), 1 / k, 1, facecolor=colour, edgecolor="black", lw=0.6, hatch=hatch[name]
                )
                ax.add_patch(cell)
                if labels:
                    text = _label(name, i, stage[t, d, j], schedule.repeats)
                    ax.text(x + 0.5 / k, y + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, devices)
    ax.set_yticks([devices - 0.5 - d for d in range(devices)], [f"device {d}" for d in range(devices)])
    ax.set_xlabel("tick")
    for d, text in notes.items():
        ax.text(ticks + 0.2, devices - 0.5 - d, text, va="center", fontsize=8)
    if title is None:
        if kinds(schedule) == ("F",):
            name = "circular" if schedule.repeats > 1 else "gpipe"
            costs, bubble = "forward table; autodiff runs it backwards", schedule.bubble_fraction()
        elif schedule.weight is None:
            name, costs, bubble = schedule.name, "F = 1, B = 2", schedule.bubble_fraction(1.0, 2.0)
        else:
            name, costs = schedule.name, "F = B = W = 1"
            bubble = schedule.bubble_fraction(1.0, 1.0, 1.0)
        title = f"{name}: m = {schedule.num_micro}, {devices} devices, bubble {bubble:.0%} ({costs})"
    ax.set_title(title, fontsize=10)
    return ax


__all__ = ["Slot", "inputs_held", "kinds", "plot", "render", "slots"]


def render_method(self) -> str:
    """The table as a text timeline, a line per device (see
    :func:`pipejax._src.schedules.timeline.render`)."""
    return render(self)


def plot_method(self, **kwargs):
    """The table as a picture with matplotlib; returns the ``Axes`` (see
    :func:`pipejax._src.schedules.timeline.plot` for ``ax``, ``title``, ``notes`` and ``labels``)."""
    return plot(self, **kwargs)
