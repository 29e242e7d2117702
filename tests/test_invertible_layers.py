"""One contract table for every invertible layer: round trip, brute-force log-determinants, derivatives.

Each case is checked against naive references in float64: the inverse undoes the forward; the
inverse's logdet is minus the forward's; the forward's logdet equals ``log|det J|`` of the full
Jacobian computed by ``jax.jacrev`` example by example. Derivatives (gradients and
forward-over-reverse Hessian-vector products) are checked against finite differences for the
layers with maths of their own, and ``jax.test_util.check_grads`` runs on the LU inverse.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pipejax.invertible as inv


def glow_step(hidden=8):
    return [inv.ActNorm(), inv.InvertibleLinear(), inv.AffineCoupling(hidden=hidden)]


def image_level(repeat):
    steps = inv.Chain([inv.ActNorm(), inv.Inv1x1Conv(), inv.AffineCoupling(hidden=4)], repeat=repeat)
    return inv.Chain([inv.Squeeze(), steps], memory="linear")


# name: (layer, input shape). Odd feature counts exercise the uneven split of couplings.
CASES = {
    "actnorm_image": (inv.ActNorm(), (2, 4, 4, 3)),
    "linear_random_perm": (inv.InvertibleLinear(permutation=3), (5, 5)),
    "inv1x1conv": (inv.Inv1x1Conv(), (2, 3, 3, 4)),
    "additive_vector_odd": (inv.AdditiveCoupling(hidden=8), (5, 5)),
    "additive_image_flip": (inv.AdditiveCoupling(hidden=4, flip=True), (2, 4, 4, 3)),
    "affine_vector_flip": (inv.AffineCoupling(hidden=8, flip=True), (5, 3)),
    "affine_image": (inv.AffineCoupling(hidden=4), (2, 4, 4, 2)),
    "squeeze": (inv.Squeeze(), (2, 4, 6, 2)),
    "chain_constant": (inv.Chain(glow_step(), repeat=3), (4, 4)),
    "multiscale": (inv.MultiScale([image_level(1), image_level(1)]), (2, 4, 4, 1)),
}


def make(name, seed=0):
    """The layer, parameters moved off their (often identity) initialisation, and an input."""
    layer, shape = CASES[name]
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float64)
    params = jax.jit(layer.init)(jax.random.key(seed), x)
    rng = np.random.default_rng(seed + 1)
    params = jax.tree.map(lambda a: a + jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), params)
    return layer, params, x


def flat(tree):
    """An example's output pytree (a multi-scale latent is a tuple) as one vector."""
    return jnp.concatenate([a.ravel() for a in jax.tree.leaves(tree)])


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_and_brute_force_logdet(name):
    """inverse(forward(x)) == x; inverse logdet == -forward logdet == -log|det J| (float64, 1e-10)."""
    layer, params, x = make(name)

    def program(params, x):
        y, logdet = layer.forward(params, x)
        back, inv_logdet = layer.inverse(params, y)

        def one_example(xi):
            jac = jax.jacrev(lambda xi: flat(layer.forward(params, xi[None])[0]))(xi)
            return jnp.linalg.slogdet(jac.reshape(jac.shape[0], -1))[1]

        return y, logdet, back, inv_logdet, jax.vmap(one_example)(x)

    y, logdet, back, inv_logdet, brute = jax.jit(program)(params, x)
    assert logdet.shape == inv_logdet.shape == (x.shape[0],)
    assert flat(y).size == x.size  # a bijection keeps the dimension
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-10)
    np.testing.assert_allclose(inv_logdet, -logdet, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(logdet, brute, rtol=1e-9, atol=1e-10)


def directional_check(fn, params, x, seed, eps=1e-5, rtol=1e-6):
    """Gradient and Hessian-vector product of a loss of ``fn``, against central differences.

    ``L = sum(w * out) + 0.1 * sum(out**2) + sum(u * logdet)`` with fixed random ``w`` and ``u``.
    Along a random direction ``v``: ``grad L . v`` against ``(L(a + eps v) - L(a - eps v)) / 2 eps``,
    and ``jvp(grad L)(v)`` (forward-over-reverse) against ``(grad L(a + eps v) - grad L(a - eps v)) /
    2 eps``. In float64 with eps=1e-5 the truncation error is about eps**2 = 1e-10 and the
    rounding error about 1e-16 / eps = 1e-11, relative; rtol=1e-6 leaves a wide margin.
    """
    rng = np.random.default_rng(seed)
    out, logdet = fn(params, x)
    w = [jnp.asarray(rng.standard_normal(a.shape)) for a in jax.tree.leaves(out)]
    u = jnp.asarray(rng.standard_normal(logdet.shape))
    v = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), (params, x))

    def loss(args):
        out, logdet = fn(*args)
        leaves = jax.tree.leaves(out)
        return sum(jnp.sum(wi * o) + 0.1 * jnp.sum(o * o) for wi, o in zip(w, leaves, strict=True)) + jnp.sum(
            u * logdet
        )

    def program(args):
        shift = lambda sign: jax.tree.map(lambda a, t: a + sign * eps * t, args, v)
        grad = jax.grad(loss)
        dot = lambda a, b: sum(
            jnp.sum(p * q) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )
        fd_grad = (loss(shift(1.0)) - loss(shift(-1.0))) / (2 * eps)
        fd_hvp = jax.tree.map(lambda a, b: (a - b) / (2 * eps), grad(shift(1.0)), grad(shift(-1.0)))
        return dot(grad(args), v), fd_grad, jax.jvp(grad, (args,), (v,))[1], fd_hvp

    g_v, fd_g_v, hvp, fd_hvp = jax.jit(program)((params, x))
    np.testing.assert_allclose(g_v, fd_g_v, rtol=rtol)
    hvp, fd_hvp = (jnp.concatenate([a.ravel() for a in jax.tree.leaves(t)]) for t in (hvp, fd_hvp))
    assert float(jnp.linalg.norm(hvp - fd_hvp) / jnp.linalg.norm(fd_hvp)) < rtol


