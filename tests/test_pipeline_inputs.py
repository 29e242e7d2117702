"""No input gets a silently different result: the pipeline's outputs and gradients have the dtypes
(weak types included) and values of the composed stages, whatever the dtypes of ``params`` and
``x`` (issue 25)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from pipejax._src import compat

SCHEDULES = ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b")


def scale(p, x, key):
    return x * p


def composed(params, x):
    for p in params:
        x = scale(p, x, None)
    return x


def kind(a):
    """dtype and weak type, e.g. ``~float32`` for a weakly typed float32."""
    t = jax.typeof(a)
    return ("~" if t.weak_type else "") + str(t.dtype)


def weak(a):
    return compat.weakly_typed(jnp.asarray(a))


X8 = np.arange(1, 9, dtype=np.float32).reshape(8, 1) / 8
WEAK_X = jnp.arange(1, 9).reshape(8, 1) / 8  # int / Python float: a weakly typed float array
# (per-stage params, x): Python scalars are weakly typed; so is `int_array / 8`
DTYPES = {
    "python-float-params/bfloat16-x": ([1.5, 0.5, 2.0, 1.0], jnp.asarray(X8, jnp.bfloat16)),
    "python-float-params/float16-x": ([1.5, 0.5, 2.0, 1.0], jnp.asarray(X8, jnp.float16)),
    "python-int-params/float32-x": ([2, 1, 3, 1], jnp.asarray(X8)),
    "python-int-params/bfloat16-x": ([2, 1, 3, 1], jnp.asarray(X8, jnp.bfloat16)),
    "bfloat16-params/float32-x": ([jnp.bfloat16(v) for v in (1.5, 0.5, 2.0, 1.0)], jnp.asarray(X8)),
    "python-float-params/weak-x": ([1.5, 0.5, 2.0, 1.0], WEAK_X),
    "float16-params/weak-x": ([jnp.float16(v) for v in (1.5, 0.5, 2.0, 1.0)], WEAK_X),
    "int32-params/int32-x": ([jnp.int32(v) for v in (2, 1, 3, 1)], jnp.arange(8, dtype=jnp.int32)[:, None]),
}


def close(a, b, dtype):
    # micro-batching changes no arithmetic of the forward pass: bitwise; gradients sum over the
    # batch in another order, which half-precision dtypes round differently
    tol = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}.get(jnp.dtype(dtype).type, 1e-6)
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def coarser(a, b):
    """Of two dtypes, the one :func:`close` allows more for: a gradient is computed in x's
    precision and accumulated over micro-batches in its parameter's."""
    half = (jnp.bfloat16, jnp.float16)
    for dtype in half:
        if dtype in (jnp.dtype(a).type, jnp.dtype(b).type):
            return dtype
    return a


