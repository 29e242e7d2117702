"""`pj.checkpoint_sequential` against a plain `lax.scan` over the same layers and keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

D = 8
DROP_RATE = 0.25  # probability of dropping a unit


def layer(p, x, key):
    h = jnp.tanh(x @ p["w"] + p["b"][None])
    if key is None:
        return h
    keep = jax.random.bernoulli(key, 1.0 - DROP_RATE, h.shape)
    return jnp.where(keep, h / (1.0 - DROP_RATE), jnp.zeros_like(h))


def plain_scan(params, x, key=None):
    """The reference: an un-checkpointed scan in which layer l draws with fold_in(key, l)."""

    def step(h, xs):
        p, index = xs
        return layer(p, h, None if key is None else jax.random.fold_in(key, index)), None

    num_layers = params["w"].shape[0]
    return jax.lax.scan(step, x, (params, jnp.arange(num_layers, dtype=jnp.int32)))[0]


def make_params(num_layers, seed=0):
    r = np.random.RandomState(seed)
    return {
        "w": jnp.asarray(r.randn(num_layers, D, D) * 0.5, jnp.float32),
        "b": jnp.asarray(r.randn(num_layers, D) * 0.1, jnp.float32),
    }


X = jnp.asarray(np.random.RandomState(1).randn(5, D), jnp.float32)


@pytest.mark.parametrize(
    ("num_layers", "segments"),
    [(16, None), (16, 4), (17, 4), (10, 3), (5, 9), (1, None), (7, 1)],
)
@pytest.mark.parametrize("with_key", [False, True])
def test_bitwise_equal_to_plain_scan(num_layers, segments, with_key):
    """Forward and gradients are bitwise those of the plain scan, with and without dropout."""
    params = make_params(num_layers)
    key = jax.random.key(3) if with_key else None
    apply = pj.checkpoint_sequential(layer, segments=segments)
    np.testing.assert_array_equal(jax.jit(apply)(params, X, key), jax.jit(plain_scan)(params, X, key))

    def loss(f):
        return lambda p, x: jnp.sum(f(p, x, key) ** 2)

    grads = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(params, X)
    ref = jax.jit(jax.grad(loss(plain_scan), argnums=(0, 1)))(params, X)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)


def test_replays_the_same_masks_every_time():
    """No hidden RNG state: the same key draws the same masks on every call."""
    params = make_params(9)
    apply = jax.jit(pj.checkpoint_sequential(layer, segments=3))
    key = jax.random.key(11)
    first = apply(params, X, key)
    for _ in range(3):
        np.testing.assert_array_equal(apply(params, X, key), first)
    assert not np.array_equal(apply(params, X, jax.random.key(12)), first)


def test_hvp_matches_plain_scan():
    """Forward-over-reverse passes through the checkpointed segments (float32, so rtol 1e-5)."""
    params = make_params(6)
    apply = pj.checkpoint_sequential(layer, segments=2)
    v = jax.tree.map(jnp.ones_like, params)

    def hvp(f):
        g = jax.grad(lambda p: jnp.sum(f(p, X) ** 2))
        return jax.jit(lambda p: jax.jvp(g, (p,), (v,))[1])(params)

    for a, b in zip(jax.tree.leaves(hvp(apply)), jax.tree.leaves(hvp(plain_scan)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _temp_bytes(fn, num_layers, width=64, batch=256):
    params = {"w": jnp.full((num_layers, width, width), 0.01), "b": jnp.zeros((num_layers, width))}
    x = jnp.ones((batch, width))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x) ** 2)))
    return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_activation_memory_grows_like_sqrt_depth():
    """Compiled temp bytes (deterministic on CPU): L=256 costs at most 1.25 * sqrt(256/16) = 5x
    L=16 with sqrt(L) segments, while the plain scan grows about 16x (at least 12x here, the
    parameter-gradient buffers being a depth-proportional part of both)."""
    sqrt_segments = pj.checkpoint_sequential(layer)
    small, large = _temp_bytes(sqrt_segments, 16), _temp_bytes(sqrt_segments, 256)
    assert large <= 1.25 * 4 * small, (small, large)
    plain_small, plain_large = _temp_bytes(plain_scan, 16), _temp_bytes(plain_scan, 256)
    assert plain_large >= 12 * plain_small, (plain_small, plain_large)


def test_bad_segments():
    with pytest.raises(ValueError, match=r"`segments` must be an int >= 1, but got 0: the number of check"):
        pj.checkpoint_sequential(layer, segments=0)
    with pytest.raises(TypeError, match=r"`segments` must be an int >= 1, but got float 2.0"):
        pj.checkpoint_sequential(layer, segments=2.0)
    for flag in (True, np.True_):
        with pytest.raises(TypeError, match=r"`segments` must be an int >= 1, but got bool"):
            pj.checkpoint_sequential(layer, segments=flag)


@pytest.mark.parametrize("segments", [np.int64(2), np.int32(2), np.uint8(2)])
def test_numpy_integer_segments_are_the_same_count(segments):
    """One rule for every count (issue 39): numpy's integers are counts, as for `chunks`."""
    params = make_params(8)
    want = pj.checkpoint_sequential(layer, segments=2)(params, X)
    np.testing.assert_array_equal(pj.checkpoint_sequential(layer, segments=segments)(params, X), want)


def test_layer_that_changes_the_shape():
    def widen(p, x, key):
        return jnp.concatenate([x, x], axis=-1)

    with pytest.raises(ValueError, match=r"`layer` must return an activation of the type it takes"):
        pj.checkpoint_sequential(widen)(make_params(4), X)


def test_params_without_a_common_leading_axis():
    params = {"w": jnp.zeros((4, D, D)), "b": jnp.zeros((3, D))}
    with pytest.raises(ValueError, match=r"same leading layer axis.*\['b'\]: 3.*\['w'\]: 4"):
        pj.checkpoint_sequential(layer)(params, X)


def test_layer_not_callable():
    with pytest.raises(TypeError, match=r"`layer` must be a callable"):
        pj.checkpoint_sequential("tanh")


def test_a_batch_of_keys_is_refused_with_the_fix():
    apply = pj.checkpoint_sequential(layer)
    for keys in (jax.random.split(jax.random.key(0), 2), jax.random.split(jax.random.PRNGKey(0), 2)):
        msg = r"`key` of checkpoint_sequential's apply must be a single PRNG key.*shape \(2,( 2)?\).*jax.vmap"
        with pytest.raises(TypeError, match=msg):
            apply(make_params(4), X, keys)
    with pytest.raises(TypeError, match=r"`key` of checkpoint_sequential's apply must be None or a PRNG key"):
        apply(make_params(4), X, 3)


def test_layer_without_a_key_argument_is_named_with_the_contract():
    params = jnp.ones((4, D, D))
    with pytest.raises(
        TypeError,
        match=r"`layer` of checkpoint_sequential, `[^`]*<lambda>\(p, x\)`, cannot be called as "
        r"`layer\(params_l, x, key_l\) -> x`: too many positional arguments\. A layer that needs no "
        r"randomness still takes `key_l`",
    ):
        pj.checkpoint_sequential(lambda p, x: x @ p)(params, jnp.ones((2, D)))
    # *args and defaults bind as the call does.
    out = pj.checkpoint_sequential(lambda p, x, *rest: x @ p)(params, jnp.ones((2, D)))
    assert out.shape == (2, D)