@pytest.mark.parametrize(
    ("name", "direction"),
    [("affine_vector_flip", "forward"), ("linear_random_perm", "inverse"), ("chain_constant", "forward")],
)
def test_derivatives_against_finite_differences(name, direction):
    """Gradients and forward-over-reverse HVPs against finite differences (float64).

    The cases with maths of their own: the coupling whose logdet depends on the input, the
    triangular solves of the LU inverse, and the hand-written custom_vjp of a constant-memory
    chain (whose HVP differentiates its backward rule).
    """
    layer, params, x = make(name)
    if direction == "inverse":
        x = layer.forward(params, x)[0]
    directional_check(getattr(layer, direction), params, x, seed=4)


def test_check_grads_invertible_linear_inverse():
    """jax.test_util.check_grads, order 2 in both modes, through the LU inverse's triangular solves."""
    layer, params, x = make("linear_random_perm")
    check_grads(jax.jit(layer.inverse), (params, x), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize(
    "layer",
    [inv.AdditiveCoupling(hidden=8), inv.AffineCoupling(hidden=8, flip=True), inv.AffineCoupling(hidden=4)],
    ids=["additive", "affine_flip", "affine_image"],
)
def test_couplings_start_as_identity(layer):
    shape = (3, 4, 4, 2) if layer.hidden == 4 else (6, 5)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float64)
    y, logdet = layer.forward(layer.init(jax.random.key(0), x), x)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(logdet, np.zeros(shape[0]))


