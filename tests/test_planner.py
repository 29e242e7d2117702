"""The planner (`pj.plan_pipeline`): its predicted steps against a naive tick-by-tick reference,
its choice the fastest candidate that fits, and the chosen program's compiled temp bytes within
the budget, on three CPU models (uniform blocks; an embedding, blocks and a head; blocks with
BatchNorm, a stateful model) under two budgets each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from benchmarks import _simulate as sim
from benchmarks.planner import (
    CHUNKS,
    HEADROOM,
    MODES,
    SCHEDULES,
    embedding_blocks_head,
    stateful,
    uniform,
)
from benchmarks.planner import block as _block


def _naive_step(table, name, mode, f, b, link=0.0):
    """The lockstep step, tick by tick and slot by slot (the reference of the planner's); each
    tick's sends take ``link`` after its compute, or alongside it on a table of hop 2."""
    redo = mode in ("always", "except_last")
    fields = table.slot_fields()
    T, n = table.num_ticks, table.num_devices

    def tick(compute):
        return max(compute, link) if table.hop == 2 else compute + link

    total = 0.0
    if table.trains:
        for t in range(T):
            busiest = 0.0
            for d in range(n):
                work = 0.0
                for kind, (micro, stage) in fields.items():
                    if micro[t, d] < 0:
                        continue
                    s = stage[t, d]
                    if kind == "F":
                        work += f[s]
                    elif "W" in fields:  # ZB-H1: half the backward each, F recomputed in both
                        work += b[s] / 2 + (f[s] if redo else 0.0)
                    else:
                        work += b[s] + (f[s] if redo else 0.0)
                busiest = max(busiest, work)
            total += tick(busiest if busiest > 0 else max(f))
        return total
    micro, stage = fields["F"]
    drain = T - (table.hop * (n - 1) + 1)
    for t in range(T):
        active = [stage[t, d] for d in range(n) if micro[t, d] >= 0]
        total += tick(max((f[s] for s in active), default=max(f)))
        keep = mode == "never" or (mode == "except_last" and t >= drain)
        back = max((b[s] + (0.0 if keep else f[s]) for s in active), default=max(b + (0 if keep else f)))
        total += tick(back)
    return total


@pytest.mark.parametrize("model", [uniform, embedding_blocks_head, stateful])
def test_planner_chooses_the_fastest_plan_that_fits(model):
    layers, params, x, *state = model()
    state = state[0] if state else None
    mesh = jax.make_mesh((4,), ("stage",))
    if state is None:
        costed, costed_params = layers, params
    else:  # the costs of the stateful layers: each on its own state, every row real
        mask = jnp.ones(x.shape[0], bool)
        costed = [
            lambda ps, x, key, f=f: f(ps[0], x, key, jax.lax.stop_gradient(ps[1]), mask)[0] for f in layers
        ]
        costed_params = list(zip(params, state, strict=True))
    forward = np.array(pj.layer_costs(costed, costed_params, x, backward=False))
    both = np.array(pj.layer_costs(costed, costed_params, x))
    loose = pj.plan_pipeline(
        layers, params, x, mesh=mesh, memory_per_device=1e9, chunks=CHUNKS, checkpoints=MODES,
        headroom=HEADROOM, layer_state=state, schedules=SCHEDULES,
    )  # fmt: skip
    # every schedule, chunks and mode; interleaved 1F1B (micro-batches in groups of 4) not at 2
    assert len(loose.sweep) == (len(SCHEDULES) * len(CHUNKS) - 1) * len(MODES)
    assert {c.schedule for c in loose.sweep} == set(SCHEDULES)
    for c in loose.sweep:  # every predicted step against the naive reference
        offsets = np.cumsum([0, *c.balance])
        f = np.add.reduceat(forward, offsets[:-1])
        b = np.add.reduceat(both, offsets[:-1]) - f
        m = -(-x.shape[0] // -(-x.shape[0] // c.chunks))
        table = pj.pipeline(
            [_block] * len(c.balance), chunks=c.chunks, mesh=mesh, schedule=c.schedule, repeats=c.repeats
        ).schedule(x.shape[0])
        assert c.step == pytest.approx(_naive_step(table, c.schedule, c.checkpoint, f / m, b / m), rel=1e-9)
    # a budget just under the loose choice's bytes forces another choice (under() measures the
    # candidates it then needs)
    budget = HEADROOM * (loose.best.temp_bytes - 1)
    tight = loose.under(budget, headroom=HEADROOM)
    for chosen, limit in ((loose, 1e9), (tight, budget)):
        _check_choice(chosen, limit)
    assert tight.best.temp_bytes * HEADROOM <= budget < loose.best.temp_bytes * HEADROOM
    # the loose choice measured only the candidates it depends on
    assert sum(c.temp_bytes is not None for c in loose.sweep) < len(loose.sweep) / 2
    # the chosen program's compiled temp bytes fit the budget
    best = tight.best
    part = pj.partition(layers, list(best.balance), stateful=state is not None)
    pipe = pj.pipeline(part.stages, mesh=mesh, stateful=part.stateful, **best.options())
    stage_params = pipe.place(part.group(params))

    def loss(y, t):
        return jnp.sum((y - t) ** 2, axis=-1)

    t = jnp.zeros((x.shape[0], costed[-1](costed_params[-1], jnp.zeros((1, 32)), None).shape[-1]))
    state_params = pipe.place(part.group(state)) if state is not None else None
    step = pipe.value_and_grad(loss)  # each schedule's training step (autodiff for GPipe, circular)
    args = (stage_params, x, t, state_params)
    compiled = jax.jit(lambda p, x, t, s: step(p, x, t, state=s)).lower(*args).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= budget
    print(tight.table())


def _check_choice(plan, budget):
    """``plan``'s best and runner-up are the fastest two that fit (ties: the smaller) among the
    whole sweep: every candidate that could rank before them was measured."""
    measured = [c for c in plan.sweep if c.temp_bytes is not None]
    for c in measured:
        assert c.fits == (c.temp_bytes * HEADROOM <= budget)
    fits = sorted((c for c in measured if c.fits), key=lambda c: (c.step, c.temp_bytes))
    assert (plan.best, plan.runner_up) == (fits[0], fits[1])
    for c in plan.sweep:  # a candidate as fast as the runner-up was measured
        assert c.temp_bytes is not None or c.step > plan.runner_up.step, c
        assert (c.temp_bytes is None) == (c.fits is None)


def test_planner_measures_what_the_choice_needs():
    """The planner measures bytes in order of the step, until two candidates fit: under every
    budget, its best and runner-up are an exhaustive sweep's, with the same bytes."""
    layers, params, x = embedding_blocks_head()
    mesh = jax.make_mesh((4,), ("stage",))
    options = dict(
        mesh=mesh, schedules=SCHEDULES[:4], chunks=(2, 4, 8), checkpoints=("always", "never", "except_last"),
        memory="estimate", headroom=HEADROOM,
    )  # fmt: skip
    full = pj.plan_pipeline(layers, params, x, memory_per_device=1e12, exhaustive=True, **options)
    assert all(c.temp_bytes is not None for c in full.sweep)
    sizes = sorted({c.temp_bytes for c in full.sweep})
    lazy = pj.plan_pipeline(layers, params, x, memory_per_device=1e12, **options)
    assert sum(c.temp_bytes is not None for c in lazy.sweep) < len(lazy.sweep)
    for size in sizes:  # each budget at which the choice can change, from the largest down
        budget = HEADROOM * size
        want = full.under(budget, headroom=HEADROOM)
        got = lazy.under(budget, headroom=HEADROOM)
        assert (got.best, got.runner_up) == (want.best, want.runner_up), size
        bytes_of = {c._key: c.temp_bytes for c in want.sweep}
        assert all(c.temp_bytes == bytes_of[c._key] for c in got.sweep if c.temp_bytes is not None)
    nothing = lazy.under(HEADROOM * sizes[0] / 2, headroom=HEADROOM)  # nothing fits: all measured
    assert nothing.best is None and all(c.fits is False for c in nothing.sweep)
    with pytest.raises(TypeError, match=r"`exhaustive` must be True or False, but got int 1"):
        pj.plan_pipeline(layers, params, x, memory_per_device=1e6, exhaustive=1, **options)


def test_planner_weighs_the_links_and_overlap():
    """Messages: each tick sends the largest boundary activation of one micro-batch, after the
    compute or (overlap=True, a table of hop 2) alongside it. Slow links choose overlap; free
    links never do (it only adds ticks)."""
    layers, params, x = uniform()
    mesh = jax.make_mesh((4,), ("stage",))
    forward = np.array(pj.layer_costs(layers, params, x, backward=False))
    both = np.array(pj.layer_costs(layers, params, x))
    options = dict(
        mesh=mesh, memory_per_device=1e9, schedules=("gpipe", "1f1b"), chunks=CHUNKS,
        checkpoints=("always",), overlaps=(False, True), memory="estimate",
    )  # fmt: skip
    free = pj.plan_pipeline(layers, params, x, **options)
    assert not free.best.overlap
    row = 32 * x.dtype.itemsize  # every layer's output: 32 features of x's dtype
    # a 1F1B tick's two messages of 8 rows (chunks=8) take about its compute (F, B and F again
    # of 2 layers on 8 of the 64 rows): overlap=True halves such ticks, for 6 more of them
    latency = 0.01 * both.max()
    bandwidth = row * 8 / ((both.max() + forward.max()) / 8 - latency)
    slow = pj.plan_pipeline(layers, params, x, bandwidth=bandwidth, latency=latency, **options)
    assert slow.best.overlap
    assert len(slow.sweep) == 2 * len(CHUNKS) * 2
    for c in slow.sweep:
        offsets = np.cumsum([0, *c.balance])
        f = np.add.reduceat(forward, offsets[:-1])
        b = np.add.reduceat(both, offsets[:-1]) - f
        m = c.chunks
        table = pj.pipeline(
            [_block] * 4, chunks=m, mesh=mesh, schedule=c.schedule, overlap=c.overlap
        ).schedule(64)
        assert table.hop == (2 if c.overlap else 1)
        message = row * (64 // m) / bandwidth + latency
        link = message * (2 if table.trains else 1)  # messages per tick
        assert c.step == pytest.approx(
            _naive_step(table, c.schedule, c.checkpoint, f / m, b / m, link), rel=1e-9
        )
        # and benchmarks/simulate.py's lockstep model of the same table ("always": F again in B)
        simulated = sim.ticks(table, f / m, (b + f) / m, 0.0, overlap=c.overlap).step(message)
        assert c.step == pytest.approx(simulated, rel=1e-9)
    assert slow.best.options()["overlap"] is True


def test_planner_with_a_data_axis():
    """A data x stage mesh: each candidate's table is a data shard's (m / 2 micro-batches), its
    step timed on it, its bytes compiled on the 2 x 2 mesh, and a chunks the data axis does not
    split is left out."""
    layers, params, x = uniform()
    mesh = jax.make_mesh((2, 2), ("data", "stage"))
    forward = np.array(pj.layer_costs(layers, params, x, backward=False))
    both = np.array(pj.layer_costs(layers, params, x))
    plan = pj.plan_pipeline(
        layers, params, x, mesh=mesh, data_axis_name="data", memory_per_device=1e9,
        schedules=("gpipe", "1f1b"), chunks=(1, 8), checkpoints=("always",),
    )  # fmt: skip
    assert {(c.schedule, c.chunks) for c in plan.sweep} == {("gpipe", 8), ("1f1b", 8)}  # 1: not split
    for c in plan.sweep:
        assert c.balance == (4, 4)
        f = np.add.reduceat(forward, [0, 4])
        b = np.add.reduceat(both, [0, 4]) - f
        pipe = pj.pipeline([_block] * 2, chunks=8, mesh=mesh, schedule=c.schedule, data_axis_name="data")
        table = pipe.schedule(64)
        assert table.num_micro == 4
        assert c.step == pytest.approx(_naive_step(table, c.schedule, c.checkpoint, f / 8, b / 8), rel=1e-9)
    with pytest.raises(ValueError, match=r"`data_axis_name='batch'` is not an axis of the mesh"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, data_axis_name="batch")
    with pytest.raises(ValueError, match=r"`memory=\"estimate\"` does not model a data axis"):
        pj.plan_pipeline(
            layers, params, x, mesh=mesh, memory_per_device=1e6, data_axis_name="data", memory="estimate"
        )


def test_planner_estimates_every_schedule():
    """`memory="estimate"` sweeps every schedule, those whose devices hold several stages too, and
    each candidate's bytes are `pj.memory_estimate`'s of its pipeline. On 8 tanh layers with
    `"never"`, V-Half keeps less than 1F1B and ZB-V more (the inputs its deferred W reads); with
    `"always"` the V's turned parameter block outweighs what V-Half saves on a model this small."""
    layers, params, x = uniform()
    mesh = jax.make_mesh((4,), ("stage",))
    plan = pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e12, chunks=(8,),
                            checkpoints=MODES, memory="estimate", exhaustive=True)  # fmt: skip
    got = {(c.schedule, c.checkpoint): c.temp_bytes for c in plan.sweep}
    assert {s for s, _ in got} >= {"interleaved-1f1b", "v-half", "zb-v"}
    assert got["v-half", "never"] < got["1f1b", "never"] < got["zb-v", "never"], got
    v = next(c for c in plan.sweep if (c.schedule, c.checkpoint) == ("v-half", "never"))
    part = pj.partition(layers, list(v.balance))
    pipe = pj.pipeline(part.stages, chunks=8, checkpoint="never", mesh=mesh, schedule="v-half")
    assert pj.memory_estimate(pipe, part.group(params), x).total == v.temp_bytes


def test_planner_refuses_bad_arguments():
    layers, params, x = uniform()
    mesh = jax.make_mesh((4,), ("stage",))
    with pytest.raises(ValueError, match=r"`memory_per_device` must be a number > 0, but got 0"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=0)
    with pytest.raises(ValueError, match=r"`schedules` must be among .* but got 'zb-h2'"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, schedules=["1f1b", "zb-h2"])
    with pytest.raises(ValueError, match=r"`layer_state` has 7 entries, but there are 8 layers"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, layer_state=[None] * 7)
    with pytest.raises(ValueError, match=r"`memory=\"estimate\"` does not model stateful layers"):
        pj.plan_pipeline(
            layers, params, x, mesh=mesh, memory_per_device=1e6, layer_state=[None] * 8, memory="estimate"
        )
    with pytest.raises(TypeError, match=r"`overlaps` must hold bools"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, overlaps=(0, 1))
    with pytest.raises(ValueError, match=r"`bandwidth` must be a number > 0, but got 0"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, bandwidth=0)
    with pytest.raises(TypeError, match=r"`stateful` must be a bool, but got int 1"):
        pj.partition(layers, [4, 4], stateful=1)
    with pytest.raises(ValueError, match=r"`axis_name='pipe'` is not an axis of the mesh"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, axis_name="pipe")
    nothing = pj.plan_pipeline(
        layers, params, x, mesh=mesh, memory_per_device=1.0, chunks=(2,), memory="estimate"
    )
    assert nothing.best is None and not any(c.fits for c in nothing.sweep)
