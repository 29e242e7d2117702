"""The planner (`pj.plan_pipeline`): its predicted steps against a naive tick-by-tick reference,
its choice the fastest candidate that fits, and the chosen program's compiled temp bytes within
the budget, on two CPU models (uniform blocks; an embedding, blocks and a head) under two
budgets each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

CHUNKS = (2, 8)
MODES = ("always", "never")  # (the mode sweep of the planner covers except_last too)


def _block(p, x, key):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def _embed(p, tokens, key):
    return p[tokens]  # a gather: no flops, a big table


def _head(p, x, key):
    return x @ p  # a wide projection: many flops


def uniform():
    k = jax.random.split(jax.random.key(0), 8)
    params = [{"w": jax.random.normal(k[i], (32, 32)) * 0.3, "b": jnp.zeros(32)} for i in range(8)]
    return [_block] * 8, params, jax.random.normal(jax.random.key(1), (64, 32))


def embedding_blocks_head():
    k = jax.random.split(jax.random.key(2), 8)
    blocks = [{"w": jax.random.normal(k[i], (32, 32)) * 0.3, "b": jnp.zeros(32)} for i in range(6)]
    params = [jax.random.normal(k[6], (512, 32)), *blocks, jax.random.normal(k[7], (32, 256))]
    return [_embed, *([_block] * 6), _head], params, jnp.arange(64) % 512


def _naive_step(table, name, mode, f, b):
    """The lockstep step, tick by tick and slot by slot (the reference of the planner's)."""
    redo = mode in ("always", "except_last")
    fields = table.slot_fields()
    T, n = table.num_ticks, table.num_devices
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
            total += busiest if busiest > 0 else max(f)
        return total
    micro, stage = fields["F"]
    drain = T - (table.hop * (n - 1) + 1)
    for t in range(T):
        active = [stage[t, d] for d in range(n) if micro[t, d] >= 0]
        total += max((f[s] for s in active), default=max(f))
        keep = mode == "never" or (mode == "except_last" and t >= drain)
        total += max((b[s] + (0.0 if keep else f[s]) for s in active), default=max(b + (0 if keep else f)))
    return total


@pytest.mark.parametrize("model", [uniform, embedding_blocks_head])
def test_planner_chooses_the_fastest_plan_that_fits(model):
    layers, params, x = model()
    mesh = jax.make_mesh((4,), ("stage",))
    forward = np.array(pj.layer_costs(layers, params, x, backward=False))
    both = np.array(pj.layer_costs(layers, params, x))
    loose = pj.plan_pipeline(
        layers, params, x, mesh=mesh, memory_per_device=1e9, chunks=CHUNKS, checkpoints=MODES, headroom=1.25
    )
    assert len(loose.sweep) == 4 * len(CHUNKS) * len(MODES)  # every schedule, chunks and mode
    for c in loose.sweep:  # every predicted step against the naive reference
        offsets = np.cumsum([0, *c.balance])
        f = np.add.reduceat(forward, offsets[:-1])
        b = np.add.reduceat(both, offsets[:-1]) - f
        m = -(-x.shape[0] // -(-x.shape[0] // c.chunks))
        table = pj.pipeline(
            [_block] * len(c.balance), chunks=c.chunks, mesh=mesh, schedule=c.schedule, repeats=c.repeats
        ).schedule(x.shape[0])
        assert c.step == pytest.approx(_naive_step(table, c.schedule, c.checkpoint, f / m, b / m), rel=1e-9)
    # a budget between the smallest and the loose choice's bytes forces a smaller choice
    smallest = min(c.temp_bytes for c in loose.sweep)
    budget = 1.25 * (smallest + loose.best.temp_bytes) / 2
    tight = loose.under(budget, headroom=1.25)
    for chosen in (loose, tight):
        fits = [c for c in chosen.sweep if c.fits]
        assert chosen.best == min(fits, key=lambda c: (c.step, c.temp_bytes))
        assert chosen.runner_up == sorted(fits, key=lambda c: (c.step, c.temp_bytes))[1]
    assert tight.best.temp_bytes * 1.25 <= budget < loose.best.temp_bytes * 1.25
    # the chosen program's compiled temp bytes fit the budget
    best = tight.best
    part = pj.partition(layers, list(best.balance))
    pipe = pj.pipeline(part.stages, mesh=mesh, **best.options())
    stage_params = pipe.place(part.group(params))

    def loss(y, t):
        return jnp.sum((y - t) ** 2, axis=-1)

    t = jnp.zeros((x.shape[0], layers[-1](params[-1], jnp.zeros((1, 32)), None).shape[-1]))
    if pipe.plan.schedule.owns_backward:
        step = pipe.value_and_grad(loss)
    else:
        step = jax.value_and_grad(lambda p, x, t: loss(pipe(p, x), t).mean())
    compiled = jax.jit(step).lower(stage_params, x, t).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= budget
    print(tight.table())


def test_planner_refuses_bad_arguments():
    layers, params, x = uniform()
    mesh = jax.make_mesh((4,), ("stage",))
    with pytest.raises(ValueError, match=r"`memory_per_device` must be a number > 0, but got 0"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=0)
    with pytest.raises(ValueError, match=r"`schedules` must be among .* but got 'interleaved-1f1b'"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, schedules=["interleaved-1f1b"])
    with pytest.raises(ValueError, match=r"`axis_name='pipe'` is not an axis of the mesh"):
        pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e6, axis_name="pipe")
    nothing = pj.plan_pipeline(
        layers, params, x, mesh=mesh, memory_per_device=1.0, chunks=(2,), memory="estimate"
    )
    assert nothing.best is None and not any(c.fits for c in nothing.sweep)
