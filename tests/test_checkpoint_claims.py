"""The PyTorch checkpointing thread's claims, as tests.

PyTorch keeps checkpointed dropout equal to the plain run by stashing and restoring the global RNG
state per device (``preserve_rng_state``), with a known hole for devices it did not guess. In JAX
every draw comes from a key passed as an argument, so:

1. ``jax.checkpoint`` around layers with dropout replays the masks: checkpointed and plain runs
   give bitwise-equal outputs and gradients (``checkpoint_sequential`` and the pipeline's modes are
   tested the same way in ``test_checkpoint_sequential.py`` and ``test_pipeline_randomness.py``).
2. The key a stage receives does not depend on which device runs it: a mesh whose devices are in
   another order draws the same masks, and so does no mesh at all.
3. There is no hidden RNG state: a checkpointed pipeline, called any number of times, draws the
   same masks, and its gradient pass replays them too.

Every comparison is bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

D = 8
DROP_RATE = 0.3  # probability of dropping a unit


def layer(p, x, key):
    return jnp.tanh(x @ p["w"] + p["b"][None]) + pj.dropout(x, key, DROP_RATE)


def stacked_params(num_layers: int, seed: int = 0):
    r = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(r.normal(size=(num_layers, D, D)) / np.sqrt(D), jnp.float32),
        "b": jnp.asarray(r.normal(size=(num_layers, D)) * 0.1, jnp.float32),
    }


X = jnp.asarray(np.random.default_rng(1).normal(size=(6, D)), jnp.float32)
KEY = jax.random.key(5)


def scan_layers(remat):
    """Layers in a ``lax.scan``; ``remat`` wraps the body (identity: plain)."""

    def apply(params, x, key):
        def step(h, xs):
            p, index = xs
            return remat(layer)(p, h, jax.random.fold_in(key, index)), None

        index = jnp.arange(params["w"].shape[0], dtype=jnp.int32)
        return jax.lax.scan(step, x, (params, index))[0]

    return apply


def unrolled_layers(params, x, key):
    for index in range(params["w"].shape[0]):
        p = jax.tree.map(lambda a, index=index: a[index], params)
        x = layer(p, x, jax.random.fold_in(key, index))
    return x


def value_and_grads(apply, params):
    def loss(p, x):
        return jnp.sum(apply(p, x, KEY) ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, X)
    return np.asarray(value), jax.tree.map(np.asarray, grads)


def assert_bitwise(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
    "variant",
    ["checkpoint each layer in a scan", "checkpoint the whole stack", "dots_saveable policy"],
)
def test_jax_checkpoint_replays_dropout_bitwise(variant):
    params = stacked_params(5)
    plain = scan_layers(lambda f: f)
    if variant == "checkpoint each layer in a scan":
        checkpointed = scan_layers(jax.checkpoint)
    elif variant == "checkpoint the whole stack":
        checkpointed = jax.checkpoint(unrolled_layers)
        plain = unrolled_layers
    else:
        policy = jax.checkpoint_policies.dots_saveable
        checkpointed = scan_layers(lambda f: jax.checkpoint(f, policy=policy))
    assert_bitwise(value_and_grads(checkpointed, params), value_and_grads(plain, params))
    # and the dropout really drew something: another key changes the result
    other = jax.jit(plain)(params, X, jax.random.key(6))
    assert not np.array_equal(np.asarray(other), np.asarray(jax.jit(plain)(params, X, KEY)))


def homogeneous_stage(p, x, key):
    return layer(p, x, key)


def test_masks_do_not_depend_on_which_device_runs_a_stage():
    """Stage s runs on a different device in each mesh; every run draws the same numbers."""
    num_stages = 4
    params = stacked_params(num_stages)
    devices = jax.devices()[:num_stages]
    results = []
    for order in (devices, devices[::-1], [devices[2], devices[0], devices[3], devices[1]], None):
        mesh = None if order is None else jax.sharding.Mesh(np.asarray(order), ("stage",))
        pipe = pj.pipeline(homogeneous_stage, num_stages=num_stages, chunks=3, checkpoint="always", mesh=mesh)
        placed = pipe.place(params)
        loss = lambda p, x, pipe=pipe: jnp.sum(pipe(p, x, KEY) ** 2)
        value, grads = jax.jit(jax.value_and_grad(loss))(placed, X)
        results.append((np.asarray(pipe(placed, X, KEY)), np.asarray(value), jax.tree.map(np.asarray, grads)))
    for result in results[1:]:
        assert_bitwise(result, results[0])


def test_no_hidden_rng_state_in_a_checkpointed_pipeline():
    """The same key draws the same masks on every call, forward or gradient; nothing advances."""
    params = stacked_params(2)
    pipe = pj.pipeline(homogeneous_stage, num_stages=2, chunks=2, checkpoint="always")
    loss = jax.jit(jax.value_and_grad(lambda p, x, key: jnp.sum(pipe(p, x, key) ** 2)))
    first_y = np.asarray(pipe(params, X, KEY))
    first = loss(params, X, KEY)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(pipe(params, X, KEY)), first_y)
        assert_bitwise(loss(params, X, KEY), first)
    # the forward value inside the gradient pass is the plain forward's
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(jnp.sum(jnp.asarray(first_y) ** 2)))
