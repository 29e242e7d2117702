"""Bad input raises ``ValueError``/``TypeError`` (never a raw XLA error) at construction or trace
time, with a message that names the argument and the value received."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models


def affine(p, x, key):
    return x * p["w"]


def pair():
    return pj.pipeline([affine, affine], chunks=2), [{"w": 2.0}, {"w": 3.0}]


X = jnp.ones((4, 3))


# --- construction -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [0, -3])
def test_chunks_below_one(chunks):
    with pytest.raises(ValueError, match=rf"`chunks` must be an int >= 1.*got {chunks}"):
        pj.pipeline([affine], chunks=chunks)


@pytest.mark.parametrize("chunks,shown", [(2.0, "float 2.0"), (True, "bool True"), ("4", "str '4'")])
def test_chunks_not_an_int(chunks, shown):
    with pytest.raises(TypeError, match=rf"`chunks` must be an int.*got {re.escape(shown)}"):
        pj.pipeline([affine], chunks=chunks)


def test_unknown_checkpoint_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="`checkpoint`") as info:
        pj.pipeline([affine], checkpoint="sometimes")
    message = str(info.value)
    assert "'sometimes'" in message
    for mode in pj.CHECKPOINT_MODES:
        assert repr(mode) in message
    assert "policy" in message


def test_checkpoint_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"`checkpoint`.*got int 3"):
        pj.pipeline([affine], checkpoint=3)


CP = jax.checkpoint_policies


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (jax.checkpoint, r"got `jax.checkpoint` itself.*pass what it may save"),
        (CP.save_only_these_names, r"`jax.checkpoint_policies.save_only_these_names` uncalled.*Call it"),
        (CP.save_any_names_but_these, r"save_any_names_but_these` uncalled"),
        (CP.save_from_both_policies, r"save_from_both_policies` uncalled.*policy_1, policy_2"),
        (CP.save_and_offload_only_these_names, r"save_and_offload_only_these_names` uncalled"),
        (lambda: True, r"got <lambda>\(\), which cannot be called as JAX calls a policy"),
        (lambda prim, x: True, r"<lambda>\(prim, x\), which cannot be called.*def policy\(prim, \*args"),
        (bool, r"got type <class 'bool'>"),
    ],
    ids=[
        "jax.checkpoint",
        "factory",
        "factory-but",
        "factory-both",
        "factory-offload",
        "arity-0",
        "arity-2",
        "class",
    ],
)
@pytest.mark.parametrize("where", ["pipeline", "checkpoint_sequential"])
def test_checkpoint_values_that_are_not_a_mode_or_a_policy(where, value, match):
    """Refused when the pipeline (every schedule checks one rule) or `checkpoint_sequential` is
    built, before JAX calls them as policies."""
    if where == "pipeline":
        for schedule in ("gpipe", "1f1b"):
            with pytest.raises(TypeError, match=r"^`checkpoint` must be one of 'always'.*" + match):
                pj.pipeline([affine, affine], checkpoint=value, schedule=schedule)
    else:
        with pytest.raises(TypeError, match=r"^`policy` of checkpoint_sequential.*" + match):
            pj.checkpoint_sequential(affine, policy=value)


@pytest.mark.parametrize(
    ("policy", "got"),
    [(lambda prim, *a, **k: None, "None"), (lambda prim, *a, **k: lambda *a, **k: True, "a function")],
    ids=["no-return", "a-factory"],
)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "sequential"])
def test_a_policy_that_returns_no_decision(schedule, policy, got):
    """A policy's result is checked where JAX calls it: None (a missing `return`) or a function
    (a factory given a primitive) is no decision, and JAX would read it as one."""
    match = rf"policy '<lambda>' returned {got} for the primitive .*Return a bool"
    w = jnp.ones((2, 3))
    with pytest.raises(TypeError, match=match):
        if schedule == "sequential":
            apply = pj.checkpoint_sequential(lambda p, x, k: jnp.tanh(x * p[None]), policy=policy)
            jax.grad(lambda p: apply(p, X).sum())(w)
        else:
            pipe = pj.pipeline([affine, affine], chunks=2, checkpoint=policy, schedule=schedule)
            params = [{"w": jnp.ones((1, 3))}, {"w": jnp.ones((1, 3))}]
            pipe.value_and_grad(lambda y, t: jnp.sum((y - t) ** 2, axis=-1))(params, X, X)


def test_no_stages():
    with pytest.raises(ValueError, match=r"`stages` is empty"):
        pj.pipeline([])


def test_stage_not_callable():
    with pytest.raises(TypeError, match=r"`stages\[1\]` must be a callable.*got int 3"):
        pj.pipeline([affine, 3])


def test_stages_not_a_sequence():
    with pytest.raises(TypeError, match=r"`stages` must be a sequence.*got int"):
        pj.pipeline(3)


def test_homogeneous_function_without_num_stages():
    with pytest.raises(TypeError, match=r"`num_stages`"):
        pj.pipeline(affine)


@pytest.mark.parametrize("num_stages,error", [(0, ValueError), (-1, ValueError), (2.0, TypeError)])
def test_bad_num_stages(num_stages, error):
    with pytest.raises(error, match=rf"`num_stages` must be an int >= 1.*got .*{num_stages!r}"):
        pj.pipeline(affine, num_stages=num_stages)


def test_num_stages_disagrees_with_the_stage_list():
    with pytest.raises(ValueError, match=r"`num_stages` is 3 but 2 stage functions"):
        pj.pipeline([affine, affine], num_stages=3)


def test_mesh_without_the_stage_axis():
    mesh = jax.make_mesh((2,), ("data",))
    with pytest.raises(ValueError, match=r"`mesh` has no axis named 'stage'.*\('data',\)"):
        pj.pipeline([affine, affine], mesh=mesh)


def test_mesh_with_a_custom_axis_name_is_accepted():
    mesh = jax.make_mesh((2,), ("pipe",))
    apply = pj.pipeline([affine, affine], mesh=mesh, axis_name="pipe")
    np.testing.assert_array_equal(np.asarray(apply([{"w": 2.0}, {"w": 3.0}], X)), np.asarray(X * 6.0))


def test_mesh_stage_axis_of_the_wrong_size():
    mesh = jax.make_mesh((2,), ("stage",))
    with pytest.raises(ValueError, match=r"`mesh` axis 'stage' has size 2, but the pipeline has 3 stages"):
        pj.pipeline([affine] * 3, mesh=mesh)


def test_mesh_not_a_mesh():
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh or None.*got str"):
        pj.pipeline([affine], mesh="stage")


def test_axis_name_not_a_string():
    with pytest.raises(TypeError, match=r"`axis_name` must be a str.*got int 0"):
        pj.pipeline([affine], axis_name=0)


# --- parameters ------------------------------------------------------------------------------------


def test_params_count_differs_from_stage_count():
    apply, params = pair()
    with pytest.raises(ValueError, match=r"`params` has 3 entries but the pipeline has 2 stages"):
        apply([*params, {"w": 1.0}], X)
    with pytest.raises(ValueError, match=r"`params` has 1 entry but the pipeline has 2 stages"):
        apply(params[:1], X)


def test_params_not_a_sequence_for_heterogeneous_stages():
    apply, _ = pair()
    with pytest.raises(TypeError, match=r"`params` must be a sequence.*2 stages.*got dict"):
        apply({"w": 2.0}, X)


def test_homogeneous_params_without_the_stacked_axis():
    apply = pj.pipeline(models.residual, num_stages=2)
    params = {"w": jnp.zeros((3, 3)), "b": jnp.zeros((2, 3))}
    with pytest.raises(
        ValueError, match=r"leading stage axis of size 2.*`params` leaf \['w'\] has shape \(3, 3\)"
    ):
        apply(params, X)


def test_homogeneous_scalar_params():
    apply = pj.pipeline(affine, num_stages=2)
    with pytest.raises(ValueError, match=r"leading stage axis of size 2.*\['w'\] has shape \(\)"):
        apply({"w": 2.0}, X)


def test_stage_params_for_homogeneous_stages():
    placed = pj.pipeline([affine, affine]).place([{"w": jnp.ones(())}, {"w": jnp.ones(())}])
    with pytest.raises(TypeError, match=r"`params` is a StageParams.*homogeneous"):
        pj.pipeline(affine, num_stages=2)(placed, X)


def test_stage_params_with_another_stage_count():
    placed = pj.pipeline([affine, affine]).place([{"w": jnp.ones(())}, {"w": jnp.ones(())}])
    with pytest.raises(ValueError, match=r"`params` packs 2 stages, but the pipeline has 3"):
        pj.pipeline([affine] * 3)(placed, X)


# --- inputs ---------------------------------------------------------------------------------------


def test_leaves_of_x_with_different_batch_sizes():
    apply, params = pair()
    x = {"a": jnp.ones((4, 3)), "b": jnp.ones((5,))}
    with pytest.raises(ValueError, match=r"`x` must share the leading batch axis.*\['a'\]: 4.*\['b'\]: 5"):
        apply(params, x)


def test_scalar_leaf_in_x():
    apply, params = pair()
    with pytest.raises(ValueError, match=r"`x` leaf \['s'\] is a scalar"):
        apply(params, {"a": X, "s": jnp.ones(())})


def test_empty_batch():
    apply, params = pair()
    with pytest.raises(ValueError, match=r"`x` has an empty batch"):
        apply(params, jnp.ones((0, 3)))


def test_x_without_leaves():
    apply, params = pair()
    with pytest.raises(ValueError, match=r"`x` has no array leaves"):
        apply(params, {})


# --- stages that do not fit together ----------------------------------------------------------------


def _dense(p, x, key):
    return x @ p["w"]


def test_stage_output_cannot_feed_the_next_stage():
    apply = pj.pipeline([_dense, _dense], chunks=2)
    params = [{"w": jnp.ones((3, 5))}, {"w": jnp.ones((4, 2))}]  # stage 1 expects width 4, gets 5
    with pytest.raises(
        ValueError, match=r"Stage 1 could not be applied to the output of stage 0.*float64\[2, 5\]"
    ):
        apply(params, X)


def test_stage_that_fails_on_x():
    apply = pj.pipeline([_dense], chunks=2)
    with pytest.raises(ValueError, match=r"Stage 0 could not be applied to a micro-batch of `x`"):
        apply([{"w": jnp.ones((7, 2))}], X)


def test_stage_that_drops_the_batch_axis():
    apply = pj.pipeline([affine, lambda p, x, key: jnp.sum(x, axis=0)], chunks=2)
    with pytest.raises(
        ValueError, match=r"Stage 1 returned leaf <root> with shape \(3,\).*micro-batch axis first \(size 2\)"
    ):
        apply([{"w": 2.0}, {}], X)


def test_stage_that_returns_a_scalar():
    apply = pj.pipeline([lambda p, x, key: jnp.sum(x)], chunks=2)
    with pytest.raises(ValueError, match=r"Stage 0 returned leaf <root> with shape \(\)"):
        apply([{}], X)


def test_homogeneous_stage_that_changes_the_activation_type():
    apply = pj.pipeline(_dense, num_stages=2)
    with pytest.raises(ValueError, match=r"Homogeneous stages must return.*float64\[4, 3\].*float64\[4, 5\]"):
        apply({"w": jnp.ones((2, 3, 5))}, X)


def test_errors_are_raised_under_jit_too():
    apply = pj.pipeline([_dense, _dense], chunks=2)
    params = [{"w": jnp.ones((3, 5))}, {"w": jnp.ones((4, 2))}]
    with pytest.raises(ValueError, match=r"Stage 1 could not be applied"):
        jax.jit(apply)(params, X)
    with pytest.raises(ValueError, match=r"must share the leading batch axis"):
        jax.jit(apply)(params, {"a": X, "b": jnp.ones((2,))})


# --- keys -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,shown",
    [
        (0, "int with shape None and dtype None"),
        (jnp.zeros(2), "with shape (2,) and dtype float64"),
        (jnp.zeros((3,), jnp.uint32), "with shape (3,) and dtype uint32"),
    ],
)
def test_key_that_is_not_a_key(key, shown):
    apply, params = pair()
    with pytest.raises(TypeError, match=rf"`key` must be None or a PRNG key.*{re.escape(shown)}"):
        apply(params, X, key=key)


def test_key_array_instead_of_one_key():
    apply, params = pair()
    with pytest.raises(TypeError, match=r"`key` must be a single PRNG key.*shape \(2,\)"):
        apply(params, X, key=jax.random.split(jax.random.key(0)))


def test_stage_that_returns_none():
    def forgot_return(p, x, key):
        x * 2.0

    apply = pj.pipeline([affine, forgot_return], chunks=2)
    with pytest.raises(ValueError, match=r"Stage 1 returned None, which holds no arrays.*missing `return`"):
        apply([{"w": 2.0}, {}], X)


# --- unusual input found by trying the API (issue 12) --------------------------------------------


class StageFailure(Exception):
    """A user's own exception type."""


