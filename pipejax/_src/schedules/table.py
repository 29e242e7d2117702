"""The one table type of every schedule, :class:`Schedule`, and the rules a table must keep to run.

A table says, for every tick ``t`` and device ``d`` of the stage axis, which slots the device
runs: at most one forward slot F, one backward slot B and one weight-gradient slot W, in that
order within the tick. A slot names a micro-batch (``-1``: idle, a bubble) and a stage. A
forward table (GPipe, circular) has F slots only, and autodiff runs it backwards; a training
table (1F1B, ZB-H1, interleaved 1F1B, V-Half, ZB-V, or one a user writes with
:func:`~pipejax._src.schedules.actions.from_actions`) has B slots, and W slots when B computes
the input cotangent only.

Every table is checked when it is built (:func:`pipejax._src.schedules.rules.check`), by the
same rules for the built-in constructors (:mod:`pipejax._src.schedules.tables`) and for a user's
list of actions: those of the engine's tick loop, listed in :mod:`pipejax._src.schedules.rules`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from pipejax._src import checks
from pipejax._src.schedules import rules, timeline  # neither imports this module

SLOT_KINDS = ("F", "B", "W")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Schedule:
    """A static schedule table: which slots each device runs at each tick (see the module).

    ``micro[k]`` and ``stage[k]`` are ``int32[ticks, num_devices]`` for each slot kind ``k`` of
    the table (``"F"``; ``"F", "B"``; or ``"F", "B", "W"``): the micro-batch of the slot (``-1``
    when idle) and its stage. On an idle slot the stage names the one the device would run if
    it computed anyway (an engine that runs a stage on a bubble feeds it the type of value it
    was written for). Built by the constructors (``pj.gpipe_schedule``, ``pj.one_f_one_b_schedule``,
    ...) or from a list of actions (:func:`~pipejax._src.schedules.actions.from_actions`); checked when built.
    """

    name: str
    micro: Mapping[str, np.ndarray]
    stage: Mapping[str, np.ndarray]
    num_micro: int
    repeats: int = 1  # v: chunks (stages) per device
    hop: int = 1  # ticks a message takes to the next stage's device (0: one device, in the tick)
    placement: str = "ring"  # stage j on device j mod D ("ring"), or the V's ("v", see the module)

    def __post_init__(self):
        rules.check(self)

    def __repr__(self) -> str:
        kinds = "".join(self.kinds)
        v = ", placement='v'" if self.placement == "v" else ""
        return (
            f"Schedule({self.name!r}, slots {kinds}, {self.num_ticks} ticks x {self.num_devices} "
            f"devices, num_micro={self.num_micro}, repeats={self.repeats}{v})"
        )

    def __eq__(self, other) -> bool:
        """Equal fields, the tables compared whole."""
        if not isinstance(other, Schedule):
            return NotImplemented
        same = (self.name, self.kinds, self.num_micro, self.repeats, self.hop, self.placement) == (
            other.name, other.kinds, other.num_micro, other.repeats, other.hop, other.placement
        )  # fmt: skip
        return same and all(
            np.array_equal(self.micro[k], other.micro[k]) and np.array_equal(self.stage[k], other.stage[k])
            for k in self.kinds
        )

    def __hash__(self) -> int:
        return hash((self.name, self.kinds, self.num_micro, self.repeats, self.hop, self.micro["F"].shape))

    def replace(self, **changes) -> Schedule:
        """A copy with ``changes`` (fields, as :func:`dataclasses.replace`), checked again."""
        return dataclasses.replace(self, **changes)

    # -- shape ---------------------------------------------------------------------------------

    @property
    def kinds(self) -> tuple[str, ...]:
        """The slot kinds of a tick, in the order a device runs them."""
        return tuple(self.micro)

    @property
    def trains(self) -> bool:
        """Whether the table holds the backward pass (B slots): a training table."""
        return "B" in self.micro

    @property
    def pooled(self) -> bool:
        """Whether what F keeps waits in one pool per device, shared by the device's stages, each
        input given its slot by the table (:meth:`stash_pool`): a training table whose devices
        hold several stages (interleaved 1F1B, the V's). Otherwise in a ring of
        :meth:`stash_slots` per stage. A pool needs no more slots than the most inputs a device
        holds at once; rings per stage are each sized for the stage holding the most (interleaved
        1F1B, ``n = 4``: 11 slots a device against 2 x 8)."""
        return self.trains and self.repeats > 1

    @property
    def num_ticks(self) -> int:
        return self.micro["F"].shape[0]

    @property
    def num_devices(self) -> int:
        """``D``: the devices along the stage axis (GPipe: the number of stages)."""
        return self.micro["F"].shape[1]

    @property
    def num_stages(self) -> int:
        """``S = repeats * num_devices``: the stages of the model."""
        return self.repeats * self.num_devices

    def device_of(self, stage):
        """The device of each stage in ``stage`` (an int or an int array): ``stage mod D`` on a
        ring, the V's ``stage`` or ``2 D - 1 - stage`` (see the module)."""
        n, j = self.num_devices, np.asarray(stage)
        return np.where(j < n, j, 2 * n - 1 - j) if self.placement == "v" else j % n

    @property
    def fill_ticks(self) -> int:
        """The tick at which the last micro-batch enters stage 0 (the end of the "fill")."""
        last = (self.micro["F"] == self.num_micro - 1) & (self.stage["F"] == 0)
        return int(np.argwhere(last)[0, 0])

    @property
    def drain_ticks(self) -> int:
        """The last ``hop (n - 1) + 1`` ticks: the last micro-batch's last pass over the devices
        (``n``, or ``2 n - 1`` when sends overlap compute), which ``"except_last"`` keeps."""
        return self.hop * (self.num_devices - 1) + 1

    @property
    def sends_per_tick(self) -> int:
        """The messages (``ppermute`` s) the loop sends on every tick, bubble or not: one for a
        forward table (activations on; autodiff's reversed ticks send the cotangents back), two
        for a training table (activations on, cotangents back; a V's go down or up the V by the
        tick's parity), none on one device."""
        return 0 if self.num_devices == 1 else 2 if self.trains else 1

    def stages(self, kind: str = "F") -> np.ndarray:
        """int32[ticks, num_devices]: the stage of each ``kind`` slot."""
        return self.stage[_kind(self, kind)]

    # the tables by their kinds' names
    table = property(lambda self: self.micro["F"], doc="int32[ticks, D]: the F slots' micro-batches.")
    forward = table
    backward = property(lambda self: self.micro.get("B"), doc="The B slots' micro-batches (or None).")
    weight = property(lambda self: self.micro.get("W"), doc="The W slots' micro-batches (or None).")
    stage_table = property(lambda self: self.stage["F"], doc="int32[ticks, D]: the F slots' stages.")
    forward_stage = stage_table
    backward_stage = property(lambda self: self.stage.get("B"), doc="The B slots' stages (or None).")

    def slot_fields(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{kind: (micro-batch table, stage table)}`` for each slot kind, in the order a device
        runs them."""
        return {k: (self.micro[k], self.stage[k]) for k in self.kinds}

    # -- work and time ---------------------------------------------------------------------------

    def slots(self) -> dict[str, np.ndarray]:
        """int[num_devices] per kind: the slots each device runs."""
        return {k: (self.micro[k] >= 0).sum(0) for k in self.kinds}

    def work_per_stage(self, kind: str = "F") -> np.ndarray:
        """int[num_stages]: the ``kind`` slots of each stage."""
        work = self.micro[_kind(self, kind)] >= 0
        return np.bincount(self.stage[kind][work], minlength=self.num_stages)

    def work_per_device(self, kind: str = "F") -> np.ndarray:
        """int[num_devices]: the ``kind`` slots of each device."""
        return self.slots()[_kind(self, kind)]

    def tick_times(self, f=1.0, b=2.0, w=0.0) -> np.ndarray:
        """float[ticks]: the lockstep time of each tick, as long as its busiest device, which
        spends ``f`` on an F slot, ``b`` on a B slot and ``w`` on a W slot: one number each, or
        one per stage (``num_stages`` of them). A tick of a forward table on which no device works
        (the circular table's last ticks with fewer micro-batches than devices) lasts the largest
        F slot: the loop runs it, and stacked stages compute on bubbles. A training table's idle
        slots compute nothing, so such a tick (the fill of a V table whose sends overlap compute,
        on every other tick) lasts none."""
        costs = _costs(self.num_stages, f=f, b=b, w=w)
        cost = sum(np.where(self.micro[k] >= 0, costs[k][self.stage[k]], 0.0) for k in self.kinds).max(axis=1)
        return cost if self.trains else np.where(cost > 0, cost, costs["F"].max())

    def step_time(self, f=1.0, b=2.0, w=0.0) -> float:
        """The lockstep time of the table, the sum of :meth:`tick_times` (a table without W
        slots: pass the whole backward as ``b``; a forward table: its F slots only)."""
        return float(self.tick_times(f, b, w).sum())

    def bubble_fraction(self, f=1.0, b=2.0, w=0.0) -> float:
        """Idle device time over all device time in lockstep (see :meth:`step_time`)."""
        costs = _costs(self.num_stages, f=f, b=b, w=w)
        work = (np.where(self.micro[k] >= 0, costs[k][self.stage[k]], 0.0).sum() for k in self.kinds)
        busy = sum(work) / self.num_devices
        step = self.step_time(f, b, w)
        return float((step - busy) / step)

    # -- what a training table keeps -------------------------------------------------------------

    def _held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """int[k] four times: the stage, micro-batch, first tick and last tick of each of the ``k``
        stage inputs a training table keeps, one per (stage, micro-batch): from the tick of its F
        to the tick of its last use (its B, or its W), both included. Linear in the table."""
        if not self.trains:
            raise ValueError(
                f"The {self.name!r} table is a forward table: autodiff keeps its inputs (see "
                "`pj.timeline_inputs_held`), it holds no B slots. Ask a training table."
            )
        first = rules.slot_ticks(self, "F")
        last = rules.slot_ticks(self, self.kinds[-1])
        stage, micro = np.divmod(np.arange(first.size), self.num_micro)
        return stage, micro, first, last

    def in_flight(self, per_stage: bool = False) -> np.ndarray:
        """int[ticks, n]: micro-batches whose stage input device ``d`` holds during tick ``t``
        (its F has run, at or before ``t``; its last use, B or W, runs at or after ``t``).
        ``per_stage``: int[ticks, n v], the same per stage (stage ``r n + d`` on device ``d``).

        Linear in the size of the result: each held input adds 1 at its first tick and -1 after
        its last one in a table of differences, whose running sum down the ticks is the count.
        """
        per_stage = checks.check_bool(per_stage, "per_stage", "Schedule.in_flight")
        stage, _, first, done = self._held()
        cols = self.num_stages if per_stage else self.num_devices
        col = stage if per_stage else self.device_of(stage)
        return self._count_held(col, cols, first, done)

    def _count_held(self, col, cols, first, last) -> np.ndarray:
        """int[ticks, cols]: how many values column ``col`` holds at each tick, each held from
        tick ``first`` to ``last`` (both included): +1 at the first tick and -1 after the last
        in a table of differences, whose running sum down the ticks is the count."""
        size = (self.num_ticks + 1) * cols
        diff = np.bincount(first * cols + col, minlength=size) - np.bincount(
            (last + 1) * cols + col, minlength=size
        )
        return np.cumsum(diff.reshape(self.num_ticks + 1, cols)[:-1], axis=0, dtype=np.int64)

    def last_stage_slots(self) -> int:
        """The ring slots (slot = micro-batch mod the size) the last stage's stashed inputs need
        in a stash of their own: 0 where the table runs the last stage's F and its last use (B,
        or W) of every micro-batch in one tick (1F1B, interleaved 1F1B, V-Half), so that what F
        keeps goes straight to B; else the fewest slots that hold its inputs in flight apart
        (ZB-H1 and ZB-V defer its W: ``n``).

        >>> from pipejax._src.schedules import tables
        >>> tables.one_f_one_b(4, 8).last_stage_slots(), tables.zb_h1(4, 8).last_stage_slots()
        (0, 4)
        """
        stage, micro, first, last = self._held()
        mine = stage == self.num_stages - 1
        micro, first, last = micro[mine], first[mine], last[mine]
        if (first == last).all():
            return 0
        for size in range(max(1, int(self.in_flight(per_stage=True)[:, -1].max())), self.num_micro):
            if not len(rules.clashes(micro % size, first, last)[0]):  # no two held at once share a slot
                return size
        return self.num_micro  # a slot per micro-batch

    def stash_slots(self) -> int:
        """The ring-buffer slots a device keeps per stage it holds: the most micro-batches ever
        in flight on one stage (``2 n - 1`` for "1f1b" with ``m >= n``, whatever ``m``)."""
        return max(1, int(self.in_flight(per_stage=True).max(initial=0)))

    def stash_pool(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(size, slot)``: one pool of stashed stage inputs per device, shared by its stages
        (the stash of a :attr:`pooled` table), and ``slot[kind]``, int32[ticks, n], the pool slot each F slot
        writes and each B (and W) slot reads (``-1``: idle).

        Each held input takes the lowest slot free at its F tick and gives it back after its
        last use (interval colouring in the order of first ticks, which needs no more slots than
        the most inputs a device holds at once, :meth:`in_flight`: ``size`` is that most).

        >>> from pipejax._src.schedules import tables
        >>> size, slot = tables.v_half(2, 2).stash_pool()
        >>> size, tables.v_half(2, 2).in_flight().max(axis=0).tolist()
        (4, [3, 4])
        """
        stage, _, first, last = self._held()
        return self._pool(stage, first, last, self.kinds)

    def cotangent_slots(self) -> int:
        """The ring slots (slot = micro-batch mod the size) that the output cotangents W reads
        take per stage, from each B to its W, in a ring table with W slots: ``n``, or the most a
        stage holds at once where that is more ("zb-floor": ``2 n - 2``).

        >>> from pipejax._src.schedules import tables
        >>> tables.zb_h1(4, 8).cotangent_slots(), tables.zb_floor(4, 8).cotangent_slots()
        (4, 6)
        """
        if "W" not in self.kinds:
            raise ValueError(f"The {self.name!r} table has no W slots, so it keeps no cotangents for them.")
        stage, _, _, _ = self._held()
        first, last = rules.slot_ticks(self, "B"), rules.slot_ticks(self, "W")
        held = self._count_held(stage, self.num_stages, first, last).max(initial=0)
        return max(self.num_devices, int(held))

    def cotangent_pool(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(size, slot)`` as :meth:`stash_pool`, for the output cotangents a table with W slots
        keeps from each B to its W (``slot["B"]`` where B writes, ``slot["W"]`` where W reads):
        the V tables' pool (a ring table keeps a ring, :meth:`cotangent_slots`)."""
        if "W" not in self.kinds:
            raise ValueError(f"The {self.name!r} table has no W slots, so it keeps no cotangents for them.")
        stage, _, _, _ = self._held()
        return self._pool(stage, rules.slot_ticks(self, "B"), rules.slot_ticks(self, "W"), ("B", "W"))

    def _pool(self, stage, first, last, kinds) -> tuple[int, dict[str, np.ndarray]]:
        """Interval colouring per device of values held from tick ``first`` to ``last`` (both
        included; one per (stage, micro-batch), in ``_held``'s order): ``(the most slots a device
        needs, {kind: int32[ticks, n] the slot of each of the ``kinds``' slots, -1 idle})``."""
        device = self.device_of(stage)
        slot_of = np.empty(len(stage), np.int32)
        free_at = [[] for _ in range(self.num_devices)]  # per device: the tick each slot frees
        for k in np.lexsort((stage, first)):
            pool = free_at[device[k]]
            s = next((j for j, t in enumerate(pool) if t < first[k]), len(pool))
            if s == len(pool):
                pool.append(0)
            pool[s], slot_of[k] = last[k], s
        size = max(1, max(len(p) for p in free_at))
        out = {}
        for kind in kinds:  # `_held`'s input j m + i is stage j's on micro-batch i
            m, j = self.micro[kind], self.stage[kind]
            out[kind] = np.where(m >= 0, slot_of[j * self.num_micro + np.maximum(m, 0)], -1).astype(np.int32)
        return size, out

    render, plot = timeline.render_method, timeline.plot_method  # drawn the same for every table


def _kind(s: Schedule, kind: str) -> str:
    if kind not in s.micro:
        raise ValueError(f"`kind` must be one of the table's slot kinds {s.kinds}, but got {kind!r}.")
    return kind


def _costs(num_stages: int, **values) -> dict[str, np.ndarray]:
    """Slot costs by kind ("F", "B", "W" for ``f``, ``b``, ``w``), each float[num_stages]: one
    finite number >= 0, or one per stage; not all zero."""
    out = {}
    for (name, v), kind in zip(values.items(), SLOT_KINDS, strict=True):
        one = not isinstance(v, (list, tuple, np.ndarray))
        if isinstance(v, (bool, str, bytes)) or (
            one and not isinstance(v, (int, float, np.integer, np.floating))
        ):
            raise TypeError(
                f"`{name}` must be a number >= 0 (a slot's cost) or one per stage, but got "
                f"{type(v).__name__} {v!r:.80}."
            )
        a = np.asarray(v, np.float64)
        if a.shape not in ((), (num_stages,)) or not (np.isfinite(a).all() and (a >= 0).all()):
            raise ValueError(
                f"`{name}` must be a finite number >= 0 (a slot's cost), or {num_stages} of them "
                f"(one per stage), but got {v!r:.80}."
            )
        out[kind] = np.broadcast_to(a, (num_stages,))
    if not any(a.any() for a in out.values()):
        names = ", ".join(f"`{n}`" for n in values)
        raise ValueError(f"The slot costs {names} are all 0; give at least one a positive cost.")
    return out