def test_actnorm_data_dependent_init():
    """After init, the initial batch is normalised per channel (images: over batch, height, width)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(
        rng.standard_normal((8, 4, 4, 3)) * np.array([0.5, 2.0, 7.0]) + np.array([1.0, -3.0, 0.0])
    )
    layer = inv.ActNorm()
    y, logdet = layer.forward(layer.init(jax.random.key(0), x), x)
    np.testing.assert_allclose(y.mean(axis=(0, 1, 2)), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.std(axis=(0, 1, 2)), 1.0, rtol=1e-5)  # eps=1e-6 in the scale
    expected = -16 * np.sum(np.log(np.std(np.asarray(x), axis=(0, 1, 2)) + 1e-6))  # H*W*sum(log_scale)
    np.testing.assert_allclose(logdet, expected, rtol=1e-12)


def test_invertible_linear_is_lu_and_starts_as_permutation():
    """W = P L U with L unit lower and U's diagonal exp(log_scale); at init W = P."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))
    layer = inv.InvertibleLinear(permutation=5)
    params = layer.init(jax.random.key(0), x)
    perm = np.random.default_rng(5).permutation(4)
    np.testing.assert_array_equal(layer.forward(params, x)[0], np.asarray(x)[:, perm])
    rng = np.random.default_rng(1)
    params = {k: v + rng.standard_normal(v.shape) for k, v in params.items()}
    lower = np.tril(np.asarray(params["lower"]), -1) + np.eye(4)
    upper = np.triu(np.asarray(params["upper"]), 1) + np.diag(np.exp(np.asarray(params["log_scale"])))
    w = (lower @ upper)[perm]  # row i of W is row perm[i] of L U
    y, logdet = layer.forward(params, x)
    np.testing.assert_allclose(y, np.asarray(x) @ w.T, rtol=1e-12)
    np.testing.assert_allclose(logdet, np.linalg.slogdet(w)[1], rtol=1e-12)


def test_squeeze_moves_blocks_to_channels():
    x = jnp.arange(2 * 4 * 4 * 1, dtype=jnp.float64).reshape(2, 4, 4, 1)
    y, _ = inv.Squeeze().forward({}, x)
    # Pixel (i, j) of the output holds the 2x2 block at (2i, 2j), ordered (row, column).
    np.testing.assert_array_equal(y[0, 1, 0], [x[0, 2, 0, 0], x[0, 2, 1, 0], x[0, 3, 0, 0], x[0, 3, 1, 0]])


# --- errors ---------------------------------------------------------------------------------------


def test_layer_errors():
    vec, img = jnp.ones((4, 6)), jnp.ones((2, 4, 4, 3))
    with pytest.raises(ValueError, match=r"`hidden` of AffineCoupling .* got 0"):
        inv.AffineCoupling(hidden=0)
    with pytest.raises(ValueError, match=r"`drop_rate` of AdditiveCoupling .*probability of dropping"):
        inv.AdditiveCoupling(hidden=4, drop_rate=1.0)
    with pytest.raises(ValueError, match=r"`scale_bound` of AffineCoupling .* positive"):
        inv.AffineCoupling(hidden=4, scale_bound=0.0)
    with pytest.raises(ValueError, match=r"`permutation` of InvertibleLinear"):
        inv.InvertibleLinear(permutation="shuffle")
    with pytest.raises(
        ValueError, match=r"`x` of InvertibleLinear.init must have rank 2 \(batch, features\)"
    ):
        inv.InvertibleLinear().init(jax.random.key(0), img)
    with pytest.raises(ValueError, match=r"`x` of Inv1x1Conv.init must have rank 4"):
        inv.Inv1x1Conv().init(jax.random.key(0), vec)
    with pytest.raises(ValueError, match=r"`x` of Squeeze.forward must have an even height and width"):
        inv.Squeeze().forward({}, jnp.ones((2, 3, 4, 1)))
    with pytest.raises(ValueError, match=r"at least 2 features"):
        inv.AdditiveCoupling(hidden=4).init(jax.random.key(0), jnp.ones((4, 1)))
    with pytest.raises(TypeError, match=r"`x` of ActNorm.init must be a floating array"):
        inv.ActNorm().init(jax.random.key(0), jnp.ones((4, 3), jnp.int32))
    params = inv.ActNorm().init(jax.random.key(0), vec)
    with pytest.raises(ValueError, match=r"has 5 channels .* made by ActNorm.init for 6 channels"):
        inv.ActNorm().forward(params, jnp.ones((4, 5)))
    coupling = inv.AffineCoupling(hidden=4)
    params = coupling.init(jax.random.key(0), vec)
    with pytest.raises(
        ValueError, match=r"`params` of AffineCoupling.forward were made by init for inputs of"
    ):
        coupling.forward(params, jnp.ones((4, 8)))
    with pytest.raises(TypeError, match=r"`levels\[0\]` of MultiScale must be an invertible layer"):
        inv.MultiScale([jnp.tanh])
    ms = inv.MultiScale([inv.ActNorm(), inv.ActNorm()])
    with pytest.raises(
        ValueError, match=r"after level 0, so that level must output an even number of channels"
    ):
        ms.init(jax.random.key(0), img)
    ms_params = ms.init(jax.random.key(0), jnp.ones((2, 4, 4, 2)))
    with pytest.raises(ValueError, match=r"`z` of MultiScale.inverse must be a tuple of 2 latents"):
        ms.inverse(ms_params, jnp.ones((2, 4, 4, 2)))