def test_a_users_exception_keeps_its_type_with_pipejax_context_as_a_note():
    def failing(p, x, key):
        raise StageFailure("my stage failed")

    apply = pj.pipeline([affine, failing], chunks=2)
    with pytest.raises(StageFailure, match="my stage failed") as info:
        apply([{"w": 2.0}, {}], X)
    assert "Stage 1 failed while pipejax inferred its output type on the output of stage 0" in str(
        info.value.__notes__
    )


def test_wrong_parameter_structure_keeps_the_key_error():
    with pytest.raises(KeyError, match="'w'") as info:
        pj.pipeline([affine], chunks=2)([{"v": 1.0}], X)
    assert "Stage 0 failed" in info.value.__notes__[0]


def test_a_collective_inside_a_stage_states_the_rule():
    def collective(p, x, key):
        return x * jax.lax.axis_index("stage")

    apply = pj.pipeline([collective, affine], chunks=2, mesh=models.make_mesh("explicit", 2))
    with pytest.raises(NameError) as info:
        apply(apply.place([{}, {"w": 1.0}]), X)
    assert "must not call collectives over the pipeline's mesh axes" in info.value.__notes__[0]


def test_python_control_flow_on_a_traced_value_says_so():
    def branchy(p, x, key):
        return x if jnp.sum(x) > 0 else -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        pj.pipeline([branchy], chunks=2)([{}], X)
    assert "use `jnp.where`, `lax.cond` or `lax.select`" in info.value.__notes__[0]


