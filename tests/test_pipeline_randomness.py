"""Randomness: every stage draws from the key it receives, which the pipeline derives as
``pj.stage_key(key, i, s) = fold_in(fold_in(key, i), s)`` for micro-batch ``i`` and stage ``s``.

So dropout masks are reproducible by construction: the same key replays bitwise; recomputation in
the backward pass of every checkpoint mode replays the same masks (checkpointed and plain runs are
bitwise equal, forward and gradients); and a mesh and no mesh draw the same numbers.

Every comparison here is bitwise (``np.testing.assert_array_equal``): the claims are exact, so
float32 is used throughout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models

KEEP = 0.75  # probability of keeping an activation
COLUMNS = 16  # mask entries drawn per example and stage


def dropout(key, x):
    """Inverted dropout with keep probability ``KEEP``."""
    return jnp.where(jax.random.bernoulli(key, KEEP, x.shape), x / KEEP, 0.0)


# --- the key each (micro-batch, stage) receives ---------------------------------------------------


def marker_stage(s):
    """Heterogeneous stage ``s``: writes its dropout mask of a row of ones into slot ``s``."""

    def stage(p, x, key):
        return x.at[:, s].set(dropout(key, x[:, s]))

    return stage


def homogeneous_marker(p, x, key):
    """The same for homogeneous stages: the stage index comes from the stacked ``p["slot"]``."""
    mask = dropout(key, jax.lax.dynamic_index_in_dim(x, p["slot"], axis=1, keepdims=False))
    hit = (jnp.arange(x.shape[1], dtype=jnp.int32) == p["slot"])[None, :, None]
    return jnp.where(hit, mask[:, None, :], x)


def make_markers(layout, num_stages, chunks, mesh):
    if layout == "heterogeneous":
        pipe = pj.pipeline([marker_stage(s) for s in range(num_stages)], chunks=chunks, mesh=mesh)
        return pipe, [{} for _ in range(num_stages)]
    pipe = pj.pipeline(homogeneous_marker, num_stages=num_stages, chunks=chunks, mesh=mesh)
    return pipe, {"slot": jnp.arange(num_stages, dtype=jnp.int32)}


def expected_masks(key, batch, chunks, num_stages):
    """``out[:, s]`` for micro-batch ``i`` is the mask drawn from ``pj.stage_key(key, i, s)``."""
    plan = pj.microbatch_plan(batch, chunks)
    rows = []
    for i in range(plan.num_micro):
        ones = jnp.ones((plan.micro_size, COLUMNS), jnp.float32)
        rows.append(jnp.stack([dropout(pj.stage_key(key, i, s), ones) for s in range(num_stages)], 1))
    return jnp.concatenate(rows)[:batch]


KEYS = {"typed": lambda seed: jax.random.key(seed), "raw": lambda seed: jax.random.PRNGKey(seed)}


@pytest.mark.parametrize("key_kind", KEYS)
@pytest.mark.parametrize("placement", ["none", "explicit"])
@pytest.mark.parametrize("layout", ["heterogeneous", "homogeneous"])
def test_stage_keys_follow_the_documented_derivation(layout, placement, key_kind):
    num_stages, batch, chunks = 3, 10, 4  # 4 micro-batches of 3, the last with 2 padding rows
    pipe, params = make_markers(layout, num_stages, chunks, models.make_mesh(placement, num_stages))
    key = KEYS[key_kind](0)
    x = jnp.ones((batch, num_stages, COLUMNS), jnp.float32)
    out = pipe(params, x, key=key)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected_masks(key, batch, chunks, 3)))

    # Every micro-batch and every stage draws its own mask.
    plan = pj.microbatch_plan(batch, chunks)
    blocks = [np.asarray(out[i * plan.micro_size : (i + 1) * plan.micro_size]) for i in range(4)]
    for s in range(num_stages):
        for i in range(4):
            for j in range(i + 1, 4):
                n = min(len(blocks[i]), len(blocks[j]))
                assert not np.array_equal(blocks[i][:n, s], blocks[j][:n, s]), (s, i, j)
    for s in range(num_stages):
        for t in range(s + 1, num_stages):
            assert not np.array_equal(np.asarray(out[:, s]), np.asarray(out[:, t])), (s, t)

    # The same key replays bitwise; another key draws other masks.
    np.testing.assert_array_equal(np.asarray(pipe(params, x, key=key)), np.asarray(out))
    assert not np.array_equal(np.asarray(pipe(params, x, key=KEYS[key_kind](1))), np.asarray(out))


def test_stage_key_is_two_fold_ins():
    key = jax.random.key(3)
    for i, s in [(0, 0), (2, 1), (5, 3)]:
        expected = jax.random.fold_in(jax.random.fold_in(key, i), s)
        np.testing.assert_array_equal(
            jax.random.key_data(pj.stage_key(key, i, s)), jax.random.key_data(expected)
        )
    assert pj.stage_key(None, 1, 2) is None


@pytest.mark.parametrize("placement", ["none", "explicit"])
@pytest.mark.parametrize("layout", ["heterogeneous", "homogeneous"])
def test_without_a_key_stages_receive_none(layout, placement):
    received = []

    def record(p, x, key):
        received.append(key)
        return x * 2.0

    mesh = models.make_mesh(placement, 2)
    if layout == "heterogeneous":
        pipe, params = pj.pipeline([record, record], chunks=2, mesh=mesh), [{}, {}]
    else:
        pipe, params = pj.pipeline(record, num_stages=2, chunks=2, mesh=mesh), {"unused": jnp.zeros(2)}
    x = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2)
    np.testing.assert_array_equal(np.asarray(pipe(params, x)), np.asarray(x * 4.0))
    assert received and all(k is None for k in received)
    received.clear()
    pipe(params, x, key=jax.random.key(0))
    assert received and all(k is not None for k in received)


# --- dropout through checkpoints and meshes: bitwise ------------------------------------------------


def dropout_dense(p, x, key):
    """A residual dense layer with dropout (homogeneous)."""
    return x + dropout(key, jnp.tanh(x @ p["w"] + p["b"][None]))


def dropout_up(p, x, key):
    """``f32[b, 3] -> (f32[b, 5], f32[b, 3])`` (heterogeneous, with a skip connection)."""
    return dropout(key, jnp.tanh(x @ p["w"])), x


def dropout_down(p, hs, key):
    """``(f32[b, 5], f32[b, 3]) -> f32[b, 2]``."""
    h, skip = hs
    return dropout(key, h) @ p["w"] + skip @ p["v"]


def _f32(r, *shape):
    return jnp.asarray(r.normal(size=shape), jnp.float32)


def make_dropout_model(layout, checkpoint, mesh):
    r = np.random.default_rng(0)
    if layout == "homogeneous":
        pipe = pj.pipeline(dropout_dense, num_stages=3, chunks=4, checkpoint=checkpoint, mesh=mesh)
        return pipe, {"w": _f32(r, 3, 3, 3), "b": _f32(r, 3, 3)}
    pipe = pj.pipeline([dropout_up, dropout_down], chunks=4, checkpoint=checkpoint, mesh=mesh)
    return pipe, [{"w": _f32(r, 3, 5)}, {"w": _f32(r, 5, 2), "v": _f32(r, 3, 2)}]


DROPOUT_X = np.random.default_rng(1).normal(size=(10, 3)).astype(np.float32)
DROPOUT_KEY = 42


@functools.cache
def dropout_run(layout, placement, checkpoint):
    """``(y, grads)`` of a jitted ``value_and_grad`` through the dropout model, as numpy arrays.

    ``y`` is the output the gradient computation produces (checkpointed stages are recomputed
    in its backward pass); ``grads`` are with respect to params and x. Cached: several tests
    compare against the same runs, and compiles are slow.
    """
    num_stages = 3 if layout == "homogeneous" else 2
    mesh = models.make_mesh(placement, num_stages)
    pipe, params = make_dropout_model(layout, models.CHECKPOINTS[checkpoint], mesh)
    key = jax.random.key(DROPOUT_KEY)

    def loss(params, x):
        y = pipe(params, x, key=key)
        return jnp.sum(jnp.sin(y)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, DROPOUT_X)
    return np.asarray(y), jax.tree.map(np.asarray, grads)


# ("except_last" without a mesh keeps the last micro-batch, a mesh its last n ticks: their
# parameter gradients group the sum differently, so the mesh cases are other modes.)
MESH_CASES = {("heterogeneous", "never"), ("homogeneous", "always")}


@pytest.mark.parametrize("checkpoint", models.CHECKPOINTS)
@pytest.mark.parametrize("layout", ["heterogeneous", "homogeneous"])
def test_dropout_replays_through_checkpoints_and_meshes(layout, checkpoint):
    """Every checkpoint mode recomputes with the same masks: outputs and gradients are bitwise
    equal to those of ``checkpoint="never"`` (``"except_last"``: parameter gradients to rounding);
    and a mesh and no mesh give bitwise-equal outputs
    and gradients (checked for one mode per layout, as compiles are slow; the contract tests
    check every mode on a mesh)."""
    y_ref, grads_ref = dropout_run(layout, "none", "never")
    y, grads = dropout_run(layout, "none", checkpoint)
    np.testing.assert_array_equal(y, y_ref)
    if (layout, checkpoint) in MESH_CASES:
        y_mesh, grads_mesh = dropout_run(layout, "explicit", checkpoint)
        np.testing.assert_array_equal(y_mesh, y_ref)
        models.assert_trees_equal(grads_mesh, grads)
    # Bitwise: the masks are replayed, and every mode sums the parameter cotangents of the
    # ticks in the same order (but "except_last", whose two scans group that sum in two parts).
    models.assert_modes_agree((0.0, grads), (0.0, grads_ref), checkpoint)


@pytest.mark.parametrize("layout", ["heterogeneous", "homogeneous"])
def test_dropout_forward_calls_replay_the_gradient_pass(layout):
    """A plain forward call draws the masks the gradient pass drew; another key draws others."""
    num_stages = 3 if layout == "homogeneous" else 2
    pipe, params = make_dropout_model(layout, "except_last", models.make_mesh("explicit", num_stages))
    forward = np.asarray(pipe(params, DROPOUT_X, key=jax.random.key(DROPOUT_KEY)))
    np.testing.assert_array_equal(forward, dropout_run(layout, "none", "never")[0])
    other = np.asarray(pipe(params, DROPOUT_X, key=jax.random.key(DROPOUT_KEY + 1)))
    assert not np.array_equal(forward, other), "dropout had no effect"


def test_dropout_pipeline_matches_composition_with_stage_keys():
    """With dropout, the pipeline equals the composition when each micro-batch's rows are run
    through the stages with the keys ``pj.stage_key(key, i, s)``."""
    pipe, params = make_dropout_model("heterogeneous", "except_last", None)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(10, 3)), jnp.float32)
    key = jax.random.PRNGKey(7)
    plan = pj.microbatch_plan(10, 4)
    xs, _, _ = pj.split_microbatches(x, 4)
    stages = (dropout_up, dropout_down)
    parts = []
    for i in range(plan.num_micro):
        h = xs[i]
        for s, (stage, p) in enumerate(zip(stages, params, strict=True)):
            h = stage(p, h, pj.stage_key(key, i, s))
        parts.append(h)
    expected = jnp.concatenate(parts)[:10]
    # The reference runs the same operations on the same micro-batches; only XLA's fusion of the
    # jitted pipeline differs from the op-by-op reference, so allow float32 rounding (1e-6).
    np.testing.assert_allclose(
        np.asarray(pipe(params, x, key=key)), np.asarray(expected), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_except_last_gradients_with_dropout(placement):
    """Issue 22's case, made harder: 4 stages of ``tanh(x @ w)`` then ``pj.dropout`` at rate 0.5,
    16 x 16 weights, 32 random rows in 8 micro-batches. All three modes give bitwise-equal
    outputs and gradients: ``"except_last"`` runs two scans, and its parameter cotangents reach
    one running sum through the carried link of ``engine._port``. (Summed in two sums of their
    own, as before, they differed from the other modes' by 1-2 ulp here.)"""

    def stage(p, x, key):
        return pj.dropout(jnp.tanh(x @ p["w"]), key, 0.5)

    r = np.random.default_rng(3)
    params = [{"w": jnp.asarray(r.normal(size=(16, 16)) / 3, jnp.float32)} for _ in range(4)]
    x = jnp.asarray(r.normal(size=(32, 16)), jnp.float32)
    mesh = models.make_mesh(placement, 4)
    runs = {}
    for mode in ("never", "always", "except_last"):
        pipe = pj.pipeline([stage] * 4, chunks=8, checkpoint=mode, mesh=mesh)
        placed = params if mesh is None else pipe.place(params)

        def loss(p, x, pipe=pipe):
            y = pipe(p, x, jax.random.key(5))
            return jnp.sum(y**2), y

        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(placed, x)
        runs[mode] = jax.tree.map(np.asarray, (y, g))
    y_ref = runs["never"][0]
    assert np.any(y_ref == 0) and np.any(y_ref != 0), "dropout had no effect"
    models.assert_trees_equal(runs["always"], runs["never"])
    models.assert_trees_equal(runs["except_last"], runs["never"])
