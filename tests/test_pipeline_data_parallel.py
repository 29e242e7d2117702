"""Data x pipeline parallelism: ``pj.pipeline(..., mesh=<("data", "stage") mesh>, data_axis_name="data")``.

The mini-batch is cut into ``m`` micro-batches exactly as without a data axis; data shard ``q`` of
``p`` runs micro-batches ``q m / p, ..., (q + 1) m / p - 1`` through its own copy of the pipeline
(parameters replicated over ``data``, sharded over ``stage``), and autodiff sums the parameter
gradients over ``data``. So a 2 x 2 mesh must give what the 1-D pipeline over the same stages
gives on the whole batch: the same outputs (bitwise: the same micro-batches meet the same keys),
with dropout as well, and the same gradients up to the grouping of the sum over micro-batches.

Tolerances (float64): against the composition as in ``test_pipeline_contract.py`` (forward rtol
1e-12, gradients rtol 1e-10 / atol 1e-12); against the 1-D pipeline, gradients rtol 1e-12 (the
data shards' partial sums are added in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import pipejax as pj
from tests import models

FWD_TOL = {"rtol": 1e-12, "atol": 1e-14}
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}
SAME_TOL = {"rtol": 1e-12, "atol": 1e-14}


def mesh2d(kind="explicit"):
    types = (AxisType.Explicit,) * 2 if kind == "explicit" else (AxisType.Auto,) * 2
    return jax.make_mesh((2, 2), ("data", "stage"), axis_types=types)


def mesh1d(kind="explicit"):
    return models.make_mesh(kind, 2)


def drop_res(p, x, key):
    return x + pj.dropout(jnp.tanh(x @ p["w"] + p["b"][None]), key, 0.25)


def homogeneous():
    stages = (drop_res, drop_res)
    return lambda **kw: pj.pipeline(drop_res, num_stages=2, **kw), models.stacked_params(2), stages, True


def heterogeneous():  # f64[b, 2] -> f64[b, 3] -> f64[b, 1], a float32 parameter among float64 ones
    stages = models.PAIR_STAGES
    return lambda **kw: pj.pipeline(list(stages), **kw), models.pair_params(), stages, False


def inputs(layout, batch):
    if layout == "homogeneous":
        return models.stacked_inputs(batch)
    return jnp.asarray(np.random.default_rng(6).normal(size=(batch, 2)))


def value_and_grads(apply, key=None):
    loss = lambda p, x: jnp.sum(jnp.sin(apply(p, x, key)) * jnp.arange(1.0, x.shape[0] + 1.0)[:, None])
    return jax.jit(lambda p, x: (apply(p, x, key), jax.grad(loss, argnums=(0, 1))(p, x)))


# (layout, batch, chunks, checkpoint, mesh kind): m = 4 micro-batches of 3 with 2 padding rows
# (on the last data shard), m = 2 of 6, m = 4 of 2.
CASES = [
    ("homogeneous", 10, 4, "except_last", "explicit"),
    ("heterogeneous", 12, 2, "always", "auto"),
    ("heterogeneous", 8, 4, "never", "explicit"),
]


@pytest.mark.parametrize("layout,batch,chunks,checkpoint,kind", CASES)
def test_matches_the_composition_and_the_1d_pipeline(layout, batch, chunks, checkpoint, kind):
    make, params, stages, stacked = {"homogeneous": homogeneous, "heterogeneous": heterogeneous}[layout]()
    x = inputs(layout, batch)
    two_d = make(chunks=chunks, checkpoint=checkpoint, mesh=mesh2d(kind), data_axis_name="data")
    one_d = make(chunks=chunks, checkpoint=checkpoint, mesh=mesh1d(kind))
    reference = lambda p, x, key=None: models.compose(stages, models.unstack(p, 2) if stacked else p, x)
    got = value_and_grads(two_d)(params, x)
    same = value_and_grads(one_d)(params, x)
    models.assert_trees_equal(got[0], same[0])
    models.assert_trees_close(got[1], same[1], **SAME_TOL)
    want = value_and_grads(reference)(params, x)
    models.assert_trees_close(got[0], want[0], **FWD_TOL)
    models.assert_trees_close(got[1], want[1], **GRAD_TOL)


@pytest.mark.parametrize("per_example_keys", [False, True])
def test_dropout_equals_the_1d_pipeline(per_example_keys):
    """Data shard q's micro-batch j is micro-batch q m / p + j of the mini-batch, and gets its keys."""
    make, params, _, _ = homogeneous()
    x, key = models.stacked_inputs(10), jax.random.key(7)
    kw = {"chunks": 4, "per_example_keys": per_example_keys}
    got = value_and_grads(make(mesh=mesh2d(), data_axis_name="data", **kw), key)(params, x)
    want = value_and_grads(make(mesh=mesh1d(), **kw), key)(params, x)
    models.assert_trees_equal(got[0], want[0])
    models.assert_trees_close(got[1], want[1], **SAME_TOL)
    assert not np.allclose(got[0], value_and_grads(make(mesh=mesh1d(), **kw))(params, x)[0])  # dropout ran