def test_numpy_integers_are_accepted_for_counts():
    apply = pj.pipeline(affine, num_stages=np.int64(2), chunks=np.int64(2))
    assert apply.num_stages == 2 and apply.chunks == 2 and type(apply.chunks) is int
    y = apply({"w": jnp.array([2.0, 3.0])}, X)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(X * 6.0))
    circular = pj.pipeline(affine, num_stages=4, schedule="circular", repeats=np.int32(2))
    assert circular.repeats == 2


@pytest.mark.parametrize("s", [7, -3, 2])
def test_stage_index_out_of_range_is_an_error(s):
    apply, params = pair()
    with pytest.raises(IndexError, match=rf"`s` is {s}, but there are 2 stages"):
        apply.stage_params(params, s)
    with pytest.raises(IndexError, match=rf"`s` is {s}, but there are 2 stages"):
        apply.place(params).stage(s)
    models.assert_trees_equal(apply.stage_params(params, -1), params[1])  # from the end, as in Python


def test_partition_without_a_balance_points_to_pj_balance():
    layers = [affine] * 3
    with pytest.raises(TypeError, match=r"`pj.partition` needs `balance`.*pj.balance\(layers"):
        pj.partition(layers)
    with pytest.raises(ValueError, match=r"sums to 2 layers.*pj.balance\("):
        pj.partition(layers, [1, 1])


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_typed_prng_keys_travel_in_x_and_params(placement):
    """Keys are ordinary data: in ``x``, across a stage boundary, and in (packed) parameters."""

    def first(p, x, key):
        noise = jax.vmap(lambda k: jax.random.normal(k, (3,)))(x["k"])
        return {"h": x["h"] * p["w"] + noise, "k": x["k"]}

    def second(p, x, key):
        return x["h"] * p["w"] + jax.random.normal(p["k"], (1, 3))

    x = {"h": X, "k": jax.random.split(jax.random.key(0), 4)}
    params = [{"w": 2.0}, {"w": 3.0, "k": jax.random.key(1)}]
    apply = pj.pipeline([first, second], chunks=2, mesh=models.make_mesh(placement, 2))
    expected = second(params[1], first(params[0], x, None), None)
    np.testing.assert_allclose(np.asarray(apply(apply.place(params), x)), np.asarray(expected), rtol=1e-12)


