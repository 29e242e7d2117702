"""The rules a schedule table must keep to run in the engine's tick loop, and :func:`check`, which
refuses a table that breaks one, naming the first offending slot.
:class:`~pipejax._src.schedules.table.Schedule` calls it when it is built, so the same rules hold
for the built-in constructors (:mod:`pipejax._src.schedules.tables`) and for a user's list of
actions (:func:`~pipejax._src.schedules.actions.from_actions`). The rules:

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
  from a ring of ``G`` slots (slot ``i mod G``; ``G`` the most held at once, at least ``D``:
  :meth:`Schedule.cotangent_slots`), likewise. W slots need ``repeats = 1``. A table whose
  devices hold several stages (interleaved 1F1B, a V) shares one pool per device instead
  (:attr:`Schedule.pooled`), each stage input given a slot by the table
  (:meth:`Schedule.stash_pool`): the stages' lifetimes differ (a V's: long on the way down,
  short on the way up), and a ring per stage would hold the longest one on every stage.

Each function takes the table (a ``Schedule``) as ``s``; this module imports none of the
schedule modules.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipejax._src import checks


def check(s) -> None:
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
    ticks = {k: slot_ticks(s, k) for k in s.kinds}  # coverage: exactly one slot per (stage, micro)
    for before, after in (("F", "B"), ("B", "W")):
        if after in ticks:
            _refuse_order(s, before, after, ticks[before], ticks[after])
    _check_messages(s, ticks)
    if s.placement == "v":
        _check_v_parity(s, ticks)
    if s.trains:
        _check_stashes(s, ticks)


def _check_fields(s) -> None:
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


def slot_ticks(s, kind: str) -> np.ndarray:
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


def _refuse_cell(s, kind: str, bad: np.ndarray, rule: str) -> None:
    if bad.any():
        t, d = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"The {s.name!r} table's {kind} slot at tick {t} on device {d} (micro-batch "
            f"{s.micro[kind][t, d]}, stage {s.stage[kind][t, d]}) {rule}."
        )


def _refuse_order(s, before: str, after: str, t0: np.ndarray, t1: np.ndarray) -> None:
    bad = np.flatnonzero(t1 < t0)
    if len(bad):
        k = bad[np.argmin(t1[bad])]
        j, i = divmod(int(k), s.num_micro)
        raise ValueError(
            f"The {s.name!r} table runs the {after} slot of stage {j} on micro-batch {i} at tick "
            f"{t1[k]}, before its {before} slot (tick {t0[k]}); a {after} slot reads what its "
            f"{before} slot made, so it runs at the same tick (after it) or later."
        )


def _check_messages(s, ticks: dict[str, np.ndarray]) -> None:
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


def _check_v_parity(s, ticks: dict[str, np.ndarray]) -> None:
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


def _check_stashes(s, ticks: dict[str, np.ndarray]) -> None:
    """Two micro-batches held at once on a stage use different ring slots (see the module)."""
    stage, micro, first, last = s._held()
    if not s.pooled:  # (a pool gives every held input a free slot: `stash_pool`)
        K = s.stash_slots()
        _refuse_overlap(
            s, stage, micro, first, last, K, f"F's stash ({K} slots per stage: the most in flight)"
        )
    if "W" in ticks and s.placement == "ring":  # (a V's cotangents wait in a pool: `cotangent_pool`)
        G = s.cotangent_slots()  # the ring held apart: checked in order of W, with its message
        _refuse_overlap(s, stage, micro, ticks["B"], ticks["W"], G, f"the W cotangents' ring ({G} slots)")


def clashes(group, first, last) -> tuple[np.ndarray, np.ndarray]:
    """``(k, order)``: values held from tick ``first`` to ``last`` (both included) in slots
    ``group``, sorted by slot and first tick (``order``); ``k`` where the ``k``-th of them and the
    next share a slot while both are held (a clash with any later one shows between neighbours)."""
    order = np.lexsort((first, group))
    g, f, lt = group[order], first[order], last[order]
    return np.flatnonzero((g[1:] == g[:-1]) & (f[1:] <= lt[:-1])), order


def _refuse_overlap(s, stage, micro, first, last, size, what) -> None:
    group = stage.astype(np.int64) * size + micro % size
    clash, order = clashes(group, first, last)
    g, f, lt, i = group[order], first[order], last[order], micro[order]
    if len(clash):
        c = clash[np.argmin(f[clash + 1])]
        j = int(g[c] // size)
        raise ValueError(
            f"The {s.name!r} table holds micro-batches {i[c]} and {i[c + 1]} on stage {j} at once "
            f"(ticks {f[c]} .. {lt[c]} and {f[c + 1]} .. {lt[c + 1]}), but they share a slot of "
            f"{what}: slot = micro-batch mod {size}. Run each stage's micro-batches in order."
        )
