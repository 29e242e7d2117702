"""Small models, naive references and comparison helpers shared by the pipeline tests.

Two stage layouts go through every contract test:

* ``tokens`` (heterogeneous, 3 stages): ``{"ids": int32[b], "feats": f64[b, 2]}`` -> embedding
  ``f64[b, 3]`` -> a wider hidden layer that returns ``(h: f64[b, 6], skip: f64[b, 3])`` (the
  embedding travels on as a skip connection) -> logits ``f64[b, 4]``. Every boundary has its own
  structure, shapes and dtypes, and the float input ``feats`` gives a gradient with respect to ``x``.
* ``stacked`` (homogeneous, 4 stages): one residual ``tanh`` layer ``f64[b, 3] -> f64[b, 3]`` with its
  parameters stacked on a leading stage axis.

The reference for both is :func:`compose`: the stages applied in turn to the whole batch.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj

VOCAB, FEATS, EMBED, WIDE, CLASSES, WIDTH = 7, 2, 3, 6, 4, 3
NUM_STACKED = 4


# --- the heterogeneous "tokens" layout ---------------------------------------------------------


def embed(p, x, key):
    """``{"ids", "feats"}`` -> ``f64[b, EMBED]``."""
    return p["table"][x["ids"]] + x["feats"] @ p["proj"]


def wide(p, e, key):
    """``f64[b, EMBED]`` -> ``(h: f64[b, WIDE], skip: f64[b, EMBED])``."""
    return jnp.tanh(e @ p["w"] + p["c"][None]), e


def head(p, hs, key):
    """``(h, skip)`` -> logits ``f64[b, CLASSES]``."""
    h, skip = hs
    return h @ p["w"] + jnp.tanh(skip) @ p["v"]


TOKEN_STAGES = (embed, wide, head)


def token_params(seed: int = 0) -> list[dict[str, jax.Array]]:
    r = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(r.normal(size=shape) / np.sqrt(shape[0]))
    return [
        {"table": normal(VOCAB, EMBED), "proj": normal(FEATS, EMBED)},
        {"w": normal(EMBED, WIDE), "c": normal(WIDE)},
        {"w": normal(WIDE, CLASSES), "v": normal(EMBED, CLASSES)},
    ]


def token_inputs(batch: int, seed: int = 1) -> dict[str, jax.Array]:
    r = np.random.default_rng(seed)
    return {
        "ids": jnp.asarray(r.integers(0, VOCAB, size=(batch,)), jnp.int32),
        "feats": jnp.asarray(r.normal(size=(batch, FEATS))),
    }


def token_loss(logits, labels):
    """Mean cross-entropy: a loss with a non-trivial Hessian."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


# --- the homogeneous "stacked" layout ----------------------------------------------------------


def residual(p, x, key):
    """``f64[b, WIDTH] -> f64[b, WIDTH]``."""
    return x + jnp.tanh(x @ p["w"] + p["b"][None])


def stacked_params(num_stages: int = NUM_STACKED, seed: int = 2) -> dict[str, jax.Array]:
    r = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(r.normal(size=(num_stages, WIDTH, WIDTH)) / np.sqrt(WIDTH)),
        "b": jnp.asarray(r.normal(size=(num_stages, WIDTH)) * 0.5),
    }


def stacked_inputs(batch: int, seed: int = 3) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, WIDTH)))


# --- references ---------------------------------------------------------------------------------


def unstack(params, num_stages: int) -> list[Any]:
    """Per-stage parameter pytrees from a tree stacked on a leading stage axis."""
    return [jax.tree.map(lambda a, s=s: a[s], params) for s in range(num_stages)]


def compose(stages, params, x, key=None):
    """The naive reference: each stage applied in turn to the whole batch."""
    for stage, p in zip(stages, params, strict=True):
        x = stage(p, x, key)
    return x


class Layout(NamedTuple):
    """A stage layout of the contract table.

    ``make(**kw)`` builds the pipeline; ``reference(params, x)`` composes the stages on the whole
    batch; ``loss(y, batch)`` turns outputs into a scalar; ``float_x(x)`` / ``with_float_x(x, f)``
    read and replace the float part of ``x`` that gradients with respect to ``x`` are taken of.
    """

    name: str
    num_stages: int
    make: Any
    params: Any
    inputs: Any
    reference: Any
    loss: Any
    float_x: Any
    with_float_x: Any


def _labels(batch: int) -> jax.Array:
    return jnp.asarray(np.arange(batch) % CLASSES, jnp.int32)


TOKENS = Layout(
    name="tokens",
    num_stages=3,
    make=lambda **kw: pj.pipeline(list(TOKEN_STAGES), **kw),
    params=token_params,
    inputs=token_inputs,
    reference=lambda params, x: compose(TOKEN_STAGES, params, x),
    loss=lambda y: token_loss(y, _labels(y.shape[0])),
    float_x=lambda x: x["feats"],
    with_float_x=lambda x, f: {"ids": x["ids"], "feats": f},
)

