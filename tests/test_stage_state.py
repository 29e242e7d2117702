"""Stage state in the pipeline engine: ``pj.pipeline(..., stateful=True)``.

A stateful stage is ``stage(params, x, key, state, mask) -> (y, stats)``. The naive reference is
the micro-batch loop written by hand: cut ``x`` with ``pj.split_microbatches``, apply the stages in
turn to each micro-batch with its row mask, and stack each stage's stats over the micro-batches.

The stages below are heterogeneous in their stats as well as their activations: stage 0 reports a
float64 per-feature masked sum and an int32 row count, stage 1 reports nothing (``None``) and
reads no state, stage 2 reports a float32 masked maximum and a float64 sum of squares. Every stat
depends on which rows are real, so counting a padding row, or a bubble tick (or a discarded drain
re-execution) writing into a slot, changes the result.

Tolerances: stats and outputs are computed by the same operations as the reference on the same
micro-batches, in float64; rtol 1e-12 / atol 1e-14 allows XLA to fuse or block reductions
differently (a few ulp). Across checkpoint modes the claim is bitwise; between a mesh and no mesh
it is bitwise where XLA compiles the stage's arithmetic alike (the homogeneous stages here) and a
few ulp otherwise (see the heterogeneous test).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models

TOL = {"rtol": 1e-12, "atol": 1e-14}
MODES = {**{m: m for m in pj.CHECKPOINT_MODES}, "dots_saveable": jax.checkpoint_policies.dots_saveable}


# --- heterogeneous stages with different state and stats layouts -------------------------------


def first(p, x, key, state, mask):
    """``f64[b, 2] -> f64[b, 3]``; state ``{"shift": f64[3]}``; stats: masked sum and row count."""
    h = jnp.tanh(x @ p["w"] + state["shift"][None])
    rows = jnp.sum(mask, dtype=jnp.int32)
    return h, {"sum": jnp.sum(jnp.where(mask[:, None], h, 0.0), axis=0), "rows": rows}


def middle(p, h, key, state, mask):
    """``f64[b, 3] -> f64[b, 4]``; no state, no stats."""
    assert state is None  # the pipeline passes a stage without state None
    return jnp.tanh(h @ p["w"]), None


def last(p, h, key, state, mask):
    """``f64[b, 4] -> f64[b, 1]``; state ``{"scale": f32[]}``; stats: f32 masked max, f64 sum of squares."""
    y = (h @ p["v"]) * state["scale"].astype(h.dtype)
    top = jnp.max(jnp.where(mask, y[:, 0], -jnp.inf)).astype(jnp.float32)
    return y, (top, jnp.sum(jnp.where(mask[:, None], h * h, 0.0), axis=0))


STAGES = (first, middle, last)


def params_and_state(seed=0):
    r = np.random.default_rng(seed)
    params = [
        {"w": jnp.asarray(r.normal(size=(2, 3)))},
        {"w": jnp.asarray(r.normal(size=(3, 4)))},
        {"v": jnp.asarray(r.normal(size=(4, 1)))},
    ]
    state = [{"shift": jnp.asarray(r.normal(size=(3,)))}, None, {"scale": jnp.asarray(1.5, jnp.float32)}]
    return params, state


def inputs(batch, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, 2)))


def by_hand(stages, params, state, x, chunks):
    """The micro-batch loop written out: per-micro-batch outputs merged, per-stage stats stacked."""
    xs, mask, plan = pj.split_microbatches(x, chunks)
    outs, stats = [], [[] for _ in stages]
    for i in range(plan.num_micro):
        h = jax.tree.map(lambda a, i=i: a[i], xs)
        for s, stage in enumerate(stages):
            h, st = stage(params[s], h, None, state[s], mask[i])
            stats[s].append(st)
        outs.append(h)
    stacked = [jax.tree.map(lambda *v: jnp.stack(v), *st) if st[0] is not None else None for st in stats]
    return pj.merge_microbatches(jnp.stack(outs), plan), stacked


@functools.cache
def run_heterogeneous(batch, chunks, mode, placement, placed):
    mesh = models.make_mesh(placement, 3)
    pipe = pj.pipeline(list(STAGES), chunks=chunks, checkpoint=MODES[mode], mesh=mesh, stateful=True)
    params, state = params_and_state()
    if placed:
        params, state = pipe.place(params), pipe.place(state)
    return pipe(params, inputs(batch), state=state)


# (batch, chunks, placement): even (b = 4, m = 3), uneven (b = 3, m = 4, 2 padding rows), chunks = 1
# with an odd batch, and a batch smaller than chunks (b = 1, m = 3); with and without a mesh.
CASES = [(12, 3, "none"), (10, 4, "none"), (7, 1, "none"), (10, 4, "explicit"), (3, 4, "explicit")]


@pytest.mark.parametrize("batch,chunks,placement", CASES)
def test_heterogeneous_stats_equal_the_micro_batch_loop(batch, chunks, placement):
    y, stats = run_heterogeneous(batch, chunks, "except_last", placement, placement != "none")
    params, state = params_and_state()
    y_ref, stats_ref = by_hand(STAGES, params, state, inputs(batch), chunks)
    models.assert_trees_close(y, y_ref, **TOL)
    models.assert_trees_close(stats, stats_ref, **TOL)
    # Stats cover exactly the real rows, in micro-batch order (stage 0 counts them).
    plan = pj.microbatch_plan(batch, chunks)
    expected_rows = [plan.micro_size] * (plan.num_micro - 1) + [plan.micro_size - plan.padding]
    assert stats[0]["rows"].tolist() == expected_rows
    assert stats[0]["rows"].dtype == jnp.int32 and stats[2][0].dtype == jnp.float32
    # And their sum is that of the whole batch: padding rows never count.
    whole = jnp.tanh(inputs(batch) @ params[0]["w"] + state[0]["shift"][None])
    np.testing.assert_allclose(stats[0]["sum"].sum(axis=0), whole.sum(axis=0), rtol=1e-12)


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_heterogeneous_outputs_and_stats_bitwise_across_checkpoint_modes(placement):
    """Uneven batch: every checkpoint mode gives the same bits (with placed state on a mesh).

    Between a mesh and no mesh the values agree to rounding only: XLA compiles a stage's own
    arithmetic in two different programs (a ``lax.switch`` branch in ``shard_map`` vs the body of
    one scan) and may contract ``a * b + c`` into an FMA or order a reduction differently; here
    stage 2's 3-row sum of squares differs by 1 ulp.
    """
    reference = run_heterogeneous(10, 4, "except_last", placement, placement == "explicit")
    for mode in MODES:
        got = run_heterogeneous(10, 4, mode, placement, placement == "explicit")
        models.assert_trees_equal(got, reference)
    models.assert_trees_close(reference, run_heterogeneous(10, 4, "except_last", "none", False), **TOL)


# --- homogeneous stages ------------------------------------------------------------------------------


def block(p, x, key, state, mask):
    """``f64[b, 3] -> f64[b, 3]``; state ``{"centre": f64[3]}``; stats: masked sum and sum of squares."""
    h = x + jnp.tanh((x - state["centre"][None]) @ p["w"])
    keep = mask[:, None]
    return h, {"sum": jnp.sum(jnp.where(keep, h, 0.0), axis=0), "sq": jnp.sum(jnp.where(keep, h * h, 0.0))}


def stacked(seed=2):
    r = np.random.default_rng(seed)
    return {"w": jnp.asarray(r.normal(size=(3, 3, 3)) / 2)}, {"centre": jnp.asarray(r.normal(size=(3, 3)))}


@functools.cache
def run_homogeneous(batch, chunks, mode, placement):
    mesh = models.make_mesh(placement, 3)
    pipe = pj.pipeline(block, num_stages=3, chunks=chunks, checkpoint=MODES[mode], mesh=mesh, stateful=True)
    params, state = stacked()
    if mesh is not None:
        params, state = pipe.place(params), pipe.place(state)
    return pipe(params, inputs(batch, seed=3).repeat(2, axis=1)[:, :3], state=state)


@pytest.mark.parametrize("batch,chunks", [(10, 4), (12, 3)])
def test_homogeneous_stats_stack_stages_then_micro_batches(batch, chunks):
    y, stats = run_homogeneous(batch, chunks, "never", "none")
    params, state = stacked()
    x = inputs(batch, seed=3).repeat(2, axis=1)[:, :3]
    y_ref, per_stage = by_hand([block] * 3, models.unstack(params, 3), models.unstack(state, 3), x, chunks)
    m = pj.microbatch_plan(batch, chunks).num_micro
    assert stats["sum"].shape == (3, m, 3) and stats["sq"].shape == (3, m)
    models.assert_trees_close(y, y_ref, **TOL)
    models.assert_trees_close(stats, jax.tree.map(lambda *v: jnp.stack(v), *per_stage), **TOL)


def test_homogeneous_bitwise_across_modes_and_mesh():
    reference = run_homogeneous(10, 4, "always", "none")
    for mode in ("always", "never"):  # (the heterogeneous test covers every mode)
        for placement in ("none", "explicit"):
            models.assert_trees_equal(run_homogeneous(10, 4, mode, placement), reference)


# --- autodiff ----------------------------------------------------------------------------------------


def test_gradients_through_y_are_those_of_the_stateless_pipeline():
    """Reporting stats does not change the derivatives of ``y`` with respect to params and ``x``."""
    mesh = models.make_mesh("explicit", 3)
    params, state = params_and_state()
    x = inputs(10)
    stateful = pj.pipeline(list(STAGES), chunks=4, checkpoint="always", mesh=mesh, stateful=True)
    stateless = pj.pipeline(
        [lambda p, x, k, s=s: STAGES[s](p, x, k, state[s], jnp.ones(x.shape[:1], bool))[0] for s in range(3)],
        chunks=4,
        checkpoint="always",
        mesh=mesh,
    )

    def loss_stateful(p, x):
        return jnp.sum(jnp.sin(stateful(p, x, state=state)[0]))

    def loss_stateless(p, x):
        return jnp.sum(jnp.sin(stateless(p, x)))

    grad = jax.jit(jax.grad(loss_stateful, argnums=(0, 1)))(params, x)
    models.assert_trees_close(grad, jax.jit(jax.grad(loss_stateless, argnums=(0, 1)))(params, x), **TOL)


def test_gradients_through_stats_match_the_micro_batch_loop():
    """Stats are differentiable: the psum that replicates them transposes correctly on a mesh."""
    mesh = models.make_mesh("explicit", 3)
    params, state = params_and_state()
    x = inputs(10)
    pipe = pj.pipeline(list(STAGES), chunks=4, checkpoint="except_last", mesh=mesh, stateful=True)

    def loss(y, stats):
        return jnp.sum(y**2) + jnp.sum(stats[0]["sum"] ** 2) + jnp.sum(stats[2][1])

    got = jax.jit(jax.grad(lambda p: loss(*pipe(p, x, state=state))))(params)
    want = jax.jit(jax.grad(lambda p: loss(*by_hand(STAGES, p, state, x, 4))))(params)
    models.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)  # reordered batch sums, as in the contract


# --- state forms and errors --------------------------------------------------------------------------


def test_state_none_gives_every_stage_none():
    def count(p, x, key, state, mask):
        assert state is None
        return x * p, jnp.sum(mask.astype(jnp.int32))

    pipe = pj.pipeline([count, count], chunks=3, stateful=True)
    y, stats = pipe([2.0, 3.0], jnp.arange(5.0))
    np.testing.assert_array_equal(y, jnp.arange(5.0) * 6.0)
    assert [s.tolist() for s in stats] == [[2, 2, 1], [2, 2, 1]]


def test_errors_name_the_argument_and_the_fix():
    params, state = params_and_state()
    x = inputs(4)
    with pytest.raises(TypeError, match=r"`state` was given, but the pipeline is not stateful.*=True"):
        pj.pipeline([models.dense_in, models.dense_out])(models.pair_params(), x, state=[None, None])
    with pytest.raises(ValueError, match=r"`state` has 2 entries but the pipeline has 3 stages"):
        pj.pipeline(list(STAGES), stateful=True)(params, x, state=state[:2])
    with pytest.raises(ValueError, match=r"Stage 0 returned .* must return a pair `\(y, stats\)`"):
        pj.pipeline([lambda p, x, k, s, m: x], stateful=True)([None], x)
    with pytest.raises(ValueError, match=r"Stage 0 could not be .*str.* at output component \[1\]\['n'\]"):
        pj.pipeline([lambda p, x, k, s, m: (x, {"n": "five"})], stateful=True)([None], x)
    with pytest.raises(ValueError, match=r"stage axis of size 3.*`state` leaf \['centre'\] has shape \(2,\)"):
        pj.pipeline(block, num_stages=3, stateful=True)(stacked()[0], x, state={"centre": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"`stateful` must be True or False"):
        pj.pipeline(list(STAGES), stateful=1)
