"""Stochastic estimates of the Hessian trace: Hutchinson and Hutch++."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from pipejax._src import checks
from pipejax._src.hessian import tree
from pipejax._src.hessian.blocks import dimension, map_blocks
from pipejax._src.hessian.data import reading
from pipejax._src.hessian.hvp import Curvature, Mode, Operator, check_key, make_operator
from pipejax._src.hessian.progress import Progress, check_progress, report

PyTree = Any


def trace(
    loss: Callable[..., jax.Array],
    params: PyTree,
    *args: Any,
    key: jax.Array,
    num_probes: int = 100,
    method: Literal["hutchinson", "hutch++"] = "hutchinson",
    data: Iterable[Any] | None = None,
    mode: Mode = "fwd_rev",
    dtype: Any = None,
    progress: Progress = False,
    curvature: Curvature = "hessian",
    blocks: Sequence[PyTree] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """An unbiased estimate of ``tr(H)`` and its standard error, from ``num_probes`` HVPs.

    **Hutchinson**: ``tr(H) = E[z^T H z]`` for Rademacher ``z`` (independent +-1 entries); the
    estimate is the mean of ``num_probes`` samples ``z_j^T H z_j`` and the standard error is their
    sample standard deviation over ``sqrt(num_probes)``.

    **Hutch++** (``method="hutch++"``) spends a third of the HVPs on a sketch ``H S``, computes the
    trace on its range ``Q`` exactly (``tr(Q^T H Q)``, another third) and Hutchinson on the rest,
    ``(I - Q Q^T) H (I - Q Q^T)``. When a few eigenvalues dominate, its error falls as
    ``1/num_probes`` instead of ``1/sqrt(num_probes)``. The standard error is that of the
    Hutchinson part (the exact part has none, given the sketch).

    Args:
      loss: ``loss(params, *args) -> scalar``.
      params: the point (any pytree of float arrays).
      *args: one batch; or pass ``data=`` (see :func:`hvp`).
      key: a PRNG key for the probes.
      num_probes: the number of HVPs (at least 2; at least 4 for Hutch++).
      method: ``"hutchinson"`` (default) or ``"hutch++"``.
      data: a list of batches, instead of ``*args``.
      mode: the HVP, ``"fwd_rev"`` or ``"rev_rev"``.
      dtype: the dtype of the probes and sums; default the parameters' dtype.
      progress: ``True`` reports progress on stderr; or a function ``f(task, done, total)``.
      curvature: ``"hessian"`` (default), ``"ggn"`` or ``"fisher"`` (for a
        :func:`pipejax.hessian.composite` loss; see :func:`pipejax.hessian.hvp`).

      blocks: a list of masks (see :func:`pipejax.hessian.stage_blocks`): the trace of each
        diagonal block ``H_bb`` (probes masked to the block), e.g. one per pipeline stage.

    Returns:
      ``(estimate, standard_error)``, two scalars (with ``blocks``: two arrays, one entry per block).

    Raises:
      ValueError: too few probes, an unknown ``method``, a non-scalar loss.
      TypeError: a ``key`` that is not a PRNG key.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.hessian import trace
      >>> loss = lambda w: 0.5 * jnp.sum(jnp.array([5.0, 2.0, -7.0, 1.0]) * w**2)
      >>> est, err = trace(loss, jnp.zeros(4), key=jax.random.key(0), num_probes=10)
      >>> float(est), float(err)  # a diagonal Hessian: every Rademacher probe is exact
      (1.0, 0.0)

    References:
      Hutchinson, *A stochastic estimator of the trace of the influence matrix for Laplacian
      smoothing splines*, 1989. Meyer, Musco, Musco and Woodruff, *Hutch++: Optimal Stochastic
      Trace Estimation*, SOSA 2021.
    """
    check_progress(progress)
    op = make_operator(loss, params, args, data, mode, dtype, curvature)
    key = check_key(key)
    if method not in ("hutchinson", "hutch++"):
        raise ValueError(f"`method` must be 'hutchinson' or 'hutch++', got {method!r}.")
    minimum = 2 if method == "hutchinson" else 4
    num_probes = checks.check_int(num_probes, "num_probes", minimum, rule=f" for method={method!r}")
    masks, n = dimension(params, blocks)
    if method == "hutch++" and num_probes // 3 > n:
        raise ValueError(
            f"`num_probes` // 3 (the Hutch++ sketch size) must be at most the number of parameters "
            f"{n}, got num_probes={num_probes}."
        )
    return reading(
        op.groups, _trace_jit,
        op.loss, op.mode, op.dtype, method, num_probes, progress, tree.layout(params),
        params, args, op.groups, masks, key,
    )  # fmt: skip


def _samples(op, key, basis, count, progress, done, total):
    """``count`` Hutchinson samples ``z^T P H P z`` with ``P`` the projector off ``basis``'s rows."""

    def body(j, out):
        z = op.restrict(tree.rademacher(jax.random.fold_in(key, j), op.like, op.dtype))
        if basis is not None:
            z, _ = tree.orthogonalise(basis, z)
        out = out.at[j].set(tree.dot(z, op.matvec(z)))
        report(progress, "trace", done + j + 1, total)
        return out

    return jax.lax.fori_loop(0, count, body, jnp.zeros(count, op.dtype))


def _mean_and_error(samples):
    n = samples.shape[0]
    return jnp.mean(samples), jnp.std(samples, ddof=1) / jnp.sqrt(jnp.asarray(n, samples.dtype))


def _trace_impl(loss, mode, dtype, method, num_probes, progress, flat, params, args, groups, masks, key):
    op = Operator(loss, params, args, groups, mode, dtype, flat)

    def one(mask, key):
        op.mask = mask
        return _trace_one(op, method, num_probes, progress, key)

    return map_blocks(one, masks, key)


def _trace_one(op, method, num_probes, progress, key):
    if method == "hutchinson":
        return _mean_and_error(_samples(op, key, None, num_probes, progress, 0, num_probes))
    s = num_probes // 3
    k_sketch, k_rest = jax.random.split(key)
    basis = tree.zeros_basis(op.like, s, op.dtype)

    def sketch(j, basis):  # Q: the orthonormalised columns of H S, built one column at a time
        probe = op.restrict(tree.rademacher(jax.random.fold_in(k_sketch, j), op.like, op.dtype))
        y, _ = tree.orthogonalise(basis, op.matvec(probe))
        report(progress, "trace", j + 1, num_probes)
        return tree.set_row(basis, j, tree.scale(1 / jnp.maximum(tree.norm(y), jnp.finfo(op.dtype).tiny), y))

    basis = jax.lax.fori_loop(0, s, sketch, basis)

    def exact(j, acc):  # tr(Q^T H Q)
        q = tree.row(basis, j)
        report(progress, "trace", s + j + 1, num_probes)
        return acc + tree.dot(q, op.matvec(q))

    head = jax.lax.fori_loop(0, s, exact, jnp.zeros((), op.dtype))
    est, err = _mean_and_error(_samples(op, k_rest, basis, num_probes - 2 * s, progress, 2 * s, num_probes))
    return head + est, err


_trace_jit = jax.jit(
    _trace_impl,
    static_argnames=("loss", "mode", "dtype", "method", "num_probes", "progress", "flat"),
)
