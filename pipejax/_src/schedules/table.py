"""The one table type of every schedule, :class:`Schedule`, and the rules a table must keep to run.

A table says, for every tick ``t`` and device ``d`` of the stage axis, which slots the device
runs: at most one forward slot F, one backward slot B and one weight-gradient slot W, in that
order within the tick. A slot names a micro-batch (``-1``: idle, a bubble) and a stage. A
forward table (GPipe, circular) has F slots only, and autodiff runs it backwards; a training
table (1F1B, ZB-H1, interleaved 1F1B, V-Half, ZB-V, or one a user writes with
:func:`~pipejax._src.schedules.actions.from_actions`) has B slots, and W slots when B computes
the input cotangent only.

Every table is checked when it is built (:func:`check`): the same rules for the built-in
constructors (:mod:`pipejax._src.schedules.tables`) and for a user's list of actions, each
refusal naming the first offending slot. The rules are those of the engine's tick loop:

* **Placement.** Stage ``j`` lives on device ``j mod D`` (``placement="ring"``: device ``d``
  holds the stages ``d, d + D, ..., d + (v - 1) D`` of ``v = repeats`` chunks), or, for the
  V-shaped tables (``placement="v"``, ``v = 2``), on device ``j`` for ``j < D`` and ``2 D - 1 - j``
  after: device ``d`` holds stages ``d`` and ``2 D - 1 - d``, the first and the last stage sit on
  device 0, and the V's turn (stage ``D - 1`` to ``D``) stays on device ``D - 1``.
* **Coverage.** Every (stage, micro-batch) has exactly one slot of each kind the table has.
* **Order.** A B slot runs at or after its F (same tick: after it); a W at or after its B.
* **Messages.** A stage's output reaches the next stage's device ``hop`` ticks after it was sent
  (``hop = 1`` on a mesh: one ``ppermute`` per tick; ``0`` for the tables of one device, whose
  columns hand on within the tick), and is read on that tick: the F of stage ``j + 1`` runs
  ``hop`` ticks after the F of stage ``j``, and the B of stage ``j`` ``hop`` ticks after the B of
  stage ``j + 1``. One exception: a forward table's loop-back (from the last device to device 0
  for the next chunk) may wait in a delay line, the same number of ticks for every micro-batch.
  A V table's messages go to the next device on the way down (chunk 0), stay on the device at
  the turn, and go to the previous device on the way up (chunk 1); cotangents the other way.
  The turn's message takes one tick, whatever the hop; the others follow the tick's parity, so
  that one ``ppermute`` per tick and message kind carries them all (:func:`_check_v_parity`).
* **Stashes** (training tables). What F keeps for B and W sits in a ring of ``K`` slots per
  stage (:meth:`Schedule.stash_slots`), micro-batch ``i`` in slot ``i mod K``, so two
  micro-batches held at once on a stage must differ mod ``K``; W reads the cotangent B received
  from a ring of ``D`` slots (slot ``i mod D``), likewise. W slots need ``repeats = 1``. A V
  table's two stages share one pool per device instead, each stage input given a slot by the
  table (:meth:`Schedule.stash_pool`): their lifetimes differ (long on the way down, short on
  the way up), and a ring per stage would hold the longest one twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from pipejax._src import checks
from pipejax._src.schedules import timeline  # presentation: reads the tables, imports none of this

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
        check(self)

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
        first = _ticks(self, "F")
        last = _ticks(self, self.kinds[-1])
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
        size = (self.num_ticks + 1) * cols
        diff = np.bincount(first * cols + col, minlength=size) - np.bincount(
            (done + 1) * cols + col, minlength=size
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
            if not len(_clashes(micro % size, first, last)[0]):  # no two held at once share a slot
                return size
        return self.num_micro  # a slot per micro-batch

    def stash_slots(self) -> int:
        """The ring-buffer slots a device keeps per stage it holds: the most micro-batches ever
        in flight on one stage (``2 n - 1`` for "1f1b" with ``m >= n``, whatever ``m``)."""
        return max(1, int(self.in_flight(per_stage=True).max(initial=0)))

    def stash_pool(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(size, slot)``: one pool of stashed stage inputs per device, shared by its stages
        (the V tables' stash), and ``slot[kind]``, int32[ticks, n], the pool slot each F slot
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

    def cotangent_pool(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(size, slot)`` as :meth:`stash_pool`, for the output cotangents a table with W slots
        keeps from each B to its W (``slot["B"]`` where B writes, ``slot["W"]`` where W reads):
        the V tables' pool (a ring table keeps a ring of ``n``)."""
        if "W" not in self.kinds:
            raise ValueError(f"The {self.name!r} table has no W slots, so it keeps no cotangents for them.")
        stage, _, _, _ = self._held()
        return self._pool(stage, _ticks(self, "B"), _ticks(self, "W"), ("B", "W"))

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