# --- extreme parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [inv.InvertibleLinear(), inv.ActNorm()], ids=["linear", "actnorm"])
def test_extreme_log_scale_stays_invertible_in_float32(layer):
    """float32 exp(-100) underflows to 0: the layer bounds its diagonal, so nothing turns into NaN."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)), jnp.float32)
    params = layer.init(jax.random.key(0), x)
    params = {**params, "log_scale": jnp.asarray([-100.0, 0.5, 100.0, -3.0], jnp.float32)}
    y, logdet = layer.forward(params, x)
    back, inv_logdet = layer.inverse(params, y)
    bound = -0.5 * np.log(np.finfo(np.float32).tiny)  # 43.67: exp(+-bound) are normal float32 numbers
    assert np.all(np.isfinite(np.asarray(y))) and np.all(np.isfinite(np.asarray(back)))
    # the map and its log-determinant use the same clipped log-scale, so they stay consistent
    np.testing.assert_allclose(logdet, np.full(6, -bound + 0.5 + bound - 3.0), rtol=1e-6)
    np.testing.assert_array_equal(inv_logdet, -logdet)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(inv.reconstruction_error(layer, params, x))) < 1e-5


def test_extreme_log_scale_gradients_of_constant_memory_match_linear():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 4)), jnp.float32)
    steps = [inv.InvertibleLinear(), inv.AffineCoupling(hidden=8)]
    grads = {}
    for memory in ("linear", "constant"):
        chain = inv.Chain(steps, repeat=2, memory=memory)
        params = chain.init(jax.random.key(0), x)
        params[0]["log_scale"] = params[0]["log_scale"].at[0, 1].set(-100.0)  # block 0's diagonal
        loss = lambda p, chain=chain: jnp.mean(chain.forward(p, x)[0] ** 2)
        grads[memory] = jax.grad(loss)(params)
    flat = {m: np.concatenate([np.ravel(a) for a in jax.tree.leaves(g)]) for m, g in grads.items()}
    assert np.all(np.isfinite(flat["constant"])), "constant-memory gradients must stay finite"
    # float32 reconstruction through a scale of exp(43.7) loses digits: compare relative to the norm
    err = np.linalg.norm(flat["constant"] - flat["linear"]) / np.linalg.norm(flat["linear"])
    assert err < 1e-4, err


def test_reconstruction_error_flags_a_non_finite_inverse():
    """An overflow in forward (1e30 * exp(43) = inf in float32) makes the inverse NaN: reported as inf."""
    layer = inv.ActNorm()
    x = jnp.asarray([[1.0, 2.0], [1e30, 2.0]], jnp.float32)
    params = {"bias": jnp.zeros(2, jnp.float32), "log_scale": jnp.asarray([43.0, 0.0], jnp.float32)}
    err = np.asarray(inv.reconstruction_error(layer, params, x))
    assert err[0] < 1e-5 and err[1] == np.inf, err
    chain = inv.Chain([layer], repeat=2)
    stacked = (jax.tree.map(lambda a: jnp.stack([a, a]), params),)
    assert np.asarray(chain.reconstruction_errors(stacked, x)).max() == np.inf


# --- hyper-parameters: NaN, infinities, bools and out-of-range values are refused ------------------

INF, NAN = float("inf"), float("nan")
BAD_HYPER_PARAMETERS = [
    # (what to build, error, message); each was accepted before and gave NaN, inf or nonsense
    (
        lambda: inv.AffineCoupling(hidden=4, scale_bound=INF),
        ValueError,
        r"`scale_bound` of AffineCoupling bounds \|log-scale\| and must be a positive finite number, "
        r"but got inf; e\.g\. AffineCoupling\(hidden=64, scale_bound=2\.0\)",
    ),
    (lambda: inv.AffineCoupling(hidden=4, scale_bound=-INF), ValueError, r"`scale_bound` .* but got -inf"),
    (
        lambda: inv.AffineCoupling(hidden=4, scale_bound=NAN),
        ValueError,
        r"`scale_bound` .* positive finite .* got nan",
    ),
    (
        lambda: inv.AffineCoupling(hidden=4, scale_bound=True),
        TypeError,
        r"`scale_bound` .* but got bool True",
    ),
    (lambda: inv.AffineCoupling(hidden=4, scale_bound="2"), TypeError, r"`scale_bound` .* but got str '2'"),
    (
        lambda: inv.ActNorm(eps=INF),
        ValueError,
        r"`eps` of ActNorm is added to the initial standard deviation .* must be a finite number > 0, "
        r"but got inf",
    ),
    (lambda: inv.ActNorm(eps=NAN), ValueError, r"`eps` of ActNorm .* finite number > 0, but got nan"),
    (
        lambda: inv.ActNorm(eps=-1e-6),
        ValueError,
        r"`eps` of ActNorm .* but got -1e-06; e\.g\. ActNorm\(eps=1e-6\)",
    ),
    (lambda: inv.ActNorm(eps=0.0), ValueError, r"`eps` of ActNorm .* finite number > 0, but got 0\.0"),
    (lambda: inv.ActNorm(eps=True), TypeError, r"`eps` of ActNorm .* but got bool True"),
    (lambda: inv.ActNorm(eps="1e-6"), TypeError, r"`eps` of ActNorm .* but got str '1e-6'"),
    (
        lambda: inv.AdditiveCoupling(hidden=4, drop_rate=False),
        TypeError,
        r"`drop_rate` of AdditiveCoupling is the probability of dropping .* in \[0, 1\), but got bool False",
    ),
    (
        lambda: inv.AffineCoupling(hidden=4, drop_rate="0.1"),
        TypeError,
        r"`drop_rate` of AffineCoupling .* str '0\.1'",
    ),
    (
        lambda: inv.AffineCoupling(hidden=4, drop_rate=NAN),
        ValueError,
        r"`drop_rate` of AffineCoupling .* got nan",
    ),
    (
        lambda: inv.AdditiveCoupling(hidden=4, drop_rate=-0.1),
        ValueError,
        r"`drop_rate` .* \[0, 1\), but got -0\.1",
    ),
    (
        lambda: inv.AdditiveCoupling(hidden=4, flip="yes"),
        TypeError,
        r"`flip` of AdditiveCoupling must be True or False \(transform the first half .*\), "
        r"but got str 'yes'",
    ),
    (
        lambda: inv.AffineCoupling(hidden=4, flip=None),
        TypeError,
        r"`flip` of AffineCoupling .* got NoneType None",
    ),
    (
        lambda: inv.AffineCoupling(hidden=True),
        TypeError,
        r"`hidden` of AffineCoupling must be an int >= 1, but got bool",
    ),
    (
        lambda: inv.AdditiveCoupling(hidden=8.0),
        TypeError,
        r"`hidden` of AdditiveCoupling must be an int >= 1, but got float",
    ),
    (
        lambda: inv.Flow(inv.ActNorm(), event_shape=(True,)),
        TypeError,
        r"`event_shape` of Flow must be a tuple of positive",
    ),
    (
        lambda: inv.Flow(inv.ActNorm(), event_shape=(3,), dtype=jnp.int32),
        TypeError,
        r"`dtype` of Flow must be None \(the dtype of the parameters\) or a floating dtype .* got <class",
    ),
    (
        lambda: inv.Flow(inv.ActNorm(), event_shape=(3,), dtype="nonsense"),
        TypeError,
        r"`dtype` of Flow .* got 'nonsense'",
    ),
]


@pytest.mark.parametrize(("make", "error", "match"), BAD_HYPER_PARAMETERS)
def test_bad_hyper_parameters_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_hyper_parameters_of_numpy_types_are_taken():
    assert (
        inv.AffineCoupling(hidden=np.int64(4), scale_bound=np.float32(2.0), flip=np.bool_(True)).hidden == 4
    )
    assert inv.ActNorm(eps=np.float32(1e-6)).eps == pytest.approx(1e-6)
    assert inv.Flow(inv.ActNorm(), event_shape=(np.int64(3),)).event_shape == (3,)


def test_scale_bound_must_fit_the_dtype():
    """A finite bound can still break in the input's dtype: 1e39 is inf in float32, 1e-320 is 0."""
    x = jnp.ones((4, 4), jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"`scale_bound=1e\+39` of AffineCoupling does not fit the float32 of `x` in "
        r"AffineCoupling\.init: it lets exp\(s\) overflow .* "
        r"Use a scale_bound in \[1\.18e-38, 43\.67\] for float32",
    ):
        inv.AffineCoupling(hidden=4, scale_bound=1e39).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"`scale_bound=1e-320` .* it rounds to 0 or a subnormal there"):
        inv.AffineCoupling(hidden=4, scale_bound=1e-320).init(jax.random.key(0), x)
    layer = inv.AffineCoupling(hidden=4, scale_bound=100.0)  # fine in float64 (bound 354)
    params = layer.init(jax.random.key(0), x.astype(jnp.float64))
    with pytest.raises(ValueError, match=r"does not fit the float32 of `y` in AffineCoupling\.inverse"):
        layer.inverse(params, x)


