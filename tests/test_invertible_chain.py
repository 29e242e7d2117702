"""`Chain`'s memory modes against plain autodiff: values, gradients of every order, memory, drift.

The reference everywhere is ``memory="linear"``: ordinary autodiff through a ``lax.scan`` that
stores every activation. ``"constant"`` must give the same gradients (it rebuilds activations
through the inverses), and ``"sqrt"`` is exact recomputation. Compiles dominate the run time, so
each test compiles one program per memory mode that computes everything it checks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
import pipejax.invertible as inv

DROP_RATE = 0.3  # probability of dropping a hidden unit of a coupling's network (only with a key)


def glow_step(hidden=16):
    return [inv.ActNorm(), inv.InvertibleLinear(), inv.AffineCoupling(hidden=hidden, drop_rate=DROP_RATE)]


def perturbed(params, seed, scale=0.1):
    """Parameters moved off the identity initialisation, so every layer does something."""
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    moved = [a + jnp.asarray(rng.standard_normal(a.shape) * scale, a.dtype) for a in leaves]
    return jax.tree.unflatten(treedef, moved)


@functools.cache
def setup(dtype, repeat=4, width=6, batch=16, seed=0):
    """Chains in every memory mode (the same layers), shared parameters and an input batch."""
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((batch, width)), dtype)
    chains = {m: inv.Chain(glow_step(), repeat=repeat, memory=m) for m in inv.MEMORY_MODES}
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


@pytest.mark.parametrize("direction", ["forward", "inverse"])
def test_same_values_and_gradients_float32(direction):
    """Values are bitwise equal across modes; gradients equal "linear" within 1e-4 (float32).

    With dropout on (a key), so the rebuilding backward pass must replay the masks. 1e-4 relative
    is the issue's bound for float32: rebuilt activations carry rounding errors of about 1e-7
    relative per layer, amplified by the layers' Lipschitz constants (here the gradient errors
    are about 1e-6). "sqrt" recomputes the same operations: 1e-6 relative.
    """
    chains, params, x = setup(jnp.float32, repeat=6)
    key = jax.random.key(5)

    def outputs_and_grads(mode):
        def program(p, x):
            out, vjp = jax.vjp(lambda p, x: getattr(chains[mode], direction)(p, x, key), p, x)
            grads = {}
            for name, loss in LOSSES.items():  # one forward pass, a backward pass per loss
                grads[name] = vjp(jax.grad(lambda o, loss=loss: loss(*o))(out))
            return out, grads

        return jax.jit(program)(params, x)

    ref_out, ref_grads = outputs_and_grads("linear")
    ref_leaves = dict(jax.tree_util.tree_flatten_with_path(ref_grads)[0])
    # The logdet-only loss has a gradient with respect to the input (couplings' logdet depends on it).
    assert float(jnp.linalg.norm(ref_grads["logdet_only"][1])) > 1e-3
    for mode, tol in (("sqrt", 1e-6), ("constant", 1e-4)):
        out, grads = outputs_and_grads(mode)
        for a, b in zip(out, ref_out, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=mode)
        for path, a in jax.tree_util.tree_flatten_with_path(grads)[0]:
            err = rel_err(a, ref_leaves[path])
            assert err < tol, (mode, jax.tree_util.keystr(path), err)


def test_higher_order_float64():
    """jvp(grad), grad(grad) and jax.hessian through "constant" equal "linear" (float64).

    Both modes of second-order autodiff go through the custom_vjp's rules: forward-over-reverse
    differentiates its backward rule, reverse-over-reverse transposes it. float64 makes the
    reconstruction error negligible (about 1e-15), so 1e-9 relative is loose.
    """
    chains, params, x = setup(jnp.float64)
    tangent = perturbed(jax.tree.map(jnp.zeros_like, (params, x)), seed=9, scale=1.0)
    x_small = x[:2, :4]

    def second_order(mode):
        loss = lambda p, x: LOSSES["nll"](*chains[mode].forward(p, x))
        grad = jax.grad(loss, argnums=(0, 1))

        def program(p, x):
            hvp = jax.jvp(grad, (p, x), tangent)[1]
            grad_norm = lambda p, x: sum(jnp.sum(g**2) for g in jax.tree.leaves(grad(p, x)))
            grad_of_grad = jax.grad(grad_norm, argnums=(0, 1))(p, x)
            hessian = jax.hessian(lambda xs: loss(p, jnp.concatenate([xs, x[:2, 4:]], axis=1)))(x_small)
            return {"jvp(grad)": hvp, "grad(grad)": grad_of_grad, "hessian": hessian}

        return jax.jit(program)(params, x)

    ref, got = second_order("linear"), second_order("constant")
    for what in ref:
        for a, b in zip(jax.tree.leaves(got[what]), jax.tree.leaves(ref[what]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=what)


def test_forward_mode_alone_is_refused_under_constant():
    """JAX refuses jvp of any custom_vjp (documented): use "linear" for pure forward mode."""
    chains, params, x = setup(jnp.float64)
    jvp = lambda mode: lambda x: jax.jvp(lambda x: chains[mode].forward(params, x)[0], (x,), (x,))
    msg = r"Chain\(memory='constant'\).forward cannot be differentiated in forward mode.*memory='linear'"
    with pytest.raises(TypeError, match=msg):  # raised when lowering, before compiling
        jax.jit(jvp("constant")).lower(x)
    jax.jit(jvp("linear")).lower(x)  # fine without a custom_vjp


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
    """Compiled temp bytes of jit(grad(loss)): K=32 <= 1.25x K=4 for "constant"; >= 3x for "linear".

    Sizes from the issue: batch 4096, width 64, hidden 32, float32, so activations dominate.
    Measured on CPU: "constant" 1.00x, "linear" 7.1x.
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
        chains, params, x = setup(dtype)
        chain = chains["constant"]

        def program(p, x, chain=chain):
            return chain.reconstruction_errors(p, x), inv.reconstruction_error(chain, p, x)

        per_depth, whole = jax.jit(program)(params, x)
        errors[dtype] = np.asarray(per_depth)
        assert errors[dtype].shape == (4,)
        # The same operations compiled into different programs: equal up to rounding, which is
        # the size of the error itself, hence the loose relative tolerance.
        tiny = 1e-6 if dtype == jnp.float32 else 1e-14
        np.testing.assert_allclose(errors[dtype][0], np.max(whole), rtol=0.5, atol=tiny)
    assert errors[jnp.float64].max() < 1e-12, errors[jnp.float64]
    assert 1e-8 < errors[jnp.float32].max() < 1e-3, errors[jnp.float32]
    assert errors[jnp.float32][0] > 1e3 * errors[jnp.float64][0]


