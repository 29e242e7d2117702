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

import numpy as np

from pipejax._src import checks
from pipejax._src.schedules.table import Schedule, _costs

KINDS = ("gpipe", "circular")


def _forward(name: str, micro: np.ndarray, stage: np.ndarray, num_micro: int, repeats: int = 1, hop: int = 1):
    """A forward table (F slots only) through the one constructor and its check."""
    return Schedule(name, {"F": micro}, {"F": stage}, num_micro, repeats, hop)


def _counts(**values) -> list[int]:
    """Each argument as an int >= 1 (the one check of every constructor here), in order."""
    what = {
        "num_stages": "the stages of the model",
        "num_devices": "the devices along the stage axis",
        "num_micro": "the number of micro-batches",
        "repeats": "the stages each device holds",
    }
    return [checks.count(v, name, what=what.get(name, "")) for name, v in values.items()]


def gpipe(num_stages: int, num_micro: int, *, hop: int = 1) -> Schedule:
    """The GPipe fill-drain schedule for ``num_stages`` stages and ``num_micro`` micro-batches
    (``hop``: see :func:`circular`)."""
    num_stages, num_micro = _counts(num_stages=num_stages, num_micro=num_micro)
    return circular(num_stages, num_micro, 1, hop=hop)


def circular(num_devices: int, num_micro: int, repeats: int, *, hop: int = 1) -> Schedule:
    """The circular (interleaved) schedule: ``repeats * num_devices`` stages on ``num_devices``.

    Device ``d`` runs stage ``r * num_devices + d`` on micro-batch ``i`` at tick
    ``r * m' + i + hop * d``, with ``m' = max(num_micro, hop * num_devices)`` slots per round
    (``m' = num_micro`` when ``repeats == 1``, which is GPipe's schedule). ``hop``: the ticks a
    message takes to the next device, 1, or 2 when sends overlap compute (the next device reads
    a message one tick after it arrives, so it travels while both devices compute; every hop of
    the fill then costs a tick more).

    Examples:
      >>> s = circular(2, 2, 2)  # 4 stages on 2 devices, 2 micro-batches
      >>> s.table.T.tolist()  # micro-batch of each device at each tick
      [[0, 1, 0, 1, -1], [-1, 0, 1, 0, 1]]
      >>> s.stage_table.T.tolist()  # device 0 holds stages 0 and 2, device 1 stages 1 and 3
      [[0, 0, 2, 2, 2], [1, 1, 1, 3, 3]]
      >>> s.bubble_fraction(), circular_bubble_fraction(2, 2, 2)
      (0.2, 0.2)
    """
    n, m, v = _counts(num_devices=num_devices, num_micro=num_micro, repeats=repeats)
    hop = _hop(hop)
    slots = m if v == 1 else max(m, hop * n)
    ticks = np.arange(v * slots + hop * (n - 1))[:, None]
    devices = np.arange(n)[None, :]
    k = ticks - hop * devices  # position of the device's work item at this tick
    r, i = np.divmod(np.clip(k, 0, v * slots - 1), slots)
    working = (k >= 0) & (k < v * slots) & (i < m)
    table = np.where(working, i, -1).astype(np.int32)
    stage_table = (r * n + devices).astype(np.int32)  # before: first stage; after: last stage
    return _forward("gpipe" if v == 1 else "circular", table, stage_table, m, v, hop)


def sequential(num_stages: int, num_micro: int) -> Schedule:
    """Every stage on micro-batch ``t`` at tick ``t``: the table of one device running the stages
    in turn, whose columns hand their output to the next column within the tick (``mesh=None``).

    No bubble; ``m`` ticks. (On a mesh a message takes a tick to travel, hence GPipe's skew.)

    >>> s = sequential(3, 2)
    >>> s.table.T.tolist(), s.stages().T.tolist(), s.bubble_fraction()
    ([[0, 1], [0, 1], [0, 1]], [[0, 0], [1, 1], [2, 2]], 0.0)
    """
    num_stages, num_micro = _counts(num_stages=num_stages, num_micro=num_micro)
    table, stage = _in_turn(num_stages, num_micro)
    return _forward("sequential", table, stage, num_micro, hop=0)