# --- the rules ---------------------------------------------------------------------------------


def check(s: Schedule) -> None:
    """Refuses a table the tick loop cannot run, naming the first offending slot (see the module
    for the rules). Linear in the table's size (plus a sort of its slots)."""
    _check_fields(s)
    n, m = s.num_devices, s.num_micro
    for k in s.kinds:
        micro, stage = s.micro[k], s.stage[k]
        bad = (micro < -1) | (micro >= m)
        _refuse_cell(s, k, bad, f"names a micro-batch outside 0 .. {m - 1} (`num_micro={m}`)")
        inside = (stage >= 0) & (stage < s.num_stages)
        held = inside & (s.device_of(np.where(inside, stage, 0)) == np.arange(n))
        rule = (
            f"the stages d and {2 * n - 1} - d (`placement='v'`)"
            if s.placement == "v"
            else f"the stages d, d + {n}, ... (`repeats={s.repeats}` of them)"
        )
        _refuse_cell(s, k, ~held, f"names a stage its device does not hold: device d holds {rule}")
    ticks = {k: _ticks(s, k) for k in s.kinds}  # coverage: exactly one slot per (stage, micro)
    for before, after in (("F", "B"), ("B", "W")):
        if after in ticks:
            _refuse_order(s, before, after, ticks[before], ticks[after])
    _check_messages(s, ticks)
    if s.placement == "v":
        _check_v_parity(s, ticks)
    if s.trains:
        _check_stashes(s, ticks)


def _check_fields(s: Schedule) -> None:
    """The fields' types and shapes; converts the tables to read-only int32 arrays."""
    if not isinstance(s.name, str):
        raise TypeError(f"`name` must be a string, but got {type(s.name).__name__} {s.name!r}.")
    for field in ("num_micro", "repeats"):
        object.__setattr__(s, field, checks.count(getattr(s, field), field))
    hop = checks.integer(s.hop)
    if hop not in (0, 1, 2):
        raise ValueError(
            f"`hop` must be 1 (a message takes one tick to the next device), 2 (the next device "
            f"reads it a tick later: sends overlap compute) or 0 (the columns of one device, "
            f"handing on within the tick), but got {s.hop!r}."
        )
    object.__setattr__(s, "hop", hop)
    if s.placement not in ("ring", "v"):
        raise ValueError(
            f"`placement` must be 'ring' (stage j on device j mod D) or 'v' (the V-shaped tables: "
            f"device d holds stages d and 2 D - 1 - d), but got {s.placement!r}."
        )
    if s.placement == "v" and (checks.integer(s.repeats) != 2 or hop == 0):
        raise ValueError(
            f"A V-shaped table (`placement='v'`) holds two stages per device and sends between "
            f"devices, so it needs `repeats=2` and `hop` 1 or 2, but got `repeats={s.repeats!r}` "
            f"and `hop={hop}`."
        )
    if not isinstance(s.micro, Mapping) or not isinstance(s.stage, Mapping):
        raise TypeError("`micro` and `stage` must be dicts from slot kind ('F', 'B', 'W') to int tables.")
    kinds = tuple(s.micro)
    if kinds not in (("F",), ("F", "B"), ("F", "B", "W")) or tuple(s.stage) != kinds:
        raise ValueError(
            f"A table's slot kinds must be ('F',), ('F', 'B') or ('F', 'B', 'W'), in that order, "
            f"the same for `micro` and `stage`, but got {kinds} and {tuple(s.stage)}."
        )
    shape = None
    for field in ("micro", "stage"):
        tables = {}
        for k, a in getattr(s, field).items():
            a = np.asarray(a)
            if a.ndim != 2 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(
                    f"`{field}[{k!r}]` must be a non-empty int table [ticks, devices], but got "
                    f"{a.dtype} of shape {a.shape}."
                )
            if shape is not None and a.shape != shape:
                raise ValueError(f"`{field}[{k!r}]` has shape {a.shape}, but the F table has {shape}.")
            shape = a.shape
            a = a.astype(np.int32)
            a.flags.writeable = False
            tables[k] = a
        object.__setattr__(s, field, tables)
    if "W" in kinds and s.repeats != 1 and s.placement != "v":
        raise ValueError(
            f"The {s.name!r} table has W slots and `repeats={s.repeats}`; on a ring the loop's W "
            "slot runs the device's one stage, so W slots need `repeats=1` (or a V table, "
            "`placement='v'`, whose pools give each W its stage's inputs)."
        )


