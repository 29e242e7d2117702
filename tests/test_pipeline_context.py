"""Side inputs (``context=``): batch-shaped data every stage reads for its micro-batch and none
passes on (attention masks, positions), cut into micro-batches with ``x``, padding included.

Checked against the composition on the whole batch (float64; forward rtol 1e-12, gradients with
respect to params, ``x`` and the context rtol 1e-10: micro-batching reorders batch sums), with and
without a mesh, for heterogeneous and homogeneous stages, a stateful pipeline, and the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models

X = jax.random.normal(jax.random.key(0), (7, 3))  # 7 examples, chunks=3: the last micro-batch pads
CONTEXT = {"mask": (jnp.arange(7) % 3 != 0).astype(jnp.float64), "pos": jnp.arange(7.0) / 7}


def masked(p, x, key, context):
    return jnp.tanh(x @ p) * context["mask"][:, None]


def shifted(p, x, key, context):
    return x @ p + context["pos"][:, None]


PARAMS = [jax.random.normal(jax.random.key(1), (3, 4)), jax.random.normal(jax.random.key(2), (4, 2))]


def composed(ps, x, context):
    return shifted(ps[1], masked(ps[0], x, None, context), None, context)


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_every_stage_reads_its_micro_batch_of_the_context(placement):
    apply = pj.pipeline([masked, shifted], chunks=3, mesh=models.make_mesh(placement, 2))
    placed = apply.place(PARAMS)
    np.testing.assert_allclose(
        np.asarray(apply(placed, X, context=CONTEXT)), np.asarray(composed(PARAMS, X, CONTEXT)), rtol=1e-12
    )

    def loss(p, x, c):
        return jnp.sum(apply(p, x, context=c) ** 2)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(placed, X, CONTEXT)
    want = jax.grad(lambda p, x, c: jnp.sum(composed(p, x, c) ** 2), argnums=(0, 1, 2))(PARAMS, X, CONTEXT)
    for s in range(2):
        np.testing.assert_allclose(apply.stage_params(got[0], s), want[0][s], rtol=1e-10, atol=1e-12)
    models.assert_trees_close(got[1:], want[1:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_homogeneous_and_stateful_stages_take_the_context_too(placement):
    def block(p, h, key, state, mask, context):
        return h + jnp.tanh(h @ p) * context[:, None], jnp.sum(jnp.where(mask, context, 0.0))

    apply = pj.pipeline(block, num_stages=2, chunks=3, stateful=True, mesh=models.make_mesh(placement, 2))
    w = jnp.stack([jnp.eye(3) * 0.5, jnp.eye(3) * 0.25])
    c = jnp.arange(7.0)
    y, stats = apply(apply.place(w), X, context=c)
    h = X
    for s in range(2):
        h = h + jnp.tanh(h @ w[s]) * c[:, None]
    np.testing.assert_allclose(np.asarray(y), np.asarray(h), rtol=1e-12)
    # stats: the sum of the context over the real rows of each micro-batch (3, 3, 1 + 2 padding)
    np.testing.assert_array_equal(np.asarray(stats), [[3.0, 12.0, 6.0]] * 2)


def test_context_must_share_the_batch_of_x():
    apply = pj.pipeline([masked, shifted], chunks=3)
    with pytest.raises(ValueError, match=r"`context` has a batch of 6 examples but `x` has 7"):
        apply(PARAMS, X, context={"mask": jnp.ones(6), "pos": jnp.ones(6)})
    with pytest.raises(ValueError, match=r"`context` leaf \['pos'\] is a scalar"):
        apply(PARAMS, X, context={"mask": jnp.ones(7), "pos": jnp.ones(())})


def test_a_stage_without_a_context_argument_says_which_stage():
    apply = pj.pipeline([masked, lambda p, x, key: x], chunks=3)
    with pytest.raises(TypeError, match=r"Stage 1, `.*\(p, x, key\)`, cannot be called .*`context=`"):
        apply([PARAMS[0], None], X, context=CONTEXT)
