"""pipejax.hessian against dense references: jax.hessian + numpy.linalg.eigh, in float64.

The reference model is an MLP of 2,906 parameters (20 -> 48 -> 32 -> 10, tanh, softmax
cross-entropy) after a few Adam steps; its dense Hessian is computed once per module.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import threadpoolctl
from jax.flatten_util import ravel_pytree

import pipejax as pj
from pipejax import hessian as ph
from pipejax._src.hessian.lanczos import _lanczos

SIZES = (20, 48, 32, 10)
BATCH = 64


def layer(p, h, key=None):
    return h @ p["w"] + p["b"][None]


def stage_fns():
    hidden = lambda p, h, key: jnp.tanh(layer(p, h))
    return [hidden, hidden, layer]


def forward(params, x):
    for fn, p in zip(stage_fns(), params, strict=True):
        x = fn(p, x, None)
    return x


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def mlp_loss(params, x, y):
    return ce(forward(params, x), y)


@pytest.fixture(scope="module")
def mlp():
    """The trained MLP, a batch, its dense Hessian and the Hessian's eigenvalues (float64)."""
    rng = np.random.default_rng(0)
    params = [
        {
            "w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a)),
            "b": jnp.asarray(0.1 * rng.standard_normal(b)),
        }
        for a, b in itertools.pairwise(SIZES)
    ]
    x = jnp.asarray(rng.standard_normal((BATCH, SIZES[0])))
    y = jnp.asarray(rng.integers(0, SIZES[-1], BATCH))
    step = jax.jit(
        lambda p: jax.tree.map(lambda a, g: a - jnp.asarray(0.5, a.dtype) * g, p, jax.grad(mlp_loss)(p, x, y))
    )
    for _ in range(5):  # a few gradient-descent steps in, as the issue asks
        params = step(params)
    flat, unravel = ravel_pytree(params)
    dense = jax.jit(jax.hessian(lambda f: mlp_loss(unravel(f), x, y)))(flat)
    dense = np.asarray(dense)
    # ascending; eigvalsh is ~1.6x faster than eigh at n = 2,906. On one BLAS thread: on the shared
    # 2-core machine OpenBLAS's two threads took 68-77 s here under load (they spin against the
    # other jobs), one thread 18 s
    with threadpoolctl.threadpool_limits(1):
        evals = np.linalg.eigvalsh(dense)
    return dict(params=params, x=x, y=y, unravel=unravel, dense=dense, evals=evals)


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def flat(tree):
    return np.asarray(ravel_pytree(tree)[0])


# --- HVP ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fwd_rev", "rev_rev"])
def test_hvp_matches_dense_hessian(mlp, mode):
    v = mlp["unravel"](jnp.asarray(np.random.default_rng(1).standard_normal(mlp["dense"].shape[0])))
    hv = ph.hvp(mlp_loss, mlp["params"], v, mlp["x"], mlp["y"], mode=mode)
    assert jax.tree.structure(hv) == jax.tree.structure(mlp["params"])
    # float64: the HVP and the dense Hessian differ only in summation order (~1e-15)
    assert rel_err(flat(hv), mlp["dense"] @ flat(v)) < 1e-10


def test_hvp_over_a_dataset_is_the_batch_size_weighted_mean(mlp):
    x, y = mlp["x"], mlp["y"]
    data = [(x[:24], y[:24]), (x[24:48], y[24:48]), (x[48:], y[48:])]  # sizes 24, 24, 16
    v = mlp["unravel"](jnp.asarray(np.random.default_rng(2).standard_normal(mlp["dense"].shape[0])))
    hv = ph.hvp(mlp_loss, mlp["params"], v, data=data)
    # the loss is a mean, so the size-weighted mean of batch Hessians is the whole batch's Hessian
    assert rel_err(flat(hv), mlp["dense"] @ flat(v)) < 1e-10


# --- eigenvalues ---------------------------------------------------------------------------------------


