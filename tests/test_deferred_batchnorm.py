"""Deferred BatchNorm through a stateful pipeline, against numpy and Flax on the whole batch.

The model (float32 unless stated): stage 0 is ``x @ w`` then BatchNorm then ``tanh``; stage 1 a
dense ``tanh`` layer without state; stage 2 BatchNorm then a linear head. The independent reference
is numpy in float64, micro-batch by micro-batch over the real rows only (a padding row never
exists there), so it shares no code with ``pj.batch_norm``.

Tolerances:
* running statistics after one mini-batch vs numpy on the whole batch: atol 1e-5 and rtol 1e-5,
  the requirement. The float32 pipeline's BN inputs differ from the float64 reference by a few
  float32 ulp (about 1e-7 relative), which the statistics inherit.
* outputs vs the numpy micro-batch loop: rtol 1e-5, atol 1e-5 (float32 through two
  normalisations and three matmuls; observed errors are below 1e-6).
* gradients and HVPs (float64 run): rtol 1e-10, atol 1e-12, as in the pipeline contract tests
  (batch sums reordered across micro-batches).
"""

from __future__ import annotations

import functools
import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models

EPS = 1e-5
MOMENTUM = 0.9
STATS_TOL = {"rtol": 1e-5, "atol": 1e-5}


def make_stages(train):
    def norm(h, p, state, mask):
        return pj.batch_norm(h, state, train=train, mask=mask, scale=p["g"], bias=p["b"], epsilon=EPS)

    def bn_in(p, x, key, state, mask):
        h, mom = norm(x @ p["w"], p, state, mask)
        return jnp.tanh(h), mom

    def dense(p, h, key, state, mask):
        return jnp.tanh(h @ p["w"]), None

    def bn_out(p, h, key, state, mask):
        h, mom = norm(h, p, state, mask)
        return h @ p["v"], mom

    return [bn_in, dense, bn_out]


def model(dtype=np.float32, seed=0):
    r = np.random.default_rng(seed)
    a = lambda *shape, scale=1.0: jnp.asarray(r.normal(size=shape) * scale, dtype)
    params = [
        {"w": a(2, 4), "g": a(4, scale=0.3) + 1, "b": a(4, scale=0.3)},
        {"w": a(4, 3)},
        {"g": a(3, scale=0.3) + 1, "b": a(3, scale=0.3), "v": a(3, 2)},
    ]
    state = [pj.batch_norm_init(4, dtype), None, pj.batch_norm_init(3, dtype)]
    return params, state


def inputs(batch, dtype=np.float32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, 2)) * 2.0 + 3.0, dtype)


# --- the numpy reference: the micro-batch loop over real rows, float64 ------------------------------


def np_bn(h, stats, p, train):
    mean, var = (h.mean(0), h.var(0)) if train else (np.asarray(stats.mean), np.asarray(stats.var))
    return (h - mean) / np.sqrt(var + EPS) * np.asarray(p["g"]) + np.asarray(p["b"])


def np_reference(params, state, x, chunks, train=True):
    """``(y, [BN-0 inputs, BN-2 inputs])`` with each micro-batch normalised by its own stats."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    b = math.ceil(len(x) / chunks)
    ys, seen0, seen2 = [], [], []
    for i in range(0, len(x), b):
        h0 = x[i : i + b] @ p[0]["w"]
        h = np.tanh(np_bn(h0, state[0], p[0], train))
        h2 = np.tanh(h @ p[1]["w"])
        ys.append(np_bn(h2, state[2], p[2], train) @ p[2]["v"])
        seen0.append(h0)
        seen2.append(h2)
    return np.concatenate(ys), [np.concatenate(seen0), np.concatenate(seen2)]


def expected_running(init, seen, unbiased=True):
    """One momentum update of ``init`` with the whole batch's mean and (unbiased) variance."""
    mean, var = seen.mean(0), seen.var(0, ddof=1 if unbiased else 0)
    return (
        MOMENTUM * np.asarray(init.mean) + (1 - MOMENTUM) * mean,
        MOMENTUM * np.asarray(init.var) + (1 - MOMENTUM) * var,
    )


# --- pipeline runs, cached across tests -------------------------------------------------------------


