"""The one table type: every built-in table and a user's list of actions go through the same
constructor and check, each refusal naming its first offending slot, and a user's table runs in
the pipeline as the built-in ones do (a table equal to 1F1B's gives 1F1B's program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from pipejax._src.schedules import tables as sched


def _actions(t: pj.Schedule) -> list[tuple]:
    """A table's slots as actions ``(device, tick, kind, micro, chunk)``."""
    n = t.num_devices
    return [
        (int(d), int(tick), k, int(t.micro[k][tick, d]), int(t.stage[k][tick, d]) // n)
        for k in t.kinds
        for tick, d in zip(*np.nonzero(t.micro[k] >= 0), strict=True)
    ]


BUILT_IN = [
    pj.one_f_one_b_schedule(4, 8),
    pj.zb_h1_schedule(3, 5),
    pj.zb_floor_schedule(4, 8),
    pj.zb_floor_schedule(3, 7, hop=2),
    pj.interleaved_one_f_one_b_schedule(2, 4, 3),
    pj.one_f_one_b_schedule(1, 3),
]


@pytest.mark.parametrize("t", BUILT_IN, ids=lambda t: t.name)
def test_actions_rebuild_every_training_table(t):
    u = pj.schedule_from_actions(
        _actions(t), num_devices=t.num_devices, num_micro=t.num_micro, repeats=t.repeats, hop=t.hop
    )
    assert u.kinds == t.kinds and u.num_ticks == t.num_ticks and u.stash_slots() == t.stash_slots()
    for k in t.kinds:
        np.testing.assert_array_equal(u.micro[k], t.micro[k])
        np.testing.assert_array_equal(u.stage[k], t.stage[k])


@pytest.mark.parametrize(
    ("n", "m", "name", "hop"),
    [
        (1, 2, "v-half", 1), (2, 3, "zb-v", 1), (4, 8, "v-half", 1), (4, 8, "zb-v", 1),
        (3, 5, "v-half", 2), (4, 8, "zb-v", 2),
    ],
)  # fmt: skip
def test_actions_rebuild_the_v_table(n, m, name, hop):
    t = (pj.v_half_schedule if name == "v-half" else pj.zb_v_schedule)(n, m, hop=hop)
    u = pj.schedule_from_actions(_actions(t), num_devices=n, num_micro=m, repeats=2, placement="v", hop=hop)
    assert u.placement == "v" and u.hop == hop and u.stash_pool()[0] == t.stash_pool()[0]
    for k in t.kinds:
        np.testing.assert_array_equal(u.micro[k], t.micro[k])
        np.testing.assert_array_equal(u.stage[k], t.stage[k])


def test_v_tables_are_checked_by_the_same_rules():
    t = pj.v_half_schedule(2, 3)
    with pytest.raises(
        ValueError, match=r"names a stage its device does not hold: device d holds the stages d and 3 - d"
    ):
        t.replace(stage={k: (t.stage[k] + 2) % 4 for k in t.kinds})
    with pytest.raises(
        ValueError, match=r"needs `repeats=2` and `hop` 1 or 2, but got `repeats=2` and `hop=0`"
    ):
        t.replace(hop=0)
    with pytest.raises(ValueError, match=r"arrives at tick 2: the loop delivers a message 2 ticks after"):
        t.replace(hop=2)  # the one-tick table's messages read a tick early
    # hop 2: every slot a tick later (an idle first tick) keeps the hops but sends each message
    # on a tick of the wrong parity
    two = pj.v_half_schedule(2, 3, hop=2)
    late = lambda tables: {k: np.concatenate([np.full_like(a[:1], -1), a]) for k, a in tables.items()}
    stages = {k: np.concatenate([a[:1], a]) for k, a in two.stage.items()}
    with pytest.raises(
        ValueError, match=r"made on an odd tick; with `hop=2` a V table sends the activations made on an even"
    ):
        two.replace(micro=late(two.micro), stage=stages)
    with pytest.raises(ValueError, match=r"`placement` must be 'ring' .* or 'v'"):
        t.replace(placement="u")
    with pytest.raises(
        ValueError, match=r"names a stage its device does not hold: device d holds the stages d, d \+ 2"
    ):
        t.replace(placement="ring")  # the V's stages 2 and 3 are on devices 1 and 0
    late = [(d, tick + 1, k, i, c) for d, tick, k, i, c in _actions(pj.v_half_schedule(2, 1))]
    with pytest.raises(
        ValueError,
        match=r"stage 0 on micro-batch 0 at tick 1 \(device 0\) sends its activation to device 1 on a "
        r"tick where t - d = 1 is odd",
    ):
        pj.schedule_from_actions(late, num_devices=2, num_micro=1, repeats=2, placement="v")
    with pytest.raises(ValueError, match=r"needs `repeats=2`.*but got `repeats=1`"):
        pj.schedule_from_actions([(0, 0, "F", 0), (0, 0, "B", 0)], num_devices=1, num_micro=1, placement="v")


def test_one_type_for_forward_and_training_tables():
    g, o = pj.gpipe_schedule(3, 4), pj.one_f_one_b_schedule(3, 4)
    assert type(g) is type(o) is pj.Schedule is pj.TrainingSchedule
    assert (g.kinds, g.trains, o.kinds, o.trains) == (("F",), False, ("F", "B"), True)
    assert g.fill_ticks == 3 and g.bubble_fraction() == pytest.approx(pj.gpipe_bubble_fraction(3, 4))
    with pytest.raises(ValueError, match="'gpipe' table is a forward table"):
        g.stash_slots()
    with pytest.raises(ValueError, match=r"`kind` must be one of the table's slot kinds \('F',\)"):
        g.stages("B")


def _one(n=2, m=2):
    return _actions(pj.one_f_one_b_schedule(n, m))


def _build(actions, n=2, m=2, **kw):
    return pj.schedule_from_actions(actions, num_devices=n, num_micro=m, **kw)


def _move(actions, old, new):
    return [new if a == old else a for a in actions]


# one case per rule: (actions, num_devices, repeats, the start of the message naming the slot)
INVALID = {
    "B before its F": (
        [(0, 1, "F", 0), (0, 0, "B", 0)],
        1,
        1,
        r"runs the B slot of stage 0 on micro-batch 0 at tick 0, before its F slot \(tick 1\)",
    ),
    "W before its B": (
        [(0, 0, "F", 0), (0, 1, "B", 0), (0, 0, "W", 0)],
        1,
        1,
        r"runs the W slot of stage 0 on micro-batch 0 at tick 0, before its B slot \(tick 1\)",
    ),
    "message read before it arrives": (
        _move(_one(), (1, 1, "F", 0, 0), (1, 0, "F", 0, 0)),
        2,
        1,
        r"runs the F slot of stage 1 on micro-batch 0 at tick 0 \(device 1\), but the message it "
        r"reads, from the F slot of stage 0 \(tick 0, device 0\), arrives at tick 1",
    ),
    "message read late": (
        _move(_one(), (0, 3, "B", 1, 0), (0, 4, "B", 1, 0)),
        2,
        1,
        r"runs the B slot of stage 0 on micro-batch 1 at tick 4 \(device 0\), but the message it "
        r"reads, from the B slot of stage 1 \(tick 2, device 1\), arrives at tick 3",
    ),
    "two slots of a kind in one tick": (
        [*_one(), (0, 0, "F", 1)],
        2,
        1,
        r"gives device 0 a second F slot at tick 0 .* a device runs at most one F, one B and one W",
    ),
    "a micro-batch missing": (
        [a for a in _one() if a[3] == 0] + [(0, 5, "F", 1)],
        2,
        1,
        r"has no F slot for stage 1 \(device 1\) on micro-batch 1",
    ),
    "a chunk missing": (
        [(0, 0, "F", 0, 0), (0, 1, "B", 0, 0)],
        1,
        2,
        r"has no F slot for stage 1 \(device 0\) on micro-batch 0",
    ),
    "a chunk the device does not hold": (
        [(0, 0, "F", 0, 2)],
        1,
        1,
        r"the chunk must be an int in 0 \.\. 0 \(`repeats=1`\), but got 2",
    ),
    "stash slots shared": (
        # micro-batch 1 goes first while 0 and 2 (slot 0 of 2 both) are held
        [(0, 0, "F", 0), (0, 1, "F", 1), (0, 2, "B", 1), (0, 3, "F", 2), (0, 4, "B", 2), (0, 5, "B", 0)],
        1,
        1,
        r"holds micro-batches 0 and 2 on stage 0 at once \(ticks 0 \.\. 5 and 3 \.\. 4\), but they "
        r"share a slot of F's stash \(2 slots per stage",
    ),
    "W slots with chunks": (
        [(0, 0, "F", 0, 0), (0, 1, "F", 0, 1), (0, 1, "B", 0, 1), (0, 2, "B", 0, 0), (0, 3, "W", 0, 0)],
        1,
        2,
        r"has W slots and `repeats=2`",
    ),
    "no B slots": ([(0, 0, "F", 0)], 1, 1, r"must hold F and B slots"),
    "a kind that is none": ([(0, 0, "X", 0)], 1, 1, r"the kind must be 'F', 'B' or 'W', but got 'X'"),
    "not a tuple": (["0F0"], 1, 1, r"must be a tuple \(device, tick, kind, micro\[, chunk\]\)"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_each_invalid_table_gets_its_error(case):
    actions, n, repeats, msg = INVALID[case]
    m = 1 + max((a[3] for a in actions if isinstance(a, tuple)), default=0)
    with pytest.raises((ValueError, TypeError), match=msg):
        _build(actions, n=n, m=m, repeats=repeats)


def test_built_in_tables_are_checked_by_the_same_rules():
    t = pj.one_f_one_b_schedule(2, 3)
    late = {**t.micro, "B": np.where(t.backward == 1, -1, t.backward)}
    with pytest.raises(
        ValueError, match=r"'1f1b' table has no B slot for stage 0 \(device 0\) on micro-batch 1"
    ):
        t.replace(micro=late)
    with pytest.raises(ValueError, match=r"names a stage its device does not hold"):
        t.replace(stage={"F": t.stages("F") + 1, "B": t.stages("B")})
    with pytest.raises(ValueError, match="`hop` must be 1"):
        t.replace(hop=3)
    with pytest.raises(ValueError, match=r"arrives at tick 2: the loop delivers a message 2 ticks after"):
        t.replace(hop=2)
    # the circular table's loop-back waits in its delay line: allowed for forward tables only
    assert sched.circular(2, 6, 2).num_ticks == 2 * 6 + 1


def test_check_is_linear_enough_for_long_tables():
    t = pj.one_f_one_b_schedule(4, 100_000)  # built and checked in well under a second
    assert t.stash_slots() == 7


# --- user tables in the pipeline -------------------------------------------------------------------


def _stage(p, x, key=None):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def _loss(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def _problem(n):
    k = jax.random.split(jax.random.key(0), 2 * n + 2)
    params = [
        {"w": jax.random.normal(k[2 * s], (3, 3)) * 0.7, "b": jax.random.normal(k[2 * s + 1], (3,))}
        for s in range(n)
    ]
    return params, jax.random.normal(k[-2], (8, 3)), jax.random.normal(k[-1], (8, 3))


def user_1f1b(num_devices, num_micro):
    """1F1B written as a list of actions."""
    t = pj.one_f_one_b_schedule(num_devices, num_micro)
    return pj.schedule_from_actions(
        _actions(t), num_devices=num_devices, num_micro=num_micro, name="user-1f1b"
    )


def all_f_then_all_b(num_devices, num_micro):
    """GPipe's order as a training table: every F, then every B (the stash holds all m)."""
    n, m = num_devices, num_micro
    f = [(s, i + s, "F", i) for s in range(n) for i in range(m)]
    start = m + n - 1
    b = [(s, start + i + (n - 1 - s), "B", i) for s in range(n) for i in range(m)]
    return pj.schedule_from_actions(f + b, num_devices=n, num_micro=m, name="f-then-b")


def test_zb_floor_reaches_the_floor_of_one_step():
    """ZB-floor (`"zb-floor"`): ZB-H1's F and B slots with the last 2 (n - 1) W slots of each device moved
    into the drain. With F = B = W its lockstep step is 3 m + n - 1 slot times (the last device
    starts after the n - 1 before it: no table of one step does better), against ZB-H1's
    3 m + 2 (n - 1); it is never longer than ZB-H1's where W costs at most F + B (hop 2: at
    most B), keeps ZB-H1's stage inputs and 2 n - 2 cotangents for W; below m = 2 (n - 1) it is
    ZB-H1's table."""
    costs = [(f, b, w) for f in (0.5, 1, 2) for b in (0.5, 1, 2) for w in (0.25, 0.5, 1, 2, 3)]
    for n in (1, 2, 3, 4, 8):
        for m in range(1, 3 * n + 2):
            for hop in (1, 2):
                t, zb = pj.zb_floor_schedule(n, m, hop=hop), pj.zb_h1_schedule(n, m, hop=hop)
                assert t.kinds == ("F", "B", "W") and t.name == "zb-floor"
                for k in ("F", "B"):  # ZB-H1's F and B slots, the drain longer
                    np.testing.assert_array_equal(t.micro[k][: zb.num_ticks], zb.micro[k])
                    assert (t.micro[k][zb.num_ticks :] < 0).all()
                assert t.stash_slots() == zb.stash_slots()
                if m < 2 * (n - 1):
                    assert t == zb.replace(name="zb-floor")
                    continue
                assert t.cotangent_slots() == max(n, 2 * n - 2)
                for f, b, w in costs:
                    if w <= (f + b if hop == 1 else b):
                        assert t.step_time(f, b, w) <= zb.step_time(f, b, w) + 1e-12, (n, m, hop, f, b, w)
                if hop == 1:
                    assert t.step_time(1, 1, 1) == 3 * m + n - 1
                    assert zb.step_time(1, 1, 1) == 3 * m + 2 * (n - 1)
    assert pj.zb_h1_schedule(4, 8).cotangent_slots() == 4  # ZB-H1's ring of n, as before


def test_a_user_table_equal_to_1f1b_gives_1f1b_program():
    mesh = jax.make_mesh((4,), ("stage",))
    params, x, t = _problem(4)
    runs = {}
    for schedule in ("1f1b", user_1f1b):
        pipe = pj.pipeline([_stage] * 4, chunks=4, mesh=mesh, schedule=schedule)
        step = jax.jit(pipe.value_and_grad(_loss))
        runs[pipe.schedule_name] = (step.lower(params, x, t).as_text(), step(params, x, t))
    (text, got), (text_user, got_user) = runs["1f1b"], runs["user_1f1b"]
    assert text == text_user
    jax.tree.map(np.testing.assert_array_equal, got, got_user)


def user_v(num_devices, num_micro):
    """V-Half written as a list of actions: chunk 1 of device d is stage 2 n - 1 - d."""
    t = pj.v_half_schedule(num_devices, num_micro)
    return pj.schedule_from_actions(
        _actions(t), num_devices=num_devices, num_micro=num_micro, repeats=2, name="user-v", placement="v"
    )


def test_a_user_v_table_gives_v_half_program():
    mesh = jax.make_mesh((2,), ("stage",))
    params, x, t = _problem(4)
    runs = {}
    for schedule, repeats in (("v-half", 1), (user_v, 2)):  # v-half: 2 stages per device anyway
        pipe = pj.pipeline([_stage] * 4, chunks=4, mesh=mesh, schedule=schedule, repeats=repeats)
        step = jax.jit(pipe.value_and_grad(_loss))
        runs[pipe.schedule_name] = (step.lower(params, x, t).as_text(), step(params, x, t))
    (text, got), (text_user, got_user) = runs["v-half"], runs["user_v"]
    assert text == text_user
    jax.tree.map(np.testing.assert_array_equal, got, got_user)


def test_v_half_refuses_what_it_cannot_run():
    mesh = jax.make_mesh((2,), ("stage",))
    assert pj.pipeline([_stage] * 4, mesh=mesh, schedule="v-half", overlap=True).schedule(8).hop == 2
    with pytest.raises(ValueError, match=r"so `repeats` is 2, but got `repeats=3`"):
        pj.pipeline([_stage] * 6, schedule="v-half", repeats=3)
    with pytest.raises(ValueError, match=r"The 'v-half' schedule with `repeats=2` needs a number of stages"):
        pj.pipeline([_stage] * 3, schedule="v-half")
    with pytest.raises(ValueError, match=r"`mesh` axis 'stage' has size 2, but .* 6 stages"):
        pj.pipeline([_stage] * 6, mesh=mesh, schedule="v-half")


def test_a_user_table_trains_as_gpipe_and_is_checked_for_its_shape():
    mesh = jax.make_mesh((4,), ("stage",))
    params, x, t = _problem(4)
    pipe = pj.pipeline([_stage] * 4, chunks=4, mesh=mesh, schedule=all_f_then_all_b)
    assert pipe.schedule(8).stash_slots() == 4 and pipe.checkpoint == "always"
    loss, grads = jax.jit(pipe.value_and_grad(_loss))(params, x, t)
    gpipe = pj.pipeline([_stage] * 4, chunks=4, mesh=mesh)
    want_loss, want = jax.jit(jax.value_and_grad(lambda p: _loss(gpipe(p, x), t).mean()))(params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, want)
    wrong = pj.pipeline([_stage] * 4, chunks=4, mesh=mesh, schedule=lambda n, m: user_1f1b(n, m + 1))
    with pytest.raises(ValueError, match=r"returned one for 4 devices, `num_micro=5`"):
        wrong.value_and_grad(_loss)(params, x, t)
    with pytest.raises(TypeError, match=r"must return a training table .* returned Schedule"):
        pj.pipeline([_stage] * 4, chunks=4, mesh=mesh, schedule=pj.gpipe_schedule).schedule(8)
