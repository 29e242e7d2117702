"""Sends that overlap compute (`overlap=True`, tables with `hop=2`): every schedule gives the
results of `overlap=False` bitwise, and in every loop body of its program (the forward loop, the
backward loop autodiff makes of it, a training table's loop) no `ppermute` sends a value of this
tick's stage computation or feeds it: each sends a loop carry, the last tick's output, so XLA may
run the send beside the stage."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import pipejax as pj
from pipejax._src.schedules import tables as sched

SCHEDULES = [
    ("gpipe", 1), ("circular", 2), ("1f1b", 1), ("zb-h1", 1), ("zb-floor", 1),
    ("interleaved-1f1b", 2), ("v-half", 2), ("zb-v", 2),
]  # fmt: skip
COMPUTE = {"dot_general", "tanh"}  # the stage's own work


def _stage(p, x, key=None):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def _loss(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def _problem():
    k = jax.random.split(jax.random.key(0), 10)
    params = [
        {"w": jax.random.normal(k[s], (3, 3)) * 0.7, "b": jax.random.normal(k[s + 4], (3,))} for s in range(4)
    ]
    return params, jax.random.normal(k[8], (8, 3)), jax.random.normal(k[9], (8, 3))


def _step(name, repeats, overlap, checkpoint=None):
    mesh = jax.make_mesh((4 // repeats,), ("stage",))
    pipe = pj.pipeline(
        [_stage] * 4,
        chunks=8,
        mesh=mesh,
        schedule=name,
        repeats=repeats,
        overlap=overlap,
        checkpoint=checkpoint,
    )
    if pipe.plan.schedule.owns_backward:
        return pipe, mesh, pipe.value_and_grad(_loss)
    return pipe, mesh, lambda p, x, t: jax.value_and_grad(lambda p: _loss(pipe(p, x), t).mean())(p)


@pytest.mark.parametrize(("name", "repeats"), SCHEDULES)
def test_overlap_gives_the_same_results_bitwise(name, repeats):
    params, x, t = _problem()
    runs = []
    for overlap in (False, True):
        pipe, _, step = _step(name, repeats, overlap)
        runs.append((jax.jit(pipe)(params, x), jax.jit(step)(params, x, t)))
        assert pipe.schedule(8).hop == (2 if overlap else 1) and pipe.overlap is overlap
    jax.tree.map(np.testing.assert_array_equal, *runs)


def test_except_last_under_overlap_is_bitwise_always():
    params, x, t = _problem()
    got = [jax.jit(_step("gpipe", 1, True, c)[2])(params, x, t) for c in ("always", "except_last")]
    jax.tree.map(np.testing.assert_array_equal, *got)


# --- the structure: what each ppermute of a loop body sends and feeds --------------------------------


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for x in value if isinstance(value, tuple | list) else (value,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def _computes(eqn) -> bool:
    return eqn.primitive.name in COMPUTE or any(_computes(e) for j in _subjaxprs(eqn) for e in j.eqns)


def _loop_bodies(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
        for j in _subjaxprs(eqn):
            yield from _loop_bodies(j)


def _permutes(eqn) -> bool:
    return eqn.primitive.name == "ppermute" or any(_permutes(e) for j in _subjaxprs(eqn) for e in j.eqns)


def _is_send(eqn) -> bool:
    """A ``ppermute``, or a ``cond`` that picks one (a V table's: the tick's parity picks the
    neighbours) and computes nothing else."""
    return eqn.primitive.name == "ppermute" or (
        eqn.primitive.name == "cond" and _permutes(eqn) and not _computes(eqn)
    )


def _sends(body) -> list[tuple[bool, bool]]:
    """``(sends this tick's compute, feeds this tick's compute)`` for each send of ``body``."""
    computed = set()  # values that depend on the stage's work in this body
    for eqn in body.eqns:
        if _computes(eqn) or any(v in computed for v in eqn.invars if isinstance(v, jcore.Var)):
            computed.update(eqn.outvars)
    out = []
    for i, eqn in enumerate(body.eqns):
        if not _is_send(eqn):
            continue
        reached, feeds = set(eqn.outvars), False
        for later in body.eqns[i + 1 :]:
            if any(v in reached for v in later.invars if isinstance(v, jcore.Var)):
                feeds |= _computes(later)
                reached.update(later.outvars)
        out.append((any(v in computed for v in eqn.invars if isinstance(v, jcore.Var)), feeds))
    return out


@pytest.mark.parametrize(("name", "repeats"), SCHEDULES)
def test_every_send_is_a_loop_carry_with_overlap(name, repeats):
    params, x, t = _problem()
    found = {}
    for overlap in (False, True):
        _, mesh, step = _step(name, repeats, overlap)
        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(step)(params, x, t).jaxpr
        sends = [s for body in _loop_bodies(jaxpr) for s in _sends(body)]
        assert sends, "no ppermute in a loop body"
        found[overlap] = sends
    assert not any(a or b for a, b in found[True]), found[True]
    assert any(a or b for a, b in found[False])  # the check can fail: without overlap it does


# --- the tables and the option's errors -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_tables_with_two_tick_hops(n):
    m = 8
    assert sched.gpipe(n, m, hop=2).num_ticks == m + 2 * (n - 1)
    for table in (sched.one_f_one_b(n, m, hop=2), sched.zb_h1(n, m, hop=2)):
        assert table.num_ticks == m + 4 * (n - 1) and table.hop == 2
        assert table.stash_slots() == min(m, 4 * n - 3)
    assert sched.interleaved_one_f_one_b(n, 2 * n, 2, hop=2).hop == 2
    with pytest.raises(ValueError, match=r"`hop` must be 1 .* or 2"):
        sched.gpipe(n, m, hop=3)


def test_overlap_option_errors():
    mesh = jax.make_mesh((2,), ("stage",))
    params, x, t = _problem()
    with pytest.raises(TypeError, match=r"`overlap` must be True or False, but got str 'yes'"):
        pj.pipeline([_stage] * 2, chunks=2, mesh=mesh, overlap="yes")
    pipe = pj.pipeline(
        [_stage] * 4, mesh=mesh, chunks=2, schedule="interleaved-1f1b", repeats=2, overlap=True
    )
    with pytest.raises(ValueError, match=r"groups of 4 \(`overlap=True`: twice the devices\)"):
        pipe.value_and_grad(_loss)(params, x, t)

    def one_tick_hops(num_devices, num_micro):
        return sched.one_f_one_b(num_devices, num_micro)

    mine = pj.pipeline(
        [_stage] * 4, mesh=jax.make_mesh((4,), ("stage",)), chunks=4, schedule=one_tick_hops, overlap=True
    )
    with pytest.raises(ValueError, match=r"whose messages take `hop=1` ticks, but `overlap=True` asks for"):
        mine.schedule(8)


def test_memory_estimate_follows_the_deeper_stash():
    """`pj.memory_estimate` reads the table the mesh runs: with overlap its predicted bytes grow
    as XLA's do (4 stages of tanh(x @ w) 64 wide, 16 micro-batches of 8 rows)."""
    mesh = jax.make_mesh((4,), ("stage",))
    params, x = {"w": jnp.zeros((4, 64, 64))}, jnp.ones((128, 64))
    for name in ("gpipe", "1f1b"):
        ratios, est = [], []
        for overlap in (False, True):
            pipe = pj.pipeline(
                lambda p, h, key=None: jnp.tanh(h @ p["w"]), num_stages=4, chunks=16, mesh=mesh,
                schedule=name, overlap=overlap,
            )  # fmt: skip
            if pipe.plan.schedule.owns_backward:
                step = pipe.value_and_grad(_loss)
            else:
                step = jax.value_and_grad(lambda p, x, t, pipe=pipe: _loss(pipe(p, x), t).mean())
            compiled = jax.jit(step).lower(pipe.place(params), x, x).compile()
            est.append(pj.memory_estimate(pipe, params, x).total)
            ratios.append(est[-1] / compiled.memory_analysis().temp_size_in_bytes)
        assert est[1] > est[0], name
        assert abs(ratios[1] - ratios[0]) < 0.08, (name, ratios)