@pytest.mark.parametrize("case", list(DTYPES))
def test_dtypes_and_values_are_those_of_the_composed_stages(case):
    params, x = DTYPES[case]
    mesh = jax.make_mesh((2,), ("stage",))
    with jax.numpy_dtype_promotion("standard"):  # as users run: bfloat16 params with float32 x
        ref = composed(params, x)
        stacked = jnp.stack([jnp.asarray(p) for p in params])
        if all(isinstance(p, (int, float)) for p in params):
            stacked = weak(stacked)  # homogeneous: a weakly typed stacked parameter
        ref_stacked = composed(list(stacked), x)
        two = composed(params[:2], x)
        pipes = {
            "gpipe": (pj.pipeline([scale] * 4, chunks=4), params, ref),
            "gpipe-mesh": (pj.pipeline([scale] * 2, chunks=4, mesh=mesh), params[:2], two),
            "homogeneous": (pj.pipeline(scale, num_stages=4, chunks=4), stacked, ref_stacked),
            "homogeneous-circular-mesh": (
                pj.pipeline(scale, num_stages=4, chunks=2, mesh=mesh, schedule="circular", repeats=2),
                stacked,
                ref_stacked,
            ),
        }
        for name, (pipe, p, want) in pipes.items():
            y = pipe(p, x)
            assert kind(y) == kind(want), (name, kind(y), kind(want))
            close(y, want, want.dtype)
        assert kind(jax.jit(pipes["gpipe"][0])(params, x)) == kind(ref)
        if not all(jnp.issubdtype(jnp.result_type(a), jnp.floating) for a in (x, *params)):
            return  # gradients with respect to floating-point parameters only

        def loss(y, t):
            return jnp.sum((y - t) ** 2, axis=-1)

        ref_loss, ref_grads = jax.value_and_grad(lambda p: jnp.mean(loss(composed(p, x), x)))(params)
        for schedule in SCHEDULES:
            repeats = 2 if schedule in ("circular", "interleaved-1f1b") else 1
            pipe = pj.pipeline([scale] * 4, chunks=4, schedule=schedule, repeats=repeats)
            value, grads = pipe.value_and_grad(loss)(params, x, x)
            assert kind(value) == kind(ref_loss), (schedule, kind(value), kind(ref_loss))
            close(value, ref_loss, x.dtype)  # computed in x's precision
            for g, r, p in zip(grads, ref_grads, params, strict=True):
                assert jnp.result_type(g) == jnp.result_type(r) == jnp.result_type(p), schedule
                close(g, r, coarser(x.dtype, jnp.result_type(p)))  # x's or the parameter's


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_homogeneous_stages_whose_output_is_weakly_typed(schedule):
    """`jnp.where(x > 0.5, 1.5, 0.0)` is weakly typed although `x` is not: the stages still chain, with the
    composed stages' values and dtype."""

    def step(p, x, key):
        return jnp.where(x * p > 0.5, 1.5, 0.0)  # weakly typed, like `(x * p > 0.5) * 1.5`

    stacked, x = jnp.array([1.0, 2.0]), jnp.linspace(0.0, 1.0, 8)[:, None]
    ref = step(stacked[1], step(stacked[0], x, None), None)
    pipe = pj.pipeline(step, num_stages=2, chunks=2, schedule=schedule, mesh=jax.make_mesh((2,), ("stage",)))
    y = pipe(stacked, x)
    assert y.dtype == ref.dtype
    np.testing.assert_array_equal(y, ref)
    loss, _ = pipe.value_and_grad(lambda y, t: jnp.sum(y - t, axis=-1))(stacked, x, x)
    np.testing.assert_allclose(loss, jnp.mean(ref - x), rtol=1e-6)


# --- every bad input gets a clear error -----------------------------------------------------------