def sequential_training(num_stages: int, num_micro: int) -> Schedule:
    """The training table of one device (``mesh=None``): at tick ``t`` the F slots of every stage
    on micro-batch ``t``, then its B slots, the columns handing activations on (and cotangents
    back) within the tick: gradient accumulation, one micro-batch's worth kept at a time.

    >>> s = sequential_training(2, 3)
    >>> s.forward.T.tolist(), s.stash_slots()
    ([[0, 1, 2], [0, 1, 2]], 1)
    """
    num_stages, num_micro = _counts(num_stages=num_stages, num_micro=num_micro)
    table, stage = _in_turn(num_stages, num_micro)
    return Schedule("sequential", {"F": table, "B": table}, {"F": stage, "B": stage}, num_micro, hop=0)


def _in_turn(num_stages: int, num_micro: int) -> tuple[np.ndarray, np.ndarray]:
    """The tables of :func:`sequential`: micro-batch ``t`` on every column (stage) at tick ``t``."""
    shape = (num_micro, num_stages)
    table = np.broadcast_to(np.arange(num_micro, dtype=np.int32)[:, None], shape)
    return table, np.broadcast_to(np.arange(num_stages, dtype=np.int32), shape)


def one_device(num_stages: int, num_micro: int) -> Schedule:
    """Every stage in turn on one device: stage ``t mod S`` of micro-batch ``t // S`` at tick
    ``t`` (``mesh=None`` with stages stacked on a stage axis: one stage function, whose row of
    parameters the tick picks). No bubble; ``m S`` ticks.

    >>> s = one_device(2, 2)
    >>> s.table.T.tolist(), s.stages().T.tolist(), s.num_stages
    ([[0, 0, 1, 1]], [[0, 1, 0, 1]], 2)
    """
    num_stages, num_micro = _counts(num_stages=num_stages, num_micro=num_micro)
    micro, stage = np.divmod(np.arange(num_micro * num_stages, dtype=np.int32), num_stages)
    return _forward("one-device", micro[:, None], stage[:, None], num_micro, num_stages)


def gpipe_bubble_fraction(num_stages: int, num_micro: int) -> float:
    """GPipe's ideal bubble fraction, ``(n - 1) / (m + n - 1)``."""
    num_stages, num_micro = _counts(num_stages=num_stages, num_micro=num_micro)
    return (num_stages - 1) / (num_micro + num_stages - 1)


def circular_bubble_fraction(num_devices: int, num_micro: int, repeats: int) -> float:
    """The circular schedule's bubble fraction, ``(n - 1) / (v m + n - 1)`` for ``m >= n``.

    With fewer micro-batches than devices (and ``v > 1``) the schedule runs ``n`` slots per
    round, so its bubble is ``1 - v m / (v n + n - 1)`` instead, which this returns then; both
    equal :meth:`Schedule.bubble_fraction` of the table.

    Examples:
      >>> import pipejax as pj
      >>> round(pj.circular_bubble_fraction(4, 2, 2), 4)
      0.6364
      >>> round(pj.circular_schedule(4, 2, 2).bubble_fraction(), 4)
      0.6364
    """
    n, m, v = _counts(num_devices=num_devices, num_micro=num_micro, repeats=repeats)
    if m < n and v > 1:
        return 1 - v * m / (v * n + n - 1)
    return (n - 1) / (v * m + n - 1)


# --- schedules that own the backward pass --------------------------------------------------------
#
# 1F1B (PipeDream-flush, Narayanan et al. 2021) and ZB-H1 (Qi et al. 2023) interleave forward and
# backward work of different micro-batches, so they are not the reverse of a forward scan: the
# training program (:mod:`pipejax._src.training.slots`) runs their tables in the engine's loop. A tick of
# a device runs, in this order, at most one forward slot F (its stage on one micro-batch), one
# backward slot B (the stage's vjp: input and parameter cotangents for "1f1b", the input
# cotangent only for "zb-h1") and, for "zb-h1", one weight slot W (the parameter cotangent); then
# activations move one device forward and cotangents one device back. Lockstep SPMD makes a tick
# as long as its slowest device, so the tables give every device one F and one B (and one W) per
# steady-state tick.
#
# Device (= stage) ``s`` of ``n``, micro-batch ``i`` of ``m``:
#
# * F(s, i) at tick ``i + s`` (GPipe's forward skew);
# * B(s, i) at tick ``i + 2 (n - 1) - s``: the last stage runs B right after F in the same tick,
#   and each cotangent reaches the previous device the tick after;
# * "zb-h1" only: W(s, i) at tick ``i + 2 (n - 1)``, i.e. ``s`` ticks after its B. Every device's
#   W runs on the same ticks, so a tick with W on one device has it on all, and the last ``n - 1``
#   ticks (the cool-down, where only B's run in "1f1b" as B+W) carry W's that were deferred there.
#
# ``m + 2 (n - 1)`` ticks. Micro-batches in flight on device ``s`` (input stashed, last use not yet
# run): ``2 (n - s) - 1`` for "1f1b", ``2 n - 1 - s`` for "zb-h1"; at most ``2 n - 1`` whatever
# ``m``. (Megatron's 1F1B keeps ``n - s`` by alternating F and B ticks on each device; in lockstep
# that puts F on half the devices and B on the other half in every tick, so a tick costs
# ``max(F, B)`` for half a unit of work each. This table keeps both slots full instead and pays
# with a deeper stash.)

