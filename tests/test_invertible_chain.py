"""`Chain`'s memory modes against plain autodiff: values, gradients of every order, memory, drift.

The reference everywhere is ``memory="linear"``: ordinary autodiff through a ``lax.scan`` that
stores every activation. ``"constant"`` must give the same gradients (it rebuilds activations
through the inverses), and ``"sqrt"`` is exact recomputation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
import pipejax.invertible as inv


def glow_step(hidden=16, drop_rate=0.0):
    return [inv.ActNorm(), inv.InvertibleLinear(), inv.AffineCoupling(hidden=hidden, drop_rate=drop_rate)]


def perturbed(params, seed, scale=0.1):
    """Parameters moved off the identity initialisation, so every layer does something."""
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    moved = [a + jnp.asarray(rng.standard_normal(a.shape) * scale, a.dtype) for a in leaves]
    return jax.tree.unflatten(treedef, moved)


def setup(dtype, repeat=6, width=6, batch=32, drop_rate=0.0, seed=0):
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((batch, width)), dtype)
    chains = {m: inv.Chain(glow_step(drop_rate=drop_rate), repeat=repeat, memory=m) for m in inv.MEMORY_MODES}
    params = perturbed(jax.jit(chains["linear"].init)(jax.random.key(seed), x), seed + 1)
    return chains, params, x


def rel_err(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


# The three kinds of loss: through the output, through the log-determinant alone (the term whose
# input dependence invtf's AffineCoupling gradient dropped), and both (a flow's NLL).
LOSSES = {
    "output": lambda y, ld: jnp.mean(jnp.sin(y) * y),
    "logdet_only": lambda y, ld: jnp.mean(ld**2) + jnp.mean(ld),
    "nll": lambda y, ld: jnp.mean(0.5 * jnp.sum(y * y, axis=1) - ld),
}


@pytest.mark.parametrize(
    ("direction", "with_key"), [("forward", False), ("forward", True), ("inverse", True)]
)
def test_same_values_and_gradients_float32(direction, with_key):
    """Forward values are bitwise equal across modes; gradients equal "linear" within 1e-4 (float32).

    1e-4 relative is the issue's bound for float32: the rebuilt activations carry rounding errors
    of about 1e-7 relative per layer, amplified by the layers' Lipschitz constants (here the
    errors are about 1e-6). "sqrt" recomputes the same operations: 1e-6 relative.
    """
    chains, params, x = setup(jnp.float32, drop_rate=0.2 if with_key else 0.0)
    key = jax.random.key(5) if with_key else None

    def outputs_and_grads(mode):
        def run(p, x):
            return getattr(chains[mode], direction)(p, x, key)

        def program(p, x):
            grads = {
                name: jax.grad(lambda p, x, loss=loss: loss(*run(p, x)), argnums=(0, 1))(p, x)
                for name, loss in LOSSES.items()
            }
            return run(p, x), grads

        return jax.jit(program)(params, x)

    ref_out, ref_grads = outputs_and_grads("linear")
    ref_leaves = dict(jax.tree_util.tree_flatten_with_path(ref_grads)[0])
    for mode, tol in (("sqrt", 1e-6), ("constant", 1e-4)):
        out, grads = outputs_and_grads(mode)
        for a, b in zip(out, ref_out, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=mode)
        for path, a in jax.tree_util.tree_flatten_with_path(grads)[0]:
            err = rel_err(a, ref_leaves[path])
            assert err < tol, (mode, jax.tree_util.keystr(path), err)


def test_logdet_gradient_reaches_the_input():
    """The log-determinant of an affine coupling depends on its input; the gradient must say so."""
    chains, params, x = setup(jnp.float64, repeat=3)
    g = jax.jit(jax.grad(lambda x: jnp.sum(chains["constant"].forward(params, x)[1])))(x)
    assert float(jnp.max(jnp.abs(g))) > 1e-3
    g_ref = jax.jit(jax.grad(lambda x: jnp.sum(chains["linear"].forward(params, x)[1])))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-10, atol=1e-13)


def test_higher_order_float64():
    """jvp(grad) (forward-over-reverse) and grad(grad) through "constant" equal "linear" (float64).

    Both modes of second-order autodiff go through the custom_vjp's rules. float64 makes the
    reconstruction error negligible (about 1e-15), so 1e-9 relative is loose.
    """
    chains, params, x = setup(jnp.float64, repeat=4, width=4, batch=8)
    tangent = perturbed(jax.tree.map(jnp.zeros_like, (params, x)), seed=9, scale=1.0)

    def second_order(mode):
        grad = jax.grad(lambda p, x: LOSSES["nll"](*chains[mode].forward(p, x)), argnums=(0, 1))

        def program(p, x):
            hvp = jax.jvp(grad, (p, x), tangent)[1]
            grad_norm = lambda p, x: sum(jnp.sum(g**2) for g in jax.tree.leaves(grad(p, x)))
            return hvp, jax.grad(grad_norm, argnums=(0, 1))(p, x)

        return jax.jit(program)(params, x)

    ref = second_order("linear")
    got = second_order("constant")
    for what in (0, 1):  # 0: Hessian-vector product; 1: gradient of the squared gradient norm
        for a, b in zip(jax.tree.leaves(got[what]), jax.tree.leaves(ref[what]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=["jvp(grad)", "grad(grad)"][what])


def test_hessian_wrt_input_float64():
    """jax.hessian (jacfwd of jacrev) through "constant" equals "linear" on a tiny problem."""
    chains, params, x = setup(jnp.float64, repeat=3, width=4, batch=2)
    hess = {
        m: jax.jit(jax.hessian(lambda x, m=m: LOSSES["nll"](*chains[m].forward(params, x))))(x)
        for m in ("linear", "constant")
    }
    np.testing.assert_allclose(hess["constant"], hess["linear"], rtol=1e-9, atol=1e-12)


def test_forward_mode_alone_is_refused_under_constant():
    """JAX refuses jvp of any custom_vjp (documented): "constant" cannot be used with jax.jvp alone."""
    chains, params, x = setup(jnp.float64, repeat=2, width=4, batch=2)
    f = lambda x: chains["constant"].forward(params, x)[0]
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(f, (x,), (x,))
    jax.jvp(lambda x: chains["linear"].forward(params, x)[0], (x,), (x,))  # fine without custom_vjp


def test_compiles_once_whatever_repeat():
    """The layers are traced the same number of times for repeat=2 and repeat=16 (a lax.scan)."""
    calls = {"forward": 0, "inverse": 0}

    class Counting(inv.AdditiveCoupling):
        def forward(self, params, x, key=None):
            calls["forward"] += 1
            return super().forward(params, x, key)

        def inverse(self, params, y, key=None):
            calls["inverse"] += 1
            return super().inverse(params, y, key)

    x = jnp.ones((4, 4))
    counts = []
    for repeat in (2, 16):
        chain = inv.Chain([Counting(hidden=4), Counting(hidden=4, flip=True)], repeat=repeat)
        params = jax.eval_shape(chain.init, jax.random.key(0), x)
        calls.update(forward=0, inverse=0)
        loss = lambda p, x, chain=chain: jnp.sum(chain.forward(p, x)[0])
        jax.jit(jax.grad(loss)).trace(params, x)
        counts.append(dict(calls))
    assert counts[0] == counts[1], counts
    assert counts[0]["inverse"] > 0  # the backward pass did rebuild inputs


def test_constant_memory_is_flat_and_linear_grows():
    """Compiled temp bytes of jit(grad(loss)): repeat=32 <= 1.25x repeat=4 for "constant"; >= 3x for "linear".

    Sizes from the issue: batch 4096, width 64, hidden 32, float32, so activations dominate.
    """
    x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
    temp = {}
    for mode in ("linear", "constant"):
        for repeat in (4, 32):
            chain = inv.Chain(glow_step(hidden=32), repeat=repeat, memory=mode)
            params = jax.eval_shape(chain.init, jax.random.key(0), x)

            def loss(p, x, chain=chain):
                return LOSSES["nll"](*chain.forward(p, x))

            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
            temp[mode, repeat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["constant", 32] <= 1.25 * temp["constant", 4], temp
    assert temp["linear", 32] >= 3 * temp["linear", 4], temp


def test_reconstruction_errors_against_depth():
    """Drift: tiny in float64, larger in float32; entry 0 is the whole chain's round-trip error."""
    errors = {}
    for dtype in (jnp.float32, jnp.float64):
        chains, params, x = setup(dtype, repeat=8, seed=3)
        chain = chains["constant"]

        def program(p, x, chain=chain):
            return chain.reconstruction_errors(p, x), inv.reconstruction_error(chain, p, x)

        per_depth, whole = jax.jit(program)(params, x)
        errors[dtype] = np.asarray(per_depth)
        assert errors[dtype].shape == (8,)
        # The same operations compiled into different programs: equal up to rounding, which is
        # the size of the error itself, hence the loose relative tolerance.
        tiny = 1e-6 if dtype == jnp.float32 else 1e-14
        np.testing.assert_allclose(errors[dtype][0], np.max(whole), rtol=0.5, atol=tiny)
    assert errors[jnp.float64].max() < 1e-12, errors[jnp.float64]
    assert 1e-8 < errors[jnp.float32].max() < 1e-3, errors[jnp.float32]
    assert errors[jnp.float32][0] > 1e3 * errors[jnp.float64][0]