def test_eps_must_fit_the_dtype():
    with pytest.raises(
        ValueError, match=r"`eps=1e-50` of ActNorm rounds to 0\.0 in the float32 of the input `x`"
    ):
        inv.ActNorm(eps=1e-50).init(jax.random.key(0), jnp.ones((4, 2), jnp.float32))
    with pytest.raises(ValueError, match=r"`eps=1e\+39` of ActNorm rounds to inf in the float32"):
        inv.ActNorm(eps=1e39).init(jax.random.key(0), jnp.ones((4, 2), jnp.float32))
    inv.ActNorm().init(jax.random.key(0), jnp.ones((4, 2), jnp.float16))  # 1e-6: a float16 subnormal, > 0


@pytest.mark.parametrize("temperature", [INF, np.float32(np.inf), jnp.inf])
def test_an_infinite_temperature_is_refused(temperature):
    flow = inv.Flow(inv.ActNorm(), event_shape=(3,))
    params = flow.init(
        jax.random.key(0), jnp.asarray(np.random.default_rng(0).standard_normal((8, 3)), jnp.float32)
    )
    with pytest.raises(
        ValueError, match=r"`temperature` of Flow.sample must be a finite scalar >= 0 .* but got .*inf"
    ):
        flow.sample(params, jax.random.key(1), 2, temperature=temperature)
    with pytest.raises(
        ValueError, match=r"`temperature=1e\+39` of Flow.sample overflows the float32 of the samples"
    ):
        flow.sample(params, jax.random.key(1), 2, temperature=1e39)