TRAINING_KINDS = ("1f1b", "zb-h1", "zb-floor", "interleaved-1f1b", "v-half", "zb-v")


def v_half(num_devices: int, num_micro: int, *, hop: int = 1) -> Schedule:
    """The V-shaped 1F1B table: ``2 n`` stages on ``n`` devices, device ``d`` holding stage ``d``
    (the way down) and stage ``2 n - 1 - d`` (the way up), so the first and the last stage sit on
    device 0 and the V turns on device ``n - 1`` without a send (``placement="v"``).

    Micro-batch ``i`` enters stage 0 at tick ``2 i`` and every stage runs its F one tick after
    the previous stage's (stage ``j`` at tick ``2 i + j``), and its B one tick after the next
    stage's B, the last stage's B right after its F (stage ``j`` at ``2 i + 4 n - 2 - j``). A
    device's way-down and way-up slots fall on ticks of opposite parity, so no two collide
    while every message is read the tick it arrives, and a device runs one F and one B per
    tick in the steady state: ``2 m + 4 n - 3`` ticks. A stage is half of a 1F1B stage, so with
    F and B slots of ``f / 2`` and ``b / 2`` the step is 1F1B's, ``(m + n - 1)(f + b)``, and so
    is the bubble (:func:`v_half_bubble_fraction`). What it saves is memory: a device holds at
    most ``2 n`` stage inputs, half a 1F1B stage each, in one pool shared by its two stages
    (:meth:`~pipejax._src.schedules.table.Schedule.stash_pool`), where 1F1B holds ``2 (n - d) -
    1`` whole ones on device ``d`` (``2 n - 1`` on device 0). It is the V-Half schedule of Qi et
    al. ("Pipeline Parallelism with Controllable Memory", 2024) in the loop's lockstep ticks.

    With ``hop = 2`` (sends that overlap compute) a message between devices is read two ticks
    after it was made, the turn's one tick after (it stays on the device): stage ``j`` runs F
    at ``2 i + 2 j`` on the way down and ``2 i + 2 j - 1`` on the way up, and every device's
    way-down slots fall on even ticks, its way-up ones on odd ticks. Then all activations of a
    tick go the same way (to ``d + 1`` when sent on an odd tick), and so do its cotangents (the
    other way): ``2 m + 8 n - 7`` ticks.

    Examples:
      >>> s = v_half(2, 2)
      >>> s.forward.T.tolist()  # micro-batch of each device's F slot at each tick
      [[0, -1, 1, 0, -1, 1, -1, -1, -1], [-1, 0, 0, 1, 1, -1, -1, -1, -1]]
      >>> s.stages("F")[s.forward[:, 0] >= 0, 0].tolist()  # device 0: stage 0 down, stage 3 up
      [0, 0, 3, 3]
      >>> s.in_flight().max(axis=0).tolist(), s.stash_pool()[0]
      ([3, 4], 4)
    """
    return _v_table("v-half", num_devices, num_micro, hop=hop)