@functools.cache
def run(batch, chunks, mode="except_last", placement="none", train=True):
    mesh = models.make_mesh(placement, 3)
    pipe = pj.pipeline(make_stages(train), chunks=chunks, checkpoint=mode, mesh=mesh, stateful=True)
    params, state = model()
    if not train:  # evaluate with the running statistics of one training step
        _, stats = run(batch, chunks)
        state = update(state, stats)
    return pipe(params, inputs(batch), state=state)


def update(state, stats, **kw):
    kw.setdefault("momentum", MOMENTUM)
    pairs = zip(state, stats, strict=True)
    return [None if st is None else pj.batch_norm_update(st, s, **kw) for st, s in pairs]


# (batch, chunks, placement): chunks 1 (one micro-batch), even (b = 4, m = 3), uneven (b = 3, m = 4,
# 2 padding rows; b = 4, m = 3, 2 padding rows); with and without a mesh.
CASES = [(12, 1, "none"), (12, 3, "none"), (10, 4, "none"), (10, 4, "explicit"), (10, 3, "explicit")]


@pytest.mark.parametrize("batch,chunks,placement", CASES)
def test_running_stats_after_one_mini_batch_equal_the_whole_batch(batch, chunks, placement):
    _, stats = run(batch, chunks, placement=placement)
    m = pj.microbatch_plan(batch, chunks).num_micro
    assert stats[0].mean.shape == (m, 4) and stats[1] is None and stats[2].m2.shape == (m, 3)
    assert float(stats[0].count.sum()) == batch  # padding rows never count
    params, state = model()
    _, seen = np_reference(params, state, inputs(batch), chunks)
    new = update(state, stats)
    for layer, rows in zip((new[0], new[2]), seen, strict=True):
        mean, var = expected_running(pj.batch_norm_init(rows.shape[1]), rows)
        np.testing.assert_allclose(layer.mean, mean, **STATS_TOL)
        np.testing.assert_allclose(layer.var, var, **STATS_TOL)
        assert layer.mean.dtype == layer.var.dtype == jnp.float32


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_outputs_and_stats_bitwise_across_checkpoint_modes(placement):
    """Every checkpoint mode gives the same bits; a mesh agrees with no mesh to float32 rounding.

    (XLA compiles the stage's reductions in two different programs with and without a mesh, and
    may order them differently or contract into FMAs: a few float32 ulp.)
    """
    reference = run(10, 4, "except_last", placement)
    for mode in pj.CHECKPOINT_MODES:  # (tests/test_stage_state.py adds a checkpoint policy)
        models.assert_trees_equal(run(10, 4, mode, placement), reference)
    models.assert_trees_close(reference, run(10, 4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch,chunks", [(10, 4), (12, 1)])
def test_biased_option_matches_flax_batch_norm_on_the_whole_batch(batch, chunks):
    _, stats = run(batch, chunks)
    params, state = model()
    _, seen = np_reference(params, state, inputs(batch), chunks)
    new = update(state, stats, unbiased=False)
    for layer, rows in zip((new[0], new[2]), seen, strict=True):
        bn = nn.BatchNorm(use_running_average=False, momentum=MOMENTUM, epsilon=EPS)
        rows = jnp.asarray(rows, jnp.float32)
        variables = bn.init(jax.random.key(0), rows)
        _, updated = bn.apply(variables, rows, mutable=["batch_stats"])
        np.testing.assert_allclose(layer.mean, updated["batch_stats"]["mean"], **STATS_TOL)
        np.testing.assert_allclose(layer.var, updated["batch_stats"]["var"], **STATS_TOL)


@pytest.mark.parametrize("batch,chunks", [(10, 4), (12, 3)])
def test_each_micro_batch_is_normalised_with_its_own_statistics(batch, chunks):
    y, _ = run(batch, chunks)
    params, state = model()
    y_ref, _ = np_reference(params, state, inputs(batch), chunks)
    np.testing.assert_allclose(y, y_ref, **STATS_TOL)
    # Normalising with whole-batch statistics instead would give a clearly different output.
    y_whole, _ = np_reference(params, state, inputs(batch), 1)
    assert np.max(np.abs(y_whole - y_ref)) > 1e-2


def test_eval_mode_uses_the_running_statistics():
    y, stats = run(10, 4, placement="explicit", train=False)
    assert stats == [None, None, None]  # evaluation reports nothing and updates nothing
    params, state = model()
    _, train_stats = run(10, 4)
    y_ref, _ = np_reference(params, update(state, train_stats), inputs(10), 4, train=False)
    np.testing.assert_allclose(y, y_ref, **STATS_TOL)
    # Running statistics make evaluation independent of how the batch is cut.
    one_chunk = pj.pipeline(make_stages(False), stateful=True)
    y_one, _ = one_chunk(params, inputs(10), state=update(state, train_stats))
    np.testing.assert_allclose(y, y_one, rtol=1e-6, atol=1e-6)  # float32, only matmul blocking differs


def test_homogeneous_batch_norm_stages_update_with_vmap():
    """Stacked BN state and stats: ``jax.vmap(pj.batch_norm_update)`` over the stage axis."""

    def stage(p, x, key, state, mask):
        h, mom = pj.batch_norm(x @ p["w"], state, train=True, mask=mask, epsilon=EPS)
        return jnp.tanh(h), mom

    r = np.random.default_rng(5)
    w = jnp.asarray(r.normal(size=(3, 3, 3)), jnp.float32)
    state = jax.tree.map(lambda a: jnp.stack([a] * 3), pj.batch_norm_init(3))
    x = jnp.asarray(r.normal(size=(10, 3)) + 2.0, jnp.float32)
    pipe = pj.pipeline(stage, num_stages=3, chunks=4, mesh=models.make_mesh("explicit", 3), stateful=True)
    _, stats = pipe(pipe.place({"w": w}), x, state=pipe.place(state))
    new = jax.vmap(functools.partial(pj.batch_norm_update, momentum=MOMENTUM))(state, stats)
    h = np.asarray(x, np.float64)
    for s in range(3):
        seen = []
        for i in range(0, 10, 3):  # b = 3: micro-batches of 3, 3, 3, 1 real rows
            part = h[i : i + 3] @ np.asarray(w[s], np.float64)
            seen.append(part)
            h[i : i + 3] = np.tanh((part - part.mean(0)) / np.sqrt(part.var(0) + EPS))
        mean, var = expected_running(pj.batch_norm_init(3), np.concatenate(seen))
        np.testing.assert_allclose(new.mean[s], mean, **STATS_TOL)
        np.testing.assert_allclose(new.var[s], var, **STATS_TOL)


# --- autodiff, float64 ----------------------------------------------------------------------------------


def test_gradients_and_hvp_match_the_per_micro_batch_composition():
    stages = make_stages(True)
    params, state = model(np.float64)
    x = inputs(10, np.float64)
    mesh = models.make_mesh("explicit", 3)  # ("always" on a mesh compiles fastest)
    pipe = pj.pipeline(stages, chunks=4, checkpoint="always", mesh=mesh, stateful=True)

    def composed(p, x):
        xs, mask, plan = pj.split_microbatches(x, 4)
        outs = []
        for i in range(plan.num_micro):
            h = xs[i]
            for s, stage in enumerate(stages):
                h, _ = stage(p[s], h, None, state[s], mask[i])
            outs.append(h)
        return pj.merge_microbatches(jnp.stack(outs), plan)

    def loss(apply):
        return lambda p, x: jnp.sum(jnp.sin(apply(p, x)))

    piped = loss(lambda p, x: pipe(p, x, state=state)[0])
    grad = jax.jit(jax.grad(piped, argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(loss(composed), argnums=(0, 1)))(params, x)
    models.assert_trees_close(grad, want, rtol=1e-10, atol=1e-12)
    v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)

    def hvp(f):
        return lambda p, v: jax.jvp(lambda p: jax.grad(f)(p, x), (p,), (v,))[1]

    models.assert_trees_close(
        jax.jit(hvp(piped))(params, v), jax.jit(hvp(loss(composed)))(params, v), rtol=1e-10, atol=1e-12
    )


# --- the functional pieces ---------------------------------------------------------------------------


def test_chan_merge_keeps_precision_where_the_sum_of_squares_loses_it():
    """float32 data with |mean| / std = 100, in uneven parts (one of a single row).

    The merged variance is within 1e-5 of float64 numpy on the same data: Chan's merge loses
    about eps * |mean| / std (6e-6 here) through the float32 part means. torchgpipe's
    E[x^2] - E[x]^2 loses about eps * (mean / std)^2 (6e-4 here).
    """
    r = np.random.default_rng(7)
    x = jnp.asarray(r.normal(size=(37, 5)) + 100.0, jnp.float32)
    bounds = [0, 5, 6, 20, 37]
    parts = [pj.moments(x[a:b]) for a, b in itertools.pairwise(bounds)]
    total = pj.merge_moments(pj.Moments(*(jnp.stack(v) for v in zip(*parts, strict=True))))
    xf = np.asarray(x, np.float64)  # the float32 data, exactly, in float64
    assert float(total.count) == 37
    np.testing.assert_allclose(total.mean, xf.mean(0), rtol=1e-6)
    np.testing.assert_allclose(total.m2 / 36, xf.var(0, ddof=1), rtol=1e-5)
    naive = jnp.mean(x * x, axis=0) - jnp.mean(x, axis=0) ** 2  # torchgpipe's formula, float32
    assert np.max(np.abs(np.asarray(naive) * 37 / 36 / xf.var(0, ddof=1) - 1)) > 1e-4


def test_moments_respect_the_mask_and_the_feature_axes():
    r = np.random.default_rng(8)
    x = jnp.asarray(r.normal(size=(4, 5, 3)))  # (b, positions, channels)
    mask = jnp.array([True, False, True, True])
    mom = pj.moments(x, mask, axis=-1)
    rows = np.asarray(x)[np.asarray(mask)].reshape(-1, 3)
    assert float(mom.count) == 15
    np.testing.assert_allclose(mom.mean, rows.mean(0), rtol=1e-12)
    np.testing.assert_allclose(mom.m2, ((rows - rows.mean(0)) ** 2).sum(0), rtol=1e-12)
    # Masked-out rows get no gradient, even through the mean.
    g = jax.grad(lambda x: jnp.sum(pj.moments(x, mask).m2 + pj.moments(x, mask).mean))(x)
    assert np.all(np.asarray(g[1]) == 0) and np.any(np.asarray(g[0]) != 0)
    with pytest.raises(ValueError, match=r"`axis` 0 includes axis 0, the batch axis"):
        pj.moments(x, axis=0)
    with pytest.raises(ValueError, match=r"`mask` must be a bool array of shape \(4,\).*got shape \(4, 5\)"):
        pj.moments(x, jnp.ones((4, 5), bool))
    with pytest.raises(ValueError, match=r"`momentum` must be a float in \[0, 1\].*got 1.5"):
        pj.batch_norm_update(pj.batch_norm_init(3), mom, momentum=1.5)


# --- bad arguments: the state of another layer, stats that are not Moments -----------------------


def test_batch_norm_in_training_refuses_the_state_of_another_layer():
    x = jnp.ones((6, 4))
    with pytest.raises(
        ValueError,
        match=r"`state\.mean` of batch_norm has shape \(3,\), but `x` of shape \(6, 4\) has features "
        r"of shape \(4,\).*pj\.batch_norm_init\(4\)",
    ):
        pj.batch_norm(x, pj.batch_norm_init(3), train=True)
    with pytest.raises(
        TypeError,
        match=r"`state` of batch_norm must be the BatchStats of the layer "
        r"\(pj\.batch_norm_init\(4\)\) or None, but got dict",
    ):
        pj.batch_norm(x, {"mean": 0}, train=True)
    y, _ = pj.batch_norm(x, None, train=True)  # the state is not read in training
    assert y.shape == x.shape


def test_stats_that_are_not_moments_are_refused():
    mom = pj.moments(jnp.arange(12.0).reshape(6, 2))
    stacked = pj.Moments(*(jnp.stack([a, a]) for a in mom))
    with pytest.raises(
        TypeError, match=r"`stats` of batch_norm_update must be a pj\.Moments .*but got NoneType\.$"
    ):
        pj.batch_norm_update(pj.batch_norm_init(2), None)
    with pytest.raises(
        TypeError, match=r"`stacked` of merge_moments must be a pj\.Moments .*but got NoneType\.$"
    ):
        pj.merge_moments(None)
    with pytest.raises(
        TypeError,
        match=r"`stacked` of merge_moments must be a pj\.Moments .*but got tuple; "
        r"wrap the triple: `pj\.Moments\(count, mean, m2\)`",
    ):
        pj.merge_moments(tuple(stacked))
    with pytest.raises(
        TypeError, match=r"`stats` of batch_norm_update must be a pj\.Moments .*but got tuple; wrap"
    ):
        pj.batch_norm_update(pj.batch_norm_init(2), tuple(stacked))