def test_circular_schedule_with_a_data_axis():
    """4 stages, 2 per device (circular), on a 2 x 2 mesh: GPipe over the 4 stages on one device."""
    params, x, key = models.stacked_params(4), models.stacked_inputs(12), jax.random.key(1)
    circular = pj.pipeline(
        drop_res, num_stages=4, chunks=4, schedule="circular", repeats=2, mesh=mesh2d(), data_axis_name="data"
    )
    got = value_and_grads(circular, key)(circular.place(params), x)
    want = value_and_grads(pj.pipeline(drop_res, num_stages=4, chunks=4), key)(params, x)
    models.assert_trees_equal(got[0], want[0])
    as_logical = jax.tree.map(lambda a: np.asarray(a).reshape(4, *a.shape[2:]), got[1][0])
    models.assert_trees_close((as_logical, got[1][1]), want[1], **SAME_TOL)


def spec(a):
    """The sharding of ``a``'s type, one entry per dimension."""
    entries = tuple(jax.typeof(a).sharding.spec)
    return entries + (None,) * (a.ndim - len(entries))


def test_shardings_inputs_outputs_and_gradients():
    """A batch split over ``data`` is used in place; ``y`` comes back split over ``data``; the
    parameters' gradients come back like the parameters (sharded over ``stage`` only)."""
    mesh = mesh2d()
    make, params, stages, _ = homogeneous()
    apply = make(chunks=4, mesh=mesh, data_axis_name="data")
    placed = apply.place(params)
    plain = models.stacked_inputs(8)
    x = jax.device_put(plain, jax.NamedSharding(mesh, PartitionSpec("data")))
    y, (g_params, g_x) = value_and_grads(apply)(placed, x)
    assert spec(y) == ("data", None)
    assert all(spec(g) == ("stage",) + (None,) * (g.ndim - 1) for g in jax.tree.leaves(g_params))
    want = value_and_grads(lambda p, x, key: models.compose(stages, models.unstack(p, 2), x))(params, plain)
    models.assert_trees_close(y, want[0], **FWD_TOL)
    models.assert_trees_close((g_params, g_x), want[1], **GRAD_TOL)
    assert "data" in repr(apply) and apply.schedule(8).num_micro == 2  # micro-batches per data shard


def test_stateful_stats_with_a_data_axis():
    def stage(p, x, key, state, mask):
        h = x + jnp.tanh(x @ p["w"] + p["b"][None])
        return h, {"sum": jnp.sum(jnp.where(mask[:, None], h, 0.0), axis=0), "rows": jnp.sum(mask)}

    params, x = models.stacked_params(2), models.stacked_inputs(10)
    kw = {"num_stages": 2, "chunks": 4, "stateful": True}
    got = pj.pipeline(stage, mesh=mesh2d(), data_axis_name="data", **kw)(params, x)
    want = pj.pipeline(stage, mesh=mesh1d(), **kw)(params, x)
    models.assert_trees_equal(got, want)
    assert got[1]["rows"].tolist() == [[3, 3, 3, 1]] * 2


def test_errors():
    stages = [drop_res] * 2
    with pytest.raises(ValueError, match=r"no axis named 'batch' for `data_axis_name`.*\('data', 'stage'\)"):
        pj.pipeline(stages, mesh=mesh2d(), data_axis_name="batch")
    with pytest.raises(ValueError, match=r"`data_axis_name` and `axis_name` are both 'stage'"):
        pj.pipeline(stages, mesh=mesh2d(), data_axis_name="stage")
    with pytest.raises(ValueError, match=r"`data_axis_name='data'` needs a mesh.*`mesh` is None"):
        pj.pipeline(stages, data_axis_name="data")
    with pytest.raises(TypeError, match=r"`data_axis_name` must be a str or None, but got int 0"):
        pj.pipeline(stages, mesh=mesh2d(), data_axis_name=0)
    mixed = jax.make_mesh((2, 2), ("data", "stage"), axis_types=(AxisType.Auto, AxisType.Explicit))
    with pytest.raises(ValueError, match=r"different axis types"):
        pj.pipeline(stages, mesh=mixed, data_axis_name="data")
    apply = pj.pipeline(drop_res, num_stages=2, chunks=3, mesh=mesh2d(), data_axis_name="data")
    with pytest.raises(ValueError, match=r"cut into 3 micro-batches of 4, which the data axis 'data' of"):
        apply(models.stacked_params(2), jnp.ones((10, 3)))
    with pytest.raises(ValueError, match=r"cut into 1 micro-batches"):
        apply.schedule(1)