def zb_v(num_devices: int, num_micro: int, *, hop: int = 1) -> Schedule:
    """The V-shaped zero-bubble table: :func:`v_half`'s F slots, B slots that compute the input
    cotangent only, and W slots (the parameter cotangent) deferred as ZB-H1 defers them: the W
    of micro-batch ``i`` runs at tick ``2 i + 4 n - 2`` on the way-down stage of every device
    and at ``2 i + 4 n - 3`` on the way-up one, the tick of (or after) the last B of ``i`` on
    the device, so the drain's ticks carry the W's that 1F1B's B slots would hold.

    Same ticks as V-Half (``2 m + 4 n - 3``); with F, B and W slots of ``f / 2``, ``b / 2`` and
    ``w / 2`` the step is ZB-H1's, ``(m + n - 1)(f + b) + m w`` (its bubble,
    :func:`zb_h1_bubble_fraction`). A device keeps each stage input from its F to its W: about
    ``3 n`` half stages, where ZB-H1 keeps up to ``2 n - 1`` whole ones; and about ``n`` output
    cotangents from B to W (ZB-H1: a ring of ``n``), both in pools shared by the two stages
    (:meth:`~pipejax._src.schedules.table.Schedule.stash_pool`, ``cotangent_pool``). The
    published ZB-V (Qi et al. 2024) reaches about zero bubble with F = B = W by running
    several F slots back to back on device 0 in the fill; in lockstep ticks, where every
    message is read the tick it arrives, the fill stays 1F1B's. ``hop = 2``: as
    :func:`v_half`'s, the W slots at the tick of (way down) and before (way up) stage 0's B.

    Examples:
      >>> s = zb_v(4, 8)
      >>> s.num_ticks, s.stash_pool()[0], s.cotangent_pool()[0]
      (29, 11, 4)
      >>> s.bubble_fraction(0.5, 0.5, 0.5) == zb_h1_bubble_fraction(4, 8, 1.0, 1.0, 1.0)
      True
    """
    return _v_table("zb-v", num_devices, num_micro, weights=True, hop=hop)


def _v_table(name: str, num_devices: int, num_micro: int, weights: bool = False, hop: int = 1) -> Schedule:
    """The V tables, device ``j`` or ``2 n - 1 - j`` running stage ``j``: F at ``2 i + h j``,
    less ``h - 1`` on the way up (``h = hop``; the turn takes one tick), the last stage's B right
    after its F, every other B ``h`` ticks after the next stage's (the turn: one), and
    (``weights``) W at the tick of stage 0's B (way down) or the one before (way up): for
    ``hop = 1``, B at ``2 i + 4 n - 2 - j`` and W at ``2 i + 4 n - 2`` or ``2 i + 4 n - 3``."""
    n, m = _counts(num_devices=num_devices, num_micro=num_micro)
    hop = _hop(hop)
    S, j = 2 * n, np.arange(2 * n)
    up = (j >= n).astype(np.int64)
    f = hop * j - (hop - 1) * up  # micro-batch 0's ticks
    b = f[-1] + hop * (S - 1 - j) - (hop - 1) * (1 - up)
    w = b[0] - up
    ticks = 2 * (m - 1) + int(b[0]) + 1
    device = np.where(j < n, j, S - 1 - j)
    kinds = ("F", "B", "W") if weights else ("F", "B")
    micro = {k: np.full((ticks, n), -1, np.int32) for k in kinds}
    stage = {k: np.broadcast_to(np.arange(n, dtype=np.int32), (ticks, n)).copy() for k in kinds}
    for i in range(m):
        for kind, when in (("F", f), ("B", b), ("W", w))[: len(kinds)]:
            micro[kind][2 * i + when, device] = i
            stage[kind][2 * i + when, device] = j
    return Schedule(name, micro, stage, m, repeats=2, hop=hop, placement="v")


def v_half_bubble_fraction(num_devices: int, num_micro: int) -> float:
    """:func:`v_half`'s lockstep bubble, ``(n - 1) / (m + n - 1)`` for any F and B costs (the
    same for every stage): 1F1B's and GPipe's. Each device idles ``2 n - 2`` F slots in the
    fill and as many B slots in the drain, of ``2 (m + n - 1)`` of each, and the ``2 m + 4 n -
    3`` ticks cost ``(m + n - 1)(f + b)`` with F and B slots of ``f / 2`` and ``b / 2``.

    Examples:
      >>> round(v_half_bubble_fraction(4, 8), 4), round(v_half(4, 8).bubble_fraction(1.0, 2.0), 4)
      (0.2727, 0.2727)
    """
    n, m = _counts(num_devices=num_devices, num_micro=num_micro)
    return (n - 1) / (m + n - 1)


TrainingSchedule = Schedule  # the one table type; the name of the training tables' type before it