def sq(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def four(schedule):
    repeats = 2 if schedule in ("circular", "interleaved-1f1b") else 1
    return pj.pipeline([scale] * 4, chunks=4, schedule=schedule, repeats=repeats), [1.0, 2.0, 0.5, 1.0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_refuses_a_non_float_loss_with_one_message(schedule):
    pipe, params = four(schedule)
    x = jnp.ones((8, 3))
    with pytest.raises(TypeError, match=r"returned losses of dtype int32, but a loss must be floating"):
        pipe.value_and_grad(lambda y, t: jnp.argmax(y, -1).astype(jnp.int32))(params, x, x)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_refuses_integer_parameters_with_one_message(schedule):
    pipe, _ = four(schedule)
    x = jnp.ones((8, 3))
    with pytest.raises(TypeError, match=r"`params` leaf \[1\] has dtype int.*must be floating point"):
        pipe.value_and_grad(sq)([1.0, 2, 0.5, 1.0], x, x)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_refuses_targets_of_another_batch_with_one_message(schedule):
    pipe, params = four(schedule)
    x = jnp.ones((8, 3))
    with pytest.raises(ValueError, match=r"`targets` has a batch of 7 examples but `x` has 8"):
        pipe.value_and_grad(sq)(params, x, x[:7])


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: pj.gpipe_schedule(0, 4), ValueError, r"`num_stages` must be an int >= 1, but got 0"),
        (lambda: pj.gpipe_schedule(-1, 4), ValueError, r"`num_stages` must be an int >= 1, but got -1"),
        (lambda: pj.gpipe_schedule(2, 0), ValueError, r"`num_micro` must be an int >= 1, but got 0"),
        (lambda: pj.gpipe_schedule(True, 4), TypeError, r"`num_stages` must be an int >= 1, but got bool"),
        (lambda: pj.gpipe_schedule(2, 4.0), TypeError, r"`num_micro` must be an int >= 1, but got float 4.0"),
        (lambda: pj.circular_schedule(2, 3, 0), ValueError, r"`repeats` must be an int >= 1, but got 0"),
        (lambda: pj.circular_schedule(0, 3, 2), ValueError, r"`num_devices` must be an int >= 1, but got 0"),
        (lambda: pj.sequential_schedule(3, 0), ValueError, r"`num_micro` must be an int >= 1"),
        (lambda: pj.one_f_one_b_schedule(0, 3), ValueError, r"`num_stages` must be an int >= 1"),
        (lambda: pj.zb_h1_schedule(2, 0), ValueError, r"`num_micro` must be an int >= 1"),
        (lambda: pj.interleaved_one_f_one_b_schedule(2, 4, 0), ValueError, r"`repeats` must be an int >= 1"),
        (
            lambda: pj.interleaved_one_f_one_b_schedule(4, 6, 2),
            ValueError,
            r"`num_micro` must be a multiple of `num_devices=4`, but got 6\. "
            r"Use `num_micro=4` or `num_micro=8`",
        ),
        (lambda: pj.gpipe_bubble_fraction(1, 0), ValueError, r"`num_micro` must be an int >= 1"),
        (lambda: pj.circular_bubble_fraction(2, 4, 0), ValueError, r"`repeats` must be an int >= 1"),
        (lambda: pj.zb_h1_bubble_fraction(2, 4, 1.0, -1.0, 1.0), ValueError, r"`b` must be a finite number"),
        (lambda: pj.zb_h1_schedule(2, 3).bubble_fraction(0, 0, 0), ValueError, r"are all 0"),
    ],
)
def test_schedule_constructors_validate_their_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_numpy_ints_are_counts_too():
    assert pj.gpipe_schedule(np.int64(2), np.int32(3)).num_micro == 3
    assert pj.microbatch_plan(np.int64(10), 4) == (10, 4, 3, 2)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: pj.microbatch_plan(0, 4), ValueError, r"`batch` must be an int >= 1, but got 0"),
        (lambda: pj.microbatch_plan(10, 0), ValueError, r"`chunks` must be an int >= 1, but got 0"),
        (lambda: pj.microbatch_plan(10.0, 2), TypeError, r"`batch` must be an int >= 1, but got float 10.0"),
        (lambda: pj.pipeline([scale] * 2, chunks=2).schedule(0), ValueError, r"`batch` must be an int >= 1"),
        (
            lambda: pj.merge_microbatches(jnp.zeros((2, 4, 1)), pj.microbatch_plan(10, 2)),
            ValueError,
            r"`ys` leaf <root> has shape \(2, 4, 1\), but the plan cuts a batch of 10 into 2 "
            r"micro-batches of 5, so every leaf needs the leading axes \(2, 5\)",
        ),
        (lambda: pj.merge_microbatches(jnp.zeros((2, 5)), (10, 2, 5, 0)), TypeError, r"`p` must be the Plan"),
    ],
)
def test_microbatch_helpers_validate_their_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_split_then_merge_round_trips():
    x = {"a": jnp.arange(10.0), "b": jnp.ones((10, 2))}
    xs, mask, plan = pj.split_microbatches(x, 4)
    assert plan == (10, 4, 3, 2) and mask.shape == (4, 3)
    back = pj.merge_microbatches(xs, plan)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, x))


def test_context_must_be_arrays_with_the_batch():
    pipe, params = four("gpipe")
    x = jnp.ones((8, 3))
    with pytest.raises(TypeError, match=r"`context` leaf <root> is str 'mask'; `context` must be an array"):
        pipe(params, x, context="mask")
    with pytest.raises(TypeError, match=r"`context` leaf \['m'\] is str"):
        pipe.value_and_grad(sq)(params, x, x, context={"m": "mask"})
    with pytest.raises(ValueError, match=r"`context` has a batch of 7 examples but `x` has 8"):
        pipe(params, x, context=jnp.ones((7, 2)))
    with pytest.raises(TypeError, match=r"`x` leaf <root> is str"):
        pipe(params, "abc")


def test_a_manual_stage_axis_is_refused():
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(jax.sharding.AxisType.Manual,))
    with pytest.raises(ValueError, match=r"`mesh` axis 'stage' \(`axis_name`\) has type AxisType.Manual"):
        pj.pipeline([scale] * 2, mesh=mesh)


@pytest.mark.parametrize("name,error", [("", ValueError), (None, TypeError)])
def test_axis_names_must_be_non_empty_strings(name, error):
    mesh = jax.make_mesh((2,), ("stage",))
    with pytest.raises(error, match=r"`axis_name` (is the empty string|must be a str, but got NoneType)"):
        pj.pipeline([scale] * 2, mesh=mesh, axis_name=name)
    mesh2 = jax.make_mesh((2, 2), ("data", "stage"))
    with pytest.raises(ValueError, match=r"`data_axis_name` is the empty string"):
        pj.pipeline([scale] * 2, mesh=mesh2, data_axis_name="")


