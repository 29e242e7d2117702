"""The spectral density of the Hessian by stochastic Lanczos quadrature (SLQ), and its smoothing."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pipejax._src import checks
from pipejax._src.hessian import tree
from pipejax._src.hessian.blocks import dimension, map_blocks
from pipejax._src.hessian.data import reading
from pipejax._src.hessian.hvp import Curvature, Mode, Operator, check_key, make_operator
from pipejax._src.hessian.lanczos import (
    Reorth,
    _lanczos,
    check_basis_dtype,
    check_none_basis,
    check_reorth,
)
from pipejax._src.hessian.progress import Progress, check_progress

PyTree = Any


class Density(NamedTuple):
    """SLQ nodes and weights: the spectral measure is ``mean_r sum_j weights[r, j] delta(nodes[r, j])``."""

    nodes: jax.Array  # (num_runs, num_steps): Ritz values of each run
    weights: jax.Array  # (num_runs, num_steps): squared first components; each row sums to 1


def density(
    loss: Callable[..., jax.Array],
    params: PyTree,
    *args: Any,
    key: jax.Array,
    num_steps: int = 90,
    num_runs: int = 10,
    data: Iterable[Any] | None = None,
    mode: Mode = "fwd_rev",
    dtype: Any = None,
    progress: Progress = False,
    reorthogonalise: Reorth = "none",
    curvature: Curvature = "hessian",
    blocks: Sequence[PyTree] | None = None,
    basis_dtype: Any = None,
) -> Density:
    """Stochastic Lanczos quadrature: the Hessian's eigenvalue density as nodes and weights.

    For a unit vector ``v``, ``v^T f(H) v = sum_i (v^T u_i)^2 f(lambda_i)``: a quadrature of
    ``f`` against the spectral measure seen from ``v``. ``num_steps`` Lanczos steps from ``v`` give
    its Gauss quadrature: nodes ``theta_j`` (the eigenvalues of ``T``) and weights ``s_{0j}^2``
    (squared first components of ``T``'s eigenvectors), exact for polynomials of degree up to
    ``2 num_steps - 1``. Averaged over ``num_runs`` random Rademacher ``v`` (normalised), it
    estimates the spectral measure ``(1/n) sum_i delta(lambda_i)``. Smooth it with
    :func:`smooth_density`.

    Cost: ``num_runs * num_steps`` HVPs; memory: three parameter-sized vectors (``num_steps + 1``
    with ``reorthogonalise="partial"`` or ``"full"``; the runs are sequential).

    Args:
      loss: ``loss(params, *args) -> scalar``.
      params: the point (any pytree of float arrays).
      *args: one batch; or pass ``data=`` (see :func:`hvp`).
      key: a PRNG key for the start vectors.
      num_steps: Lanczos steps per run (90, as in Ghorbani et al.).
      num_runs: independent runs (start vectors).
      data: a list of batches, instead of ``*args``.
      mode: the HVP, ``"fwd_rev"`` or ``"rev_rev"``.
      dtype: the dtype Lanczos accumulates in; default the parameters' dtype.
      progress: ``True`` reports progress on stderr; or a function ``f(task, done, total)``.
      reorthogonalise: ``"none"`` (default), ``"partial"`` or ``"full"`` (see
        :func:`pipejax.hessian.lanczos`). ``"none"`` stores no basis: memory for three vectors
        instead of ``num_steps + 1``, and no pass against a basis. Gauss quadrature does not need
        orthogonality (Greenbaum 1989, Knizhnerman 1996): ghost copies of a converged eigenvalue
        share its weight, and the measure's moments are as accurate as with reorthogonalisation
        (tested against the dense Hessian; the same Wasserstein distance to the exact spectrum).
      curvature: ``"hessian"`` (default), ``"ggn"`` or ``"fisher"`` (for a
        :func:`pipejax.hessian.composite` loss; see :func:`pipejax.hessian.hvp`).

      blocks: a list of masks (see :func:`pipejax.hessian.stage_blocks`): the density of each
        diagonal block ``H_bb`` (start vectors and restarts inside the block), all in one call.
      basis_dtype: with ``reorthogonalise="partial"`` or ``"full"``, store each run's Lanczos basis
        in this dtype (e.g. ``jnp.float32`` for float64 parameters: half the memory); default the
        accumulation dtype. See :func:`pipejax.hessian.lanczos`. Must be ``None`` with ``"none"``.

    Returns:
      A :class:`Density` of ``nodes`` and ``weights``, each of shape ``(num_runs, num_steps)``
      (with ``blocks``: ``(num_blocks, num_runs, num_steps)``; block ``b`` is
      ``Density(d.nodes[b], d.weights[b])``).

    Raises:
      ValueError: ``num_steps`` more than the number of parameters; counts below 1.
      TypeError: a ``key`` that is not a PRNG key.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.hessian import density
      >>> loss = lambda w: 0.5 * jnp.sum(jnp.array([5.0, 2.0, -7.0, 1.0]) * w**2)
      >>> d = density(loss, jnp.zeros(4), key=jax.random.key(0), num_steps=4, num_runs=2)
      >>> d.nodes.shape, d.weights.sum(axis=1).round(4).tolist()
      ((2, 4), [1.0, 1.0])

    References:
      Golub and Meurant, *Matrices, Moments and Quadrature with Applications*, 2010. Ghorbani,
      Krishnan and Xiao, *An Investigation into Neural Net Optimization via Hessian Eigenvalue
      Density*, ICML 2019. Yao et al., *PyHessian: Neural Networks Through the Lens of the
      Hessian*, 2020. Greenbaum, *Behavior of slightly perturbed Lanczos and conjugate-gradient
      recurrences*, Linear Algebra Appl. 113, 1989. Knizhnerman, *The simple Lanczos procedure:
      estimates of the error of the Gauss quadrature formula and their applications*, Comput. Math.
      Math. Phys. 36, 1996.
    """
    check_progress(progress)
    op = make_operator(loss, params, args, data, mode, dtype, curvature)
    key = check_key(key)
    num_runs = checks.check_int(num_runs, "num_runs", 1)
    num_steps = checks.check_int(num_steps, "num_steps", 1)
    masks, n = dimension(params, blocks)
    if num_steps > n:
        raise ValueError(
            f"`num_steps` must be at most the number of parameters {n} (of the smallest block, with "
            f"`blocks`), got {num_steps}."
        )
    check_reorth(reorthogonalise)
    check_none_basis(reorthogonalise, basis_dtype)
    bdt = None if basis_dtype is None else check_basis_dtype(basis_dtype, op.dtype, n)
    return reading(
        op.groups, _density_jit,
        op.loss, op.mode, op.dtype, num_steps, num_runs, progress, reorthogonalise, bdt,
        tree.layout(params), params, args, op.groups, masks, key,
    )  # fmt: skip


def _density_impl(
    loss, mode, dtype, num_steps, num_runs, progress, reorth, basis_dtype, flat, params, args, groups, masks,
    key,
):  # fmt: skip
    op = Operator(loss, params, args, groups, mode, dtype, flat)
    total = num_runs * num_steps

    def one(mask, key):
        op.mask = mask

        def run(r, out):
            k_start, k_restart = jax.random.split(jax.random.fold_in(key, r))
            v0 = op.restrict(tree.rademacher(k_start, op.like, op.dtype))
            t = _lanczos(
                op.matvec,
                v0,
                num_steps,
                k_restart,
                False,
                "density",
                reorth,
                op.precision,
                op.restrict,
                op.constrain,
                basis_dtype,
            )[0]
            theta, s = jnp.linalg.eigh(t.matrix())
            nodes, weights = out
            if progress:  # once per run (the default prints every run)
                fn = progress if callable(progress) else _print_run
                jax.debug.callback(lambda rr: fn("density", (int(rr) + 1) * num_steps, total), r)
            return nodes.at[r].set(theta), weights.at[r].set(s[0] ** 2)

        init = (jnp.zeros((num_runs, num_steps), op.dtype), jnp.zeros((num_runs, num_steps), op.dtype))
        return Density(*jax.lax.fori_loop(0, num_runs, run, init))

    return map_blocks(one, masks, key)


def _print_run(task: str, done: int, total: int) -> None:
    print(f"pipejax.hessian {task}: {done}/{total} HVPs", file=sys.stderr, flush=True)


_density_jit = jax.jit(
    _density_impl,
    static_argnames=(
        "loss",
        "mode",
        "dtype",
        "num_steps",
        "num_runs",
        "progress",
        "reorth",
        "basis_dtype",
        "flat",
    ),
)


def check_density(d: Any, where: str) -> None:
    """``d`` must be a :class:`Density` (what :func:`density` returns): nodes and weights of one 2-D shape."""
    if not isinstance(d, Density):
        raise TypeError(
            f"`d` of {where} must be the Density that pipejax.hessian.density returns (its nodes and "
            f"weights), but got {type(d).__name__}"
            f"{' of shape ' + str(jnp.shape(d)) if hasattr(d, 'shape') else ''}. Pass `density(...)`'s "
            "result, or build one: `Density(nodes=..., weights=...)`, both of shape (num_runs, num_steps)."
        )
    shapes = jnp.shape(d.nodes), jnp.shape(d.weights)
    if len(shapes[0]) != 2 or shapes[0] != shapes[1]:
        raise ValueError(
            f"`d` of {where} must have nodes and weights of one shape (num_runs, num_steps), but got "
            f"nodes of shape {shapes[0]} and weights of shape {shapes[1]}."
        )


def spectral_range(d: Density) -> jax.Array:
    """The mean over runs of (largest node - smallest node): the range the conventions scale by."""
    check_density(d, "spectral_range")
    return jnp.mean(jnp.max(d.nodes, axis=1) - jnp.min(d.nodes, axis=1))


def smooth_density(
    d: Density,
    grid: jax.Array | None = None,
    *,
    num_points: int = 1000,
    sigma_squared: float = 1e-5,
    relative: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The SLQ measure convolved with a Gaussian kernel, on a grid: a density to plot.

    ``p(x) = mean_r sum_j weights[r, j] N(x; nodes[r, j], var)``, which integrates to 1 over the
    whole real line. The default grid ends just past the outermost nodes (see ``grid``), so the
    kernels' outer tails fall off it: the curve sums to about 1 on it only while the kernel's
    width ``sqrt(var)`` is small next to that margin, as with the default ``sigma_squared``
    (the margin is then at least 3 widths). For a wider kernel, pass a grid that extends a few
    widths past the nodes, e.g. ``jnp.linspace(lo - 4 * sqrt(var), hi + 4 * sqrt(var), n)``.

    **Variance convention.** With ``relative=True`` (default) the kernel's variance is
    ``var = sigma_squared * max(1, range)``, where ``range`` is the spectral range of the nodes
    (:func:`spectral_range`). This is the convention of google/spectral-density and PyHessian,
    whose ``sigma_squared`` (default 1e-5) is a variance scaled by the range, not a width: so the
    same ``sigma_squared`` gives the same plots as theirs. (They also renormalise the curve to
    sum to 1 on their grid; this function returns the exact Gaussian mixture.) With
    ``relative=False``, ``var = sigma_squared`` in squared eigenvalue units.

    Args:
      d: the :class:`Density` from :func:`density`.
      grid: the points; default ``num_points`` points spanning the nodes, widened by 1% of the
        range (and at least 0.01) on each side.
      num_points: the default grid's size.
      sigma_squared: the kernel's variance, relative or absolute (see above).
      relative: scale the variance by ``max(1, range)``.

    Returns:
      ``(grid, values)``, two arrays of shape ``(num_points,)`` (or the given grid's).

    Raises:
      TypeError: ``d`` is not a :class:`Density` (e.g. an array), a ``relative`` that is not a bool.
      ValueError: a non-positive ``sigma_squared``, a grid that is not 1-D.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pipejax.hessian import Density, smooth_density
      >>> d = Density(nodes=jnp.array([[0.0, 1.0]]), weights=jnp.array([[0.5, 0.5]]))
      >>> x, p = smooth_density(d, jnp.array([0.0, 0.5]), sigma_squared=0.01, relative=False)
      >>> p.round(3).tolist()  # half of N(0; 0, 0.01) = 0.5 / sqrt(2 pi 0.01)
      [1.995, 0.0]
    """
    check_density(d, "smooth_density")
    checks.check_int(num_points, "num_points", 1, "smooth_density")
    relative = checks.check_bool(
        relative, "relative", "smooth_density", " (scale `sigma_squared` by the spectral range)"
    )
    if isinstance(sigma_squared, bool) or not isinstance(sigma_squared, int | float) or not sigma_squared > 0:
        raise ValueError(
            f"`sigma_squared` of smooth_density must be a positive number (the kernel's variance), but "
            f"got {sigma_squared!r}."
        )
    if grid is not None and jnp.ndim(grid) != 1:
        raise ValueError(
            f"`grid` of smooth_density must be a 1-D array of points, but got shape {jnp.shape(grid)}."
        )
    nodes, weights = jnp.asarray(d.nodes), jnp.asarray(d.weights)
    span = spectral_range(d)
    var = sigma_squared * (jnp.maximum(1.0, span) if relative else 1.0)
    var = jnp.asarray(var, nodes.dtype)
    if grid is None:
        pad = jnp.maximum(0.01 * span, 0.01)
        grid = jnp.linspace(jnp.min(nodes) - pad, jnp.max(nodes) + pad, num_points, dtype=nodes.dtype)
    grid = jnp.asarray(grid, nodes.dtype)
    diff = grid[:, None, None] - nodes[None]
    two = jnp.asarray(2.0, nodes.dtype)
    kernel = jnp.exp(-(diff**2) / (two * var)) / jnp.sqrt(two * jnp.pi * var)
    values = jnp.sum(kernel * weights[None], axis=2).mean(axis=1)
    return grid, values
