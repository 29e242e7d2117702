"""Gauss-Newton and empirical Fisher products against dense references (float64).

The model is a small MLP (8 -> 16 -> 5, tanh, softmax cross-entropy; 229 parameters): the dense
``J`` (``jax.jacfwd``), ``H_z`` (``jax.hessian`` of the loss in the logits) and per-example
gradients (``jax.jacrev``) are cheap to form, and every spectrum function is checked against them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from pipejax import hessian as ph
from tests import models

SIZES = (8, 16, 5)
BATCH = 24


def logits(params, x, y):
    for j, p in enumerate(params):
        x = x @ p["w"] + p["b"][None]
        if j < len(params) - 1:
            x = jnp.tanh(x)
    return x


def ce(z, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()


LOSS = ph.composite(logits, ce)


@pytest.fixture(scope="module")
def model():
    params, x, y = models.random_mlp(SIZES, BATCH)
    flat, unravel = ravel_pytree(params)
    z = logits(params, x, y)
    # each reference under jax.jit: one compile, where op-by-op autodiff dispatched thousands of ops
    jac = np.asarray(jax.jit(jax.jacfwd(lambda f: logits(unravel(f), x, y)))(flat))
    jac = jac.reshape(z.size, flat.size)
    h_z = np.asarray(jax.jit(jax.hessian(lambda z: ce(z.reshape(BATCH, -1), x, y)))(z.ravel()))

    def example_grad(xi, yi):  # the gradient of one example's loss
        return jax.grad(lambda f: LOSS(unravel(f), xi[None], yi[None]))(flat)

    g = np.asarray(jax.jit(jax.vmap(example_grad))(x, y))  # (BATCH, n)
    hessian = np.asarray(jax.jit(jax.hessian(lambda f: LOSS(unravel(f), x, y)))(flat))
    return dict(
        params=params,
        x=x,
        y=y,
        unravel=unravel,
        ggn=jac.T @ h_z @ jac,
        fisher=g.T @ g / BATCH,
        hessian=hessian,
    )


def flat(tree):
    return np.asarray(ravel_pytree(tree)[0])


@pytest.mark.parametrize("mode", ["fwd_rev", "rev_rev"])
@pytest.mark.parametrize("curvature", ["hessian", "ggn", "fisher"])
def test_products_match_dense(model, curvature, mode):
    n = model["ggn"].shape[0]
    v = model["unravel"](jnp.asarray(np.random.default_rng(1).standard_normal(n)))
    got = flat(ph.hvp(LOSS, model["params"], v, model["x"], model["y"], curvature=curvature, mode=mode))
    want = model[curvature] @ flat(v)
    # float64, summation order only
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())


def test_ggn_spectrum_matches_dense_and_is_psd(model):
    args = (model["params"], model["x"], model["y"])
    dense = np.linalg.eigvalsh(model["ggn"])[::-1]
    assert dense[-1] > -1e-12 * dense[0]  # the reference is PSD: cross-entropy is convex in the logits
    vals = ph.eigenvalues(LOSS, *args, key=jax.random.key(0), k=5, curvature="ggn")
    np.testing.assert_allclose(vals, dense[:5], rtol=1e-8)
    # PSD through the operator: the most negative Ritz value is a rounding-level zero
    low = ph.eigenvalues(lambda p, x, y: -LOSS(p, x, y), *args, key=jax.random.key(0), k=1)  # sanity: -H
    assert float(low[0]) > 0  # the Hessian itself is indefinite here, so -H has a positive top
    d = ph.density(LOSS, *args, key=jax.random.key(1), num_steps=60, num_runs=2, curvature="ggn")
    assert float(jnp.min(d.nodes)) > -1e-8 * dense[0]
    # the trace: Hutchinson within 4 standard errors of the dense one
    est, err = ph.trace(LOSS, *args, key=jax.random.key(2), num_probes=40, curvature="ggn")
    assert abs(float(est) - np.trace(model["ggn"])) < 4 * float(err)


def test_fisher_spectrum_matches_dense(model):
    args = (model["params"], model["x"], model["y"])
    dense = np.linalg.eigvalsh(model["fisher"])[::-1]
    # rank <= BATCH: the Krylov space is exhausted and Lanczos restarts; the top 5 are exact
    vals = ph.eigenvalues(LOSS, *args, key=jax.random.key(0), k=5, curvature="fisher")
    np.testing.assert_allclose(vals, dense[:5], rtol=1e-8)


def test_curvature_errors(model):
    args = (model["params"], model["x"], model["y"])
    with pytest.raises(TypeError, match=r"curvature='ggn' needs the loss split into a model.*composite"):
        ph.eigenvalues(lambda p, x, y: LOSS(p, x, y), *args, key=jax.random.key(0), curvature="ggn")
    with pytest.raises(ValueError, match=r"`curvature` must be one of \('hessian', 'ggn', 'fisher'\)"):
        ph.trace(LOSS, *args, key=jax.random.key(0), curvature="gauss")
    scalar_out = ph.composite(lambda p, x, y: jnp.sum(logits(p, x, y)), lambda z, x, y: z**2)
    with pytest.raises(ValueError, match=r"curvature='fisher' needs outputs whose leaves share a leading"):
        ph.hvp(scalar_out, model["params"], model["params"], model["x"], model["y"], curvature="fisher")


# --- a streamed dataset ------------------------------------------------------------------------------


def test_streamed_batches_give_the_dataset_curvature(model):
    """4 batches of 6 read one at a time from the host, in every product: the whole batch's curvature."""
    x, y = model["x"], model["y"]
    reads = []

    def batches():  # a fresh generator per pass, as a data loader's epoch would be
        for i in range(0, BATCH, 6):
            reads.append(i)
            yield x[i : i + 6], y[i : i + 6]

    data = ph.stream(batches, 4)
    vals = ph.eigenvalues(LOSS, model["params"], key=jax.random.key(0), k=3, num_steps=40, data=data)
    # the loss is a mean over equal batches, so the streamed operator is the whole batch's Hessian
    np.testing.assert_allclose(vals, np.linalg.eigvalsh(model["hessian"])[::-1][:3], rtol=1e-8)
    assert len(reads) >= 4 * 40  # every Lanczos step read all 4 batches (plus the first peek)
    est, err = ph.trace(
        LOSS, model["params"], key=jax.random.key(1), num_probes=20, data=data, curvature="ggn"
    )
    assert abs(float(est) - np.trace(model["ggn"])) < 4 * float(err)


def test_stream_errors(model):
    x, y = model["x"], model["y"]
    with pytest.raises(TypeError, match=r"`data` must be a re-iterable.*pipejax.hessian.stream"):
        ph.hvp(LOSS, model["params"], model["params"], data=iter([(x, y)]))
    with pytest.raises(ValueError, match=r"`num_batches` must be an int >= 1"):
        ph.stream(lambda: iter([(x, y)]), 0)
    short = ph.stream(lambda: iter([(x[:6], y[:6])]), 3)  # says 3 batches, holds 1
    with pytest.raises(Exception, match=r"num_batches=3, but its source ended after 1 batches"):
        jax.block_until_ready(ph.hvp(LOSS, model["params"], model["params"], data=short))
