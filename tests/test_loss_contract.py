"""The loss contract of ``value_and_grad``, under every schedule: what ``loss_fn`` may return.

* One loss per example: the loss is their mean.
* ``pj.LossSums(sums, weights)`` (or a plain pair): ``sum(sums) / sum(weights)``; the weights only
  normalise. Integer and boolean weights are data (token counts, masks), read in the losses'
  dtype.
* ``pj.weighted_mean(losses, weights)``: the weighted mean ``sum(w l) / sum(w)``, rows of weight
  0 left out; a plain pair with the same arrays gives another number (the trap the named type
  and the helper are there to avoid).
* Anything else (a tuple of 3, a list of floats as weights, a dict, None) is refused with
  pipejax's message, under every schedule.

References are numpy sums over the composed model's per-example losses. Tolerances (float64):
the training schedules add per-micro-batch sums in another order, so rtol 1e-12.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

SCHEDULES = ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b", "v-half", "zb-v")
TOL = {"rtol": 1e-12}
B = 8


def scale(p, x, key):
    return jnp.tanh(x * p)


def four(schedule):
    repeats = 2 if schedule in ("circular", "interleaved-1f1b", "v-half", "zb-v") else 1
    return pj.pipeline([scale] * 4, chunks=4, schedule=schedule, repeats=repeats), [1.0, 2.0, 0.5, 1.0]


def data():
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(B, 3)))
    t = jnp.asarray(r.normal(size=(B, 3)))
    w = jnp.asarray([1, 0, 2, 1, 0, 3, 1, 1], jnp.int32)  # rows of weight 0 among them
    return x, t, w


def per_row(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def composed_rows(params, x, t):
    for p in params:
        x = scale(p, x, None)
    return np.asarray(per_row(x, t))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])  # the forward; two tables
def test_weights_of_any_numeric_dtype_and_the_weighted_mean(schedule):
    """Integer, boolean and float weights give the same loss; `weighted_mean` is the weighted mean
    and a plain pair of the same arrays is `sum(l) / sum(w)`, under every schedule."""
    pipe, params = four(schedule)
    x, t, w = data()
    rows = composed_rows(params, x, t)
    wf = np.asarray(w, np.float64)
    pair = lambda weights: lambda y, tw: (per_row(y, tw[0]), tw[1])
    got = {
        "int": pipe.value_and_grad(pair(w))(params, x, (t, w))[0],
        "float": pipe.value_and_grad(pair(w))(params, x, (t, w.astype(jnp.float64)))[0],
        "named": pipe.value_and_grad(lambda y, tw: pj.LossSums(per_row(y, tw[0]), tw[1]))(params, x, (t, w))[
            0
        ],
        "weighted": pipe.value_and_grad(lambda y, tw: pj.weighted_mean(per_row(y, tw[0]), tw[1]))(
            params, x, (t, w)
        )[0],
    }
    mask = w > 0
    got["bool"] = pipe.value_and_grad(pair(mask))(params, x, (t, mask))[0]
    np.testing.assert_allclose(got["int"], rows.sum() / wf.sum(), **TOL)  # the weights normalise only
    np.testing.assert_allclose(got["float"], got["int"], **TOL)
    np.testing.assert_allclose(got["named"], got["int"], **TOL)
    np.testing.assert_allclose(got["bool"], rows.sum() / np.asarray(mask).sum(), **TOL)
    weighted = (rows * wf).sum() / wf.sum()
    np.testing.assert_allclose(got["weighted"], weighted, **TOL)
    assert abs(float(got["weighted"]) - float(got["int"])) > 1e-3  # the two readings differ here


def test_weighted_mean_gradients_equal_the_weighted_model():
    """`weighted_mean` under a training schedule: gradients of the weighted mean, no gradient
    through the weights."""
    pipe, params = four("1f1b")
    x, t, w = data()
    wf = jnp.asarray(w, jnp.float64)

    def reference(p):
        y = x
        for s in p:
            y = scale(s, y, None)
        return jnp.sum(per_row(y, t) * wf) / jnp.sum(wf)

    want = jax.value_and_grad(reference)(params)
    got = pipe.value_and_grad(lambda y, tw: pj.weighted_mean(per_row(y, tw[0]), tw[1]))(params, x, (t, w))
    np.testing.assert_allclose(got[0], want[0], **TOL)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), **TOL)


def test_a_zero_total_weight_gives_nan_as_documented():
    """`sum(sums) / sum(weights)` with no weight: 0 / 0 (the docs say so; nothing to check at
    trace time, the weights are data)."""
    pipe, params = four("1f1b")
    x, t, _ = data()
    loss, _ = pipe.value_and_grad(lambda y, t: pj.LossSums(jnp.zeros(y.shape[0]), jnp.zeros(y.shape[0])))(
        params, x, t
    )
    assert np.isnan(loss)


BAD = {
    "tuple-of-3": (
        lambda y, t: (per_row(y, t), jnp.ones(y.shape[0]), jnp.ones(y.shape[0])),
        TypeError,
        r"returned a tuple of 3 \(an array of shape \(\d,\), .*read as a pair `\(sums, weights\)`",
    ),
    "tuple-of-1": (lambda y, t: (per_row(y, t),), TypeError, r"returned a tuple of 1 .*pj.LossSums"),
    "weights-list": (
        lambda y, t: (per_row(y, t), [1.0] * y.shape[0]),
        TypeError,
        r"a list of \d\).*make a list an array with `jnp.asarray`",
    ),
    "dict": (lambda y, t: {"loss": per_row(y, t)}, TypeError, r"returned a dict with keys \['loss'\]"),
    "none": (lambda y, t: None, TypeError, r"returned NoneType None, but it must return an array"),
    "string": (lambda y, t: "loss", TypeError, r"returned str 'loss'"),
    "mean": (
        lambda y, t: jnp.mean(per_row(y, t)),
        ValueError,
        r"must return losses one per example.*shape \(\)",
    ),
    "complex-weights": (
        lambda y, t: (per_row(y, t), jnp.ones(y.shape[0], jnp.complex64)),
        TypeError,
        r"weights of dtype complex64, but weights must be real numbers",
    ),
    "integer-loss": (
        lambda y, t: jnp.argmax(y, -1),
        TypeError,
        r"returned losses of dtype int\d+, but a loss",
    ),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_refuses_what_the_contract_does_not_allow(schedule):
    pipe, params = four(schedule)
    x, t, _ = data()
    for name, (loss_fn, error, match) in BAD.items():
        with pytest.raises(error, match=r"`loss_fn\(outputs, targets\)`.*" + match):
            pipe.value_and_grad(loss_fn)(params, x, t)
        assert name  # (the case that failed is in the traceback's locals)


def test_a_list_of_two_scalars_says_how_it_was_read():
    """Under a training schedule a micro-batch of 2 rows: `list(losses)` is a list of 2 scalars,
    read as the pair; the message says so."""
    pipe = pj.pipeline([scale] * 4, chunks=4, schedule="1f1b")
    x, t, _ = data()
    with pytest.raises(
        ValueError, match=r"returned shape \(\) \(`loss_fn` returned a list of 2, read as the pair"
    ):
        pipe.value_and_grad(lambda y, t: list(per_row(y, t)))([1.0, 2.0, 0.5, 1.0], x, t)


def test_weighted_mean_checks_its_arguments():
    with pytest.raises(ValueError, match=r"two arrays of shape \(b,\), but got losses of shape \(2, 3\)"):
        pj.weighted_mean(jnp.ones((2, 3)), jnp.ones(2))
    with pytest.raises(TypeError, match=r"`losses` has dtype int32"):
        pj.weighted_mean(jnp.ones(2, jnp.int32), jnp.ones(2))
    with pytest.raises(TypeError, match=r"`weights` must be an array, but got a list of 2"):
        pj.weighted_mean(jnp.ones(2), [1.0, 2.0])
    with pytest.raises(TypeError, match=r"weights of dtype complex64, but weights must be real"):
        pj.weighted_mean(jnp.ones(2), jnp.ones(2, jnp.complex64))