def one_f_one_b(num_stages: int, num_micro: int, *, hop: int = 1) -> Schedule:
    """The lockstep 1F1B table: F(s, i) at tick ``i + s``, B(s, i) at tick ``i + 2 (n - 1) - s``
    (with ``hop = 2``, sends that overlap compute: ``i + 2 s`` and ``i + 4 (n - 1) - 2 s``).

    Examples:
      >>> s = one_f_one_b(2, 3)
      >>> s.forward.T.tolist(), s.backward.T.tolist()
      ([[0, 1, 2, -1, -1], [-1, 0, 1, 2, -1]], [[-1, -1, 0, 1, 2], [-1, 0, 1, 2, -1]])
      >>> s.in_flight().max(axis=0).tolist(), s.stash_slots()
      ([3, 1], 3)
      >>> s.bubble_fraction(1.0, 2.0), gpipe_bubble_fraction(2, 3)
      (0.25, 0.25)
    """
    return _training_table("1f1b", num_stages, num_micro, hop)


def zb_h1(num_stages: int, num_micro: int, *, hop: int = 1) -> Schedule:
    """The lockstep ZB-H1 table: F and B as :func:`one_f_one_b` (B the input cotangent only),
    W(s, i) at tick ``i + 2 (n - 1)``, ``s`` ticks after its B (also with ``hop = 2``).

    Examples:
      >>> s = zb_h1(2, 3)
      >>> s.weight.T.tolist()
      [[-1, -1, 0, 1, 2], [-1, -1, 0, 1, 2]]
      >>> s.bubble_fraction(1.0, 1.0, 1.0), zb_h1_bubble_fraction(2, 3, 1.0, 1.0, 1.0)
      (0.181..., 0.181...)
    """
    return _training_table("zb-h1", num_stages, num_micro, hop)