def test_eager_autodiff_on_an_explicit_mesh_says_to_jit():
    apply, params = pair()
    apply = pj.pipeline([affine, affine], chunks=2, mesh=models.make_mesh("explicit", 2))
    placed = apply.place(params)
    with pytest.raises(ValueError, match=r"differentiated outside `jax.jit`.*jax.set_mesh"):
        jax.grad(lambda p: jnp.sum(apply(p, X)))(placed)
    jitted = jax.jit(jax.grad(lambda p: jnp.sum(apply(p, X))))(placed)  # the fix the message gives
    np.testing.assert_allclose(np.asarray(apply.stage_params(jitted, 0)["w"]), 3.0 * 12)


# --- another mesh context (`jax.set_mesh`) --------------------------------------------------------


def test_a_pipeline_runs_eagerly_inside_another_mesh_context():
    """Eagerly, a pipeline runs on its own mesh (`mesh=None`: one device, inputs committed to it
    too) whatever mesh `jax.set_mesh` set; traced inside a program under another mesh, one on a
    mesh is refused with pipejax's message (JAX's shard_map needs the two to match)."""
    mesh2 = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    mesh4 = jax.make_mesh((4,), ("stage",))
    params = jax.device_put([{"w": 2.0}, {"w": 3.0}], jax.devices()[0])  # committed to one device
    x = jnp.arange(8.0).reshape(4, 2)
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)
    for mesh in (None, mesh2):
        pipe = pj.pipeline([affine, affine], chunks=2, mesh=mesh, schedule="1f1b")
        want_y, want_loss = np.asarray(pipe(params, x)), float(pipe.value_and_grad(sq)(params, x, x)[0])
        with jax.set_mesh(mesh4):
            np.testing.assert_array_equal(np.asarray(pipe(params, x)), want_y)
            assert float(jax.device_get(pipe.value_and_grad(sq)(params, x, x)[0])) == want_loss
            if mesh is not None:
                with pytest.raises(
                    ValueError,
                    match=r"runs on the mesh \{'stage': 2\} \(Explicit\), but it is "
                    r"traced inside `jax.set_mesh` of another mesh, \{'stage': 4\}",
                ):
                    jax.jit(lambda p, _pipe=pipe: _pipe(p, x))(jax.device_get(params))


def test_table_helpers_check_their_flags_and_stage_params_its_params():
    with pytest.raises(TypeError, match=r"`per_stage` of Schedule.in_flight must be True or False"):
        pj.one_f_one_b_schedule(2, 4).in_flight(per_stage="yes")
    pipe = pj.pipeline([affine, affine])
    with pytest.raises(TypeError, match=r"`params` must be a sequence"):
        pipe.stage_params({"w": 2.0}, 0)