def test_top5_eigenvalues_default_settings(mlp):
    vals, vecs = ph.eigenvalues(
        mlp_loss, mlp["params"], mlp["x"], mlp["y"], key=jax.random.key(0), k=5, return_eigenvectors=True
    )
    exact = mlp["evals"][::-1][:5]
    np.testing.assert_allclose(vals, exact, rtol=1e-6)
    # Ritz vectors: unit norm, and H u = lambda u (residual relative to the top eigenvalue)
    for j in range(5):
        u = flat(jax.tree.map(lambda a, j=j: a[j], vecs))
        assert abs(np.linalg.norm(u) - 1) < 1e-8
        assert np.linalg.norm(mlp["dense"] @ u - exact[j] * u) < 1e-3 * exact[0]


@pytest.mark.parametrize("reorth", ["full", "partial"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_lanczos_basis_stays_orthogonal_without_ghosts(mlp, dtype, reorth):
    # full: the three-term recurrence and one Gram-Schmidt pass against all vectors at each step,
    # the basis orthonormal to a few ulps. partial: a pass against all vectors only where Simon's
    # estimate passes sqrt(eps), the basis semi-orthogonal. Either way no converged eigenvalue may
    # come back as a ghost copy, and the top Ritz values must be as accurate.
    flat0, unravel = ravel_pytree(mlp["params"])
    x = mlp["x"].astype(dtype)
    grad = jax.grad(lambda f: mlp_loss(unravel(f), x, mlp["y"]))

    @jax.jit
    def run(f, v):
        matvec = lambda u: jax.jvp(grad, (f,), (u,))[1]
        return _lanczos(matvec, v, 90, None, False, "lanczos", reorth)

    v = jnp.asarray(np.random.default_rng(6).standard_normal(flat0.size), dtype)
    t, passes = run(flat0.astype(dtype), v)
    q = np.asarray(t.basis, np.float64)
    eps = float(jnp.finfo(dtype).eps)
    loss_of_orthogonality = np.abs(q @ q.T - np.eye(90)).max()
    if reorth == "full":
        # measured: 2.1e-7 (float32) and 6.7e-16 (float64), i.e. 2-3 ulps; allow 50
        assert loss_of_orthogonality < 50 * eps
        assert int(passes) == 90
    else:
        # semi-orthogonal by construction; measured 1.1e-5 (float32) and 2.9e-10 (float64)
        assert loss_of_orthogonality < np.sqrt(eps)
        # measured 18 (float32) and 8 (float64) passes over the basis instead of 90
        assert int(passes) < (60 if dtype == jnp.float32 else 30), int(passes)
    ritz = np.sort(np.linalg.eigvalsh(np.asarray(t.matrix(), np.float64)))[::-1]
    exact = mlp["evals"][::-1]
    # no ghost: one Ritz value at the top eigenvalue, and the next four are the next eigenvalues
    # (measured 5e-8 relative in float32: the HVP's rounding; 4e-15 in float64)
    assert np.sum(np.abs(ritz - exact[0]) < 1e-3 * exact[0]) == 1
    np.testing.assert_allclose(ritz[:5], exact[:5], rtol=1e-5 if dtype == jnp.float32 else 1e-10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_lanczos_without_a_basis_keeps_the_quadrature(mlp, dtype):
    # reorthogonalise="none" stores no basis and lets orthogonality go: converged eigenvalues come
    # back as ghost copies. The Gauss quadrature v^T H^p v = sum_j s_0j^2 theta_j^p stays accurate
    # (Paige, Greenbaum): checked against the start vector's moments u^T H^p u from the dense
    # Hessian (measured 1e-7 relative in float32, 2e-15 in float64, as with partial)
    flat0, unravel = ravel_pytree(mlp["params"])
    x = mlp["x"].astype(dtype)
    grad = jax.grad(lambda f: mlp_loss(unravel(f), x, mlp["y"]))

    @jax.jit
    def run(f, v):
        return ph.lanczos(lambda u: jax.jvp(grad, (f,), (u,))[1], v, 90, reorthogonalise="none")

    v = np.random.default_rng(7).standard_normal(flat0.size)
    t = run(flat0.astype(dtype), jnp.asarray(v, dtype))
    assert t.basis is None and t.diag.shape == (90,) and t.offdiag.shape == (89,)
    theta, s = np.linalg.eigh(np.asarray(t.matrix(), np.float64))
    weights = s[0] ** 2
    exact = mlp["evals"]
    ghosts = np.sum(np.abs(theta - exact[-1]) < 1e-6 * exact[-1])
    # measured: 3 copies of the top eigenvalue in float32, 2 in float64 (partial: 1)
    assert ghosts >= 2, ghosts
    np.testing.assert_allclose(weights.sum(), 1.0, rtol=1e-12)
    u = v / np.linalg.norm(v)
    hu, tol = u, (1e-5 if dtype == jnp.float32 else 1e-10)
    for p in range(1, 12):
        hu = mlp["dense"] @ hu
        moment = u @ hu
        np.testing.assert_allclose(np.sum(weights * theta**p), moment, rtol=tol, atol=tol * exact[-1] ** p)


def test_basis_stored_in_float32_keeps_the_float64_accuracy(mlp):
    """basis_dtype=float32 halves the basis of a float64 Lanczos and keeps its accuracy contract."""
    args, key = (mlp["params"], mlp["x"], mlp["y"]), jax.random.key(0)
    vals, vecs = ph.eigenvalues(
        mlp_loss, *args, key=key, k=5, return_eigenvectors=True, basis_dtype=jnp.float32
    )
    exact = mlp["evals"][::-1][:5]
    # a ghost would repeat a converged eigenvalue and shift the rest off `exact`
    np.testing.assert_allclose(vals, exact, rtol=1e-6)
    assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(vecs))
    for j in range(5):  # Ritz vectors as accurate as float32 rows allow
        u = flat(jax.tree.map(lambda a, j=j: a[j], vecs))
        assert abs(np.linalg.norm(u) - 1) < 1e-6
        assert np.linalg.norm(mlp["dense"] @ u - exact[j] * u) < 1e-3 * exact[0]
    d = ph.density(
        mlp_loss, *args, key=jax.random.key(4), num_steps=90, num_runs=10, basis_dtype=jnp.float32,
        reorthogonalise="partial",
    )  # fmt: skip
    evals = mlp["evals"]
    nodes, weights = np.asarray(d.nodes).ravel(), np.asarray(d.weights).ravel() / 10
    grid = np.linspace(min(evals.min(), nodes.min()), max(evals.max(), nodes.max()), 200_001)
    w1 = wasserstein1(nodes, weights, evals, np.full(evals.size, 1 / evals.size), grid)
    assert w1 / (evals.max() - evals.min()) < 0.005
    # the public lanczos stores its rows in basis_dtype
    t = ph.lanczos(lambda v: jnp.arange(1.0, 201.0) * v, jnp.ones(200), 20, basis_dtype=jnp.float32)
    assert t.basis.dtype == jnp.float32 and t.diag.dtype == jnp.float64


def test_partial_reorthogonalisation_on_a_clustered_spectrum():
    """Many eigenvalues converge in 150 steps (a spread top and a cluster): no ghosts, all exact."""
    top = np.geomspace(100.0, 2.0, 30)
    eigs = np.concatenate([top, np.linspace(-1.0, 1.0, 270)])  # n = 300
    a = np.asarray(chosen_matrix(eigs, 7))
    v = jnp.asarray(np.random.default_rng(8).standard_normal(300))
    t, passes = jax.jit(lambda v: _lanczos(lambda u: a @ u, v, 150, None, False, "lanczos", "partial"))(v)
    ritz = np.sort(np.linalg.eigvalsh(np.asarray(t.matrix())))[::-1]
    # the 30 outer eigenvalues converged once each (a ghost would repeat one and shift the rest)
    np.testing.assert_allclose(ritz[:30], top, rtol=1e-10)
    assert 0 < int(passes) < 150


def test_eigenvalues_under_jit_and_in_float64_from_float32(mlp):
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), mlp["params"])
    x32 = mlp["x"].astype(jnp.float32)

    @jax.jit
    def top(p, x, y, key):
        return ph.eigenvalues(mlp_loss, p, x, y, key=key, k=3, dtype=jnp.float64, num_steps=60)

    vals = top(p32, x32, mlp["y"], jax.random.key(1))
    assert vals.dtype == jnp.float64
    # the HVP runs in float32 (relative rounding ~1e-7 per product, amplified by the depth)
    np.testing.assert_allclose(vals, mlp["evals"][::-1][:3], rtol=1e-4)