STACKED = Layout(
    name="stacked",
    num_stages=NUM_STACKED,
    make=lambda **kw: pj.pipeline(residual, num_stages=NUM_STACKED, **kw),
    params=stacked_params,
    inputs=stacked_inputs,
    reference=lambda params, x: compose((residual,) * NUM_STACKED, unstack(params, NUM_STACKED), x),
    loss=lambda y: jnp.sum(jnp.sin(y) * jnp.cos(2.0 * y)),
    float_x=lambda x: x,
    with_float_x=lambda x, f: f,
)

LAYOUTS = {layout.name: layout for layout in (TOKENS, STACKED)}


# --- placements ---------------------------------------------------------------------------------


def make_mesh(placement: str, num_stages: int):
    """``None``, or a 1-D stage mesh with Explicit (JAX's default) or Auto axis type."""
    if placement == "none":
        return None
    if placement == "explicit":
        return jax.make_mesh((num_stages,), ("stage",))
    if placement == "auto":
        return jax.make_mesh((num_stages,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    raise AssertionError(placement)


PLACEMENTS = ("none", "explicit", "auto")

CHECKPOINTS = {
    "always": "always",
    "except_last": "except_last",
    "never": "never",
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}

# (batch, chunks): b = ceil(B / chunks) examples per micro-batch, m = ceil(B / b) micro-batches.
CHUNKINGS = {
    "even": (12, 3),  # b = 4, m = 3, no padding
    "uneven": (10, 4),  # b = 3, m = 4, 2 padding rows
    "small": (3, 5),  # batch < chunks: b = 1, m = 3
}


# --- comparisons --------------------------------------------------------------------------------


F32_RTOL = 1e-6  # float32 leaves: ~8 ulp of float32 (eps 1.2e-7)


def assert_trees_close(actual, desired, *, rtol, atol):
    """Same pytree structure and every leaf close (``numpy.testing.assert_allclose``).

    ``rtol``/``atol`` are meant for float64. A float32 leaf among float64 ones (e.g. the gradient
    of a float32 parameter, computed in float64 and rounded once to float32) can differ by an ulp
    of float32 when the float64 values differ in their last bits, so it gets at least
    ``F32_RTOL``.
    """
    assert jax.tree.structure(actual) == jax.tree.structure(desired)
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        assert jnp.shape(a) == jnp.shape(d)
        assert jnp.result_type(a) == jnp.result_type(d)
        tol = rtol
        if jnp.result_type(a) == jnp.float32:
            tol = max(rtol, F32_RTOL)
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), rtol=tol, atol=atol)


def assert_trees_equal(actual, desired):
    """Same pytree structure and every leaf bitwise equal."""
    assert jax.tree.structure(actual) == jax.tree.structure(desired)
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        assert jnp.result_type(a) == jnp.result_type(d)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(d))


def assert_trees_finite(tree):
    for leaf in jax.tree.leaves(tree):
        assert np.all(np.isfinite(np.asarray(leaf))), leaf


# --- a cheap heterogeneous pair with mixed-dtype parameters ---------------------------------------


def dense_in(p, x, key):
    """``f64[b, 2] -> f64[b, 3]``; parameters ``{"w": f64[2, 3], "b": f64[3]}``."""
    return jnp.tanh(x @ p["w"] + p["b"][None])


def dense_out(p, h, key):
    """``f64[b, 3] -> f64[b, 1]``; parameters ``{"w": f64[3, 1], "scale": f32[]}`` (two dtypes)."""
    return (h @ p["w"]) * p["scale"].astype(h.dtype)


PAIR_STAGES = (dense_in, dense_out)


def pair_params(seed: int = 4) -> list[dict[str, jax.Array]]:
    r = np.random.default_rng(seed)
    return [
        {"w": jnp.asarray(r.normal(size=(2, 3))), "b": jnp.asarray(r.normal(size=(3,)))},
        {"w": jnp.asarray(r.normal(size=(3, 1))), "scale": jnp.asarray(1.5, jnp.float32)},
    ]


def pair_inputs(batch: int, seed: int = 5) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, 2)))


def assert_modes_agree(got, reference, mode):
    """``(value, (param_grads, x_grads))`` of two checkpoint modes: bitwise, except that
    ``"except_last"`` runs its drain as a second scan, whose backward sums the parameter
    cotangents of the two scans separately (another association: equal to rounding)."""
    value, (g_params, g_x) = got
    if mode != "except_last":
        assert_trees_equal(got, reference)
        return
    assert_trees_equal((value, g_x), (reference[0], reference[1][1]))
    assert_trees_close(g_params, reference[1][0], rtol=1e-13, atol=1e-15)


def random_mlp(sizes, batch, seed=0):
    """``(params, x, y)`` of a dense classifier with layer widths ``sizes``: per layer ``{"w": (a, b)
    scaled by 1/sqrt(a), "b": (b,)}``, inputs ``(batch, sizes[0])`` and integer labels below
    ``sizes[-1]``, from one numpy generator (float64 under the tests' x64)."""
    rng = np.random.default_rng(seed)
    params = [
        {"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a)), "b": jnp.asarray(rng.standard_normal(b))}
        for a, b in itertools.pairwise(sizes)
    ]
    x = jnp.asarray(rng.standard_normal((batch, sizes[0])))
    y = jnp.asarray(rng.integers(0, sizes[-1], batch))
    return params, x, y