def _ticks(s: Schedule, kind: str) -> np.ndarray:
    """int[S m]: the tick of the ``kind`` slot of each (stage ``j``, micro-batch ``i``), at
    ``j m + i``; refuses a pair with no such slot or with two."""
    micro, stage = s.micro[kind], s.stage[kind]
    t, d = np.nonzero(micro >= 0)  # row-major: ticks ascending
    key = stage[t, d].astype(np.int64) * s.num_micro + micro[t, d]
    size = s.num_stages * s.num_micro
    count = np.bincount(key, minlength=size)
    if (count > 1).any():
        j, i = divmod(int(np.flatnonzero(count > 1)[0]), s.num_micro)
        at = t[key == j * s.num_micro + i][:2].tolist()
        raise ValueError(
            f"The {s.name!r} table runs the {kind} slot of stage {j} on micro-batch {i} twice, at "
            f"ticks {at[0]} and {at[1]}; each (stage, micro-batch) runs one {kind} slot."
        )
    if (count == 0).any():
        j, i = divmod(int(np.flatnonzero(count == 0)[0]), s.num_micro)
        raise ValueError(
            f"The {s.name!r} table has no {kind} slot for stage {j} (device {s.device_of(j)}) on "
            f"micro-batch {i}; every (stage, micro-batch) needs one of each kind the table has "
            f"({', '.join(s.kinds)})."
        )
    out = np.empty(size, np.int64)
    out[key] = t
    return out


def _refuse_cell(s: Schedule, kind: str, bad: np.ndarray, rule: str) -> None:
    if bad.any():
        t, d = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"The {s.name!r} table's {kind} slot at tick {t} on device {d} (micro-batch "
            f"{s.micro[kind][t, d]}, stage {s.stage[kind][t, d]}) {rule}."
        )


def _refuse_order(s: Schedule, before: str, after: str, t0: np.ndarray, t1: np.ndarray) -> None:
    bad = np.flatnonzero(t1 < t0)
    if len(bad):
        k = bad[np.argmin(t1[bad])]
        j, i = divmod(int(k), s.num_micro)
        raise ValueError(
            f"The {s.name!r} table runs the {after} slot of stage {j} on micro-batch {i} at tick "
            f"{t1[k]}, before its {before} slot (tick {t0[k]}); a {after} slot reads what its "
            f"{before} slot made, so it runs at the same tick (after it) or later."
        )


def _check_messages(s: Schedule, ticks: dict[str, np.ndarray]) -> None:
    """Each message is read the tick it arrives (see the module); a forward table's loop-back may
    wait, the same number of ticks for every micro-batch."""
    S, m, n, hop = s.num_stages, s.num_micro, s.num_devices, s.hop
    if S == 1:
        return
    # stage j + 1 starts the next chunk on device 0 (a ring; a V turns on its device, where the
    # message takes one tick whatever the hop)
    back = ((np.arange(1, S) % n == 0) & (s.placement == "ring"))[:, None]
    gap = np.where((np.arange(1, S) == n) & (s.placement == "v"), 1, hop)[:, None]
    for kind, sign in (("F", 1), ("B", -1)):
        if kind not in ticks:
            continue
        t = ticks[kind].reshape(S, m)
        sent, read = (t[:-1], t[1:]) if sign > 0 else (t[1:], t[:-1])
        wait = read - sent - gap
        delay = int(wait[np.broadcast_to(back, wait.shape)][0]) if back.any() and not s.trains else 0
        bad = np.where(back, wait != delay, wait != 0) if delay else wait != 0
        if delay < 0 or bad.any():
            j, i = (int(x) for x in np.argwhere(bad if bad.any() else wait < 0)[0])
            src, dst = (j, j + 1) if sign > 0 else (j + 1, j)
            arrive = int(sent[j, i]) + int(gap[j, 0])
            late = "a delay line the same for every micro-batch" if not s.trains else "no wait"
            raise ValueError(
                f"The {s.name!r} table runs the {kind} slot of stage {dst} on micro-batch {i} at "
                f"tick {read[j, i]} (device {s.device_of(dst)}), but the message it reads, from the "
                f"{kind} slot of stage {src} (tick {sent[j, i]}, device {s.device_of(src)}), arrives "
                f"at tick {arrive}: "
                f"the loop delivers a message {hop} tick{'s' * (hop != 1)} after it is sent and the "
                f"next slot reads it then ({late} on the loop back to device 0). Run it at tick "
                f"{arrive}."
            )