def test_hvp_is_traced_once_whatever_the_number_of_steps():
    traces = []

    def counted(w, x):
        traces.append(None)
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 40)))
    counts = []
    for m in (8, 24, 24):
        traces.clear()
        ph.eigenvalues(counted, jnp.ones(40), x, key=jax.random.key(0), num_steps=m)
        counts.append(len(traces))
    # the first call checks the loss's shape (one trace) and compiles (one trace); a new number of
    # steps compiles again with one trace of the loop body, not one per step; the same call again
    # reuses the compiled program
    assert counts == [2, 1, 0], counts


# --- known answers ---------------------------------------------------------------------------------


def chosen_matrix(eigs, seed):
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((len(eigs), len(eigs))))
    return jnp.asarray((q * np.asarray(eigs)) @ q.T)


def test_matrix_from_chosen_eigenvalues():
    eigs = np.concatenate([[10.0, 9.0, 8.5, 8.4], np.linspace(-3.0, 1.0, 36), [-12.0]])  # n = 41
    a = chosen_matrix(eigs, 3)
    quad = lambda w: 0.5 * w @ a @ w
    key = jax.random.key(2)
    w = jnp.zeros(41)
    np.testing.assert_allclose(ph.eigenvalues(quad, w, key=key, k=4, num_steps=30), eigs[:4], rtol=1e-10)
    lm = ph.eigenvalues(quad, w, key=key, k=2, which="LM", num_steps=30)
    np.testing.assert_allclose(lm, [-12.0, 10.0], rtol=1e-10)
    # all n steps: the Krylov space is the whole space, every eigenvalue is exact
    np.testing.assert_allclose(
        np.sort(ph.eigenvalues(quad, w, key=key, k=41, num_steps=41)), np.sort(eigs), atol=1e-10
    )
    # a low-rank Hessian: the Krylov space is exhausted after 3 steps and Lanczos restarts
    low = chosen_matrix([5.0, 3.0, 1.0] + [0.0] * 17, 4)
    top = ph.eigenvalues(lambda w: 0.5 * w @ low @ w, jnp.zeros(20), key=key, k=4, num_steps=20)
    np.testing.assert_allclose(top, [5.0, 3.0, 1.0, 0.0], atol=1e-10)
    # density without a basis restarts against q_i and q_{i-1} only: the blocks after a restart
    # carry no weight, so every run's measure sits on the 4 distinct eigenvalues, with the
    # start vector's weights (those of partial reorthogonalisation, which restarts against all)
    dens = {
        r: ph.density(lambda w: 0.5 * w @ low @ w, jnp.zeros(20), key=key, num_steps=12, num_runs=3,
                      reorthogonalise=r)
        for r in ("none", "partial")
    }  # fmt: skip
    for d in dens.values():
        nodes, weights = np.asarray(d.nodes), np.asarray(d.weights)
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-12)
        carried = np.abs(nodes[weights > 1e-12][:, None] - np.array([5.0, 3.0, 1.0, 0.0])).min(axis=1)
        assert carried.max() < 1e-8, carried.max()
    for p in range(1, 5):
        moments = [np.sum(np.asarray(d.weights * d.nodes**p), axis=1) for d in dens.values()]
        np.testing.assert_allclose(*moments, rtol=1e-10, atol=1e-12)