def test_a_stage_without_a_key_argument_says_stages_take_one():
    with pytest.raises(TypeError, match=r"Stage 0, `.*\(p, x\)`, cannot be called.*`\(params, x, key\)`"):
        pj.pipeline([lambda p, x: x * p] * 2, chunks=2)([2.0, 3.0], X8)
    with pytest.raises(TypeError, match=r"`\(params, x, key, state, mask\)`"):
        pj.pipeline([lambda p, x, k: (x * p, None)] * 2, stateful=True)([2.0, 3.0], X8)


def test_stages_with_star_args_defaults_or_partial_are_accepted():
    import functools

    def scaled(p, x, key, factor):
        return x * p * factor

    star, defaults = (lambda *a: a[1] * a[0]), (lambda p, x, key=None, z=1: x * p)
    stages = [star, functools.partial(scaled, factor=2.0), defaults]
    y = pj.pipeline(stages, chunks=2)([2.0, 3.0, 0.5], X8)
    np.testing.assert_allclose(y, X8 * 6.0)


def test_stage_params_for_another_number_of_stages_says_how_to_fix_it():
    mesh = jax.make_mesh((4,), ("stage",))
    packed = pj.pipeline([scale] * 3).place([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"`params` packs 3 stages, but the pipeline has 4 stages\. Pack"):
        pj.pipeline([scale] * 4, mesh=mesh)(packed, X8)


def test_interleaved_suggests_the_nearest_chunks_that_work():
    mesh = jax.make_mesh((4,), ("stage",))
    pipe = pj.pipeline([scale] * 8, chunks=6, schedule="interleaved-1f1b", repeats=2, mesh=mesh)
    x = jnp.ones((12, 1))
    with pytest.raises(ValueError, match=r"batch of 12 with `chunks=6` gives 6 .*`chunks=4` \(or 12\)"):
        pipe.value_and_grad(sq)([1.0] * 8, x, x)


def test_a_mean_loss_is_refused_quoting_the_users_batch():
    pipe = pj.pipeline([scale] * 2, chunks=4, schedule="1f1b")
    x = jnp.ones((16, 2))
    with pytest.raises(ValueError, match=r"losses one per example of the batch of 16: shape \(4,\) per call"):
        pipe.value_and_grad(lambda y, t: jnp.mean(sq(y, t)))([1.0, 2.0], x, x)


def test_partition_without_layers_points_to_pj_balance():
    with pytest.raises(ValueError, match=r"`layers` is empty.*`balance` \[1\] asks for 1.*pj\.balance\("):
        pj.partition([], [1])


class Mine(Exception):
    pass


@pytest.mark.parametrize("by", ["time", "flops", "memory"])
def test_layer_costs_keeps_a_users_exception_with_a_note(by):
    def broken(p, x, key):
        raise Mine("mine")

    with pytest.raises(Mine, match="mine") as info:
        pj.layer_costs([broken], [None], jnp.ones((2, 1)), by=by)
    assert any("Layer 0 failed on `sample_x`" in note for note in info.value.__notes__)


# --- uneven batches on an Explicit data axis ------------------------------------------------------


def test_an_uneven_batch_on_an_explicit_data_axis_equals_the_composed_stages():
    mesh = jax.make_mesh((2, 2), ("data", "stage"))  # Explicit axes, JAX's default
    stage = lambda p, x, key: jnp.sin(x * p)
    pipe = pj.pipeline([stage] * 2, chunks=4, mesh=mesh, data_axis_name="data")
    x = jnp.arange(7.0).reshape(7, 1) / 7
    ref = lambda p: stage(p[1], stage(p[0], x, None), None)
    params = [2.0, 3.0]
    np.testing.assert_allclose(pipe(params, x), ref(params), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(pipe)(params, x), ref(params), rtol=1e-6)
    want = jax.grad(lambda p: jnp.sum(ref(p)))(params)
    got = jax.jit(jax.grad(lambda p: jnp.sum(pipe(p, x))))(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(pipe(params, x), ref(params), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(lambda p: jnp.sum(pipe(p, x)))(params), want, rtol=1e-6)
    loss, grads = pipe.value_and_grad(lambda y, t: jnp.sum(y, axis=-1))(params, x, x)
    np.testing.assert_allclose(loss, jnp.mean(ref(params)), rtol=1e-6)
    np.testing.assert_allclose(grads, [g / 7 for g in want], rtol=1e-6)