def interleaved_one_f_one_b(num_devices: int, num_micro: int, repeats: int, *, hop: int = 1) -> Schedule:
    """Interleaved 1F1B (Megatron's virtual stages) in lockstep: ``S = v n`` stages on ``n``.

    Device ``d`` holds stages ``d, d + n, ..., d + (v - 1) n``. Micro-batches go in groups of
    ``n``: micro-batch ``i = g n + k`` starts at ``base(i) = g n v + k``, and its F on stage
    ``j`` runs at tick ``base(i) + j`` and its B at ``base(i) + 2 (S - 1) - j``, so an activation
    leaving device ``n - 1`` enters device 0 for its next round at the next tick (the ring), and
    every device has at most one F and one B per tick. Needs ``m`` a multiple of ``n``. With
    ``v = 1`` it is :func:`one_f_one_b`. With ``hop = 2`` (sends that overlap compute) a hop
    takes two ticks and the groups hold ``2 n`` micro-batches: ``base(i) = 2 g n v + k`` for
    ``i = 2 g n + k``, F at ``base(i) + 2 j`` and B at ``base(i) + 4 (S - 1) - 2 j``.

    Examples:
      >>> s = interleaved_one_f_one_b(2, 2, 2)  # 4 stages on 2 devices
      >>> s.forward.T.tolist()[0], s.forward_stage.T.tolist()[0]  # device 0: micro-batch, stage
      ([0, 1, 0, 1, -1, -1, -1, -1], [0, 0, 2, 2, 0, 0, 0, 0])
      >>> s.slots()["F"].tolist(), s.stash_slots()
      ([4, 4], 2)
    """
    n, m, v = _counts(num_devices=num_devices, num_micro=num_micro, repeats=repeats)
    hop = _hop(hop)
    g = hop * n  # micro-batches per group
    if m % g:
        up = -(-m // g) * g
        near = sorted({c for c in (up - g, up) if c > 0}, key=lambda c: (abs(c - m), c))
        fix = " or ".join(f"`num_micro={c}`" for c in near)
        size = f"`num_devices={n}`" if hop == 1 else f"{hop} x `num_devices={n}` (`hop={hop}`)"
        raise ValueError(
            f"Interleaved 1F1B sends micro-batches round the {n} devices in groups of {g}, so "
            f"`num_micro` must be a multiple of {size}, but got {m}. Use {fix}."
        )
    S = n * v
    i = np.arange(m)
    base = (i // g) * g * v + i % g
    ticks = int(base[-1]) + 2 * hop * (S - 1) + 1
    forward, backward = (np.full((ticks, n), -1, np.int32) for _ in range(2))
    fstage = np.broadcast_to(np.arange(n, dtype=np.int32), (ticks, n)).copy()
    bstage = fstage.copy()
    j, k = np.arange(S)[:, None], np.arange(m)[None, :]  # every (stage, micro-batch) at once
    d = np.broadcast_to(j % n, (S, m))
    tf, tb = base[None, :] + hop * j, base[None, :] + hop * (2 * (S - 1) - j)
    for t in (tf, tb):  # at most one F and one B per device and tick
        assert np.bincount((t * n + d).ravel(), minlength=ticks * n).max() <= 1
    forward[tf, d], fstage[tf, d] = k, j
    backward[tb, d], bstage[tb, d] = k, j
    micro, stage = {"F": forward, "B": backward}, {"F": fstage, "B": bstage}
    return Schedule("interleaved-1f1b", micro, stage, m, v, hop)


def training(name: str, num_stages: int, num_micro: int, repeats: int = 1, *, hop: int = 1) -> Schedule:
    """The table of schedule ``name`` (one of :data:`TRAINING_KINDS`) for ``num_stages`` stages
    (``num_stages / repeats`` devices for "interleaved-1f1b"), messages taking ``hop`` ticks."""
    if name not in TRAINING_KINDS:
        kinds = ", ".join(repr(k) for k in TRAINING_KINDS)
        raise ValueError(f"`name` must be one of {kinds}, but got {name!r}.")
    num_stages, num_micro, repeats = _counts(num_stages=num_stages, num_micro=num_micro, repeats=repeats)
    if name in ("v-half", "zb-v") and repeats != 2:
        raise ValueError(
            f"{name!r} holds two stages per device, so it needs `repeats=2`, but got `repeats={repeats}`."
        )
    if name not in ("interleaved-1f1b", "v-half", "zb-v") and repeats != 1:
        raise ValueError(
            f"`repeats={repeats}` needs `name='interleaved-1f1b'`; {name!r} runs one stage per device."
        )
    if num_stages % repeats:
        raise ValueError(
            f"`num_stages={num_stages}` must be a multiple of `repeats={repeats}` (each device "
            f"holds {repeats} stages); use {repeats * max(1, round(num_stages / repeats))} stages "
            "or change `repeats`."
        )
    if name == "interleaved-1f1b":
        return interleaved_one_f_one_b(num_stages // repeats, num_micro, repeats, hop=hop)
    if name in ("v-half", "zb-v"):
        return _v_table(name, num_stages // 2, num_micro, weights=name == "zb-v", hop=hop)
    if name == "zb-floor":
        return zb_floor(num_stages, num_micro, hop=hop)
    return _training_table(name, num_stages, num_micro, hop)


def _hop(hop) -> int:
    """``hop`` checked: 1 (a message is read the tick it arrives) or 2 (a tick later: sends
    overlap compute)."""
    h = checks.integer(hop)
    if h not in (1, 2):
        raise ValueError(
            f"`hop` must be 1 (the next device reads a message the tick it arrives) or 2 (a tick "
            f"later, so the send overlaps compute), but got {hop!r}."
        )
    return h


def _training_table(name, n, m, hop=1) -> Schedule:
    assert name in ("1f1b", "zb-h1"), name
    n, m = _counts(num_stages=n, num_micro=m)
    h = _hop(hop)
    ticks = m + 2 * h * (n - 1)
    t = np.arange(ticks)[:, None]
    s = np.arange(n)[None, :]

    def slot(offset):
        i = t - offset
        return np.where((i >= 0) & (i < m), i, -1).astype(np.int32)

    micro = {"F": slot(h * s), "B": slot(h * (2 * (n - 1) - s))}
    if name == "zb-h1":  # W s ticks after its B: a ring of n output cotangents holds it
        micro["W"] = slot(h * (2 * (n - 1) - s) + s)
    stage = np.broadcast_to(np.arange(n, dtype=np.int32), (ticks, n))
    return Schedule(name, micro, dict.fromkeys(micro, stage), m, hop=h)


def zb_floor(num_stages: int, num_micro: int, *, hop: int = 1) -> Schedule:
    """ZB-H1's F and B slots with the W slots of the last ``2 (n - 1)`` micro-batches moved into
    the drain: the step of ZB-H1 at the floor of one synchronous step.

    With one stage per device and F = B = W, no table runs a step in fewer than ``3 m + n - 1``
    slot times: the last device starts after the ``n - 1`` before it
    (``docs/decisions/0034-no-zb-h2.md``). ZB-H1 runs ``3 m + 2 (n - 1)``: its drain runs each
    W the tick after its B on every device, so each drain tick lasts a B and a W while the
    devices that have finished wait. Here micro-batch ``i < m - 2 (n - 1)`` keeps ZB-H1's W,
    and each device runs the W slots of the others in order, each in the first tick at or after
    its B where the device runs less than the busiest device's F and B, else one a tick after
    its last B. For ``m >= 2 (n - 1)`` the step is ``3 m + n - 1`` (``hop = 1``, F = B = W), and
    never longer than ZB-H1's where W costs at most F + B (``hop = 2``, sends that overlap
    compute: at most B). It keeps ZB-H1's stage inputs (``2 n - 1``
    at most) and ``2 n - 2`` output cotangents where ZB-H1 keeps ``n``
    (:meth:`~pipejax._src.schedules.table.Schedule.cotangent_slots`). For ``m < 2 (n - 1)`` it
    is ZB-H1's table.

    Examples:
      >>> zb_floor(4, 8).step_time(1, 1, 1), zb_h1(4, 8).step_time(1, 1, 1)
      (27.0, 30.0)
      >>> zb_floor(4, 8).stash_slots(), zb_floor(4, 8).cotangent_slots()
      (7, 6)
    """
    base = _training_table("zb-h1", num_stages, num_micro, hop)
    n, m, h = base.num_devices, base.num_micro, base.hop
    f, b = base.micro["F"], base.micro["B"]
    busy = (f >= 0).astype(int) + (b >= 0)  # each device's F and B slots per tick
    busiest = busy.max(axis=1)
    # these micro-batches keep ZB-H1's W (all of them when m < 2 (n - 1): the table is ZB-H1's)
    keep = m - 2 * (n - 1) if m >= 2 * (n - 1) else m
    w_tick = {}
    for d in range(n):
        b_tick = {int(i): t for t, i in enumerate(b[:, d]) if i >= 0}
        zb = {int(i): t for t, i in enumerate(base.micro["W"][:, d]) if i >= 0}
        w_tick.update({(d, i): zb[i] for i in range(keep)})
        t = zb[keep - 1] if keep else -1
        for i in range(keep, m):
            t = max(t + 1, b_tick[i])
            while t < len(busy) and not busy[t, d] < busiest[t] and t <= b_tick[m - 1]:
                t += 1
            w_tick[d, i] = t
    ticks = max(base.num_ticks, max(w_tick.values()) + 1)

    def grown(a, fill):
        return np.concatenate([a, np.full((ticks - len(a), n), fill, a.dtype)])

    micro = {k: grown(base.micro[k], -1) for k in ("F", "B")}
    micro["W"] = np.full((ticks, n), -1, np.int32)
    for (d, i), t in w_tick.items():
        micro["W"][t, d] = i
    stage = np.broadcast_to(np.arange(n, dtype=np.int32), (ticks, n))
    return Schedule("zb-floor", micro, dict.fromkeys(micro, stage), m, hop=h)


def zb_h1_bubble_fraction(num_stages: int, num_micro: int, f: float, b: float, w: float) -> float:
    """ZB-H1's lockstep bubble for ``m >= n``: ``(n - 1)(f + b) / ((m + n - 1)(f + b) + m w)``.

    The fill and drain cost ``(n - 1)(f + b)`` as in 1F1B, whose bubble (with ``b`` its whole
    backward) is GPipe's ``(n - 1) / (m + n - 1)``; the ``n - 1`` deferred W's of each device run
    in the drain, where they cost nothing extra.
    """
    n, m = _counts(num_stages=num_stages, num_micro=num_micro)
    if any(np.ndim(c) for c in (f, b, w)):
        raise ValueError(f"`f`, `b` and `w` must be numbers here, but got {f!r:.40}, {b!r:.40}, {w!r:.40}.")
    costs = _costs(1, f=f, b=b, w=w)
    f, b, w = (float(costs[k][0]) for k in ("F", "B", "W"))
    return (n - 1) * (f + b) / ((m + n - 1) * (f + b) + m * w)