def test_linear_regression_hessian_is_two_over_n_xtx():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((50, 8)) * np.arange(1, 9))
    t = jnp.asarray(rng.standard_normal(50))
    mse = lambda p, x, t: jnp.mean((x @ p["w"] + p["b"] - t) ** 2)
    params = {"b": jnp.zeros(()), "w": jnp.zeros(8)}
    xb = np.concatenate([np.ones((50, 1)), np.asarray(x)], axis=1)  # ravel order: b, then w
    h = 2.0 / 50 * xb.T @ xb
    v = {"b": jnp.asarray(1.0), "w": jnp.asarray(rng.standard_normal(8))}
    assert rel_err(flat(ph.hvp(mse, params, v, x, t)), h @ flat(v)) < 1e-12
    vals = ph.eigenvalues(mse, params, x, t, key=jax.random.key(0), k=3)
    np.testing.assert_allclose(vals, np.linalg.eigvalsh(h)[::-1][:3], rtol=1e-10)
    est, err = ph.trace(mse, params, x, t, key=jax.random.key(1), num_probes=9, method="hutch++")
    # 9 probes: a sketch of 3, its exact trace, and 3 probes on the rest; n = 9, so it is exact
    # up to rounding only if the sketch spans the top 3; check it against 4 standard errors
    assert abs(float(est) - np.trace(h)) <= 4 * float(err) + 1e-9 * np.trace(h)


