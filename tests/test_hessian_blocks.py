"""Block (per-stage, per-parameter-subset) curvature against dense blocks of jax.hessian (float64).

The pipelined model is an MLP of three stages (6 -> 10 -> 8 -> 4, tanh, cross-entropy; stages of
70, 88 and 36 parameters) on a 3-device mesh with stage-sharded parameters, used only through the
public API: ``pj.pipeline``, ``apply.place`` and the ``StageParams`` it returns, as a pytree.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import pipejax as pj
from pipejax import hessian as ph
from tests import models

SIZES = (6, 10, 8, 4)
BATCH = 32


def layer(p, h, key=None):
    return h @ p["w"] + p["b"][None]


STAGES = [lambda p, h, key: jnp.tanh(layer(p, h)), lambda p, h, key: jnp.tanh(layer(p, h)), layer]


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def plain_loss(params, x, y):
    for fn, p in zip(STAGES, params, strict=True):
        x = fn(p, x, None)
    return ce(x, y)


@pytest.fixture(scope="module")
def setup():
    params, x, y = models.random_mlp(SIZES, BATCH)
    flat, unravel = ravel_pytree(params)
    # jitted: one compile instead of op-by-op autodiff
    dense = np.asarray(jax.jit(jax.hessian(lambda f: plain_loss(unravel(f), x, y)))(flat))
    ends = np.cumsum([a * b + b for a, b in itertools.pairwise(SIZES)])
    spans = list(zip([0, *ends[:-1]], ends, strict=True))  # ravel order: stage by stage
    dense_blocks = [dense[a:b, a:b] for a, b in spans]
    return dict(params=params, x=x, y=y, dense=dense, blocks=dense_blocks)


def test_per_stage_curvature_through_the_pipeline(setup):
    mesh = jax.make_mesh((3,), ("stage",))
    apply = pj.pipeline(STAGES, chunks=2, checkpoint="always", mesh=mesh)
    placed = apply.place(setup["params"])
    support = apply.place(jax.tree.map(jnp.ones_like, setup["params"]))  # 1 at real entries, 0 at padding
    blocks = ph.stage_blocks(placed, support)
    loss = lambda p, x, y: ce(apply(p, x), y)
    args = (placed, setup["x"], setup["y"])
    exact = [np.linalg.eigvalsh(b)[::-1] for b in setup["blocks"]]

    # top eigenvalues of every stage's block, one call (36 steps: the smallest stage's dimension)
    vals = ph.eigenvalues(loss, *args, key=jax.random.key(0), k=3, num_steps=36, blocks=blocks)
    assert vals.shape == (3, 3)
    for s in range(3):
        np.testing.assert_allclose(vals[s], exact[s][:3], rtol=1e-6)

    # traces: Hutchinson in each block, within 4 standard errors of the dense block's trace
    est, err = ph.trace(loss, *args, key=jax.random.key(1), num_probes=30, blocks=blocks)
    assert est.shape == err.shape == (3,)
    for s in range(3):
        assert abs(float(est[s]) - np.trace(setup["blocks"][s])) < 4 * float(err[s]) + 1e-12

    # densities: every block's spectral measure (its nodes within the block's spectrum)
    d = ph.density(loss, *args, key=jax.random.key(2), num_steps=20, num_runs=2, blocks=blocks)
    assert d.nodes.shape == d.weights.shape == (3, 2, 20)
    np.testing.assert_allclose(d.weights.sum(axis=-1), 1.0, rtol=1e-10)
    for s in range(3):
        lo, hi = exact[s][-1], exact[s][0]
        span = hi - lo
        assert lo - 1e-8 * span <= float(d.nodes[s].min()) and float(d.nodes[s].max()) <= hi + 1e-8 * span
        # the first moment of the measure is the block's mean eigenvalue (exact for SLQ up to
        # Monte Carlo error of 2 runs: within 25% of the spread)
        mean = float(jnp.sum(d.nodes[s] * d.weights[s]) / 2)
        assert abs(mean - exact[s].mean()) < 0.25 * span
    # with a basis (partial reorthogonalisation; the default "none" stores none), from the same start
    # vectors: the same quadrature, i.e. the same moments sum_j w_j theta_j^p of every run (exact for
    # p <= 2 num_steps - 1)
    d0 = ph.density(
        loss, *args, key=jax.random.key(2), num_steps=20, num_runs=2, blocks=blocks, reorthogonalise="partial"
    )
    for p in range(1, 6):
        np.testing.assert_allclose(
            jnp.sum(d0.weights * d0.nodes**p, axis=-1), jnp.sum(d.weights * d.nodes**p, axis=-1), rtol=1e-8
        )


def test_parameter_subset_blocks_without_a_pipeline(setup):
    """Any subset: the weights of layer 0, and all the biases (a block across layers)."""
    params = setup["params"]
    zeros = jax.tree.map(jnp.zeros_like, params)
    w0 = [{"w": jnp.ones(()), "b": jnp.zeros(())}, *zeros[1:]]  # scalars broadcast to the leaf
    biases = [{"w": jnp.zeros(()), "b": jnp.ones(())} for _ in params]
    args = (params, setup["x"], setup["y"])
    dense = setup["dense"]  # jax.hessian of plain_loss at these parameters
    full = lambda m: jax.tree.map(lambda a, p: jnp.broadcast_to(a, p.shape), m, params)
    idx = [np.flatnonzero(np.asarray(ravel_pytree(full(m))[0])) for m in (w0, biases)]
    vals = ph.eigenvalues(plain_loss, *args, key=jax.random.key(0), k=2, num_steps=22, blocks=[w0, biases])
    for b, ix in enumerate(idx):
        np.testing.assert_allclose(vals[b], np.linalg.eigvalsh(dense[np.ix_(ix, ix)])[::-1][:2], rtol=1e-6)


def test_block_errors(setup):
    params = setup["params"]
    args = (params, setup["x"], setup["y"])
    with pytest.raises(TypeError, match=r"`blocks` must be a non-empty list of masks"):
        ph.trace(plain_loss, *args, key=jax.random.key(0), blocks=[])
    with pytest.raises(ValueError, match=r"`blocks\[0\]` must have the pytree structure of `params`"):
        ph.trace(plain_loss, *args, key=jax.random.key(0), blocks=[{"w": 1.0}])
    bad = jax.tree.map(lambda a: jnp.ones((7,)), params)
    with pytest.raises(
        ValueError, match=r"`blocks\[0\]` leaf .* does not broadcast to the parameter's shape"
    ):
        ph.trace(plain_loss, *args, key=jax.random.key(0), blocks=[bad])
    with pytest.raises(ValueError, match=r"`blocks\[0\]` is empty"):
        ph.trace(plain_loss, *args, key=jax.random.key(0), blocks=[jax.tree.map(jnp.zeros_like, params)])
    with pytest.raises(ValueError, match=r"one leading stage axis on every leaf"):
        ph.stage_blocks({"a": jnp.zeros((3, 2)), "b": jnp.zeros((2,))})


def test_stage_blocks_refuses_a_support_unlike_params():
    params = {"a": jnp.zeros((3, 2))}
    with pytest.raises(
        ValueError, match=r"`support` of stage_blocks must have the pytree structure of `params`"
    ):
        ph.stage_blocks(params, support={"b": jnp.ones((3, 2))})
    with pytest.raises(
        ValueError,
        match=r"`support` of stage_blocks leaf \['a'\] has shape \(2, 2\), which does not broadcast "
        r"to the parameter's shape \(3, 2\)",
    ):
        ph.stage_blocks(params, support={"a": jnp.ones((2, 2))})
    masks = ph.stage_blocks(params, support={"a": jnp.array([[1.0, 0.0]] * 3)})
    assert masks[1]["a"].tolist() == [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]