def test_dropout_replays_from_keys():
    """The same key gives the same masks: forward then inverse is exact; another key differs."""
    chains, params, x = setup(jnp.float64)
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
    const, linear = (inv.Chain(step, repeat=2, memory=m) for m in ("constant", "linear"))
    params = [perturbed(jax.jit(const.init)(jax.random.key(s), x), s) for s in range(2)]
    mesh = jax.make_mesh(
        (2,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    pipe = pj.pipeline([inv.as_stage(const)] * 2, chunks=2, mesh=mesh)

    def piped(params, x):
        y, ld = pipe(params, (x, jnp.zeros(x.shape[:1], x.dtype)))
        return LOSSES["nll"](y, ld)

    def direct(params, x):
        h, ld0 = linear.forward(params[0], x)
        y, ld1 = linear.forward(params[1], h)
        return LOSSES["nll"](y, ld0 + ld1)

    value, (g_params, g_x) = jax.jit(jax.value_and_grad(piped, argnums=(0, 1)))(pipe.place(params), x)
    ref_value, (ref_params, ref_x) = jax.jit(jax.value_and_grad(direct, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10)
    np.testing.assert_allclose(g_x, ref_x, rtol=1e-10, atol=1e-13)
    got = g_params.unpack() if isinstance(g_params, pj.StageParams) else g_params
    for s in range(2):
        for a, b in zip(jax.tree.leaves(got[s]), jax.tree.leaves(ref_params[s]), strict=True):
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
    params = jax.eval_shape(chain.init, jax.random.key(0), X)
    forward = lambda p, x, key=None: jax.eval_shape(chain.forward, p, x, key)  # errors come at trace time
    with pytest.raises(ValueError, match="one entry per layer"):
        forward(params[:1], X)
    with pytest.raises(
        ValueError, match=r"leading axis of length repeat=3.*params\[0\]\['bias'\] has shape \(2, 6\)"
    ):
        bad = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2, *a.shape[1:]), a.dtype), params[0])
        forward((bad, params[1]), X)
    with pytest.raises(TypeError, match="floating arrays, but got dtype int"):
        forward(params, jnp.ones((4, 6), jnp.int32))
    with pytest.raises(TypeError, match="one PRNG key"):
        forward(params, X, jax.random.split(jax.random.key(0), 4))
    with pytest.raises(TypeError, match=r"`key` of Chain.init must be a PRNG key"):
        chain.init(None, X)
    with pytest.raises(ValueError, match=r"same shape and dtype.*Squeeze"):
        jax.eval_shape(inv.Chain([inv.Squeeze()], repeat=2).init, jax.random.key(0), jnp.ones((2, 4, 4, 1)))