# --- trace and density ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["hutchinson", "hutch++"])
def test_trace_within_four_standard_errors(mlp, method):
    est, err = ph.trace(
        mlp_loss, mlp["params"], mlp["x"], mlp["y"], key=jax.random.key(3), num_probes=60, method=method
    )
    exact = np.trace(mlp["dense"])
    assert 0 < float(err) < 0.5 * abs(exact)  # a real, informative error bar
    assert abs(float(est) - exact) < 4 * float(err), (float(est), float(err), exact)


def wasserstein1(atoms_a, weights_a, atoms_b, weights_b, grid):
    """W1 = integral |F_a - F_b| dx, with the CDFs evaluated on a fine grid."""

    def cdf(atoms, weights):
        order = np.argsort(atoms)
        cum = np.concatenate([[0.0], np.cumsum(weights[order])])
        return cum[np.searchsorted(atoms[order], grid, side="right")]

    return float(np.sum(np.abs(cdf(atoms_a, weights_a) - cdf(atoms_b, weights_b))[:-1] * np.diff(grid)))


@pytest.mark.parametrize("reorth", ["partial", "none"])
def test_slq_density_is_close_to_the_exact_spectral_measure(mlp, reorth):
    # "none" stores no basis: ghost copies of converged eigenvalues share their weight
    d = ph.density(
        mlp_loss, mlp["params"], mlp["x"], mlp["y"], key=jax.random.key(4), num_steps=90, num_runs=10,
        reorthogonalise=reorth,
    )  # fmt: skip
    assert d.nodes.shape == d.weights.shape == (10, 90)
    np.testing.assert_allclose(d.weights.sum(axis=1), 1.0, rtol=1e-10)
    evals = mlp["evals"]
    nodes, weights = np.asarray(d.nodes).ravel(), np.asarray(d.weights).ravel() / 10
    lo, hi = min(evals.min(), nodes.min()), max(evals.max(), nodes.max())
    grid = np.linspace(lo, hi, 200_001)
    span = evals.max() - evals.min()
    w1 = wasserstein1(nodes, weights, evals, np.full(evals.size, 1 / evals.size), grid)
    assert w1 / span < 0.005, w1 / span
    # the smoothed density integrates to 1 over a grid that covers it
    x, p = ph.smooth_density(d, num_points=20_000)
    assert abs(float(jnp.sum(p[:-1] * jnp.diff(x))) - 1) < 1e-3


def test_smoothing_variance_convention():
    d = ph.Density(nodes=jnp.array([[-1.0, 3.0]]), weights=jnp.array([[0.0, 1.0]]))  # range 4
    at = jnp.array([3.0])
    _, rel = ph.smooth_density(d, at, sigma_squared=0.01)  # var = 0.01 * max(1, 4)
    _, ab = ph.smooth_density(d, at, sigma_squared=0.04, relative=False)
    np.testing.assert_allclose(rel, ab, rtol=1e-12)
    np.testing.assert_allclose(ab, 1 / np.sqrt(2 * np.pi * 0.04), rtol=1e-12)


# --- the pipeline ------------------------------------------------------------------------------------


def test_pipelined_model_sharded_over_three_stages_has_the_same_spectrum(mlp):
    mesh = jax.make_mesh((3,), ("stage",))
    apply = pj.pipeline(stage_fns(), chunks=2, checkpoint="always", mesh=mesh)
    placed = apply.place(mlp["params"])  # a StageParams: each device holds its stage (padded)

    def pipe_loss(params, x, y):
        return ce(apply(params, x), y)

    vals, vecs = ph.eigenvalues(
        pipe_loss, placed, mlp["x"], mlp["y"], key=jax.random.key(0), k=5, return_eigenvectors=True
    )
    np.testing.assert_allclose(vals, mlp["evals"][::-1][:5], rtol=1e-6)
    # the Ritz vectors are StageParams with a leading axis k, each stage's part on its own device
    # (Lanczos kept its vectors sharded like the parameters, it did not gather them)
    assert type(vecs) is type(placed)
    for leaf in jax.tree.leaves(vecs):
        assert leaf.shape[:2] == (5, 3) and leaf.sharding.spec[:2] == (None, "stage"), leaf.sharding
    est, err = ph.trace(pipe_loss, placed, mlp["x"], mlp["y"], key=jax.random.key(3), num_probes=60)
    assert abs(float(est) - np.trace(mlp["dense"])) < 4 * float(err)