def test_dropout_replays_from_keys():
    """The same key gives the same masks: forward then inverse is exact; another key differs."""
    chains, params, x = setup(jnp.float64, repeat=3, drop_rate=0.3)
    chain = chains["constant"]

    def program(p, x):
        key = jax.random.key(1)
        y, ld = chain.forward(p, x, key)
        back, minus_ld = chain.inverse(p, y, key)
        return y, ld, back, minus_ld, chain.forward(p, x, jax.random.key(2))[0], chain.forward(p, x)[0]

    y, ld, back, minus_ld, other_key, no_key = jax.jit(program)(params, x)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-12)
    np.testing.assert_allclose(minus_ld, -ld, rtol=1e-12)
    assert not np.allclose(other_key, y) and not np.allclose(no_key, y)


def test_chain_as_pipeline_stage():
    """Two constant-memory chains as the stages of a GPipe pipeline on a 2-device mesh.

    Reference: the same chains composed directly with memory="linear". float64; the pipeline
    reorders nothing within an example, so agreement is at rounding level (1e-10).
    """
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)), jnp.float64)
    step = [inv.InvertibleLinear(), inv.AffineCoupling(hidden=8)]
    const, linear = (inv.Chain(step, repeat=3, memory=m) for m in ("constant", "linear"))
    params = [perturbed(jax.jit(const.init)(jax.random.key(s), x), s) for s in range(2)]
    mesh = jax.make_mesh(
        (2,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    pipe = pj.pipeline([inv.as_stage(const)] * 2, chunks=3, mesh=mesh)

    def piped(params, x):
        y, ld = pipe(params, (x, jnp.zeros(x.shape[:1], x.dtype)))
        return LOSSES["nll"](y, ld)

    def direct(params, x):
        h, ld0 = linear.forward(params[0], x)
        y, ld1 = linear.forward(params[1], h)
        return LOSSES["nll"](y, ld0 + ld1)

    placed = pipe.place(params)
    np.testing.assert_allclose(jax.jit(piped)(placed, x), jax.jit(direct)(params, x), rtol=1e-10)
    g_pipe = jax.jit(jax.grad(piped, argnums=(0, 1)))(placed, x)
    g_ref = jax.jit(jax.grad(direct, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(g_pipe[1], g_ref[1], rtol=1e-10, atol=1e-13)
    got = g_pipe[0].unpack() if isinstance(g_pipe[0], pj.StageParams) else g_pipe[0]
    for s in range(2):
        for a, b in zip(jax.tree.leaves(got[s]), jax.tree.leaves(g_ref[0][s]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


# --- errors ---------------------------------------------------------------------------------------

X = jnp.ones((4, 6))


def test_chain_construction_errors():
    with pytest.raises(TypeError, match="non-empty sequence"):
        inv.Chain([])
    with pytest.raises(TypeError, match=r"layers\[1\].*lacks init"):
        inv.Chain([inv.ActNorm(), object()])
    with pytest.raises(ValueError, match="`repeat` of Chain must be an int >= 1, but got 0"):
        inv.Chain([inv.ActNorm()], repeat=0)
    with pytest.raises(ValueError, match="`memory` of Chain must be one of 'linear', 'sqrt', 'constant'"):
        inv.Chain([inv.ActNorm()], memory="quadratic")
    with pytest.raises(ValueError, match="only applies to memory='sqrt'"):
        inv.Chain([inv.ActNorm()], segments=2)


def test_chain_call_errors():
    chain = inv.Chain([inv.ActNorm(), inv.AffineCoupling(hidden=4)], repeat=3)
    params = chain.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match="one entry per layer"):
        chain.forward(params[:1], X)
    with pytest.raises(
        ValueError, match=r"leading axis of length repeat=3.*params\[0\]\['bias'\] has shape \(2, 6\)"
    ):
        chain.forward((jax.tree.map(lambda a: a[:2], params[0]), params[1]), X)
    with pytest.raises(TypeError, match="floating arrays, but got dtype int"):
        chain.forward(params, jnp.ones((4, 6), jnp.int32))
    with pytest.raises(TypeError, match="one PRNG key"):
        chain.forward(params, X, jax.random.split(jax.random.key(0), 4))
    with pytest.raises(TypeError, match=r"`key` of Chain.init must be a PRNG key"):
        chain.init(None, X)
    with pytest.raises(ValueError, match=r"same shape and dtype.*Squeeze"):
        inv.Chain([inv.Squeeze()], repeat=2).init(jax.random.key(0), jnp.ones((2, 4, 4, 1)))