def _check_v_parity(s: Schedule, ticks: dict[str, np.ndarray]) -> None:
    """A V table's sends follow the tick's parity, so one ``ppermute`` per tick and message kind
    carries every message. ``hop = 1``: a message made at tick ``t`` on device ``d`` goes out
    at once; activations go down the V (to ``d + 1``) and cotangents back (to ``d - 1``) when
    ``t - d`` is even, and the other ways when it is odd (one swap of neighbouring devices: the
    pairs ``(d, d + 1)`` with ``d`` of the tick's parity for activations, of the other parity
    for cotangents). ``hop = 2``: it goes out at the next tick, with every message of its kind
    that tick, all one way (a shift): activations to ``d + 1`` and cotangents to ``d - 1`` when
    made on an even tick, the other ways when made on an odd one."""
    S, m, n = s.num_stages, s.num_micro, s.num_devices
    j = np.arange(S)[:, None]
    # `on`: the message goes to device d + 1 (activations on the way down, cotangents on the way up)
    for kind, src, on in (("F", j[:-1], j[:-1] < n - 1), ("B", j[1:], j[1:] >= n + 1)):
        if S == 2:
            return
        turn = (src == n - 1) if kind == "F" else (src == n)  # stays on its device
        sent = ticks[kind].reshape(S, m)[src[:, 0]]
        device = s.device_of(src)
        even = (sent - (device if s.hop == 1 else 0)) % 2 == 0
        want = on if kind == "F" else ~on  # activations to d + 1, cotangents to d - 1: t - d even
        bad = (even != want) & ~turn
        if bad.any():
            r, i = (int(x) for x in np.argwhere(bad)[0])
            stage, t, d = int(src[r, 0]), int(sent[r, i]), int(device[r, 0])
            to = d + 1 if bool(on[r, 0]) else d - 1
            what = "activation" if kind == "F" else "cotangent"
            if s.hop == 1:
                rule = (
                    f"on a tick where t - d = {t - d} is {'even' if t % 2 == d % 2 else 'odd'}; a V "
                    "table sends activations to device d + 1 and cotangents to d - 1 when t - d is "
                    "even, and the other ways when it is odd, so one swap of neighbours per tick "
                    "carries every message. Move that micro-batch's slots by one tick (e.g. "
                    "micro-batch i entering at tick 2 i)."
                )
            else:
                rule = (
                    f"made on an {'even' if t % 2 == 0 else 'odd'} tick; with `hop=2` a V table "
                    "sends the activations made on an even tick to device d + 1 and the cotangents "
                    "to d - 1 (the other ways from an odd tick), so one shift per tick carries "
                    "every message. Run the way-down slots on even ticks and the way-up slots on "
                    "odd ones (e.g. `pj.v_half_schedule(n, m, hop=2)`)."
                )
            raise ValueError(
                f"The {s.name!r} table's {kind} slot of stage {stage} on micro-batch {i} at tick {t} "
                f"(device {d}) sends its {what} to device {to} {rule}"
            )


def _check_stashes(s: Schedule, ticks: dict[str, np.ndarray]) -> None:
    """Two micro-batches held at once on a stage use different ring slots (see the module)."""
    stage, micro, first, last = s._held()
    if s.placement == "ring":  # (a V's pool gives every held input a free slot: `stash_pool`)
        K = s.stash_slots()
        _refuse_overlap(
            s, stage, micro, first, last, K, f"F's stash ({K} slots per stage: the most in flight)"
        )
    if "W" in ticks and s.placement == "ring":  # (a V's cotangents wait in a pool: `cotangent_pool`)
        b = ticks["B"]
        _refuse_overlap(s, stage, micro, b, ticks["W"], s.num_devices, "the W cotangents' ring")


def _clashes(group, first, last) -> tuple[np.ndarray, np.ndarray]:
    """``(k, order)``: values held from tick ``first`` to ``last`` (both included) in slots
    ``group``, sorted by slot and first tick (``order``); ``k`` where the ``k``-th of them and the
    next share a slot while both are held (a clash with any later one shows between neighbours)."""
    order = np.lexsort((first, group))
    g, f, lt = group[order], first[order], last[order]
    return np.flatnonzero((g[1:] == g[:-1]) & (f[1:] <= lt[:-1])), order


def _refuse_overlap(s, stage, micro, first, last, size, what) -> None:
    group = stage.astype(np.int64) * size + micro % size
    clash, order = _clashes(group, first, last)
    g, f, lt, i = group[order], first[order], last[order], micro[order]
    if len(clash):
        c = clash[np.argmin(f[clash + 1])]
        j = int(g[c] // size)
        raise ValueError(
            f"The {s.name!r} table holds micro-batches {i[c]} and {i[c + 1]} on stage {j} at once "
            f"(ticks {f[c]} .. {lt[c]} and {f[c + 1]} .. {lt[c + 1]}), but they share a slot of "
            f"{what}: slot = micro-batch mod {size}. Run each stage's micro-batches in order."
        )


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