# --- progress and errors ---------------------------------------------------------------------------


def test_progress_is_reported():
    seen = []
    quad = lambda w: 0.5 * jnp.sum(jnp.arange(1.0, 11.0) * w**2)
    ph.eigenvalues(
        quad, jnp.zeros(10), key=jax.random.key(0), num_steps=6, progress=lambda *a: seen.append(a)
    )
    jax.effects_barrier()
    assert sorted(seen) == [("eigenvalues", i, 6) for i in range(1, 7)]


def test_bad_input_is_reported():
    quad = lambda w: 0.5 * jnp.sum(w**2)
    w, key = jnp.zeros(5), jax.random.key(0)
    with pytest.raises(ValueError, match=r"`k` must be at most the number of parameters 5, got k=6"):
        ph.eigenvalues(quad, w, key=key, k=6)
    with pytest.raises(ValueError, match=r"`num_steps` must be at least `k`.*num_steps=2 < k=3"):
        ph.eigenvalues(quad, w, key=key, k=3, num_steps=2)
    with pytest.raises(ValueError, match=r"must return a real scalar.*shape=\(5,\)"):
        ph.eigenvalues(lambda w: w**2, w, key=key)
    with pytest.raises(ValueError, match=r"must return a real scalar"):
        ph.hvp(lambda w: w**2, w, w)
    for bad in (0, np.uint32(3), jnp.zeros(3, jnp.uint32), jax.random.split(key, 2)):
        with pytest.raises(TypeError, match=r"`key` must be"):
            ph.trace(quad, w, key=bad)
    with pytest.raises(ValueError, match=r"`which` must be 'LA'.*'LM'"):
        ph.eigenvalues(quad, w, key=key, which="SA")
    with pytest.raises(ValueError, match=r"`mode` must be one of"):
        ph.hvp(quad, w, w, mode="fwd_fwd")
    with pytest.raises(TypeError, match=r"`data` must be a re-iterable"):
        ph.hvp(lambda w, x: jnp.sum(x @ w), w, w, data=iter([jnp.ones((2, 5))]))
    with pytest.raises(ValueError, match=r"either one batch as `\*args` or a dataset"):
        ph.hvp(lambda w, x: jnp.sum(x @ w), w, w, jnp.ones((2, 5)), data=[jnp.ones((2, 5))])
    with pytest.raises(ValueError, match=r"`num_probes` must be an int >= 4 for method='hutch\+\+'"):
        ph.trace(quad, w, key=key, num_probes=3, method="hutch++")
    with pytest.raises(ValueError, match=r"`num_steps` must be at most the number of parameters 5"):
        ph.density(quad, w, key=key, num_steps=6)
    # a vector of the wrong structure, shapes or dtype
    p = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
    with pytest.raises(ValueError, match=r"`v` must have the pytree structure of `params`.*ravel_pytree"):
        ph.hvp(lambda p: jnp.sum(p["a"] ** 2), p, jnp.ones(5))
    with pytest.raises(
        ValueError, match=r"leaf \['b'\] has shape \(3,\) where the parameter has shape \(2,\)"
    ):
        ph.hvp(lambda p: jnp.sum(p["a"] ** 2), p, {"a": jnp.ones(3), "b": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"`v` must hold floating-point arrays"):
        ph.hvp(quad, w, jnp.ones(5, jnp.int32))
    # basis_dtype: a float dtype, no finer than the vectors', coarse enough only for large n
    with pytest.raises(ValueError, match=r"`basis_dtype` must be None or a real floating dtype.*int32"):
        ph.eigenvalues(quad, w, key=key, basis_dtype=jnp.int32)
    with pytest.raises(
        ValueError, match=r"`basis_dtype` must not be more precise than.*float32, got float64"
    ):
        ph.density(
            quad, w.astype(jnp.float32), key=key, num_steps=3, basis_dtype=jnp.float64, reorthogonalise="full"
        )
    with pytest.raises(ValueError, match=r"`basis_dtype` bfloat16 is too coarse for 5 float64 parameters"):
        ph.eigenvalues(quad, w, key=key, basis_dtype=jnp.bfloat16)
    # reorthogonalise="none": no basis, so neither eigenvalues nor a basis_dtype
    with pytest.raises(ValueError, match=r"`reorthogonalise='none'` is for `density` and `lanczos`"):
        ph.eigenvalues(quad, w, key=key, reorthogonalise="none")
    with pytest.raises(ValueError, match=r"`basis_dtype` must be None with `reorthogonalise='none'`"):
        ph.density(quad, w, key=key, num_steps=3, reorthogonalise="none", basis_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"`reorthogonalise` must be one of \('partial', 'full', 'none'\)"):
        ph.lanczos(lambda v: v, w + 1, 3, reorthogonalise="selective")
    # a legacy uint32[2] key is accepted
    assert ph.eigenvalues(quad, w, key=jax.random.PRNGKey(0), num_steps=3).shape == (1,)


def test_bad_flags_batches_and_value_and_grad_are_reported():
    quad = lambda w, x: 0.5 * jnp.sum(w**2) * jnp.mean(x)
    w, key, x = jnp.zeros(3), jax.random.key(0), jnp.ones((4, 2))
    # bool flags must be bools, not truthy strings
    with pytest.raises(
        TypeError, match=r"`return_eigenvectors` of eigenvalues must be True or False.*str 'yes'"
    ):
        ph.eigenvalues(quad, w, x, key=key, return_eigenvectors="yes")
    d = ph.Density(nodes=jnp.array([[0.0, 1.0]]), weights=jnp.array([[0.5, 0.5]]))
    with pytest.raises(TypeError, match=r"`relative` of smooth_density must be True or False.*str 'yes'"):
        ph.smooth_density(d, relative="yes")
    # every leaf of a batch of `data` shares the leading batch axis that weights the batch
    two = lambda w, x, y: quad(w, x) * jnp.mean(y)
    with pytest.raises(
        ValueError,
        match=r"`data\[0\]` must hold leaves that share a leading batch axis.*leaf \[0\] has shape "
        r"\(4, 2\) and leaf \[1\] has shape \(3,\)",
    ):
        ph.hvp(two, w, w, data=[(x, jnp.ones(3)), (x[:2], jnp.ones(2))])
    with pytest.raises(
        ValueError, match=r"`data\[1\]` must hold leaves that share.*leaf \[1\] has shape \(\)"
    ):
        ph.hvp(two, w, w, data=[(x, jnp.ones(4)), (x[:2], jnp.float32(1))])
    # from_value_and_grad takes (loss, grads), not the loss alone
    with pytest.raises(
        TypeError,
        match=r"`value_and_grad` of from_value_and_grad must return a pair `\(loss, grads\)`.*"
        r"one array of shape \(\).*jax.value_and_grad\(loss\)",
    ):
        ph.hvp(ph.from_value_and_grad(quad), w, w, x)
    with pytest.raises(TypeError, match=r"must return a pair `\(loss, grads\)`.*a tuple of length 3"):
        ph.hvp(ph.from_value_and_grad(lambda w, x: (quad(w, x), w, w)), w, w, x)


def test_smooth_density_integrates_to_one_on_a_wide_enough_grid():
    d = ph.Density(nodes=jnp.array([[0.0, 1.0]]), weights=jnp.array([[0.5, 0.5]]))
    grid, p = ph.smooth_density(d, jnp.linspace(-1.0, 2.0, 30_001), sigma_squared=1e-3)
    assert abs(float(jnp.trapezoid(p, grid)) - 1) < 1e-3
    grid, p = ph.smooth_density(d)  # the default grid: the default kernel's tails are negligible
    assert abs(float(jnp.trapezoid(p, grid)) - 1) < 2e-3