@pytest.mark.parametrize(
    "layer",
    [inv.AffineCoupling(hidden=4), inv.AdditiveCoupling(hidden=4), inv.ActNorm(), inv.InvertibleLinear()],
    ids=["affine", "additive", "actnorm", "linear"],
)
def test_layers_refuse_a_key_that_is_not_a_prng_key(layer):
    x = jax.random.normal(jax.random.key(0), (4, 6))
    name = type(layer).__name__
    params = layer.init(jax.random.key(1), x)
    for method in ("forward", "inverse"):
        with pytest.raises(TypeError, match=rf"`key` of {name}.{method} must be None or a PRNG key"):
            getattr(layer, method)(params, x, key=3)
        getattr(layer, method)(params, x, jax.random.key(2))  # typed, legacy and None keys pass
        getattr(layer, method)(params, x, jax.random.PRNGKey(2))
        getattr(layer, method)(params, x)
    with pytest.raises(TypeError, match=rf"`key` of {name}.init must be"):
        layer.init(3, x)


def test_squeeze_refuses_a_key_that_is_not_a_prng_key():
    img = jnp.ones((2, 4, 4, 1))
    with pytest.raises(TypeError, match=r"`key` of Squeeze.forward must be None or a PRNG key"):
        inv.Squeeze().forward({}, img, key=3)
    with pytest.raises(TypeError, match=r"`key` of Squeeze.inverse must be None or a PRNG key"):
        inv.Squeeze().inverse({}, jnp.ones((2, 2, 2, 4)), key="0")
