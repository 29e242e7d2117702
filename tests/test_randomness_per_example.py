"""Chunk-invariant randomness (`per_example_keys=True`) and the `pj.dropout` helper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models

D = 6
DROP_RATE = 0.5  # probability of dropping


def dense(p, x, key):
    return pj.dropout(jnp.tanh(x @ p), key, DROP_RATE)


def recording(s):
    """Stage ``s`` of a 3-stage ``dense`` pipeline that also records its dropout mask (float 0/1,
    drawn with the same keys and shape as ``dense``'s) in column ``s`` of the masks it carries."""

    def stage(p, carry, key):
        h, masks = carry
        mask = (pj.dropout(jnp.ones_like(h), key, DROP_RATE) != 0).astype(h.dtype)
        return dense(p, h, key), masks.at[:, s].set(mask)

    return stage


def params(n=3):
    r = np.random.RandomState(0)
    return [jnp.asarray(r.randn(D, D) * 0.5, jnp.float32) for _ in range(n)]


@pytest.mark.parametrize("batch", [8, 11])
@pytest.mark.parametrize("mesh_size", [None, 3])
def test_masks_and_outputs_do_not_depend_on_chunks(batch, mesh_size):
    """Every stage's mask (bitwise) and the output are those of ``chunks=1``; one program per
    chunk count computes both."""
    x = jnp.asarray(np.random.RandomState(1).randn(batch, D), jnp.float32)
    carry = (x, jnp.zeros((batch, 3, D), jnp.float32))
    key = jax.random.key(7)
    mesh = None if mesh_size is None else jax.make_mesh((mesh_size,), ("stage",))
    stages = [recording(s) for s in range(3)]
    outs, masks = [], []
    for chunks in (1, 2, 4, 8):
        out, mask = jax.jit(pj.pipeline(stages, chunks=chunks, mesh=mesh, per_example_keys=True))(
            params(), carry, key
        )
        outs.append(out)
        masks.append(mask)
    assert 0 < float(jnp.mean(masks[0])) < 1  # dropout is on: some entries kept, some dropped
    for mask in masks[1:]:
        np.testing.assert_array_equal(mask, masks[0])  # masks: exactly the same
    for out in outs[1:]:
        # Rows are computed independently, but XLA may pick another dot kernel for another
        # micro-batch size: float32, three layers, so rtol 1e-6.
        np.testing.assert_allclose(out, outs[0], rtol=1e-6, atol=1e-7)


def test_mesh_and_no_mesh_draw_the_same_masks():
    x = jnp.asarray(np.random.RandomState(2).randn(9, D), jnp.float32)
    key = jax.random.key(3)
    runs = [
        jax.jit(pj.pipeline([dense] * 3, chunks=3, mesh=m, per_example_keys=True))(params(), x, key)
        for m in (None, jax.make_mesh((3,), ("stage",)))
    ]
    np.testing.assert_array_equal(runs[0], runs[1])


def test_the_documented_per_example_derivation():
    """Row e of the batch at stage s draws with fold_in(fold_in(key, e), s)."""

    def draw(p, x, key):
        return x + jax.vmap(lambda k: jax.random.uniform(k, (D,), x.dtype))(key)

    x = jnp.zeros((7, D), jnp.float32)
    key = jax.random.key(5)
    out = jax.jit(pj.pipeline([draw, draw], chunks=3, per_example_keys=True))([None, None], x, key)
    expected = np.stack(
        [
            sum(
                np.asarray(
                    jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, e), s), (D,), jnp.float32)
                )
                for s in range(2)
            )
            for e in range(7)
        ]
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_checkpoint_modes_agree_bitwise_with_per_example_keys():
    x = jnp.asarray(np.random.RandomState(4).randn(10, D), jnp.float32)
    key = jax.random.key(9)

    def grad(mode):
        pipe = pj.pipeline([dense] * 3, chunks=4, checkpoint=mode, per_example_keys=True)
        return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(pipe(p, x, key) ** 2), argnums=(0, 1)))(
            params(), x
        )

    ref = grad("never")
    for mode in ("always", "except_last"):
        models.assert_modes_agree(grad(mode), ref, mode)


def test_dropout_rate_is_the_probability_of_dropping():
    """100,000 draws, fixed seed: the dropped fraction is within 4 standard errors of drop_rate."""
    n, rate = 100_000, 0.3
    y = pj.dropout(jnp.ones((n,), jnp.float32), jax.random.key(0), rate)
    dropped = float(jnp.mean(y == 0))
    assert abs(dropped - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
    np.testing.assert_allclose(np.unique(np.asarray(y)), [0.0, 1 / (1 - rate)], rtol=1e-6)


def test_dropout_identity_cases_and_errors():
    x = jnp.ones((3, 4))
    assert pj.dropout(x, None, 0.5) is x
    assert pj.dropout(x, jax.random.key(0), 0.0) is x
    with pytest.raises(ValueError, match=r"`drop_rate` is the probability of dropping.*got 1.0"):
        pj.dropout(x, jax.random.key(0), 1.0)
    with pytest.raises(ValueError, match=r"neither one key nor one key per row"):
        pj.dropout(x, jax.random.split(jax.random.key(0), 5), 0.5)


def test_per_example_keys_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`per_example_keys` must be True or False"):
        pj.pipeline([dense], per_example_keys="yes")
