"""The public contract of ``pipejax.pipeline``, against composing the stages on the whole batch.

One shared table drives every test: stage layouts (``tests.models.LAYOUTS``: heterogeneous token
stages with a tuple skip connection, homogeneous stacked stages) x checkpoint modes x placements
(no mesh, Explicit mesh, Auto mesh) x chunkings (even, uneven, batch smaller than chunks).

Forward results are checked for every checkpoint mode x placement (bitwise against each other)
on the uneven chunking, and on a covering subset for the other chunkings. Compiles are slow, so
gradients use a covering array (every checkpoint mode, placement and chunking for each layout)
and second derivatives a smaller covering subset (every layout, checkpoint mode, placement,
chunking and derivative kind appears at least once).

Everything is float64, and all autodiff goes through ``jax.jit`` (eager autodiff with an Explicit
mesh needs ``jax.set_mesh``, a JAX rule unrelated to pipejax).

Tolerances (float64, eps = 2.2e-16):
* forward, rtol 1e-12: each output row is computed by the same operations as in the composition;
  only the batch size of the matmuls differs, which may change their blocking (a few ulp). The
  atol 1e-14 covers outputs that are near zero (values are O(1)).
* gradients and second derivatives, rtol 1e-10 and atol 1e-12: gradients with respect to
  parameters are sums over the batch, and the pipeline sums per micro-batch and then over
  micro-batches: a reordered sum of <= 12 O(1) terms, error <= 12 * eps * sum|terms| ~ 1e-14,
  amplified by at most two more matmul layers in the second derivatives. The limits leave a margin
  of about 100x.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models
from tests.models import CHECKPOINTS, CHUNKINGS, LAYOUTS, PLACEMENTS

FWD_TOL = {"rtol": 1e-12, "atol": 1e-14}
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}


def build(layout, checkpoint, placement, chunking):
    """The pipeline, its parameters and its inputs for one row of the table."""
    batch, chunks = CHUNKINGS[chunking]
    mesh = models.make_mesh(placement, layout.num_stages)
    pipe = layout.make(chunks=chunks, checkpoint=CHECKPOINTS[checkpoint], mesh=mesh)
    return pipe, layout.params(), layout.inputs(batch)


def losses(layout, pipe, x):
    """Scalar losses ``f(params, float_x)`` of the pipeline and of the reference."""

    def through(apply):
        return lambda params, fx: layout.loss(apply(params, layout.with_float_x(x, fx)))

    return through(pipe), through(layout.reference)


# --- forward: every checkpoint mode x placement, bitwise -------------------------------------------


FORWARD_CASES = {
    "uneven": list(itertools.product(CHECKPOINTS, PLACEMENTS)),
    "even": [("never", "none"), ("except_last", "explicit"), ("always", "auto")],
    "small": [("never", "none"), ("except_last", "auto"), ("dots_saveable", "explicit")],
}


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_forward_matches_composition_and_is_bitwise_stable(layout_name, chunking):
    """Every checkpoint mode x placement equals the composition, and all of them bitwise agree.

    The full product runs for the uneven chunking; the other chunkings run every placement and
    three checkpoint modes (compiles are slow).
    """
    layout = LAYOUTS[layout_name]
    results = {}
    for checkpoint, placement in FORWARD_CASES[chunking]:
        pipe, params, x = build(layout, checkpoint, placement, chunking)
        results[checkpoint, placement] = pipe(params, x)
    expected = layout.reference(params, x)
    first = results["never", "none"]
    models.assert_trees_close(first, expected, **FWD_TOL)
    for case, y in results.items():
        assert y.shape == expected.shape, case
        np.testing.assert_array_equal(np.asarray(y), np.asarray(first), err_msg=str(case))


def test_forward_under_jit_equals_eager():
    """The pipeline is jit-able: calling it inside ``jax.jit`` gives the eager result."""
    layout = LAYOUTS["stacked"]
    pipe, params, x = build(layout, "except_last", "explicit", "uneven")
    np.testing.assert_array_equal(np.asarray(jax.jit(pipe)(params, x)), np.asarray(pipe(params, x)))


# --- gradients: covering arrays ----------------------------------------------------------------


def _gradient_cases():
    """``stacked`` (cheap to compile): every checkpoint mode without a mesh and with one (Explicit
    or Auto, alternating), the chunking cycling. ``tokens`` (slow to compile): every checkpoint
    mode, placement and chunking at least once. (``test_pipeline_bubbles.py`` and
    ``test_pipeline_randomness.py`` add gradient checks of every mode with and without a mesh.)"""
    chunkings = list(CHUNKINGS)
    for i, checkpoint in enumerate(CHECKPOINTS):
        yield "stacked", checkpoint, "none", chunkings[i % 3]
        yield "stacked", checkpoint, ("explicit", "auto")[i % 2], chunkings[(i + 1) % 3]
    yield "tokens", "always", "explicit", "uneven"
    yield "tokens", "except_last", "none", "small"
    yield "tokens", "never", "auto", "even"
    yield "tokens", "dots_saveable", "explicit", "small"


@pytest.mark.parametrize("layout_name,checkpoint,placement,chunking", list(_gradient_cases()))
def test_gradients_match_composition(layout_name, checkpoint, placement, chunking):
    """Value and gradients with respect to ``params`` and to the float part of ``x``."""
    layout = LAYOUTS[layout_name]
    pipe, params, x = build(layout, checkpoint, placement, chunking)
    loss, ref_loss = losses(layout, pipe, x)
    fx = layout.float_x(x)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, fx)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))(params, fx)
    np.testing.assert_allclose(value, ref_value, **FWD_TOL)
    models.assert_trees_close(grads, ref_grads, **GRAD_TOL)


# --- second order: a covering subset ------------------------------------------------------------

SECOND_ORDER = [
    # layout, derivative, checkpoint, placement, chunking
    ("tokens", "hvp", "always", "explicit", "uneven"),
    ("tokens", "grad_of_grad", "dots_saveable", "auto", "even"),
    ("stacked", "hvp", "never", "auto", "small"),
    ("stacked", "hessian", "always", "explicit", "even"),
    ("stacked", "grad_of_grad", "except_last", "explicit", "uneven"),
    ("stacked", "hvp", "dots_saveable", "none", "uneven"),
]


def _hvp(loss):
    """``(params, fx, v_params, v_x) -> (grad, Hessian-vector product)``, forward-over-reverse."""
    grad = jax.grad(loss, argnums=(0, 1))
    return lambda p, fx, vp, vx: jax.jvp(grad, (p, fx), (vp, vx))


def _grad_of_grad(loss):
    """Reverse-over-reverse: the gradient of a scalar function of the gradient."""

    def g(p, fx):
        gp, gx = jax.grad(loss, argnums=(0, 1))(p, fx)
        squares = jax.tree.map(lambda a: jnp.sum(a**2), gp)
        return sum(jax.tree.leaves(squares)) + jnp.sum(jnp.sin(gx))

    return jax.grad(g, argnums=(0, 1))


@pytest.mark.parametrize("layout_name,derivative,checkpoint,placement,chunking", SECOND_ORDER)
def test_second_derivatives_match_composition(layout_name, derivative, checkpoint, placement, chunking):
    layout = LAYOUTS[layout_name]
    pipe, params, x = build(layout, checkpoint, placement, chunking)
    loss, ref_loss = losses(layout, pipe, x)
    fx = layout.float_x(x)
    if derivative == "hvp":
        r = np.random.default_rng(7)
        vp = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape)), params)
        vx = jnp.asarray(r.normal(size=fx.shape))
        args = (params, fx, vp, vx)
        make = _hvp
    elif derivative == "hessian":
        args = (params, fx)
        make = lambda f: jax.hessian(f, argnums=(0, 1))
    else:
        args = (params, fx)
        make = _grad_of_grad
    got = jax.jit(make(loss))(*args)
    expected = jax.jit(make(ref_loss))(*args)
    models.assert_trees_close(got, expected, **GRAD_TOL)


# --- the torchgpipe Hessian case ------------------------------------------------------------------


def _linear(p, x, key):
    return x * p["w"] + p["b"]


def test_torchgpipe_second_order_through_checkpoints():
    """torchgpipe could not build a second-order graph through its checkpoints: two
    ``Linear(1, 1)`` stages, ``chunks=2``, ``checkpoint="always"``. Here ``jax.hessian`` and
    grad-of-grad through the pipeline equal those of the plain composition."""
    pipe = pj.pipeline(
        [_linear, _linear], chunks=2, checkpoint="always", mesh=models.make_mesh("explicit", 2)
    )
    params = [{"w": jnp.asarray(0.7), "b": jnp.asarray(-0.3)}, {"w": jnp.asarray(1.3), "b": jnp.asarray(0.2)}]
    x = jnp.asarray([[1.0], [2.0], [-0.5], [3.0]])
    target = jnp.asarray([[0.5], [1.0], [0.0], [2.0]])

    def make_loss(apply):
        return lambda params: jnp.mean((jnp.tanh(apply(params, x)) - target) ** 2)

    loss = make_loss(pipe)
    ref = make_loss(lambda p, x: models.compose([_linear, _linear], p, x))

    def grad_of_grad(f):
        return jax.grad(lambda p: sum(jnp.sum(g**2) for g in jax.tree.leaves(jax.grad(f)(p))))

    models.assert_trees_close(
        jax.jit(jax.hessian(loss))(params), jax.jit(jax.hessian(ref))(params), **GRAD_TOL
    )
    models.assert_trees_close(
        jax.jit(grad_of_grad(loss))(params), jax.jit(grad_of_grad(ref))(params), **GRAD_TOL
    )


# --- placement of parameters --------------------------------------------------------------------


def _assert_one_row_per_device(leaf, num_stages):
    """Device ``s`` holds exactly row ``s`` of the stage axis, and nothing else."""
    shards = sorted(leaf.addressable_shards, key=lambda sh: sh.index[0].start)
    assert len(shards) == num_stages
    assert len({sh.device for sh in shards}) == num_stages
    for s, shard in enumerate(shards):
        assert shard.data.shape == (1, *leaf.shape[1:])
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(leaf)[s : s + 1])


def test_place_heterogeneous_gives_stage_params():
    """Two stages with different parameter trees and dtypes (f64 and f32) packed into one buffer
    per dtype, stacked on the stage axis."""
    pipe = pj.pipeline(list(models.PAIR_STAGES), chunks=3, mesh=models.make_mesh("explicit", 2))
    params, x = models.pair_params(), models.pair_inputs(7)
    placed = pipe.place(params)
    assert isinstance(placed, pj.StageParams)
    assert placed.num_stages == 2
    assert sorted(str(b.dtype) for b in placed.buffers) == ["float32", "float64"]
    models.assert_trees_equal(placed.unpack(), params)
    np.testing.assert_array_equal(np.asarray(pipe(placed, x)), np.asarray(pipe(params, x)))

    grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(pipe(p, x)))))
    placed_grads = grad(placed)
    assert isinstance(placed_grads, pj.StageParams)
    # Packing and unpacking are exact copies, so the gradients agree to the bit.
    models.assert_trees_equal(placed_grads.unpack(), grad(params))
    # Parameters and their gradients: each device holds its own stage's row only.
    for buf in placed.buffers + placed_grads.buffers:
        _assert_one_row_per_device(buf, 2)


def test_place_homogeneous_shards_the_stage_axis():
    layout = LAYOUTS["stacked"]
    pipe, params, x = build(layout, "always", "explicit", "even")
    placed = pipe.place(params)
    assert jax.tree.structure(placed) == jax.tree.structure(params)
    np.testing.assert_array_equal(np.asarray(pipe(placed, x)), np.asarray(pipe(params, x)))
    loss, _ = losses(layout, pipe, x)
    grad = jax.jit(jax.grad(loss))
    placed_grads = grad(placed, x)
    models.assert_trees_equal(placed_grads, grad(params, x))
    for leaf in jax.tree.leaves((placed, placed_grads)):
        _assert_one_row_per_device(leaf, models.NUM_STACKED)


# --- compilation and input placement -------------------------------------------------------------


def test_second_call_does_not_retrace():
    traces = []

    def counted(p, x, key):
        traces.append(1)
        return models.residual(p, x, key)

    mesh = models.make_mesh("explicit", 2)
    pipe = pj.pipeline(counted, num_stages=2, chunks=3, mesh=mesh)
    params = models.stacked_params(2)
    x = models.stacked_inputs(7)
    y = pipe(params, x)
    after_first = len(traces)
    assert after_first > 0
    y2 = pipe(jax.tree.map(lambda a: a * 0.5, params), x + 1.0)
    assert len(traces) == after_first, "a second call with the same shapes traced the stages again"
    assert not np.array_equal(np.asarray(y), np.asarray(y2))

    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(pipe(p, x))))
    grad(params, x)
    after_grad = len(traces)
    grad(params, x + 2.0)
    assert len(traces) == after_grad


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_inputs_committed_to_another_device_work_eagerly(placement):
    layout = LAYOUTS["tokens"]
    pipe, params, x = build(layout, "except_last", placement, "uneven")
    expected = layout.reference(params, x)
    last = jax.devices()[3]
    x_committed = jax.device_put(x, last)
    models.assert_trees_close(pipe(params, x_committed), expected, **FWD_TOL)
    # Parameters committed to one device and inputs to another.
    params_committed = jax.device_put(params, jax.devices()[0])
    models.assert_trees_close(pipe(params_committed, x_committed), expected, **FWD_TOL)


def test_mesh_with_a_data_axis_beside_the_stage_axis():
    """A 2-D ``(data, stage)`` mesh: the pipeline runs along ``stage`` and matches the composition."""
    mesh = jax.make_mesh((2, 2), ("data", "stage"))
    pipe = pj.pipeline(list(models.PAIR_STAGES), chunks=3, mesh=mesh)
    params, x = models.pair_params(), models.pair_inputs(8)
    ref = lambda p, x: models.compose(models.PAIR_STAGES, p, x)
    models.assert_trees_close(pipe(params, x), ref(params, x), **FWD_TOL)
    loss = lambda f: jax.grad(lambda p, x: jnp.sum(jnp.sin(f(p, x))), argnums=(0, 1))
    models.assert_trees_close(jax.jit(loss(pipe))(params, x), jax.jit(loss(ref))(params, x), **GRAD_TOL)


def _split_types(p, x, key):
    """``f64[b, 3]`` -> ``(bool[b, 3], int32[b, 3], f32[b, 3])``: three dtypes in one boundary."""
    return x > 0.0, jnp.round(x * 10.0).astype(jnp.int32), (x * p["s"][None]).astype(jnp.float32)


def _join_types(p, t, key):
    mask, ints, small = t
    return jnp.where(mask, small.astype(jnp.float64), 0.0) + ints.astype(jnp.float64)


def test_boundary_of_bool_int_and_float32_leaves_travels_exactly():
    """A boundary holding bool, int32 and float32 leaves travels through the per-dtype containers
    unchanged: the forward result equals the composition bitwise, with and without a mesh."""
    stages = [_split_types, _join_types]
    params = [{"s": jnp.asarray([1.0, -2.0, 0.5])}, {}]
    x = models.stacked_inputs(7)
    expected = np.asarray(models.compose(stages, params, x))
    for placement in ("none", "explicit"):
        pipe = pj.pipeline(stages, chunks=3, mesh=models.make_mesh(placement, 2))
        np.testing.assert_array_equal(np.asarray(pipe(params, x)), expected, err_msg=placement)
