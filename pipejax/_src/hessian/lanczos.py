"""Lanczos tridiagonalisation with partial or full reorthogonalisation, and the top eigenvalues.

After ``m`` steps from a unit vector ``q_0``, Lanczos has an orthonormal basis ``Q = [q_0 ..
q_{m-1}]`` of the Krylov space ``span(q_0, H q_0, ..., H^{m-1} q_0)`` and the tridiagonal
``T = Q^T H Q``. The eigenvalues of ``T`` (Ritz values) converge to the extreme eigenvalues of
``H`` first. In floating point the plain three-term recurrence loses orthogonality as Ritz values
converge, and converged eigenvalues come back as "ghost" copies that hide the next ones. So after
the recurrence each new vector goes through one classical Gram-Schmidt pass against all previous
ones (full reorthogonalisation): ``m + 1`` stored vectors, and per step two matrix-vector products
with the stored basis, ``4 (m + 1) n`` flops that are bound by memory bandwidth (they read
``(m + 1) n`` numbers twice), next to the HVP's ``O(batch n)``.

The loop is one ``lax.fori_loop`` whose body calls the HVP, so the HVP is traced and compiled
once, whatever ``m`` is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from pipejax._src.hessian import tree
from pipejax._src.hessian.blocks import dimension, map_blocks
from pipejax._src.hessian.hvp import Curvature, Mode, Operator, check_count, check_key, make_operator

PyTree = Any
Progress = bool | Callable[[str, int, int], None]


class Tridiagonal(NamedTuple):
    """The result of :func:`lanczos`."""

    diag: jax.Array  # (m,): alpha_i = q_i^T H q_i
    offdiag: jax.Array  # (m - 1,): beta_i = q_{i+1}^T H q_i; 0 where Lanczos restarted
    basis: PyTree  # the vectors q_0 .. q_{m-1}: every leaf of shape (m, *leaf.shape)

    def matrix(self) -> jax.Array:
        """``T`` as a dense ``(m, m)`` matrix."""
        return jnp.diag(self.diag) + jnp.diag(self.offdiag, 1) + jnp.diag(self.offdiag, -1)


def print_progress(task: str, done: int, total: int) -> None:
    """The default progress report: a line on stderr about every tenth of the work."""
    every = max(1, total // 10)
    if done % every == 0 or done == total:
        print(f"pipejax.hessian {task}: {done}/{total} HVPs", file=__import__("sys").stderr, flush=True)


def report(progress: Progress, task: str, done: jax.Array, total: int) -> None:
    """Calls the progress function from inside compiled code (nothing when ``progress`` is off)."""
    if not progress:
        return
    fn = print_progress if progress is True else progress
    jax.debug.callback(lambda d: fn(task, int(d), total), done)


Reorth = Literal["partial", "full"]
REORTHS = ("partial", "full")


def check_reorth(reorthogonalise: Any) -> None:
    if reorthogonalise not in REORTHS:
        raise ValueError(
            f"`reorthogonalise` must be one of {REORTHS}, got {reorthogonalise!r}. 'partial' (default) "
            "reorthogonalises only when Simon's estimate of the lost orthogonality passes sqrt(eps); "
            "'full' does it at every step (about twice the cost at small batches, for comparison)."
        )


def lanczos(
    matvec: Callable[[PyTree], PyTree],
    v0: PyTree,
    num_steps: int,
    *,
    key: jax.Array | None = None,
    progress: Progress = False,
    task: str = "lanczos",
    reorthogonalise: Reorth = "partial",
) -> Tridiagonal:
    """``num_steps`` Lanczos steps on a symmetric operator, with partial (or full) reorthogonalisation.

    Vectors are pytrees (like ``v0``, in ``v0``'s dtypes). Each step is the three-term recurrence
    ``w = H q_i - beta_{i-1} q_{i-1} - alpha_i q_i``, then a Gram-Schmidt pass of ``w``:

    - ``reorthogonalise="partial"`` (default; Simon 1984): a second local pass against ``q_i`` and
      ``q_{i-1}`` (two vectors), and a pass against *all* previous vectors only when it is due.
      Simon's recurrence for ``omega_{i+1,k} ~ q_{i+1}^T q_k`` propagates the loss of
      orthogonality from ``alpha``, ``beta`` and a rounding term (``O(m)`` scalars per step, no
      vector reads); when ``max_k |omega| > sqrt(eps)`` the new vector and the next one are
      reorthogonalised against the whole basis and the estimates reset. The basis stays
      semi-orthogonal (``|q_i^T q_k| <= sqrt(eps)``), which is enough for ``T`` to be, up to
      working precision, the projection of ``H`` on the Krylov space: Ritz values as accurate as
      with full reorthogonalisation and no ghost copies (Simon 1984, Parlett 1998).
    - ``reorthogonalise="full"``: one classical Gram-Schmidt pass against all previous vectors at
      every step: orthonormal to a few ulps, at two reads of the ``(m + 1) x n`` basis per step.

    If the Krylov space is exhausted (a new vector is numerically zero: ``beta <= eps^(3/4)
    ||T||``), Lanczos restarts with a random vector orthogonalised twice against the basis and
    records ``beta = 0``, so ``T`` splits into blocks and stays exact; ``num_steps`` may then reach
    the dimension.

    Cost per step: one ``matvec``; with ``"full"`` also two products with the basis, which read it
    from memory (bandwidth-bound; on a 2-core CPU with ``m = 90`` and 77k parameters about as long
    as an HVP at batch 256); with ``"partial"`` those reads happen at the steps where they are due
    only (see ``benchmarks/hessian.py`` for the counts). Memory: the ``(m + 1) x n`` basis either way.

    Args:
      matvec: the symmetric linear map, ``v -> H v``, traceable.
      v0: the start vector (need not be normalised, must not be zero).
      num_steps: ``m``, the number of matvecs and the size of ``T``.
      key: draws restart vectors; ``None``: a fixed key.
      progress: ``True`` prints a line about every tenth step; a function ``f(task, done, total)``
        is called after each step.
      task: the name passed to ``progress``.
      reorthogonalise: ``"partial"`` (default) or ``"full"``.

    Returns:
      A :class:`Tridiagonal` with ``diag``, ``offdiag`` and the ``basis``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.hessian import lanczos
      >>> a = jnp.diag(jnp.array([3.0, 1.0, -2.0]))
      >>> t = lanczos(lambda v: a @ v, jnp.ones(3), 3)
      >>> jnp.linalg.eigvalsh(t.matrix()).round(4).tolist()
      [-2.0, 1.0, 3.0]

    References:
      Simon, *The Lanczos algorithm with partial reorthogonalization*, Math. Comp. 42, 1984.
      Parlett, *The Symmetric Eigenvalue Problem*, SIAM, 1998, chapter 13.
    """
    return _lanczos(matvec, v0, num_steps, key, progress, task, reorthogonalise)[0]


def _lanczos(
    matvec, v0, num_steps, key, progress, task, reorthogonalise, precision=None, restrict=None, constrain=None
):
    """:func:`lanczos`, and the number of steps that ran a pass against the whole basis.

    ``precision``: the least precise dtype the operator computes in (the HVP's, when Lanczos
    accumulates float32 HVPs in float64); ``None``: the dtypes of ``matvec``'s output and ``v0``.
    The rounding of the operator, not of the accumulation, sets how fast orthogonality is lost.
    ``restrict``: the projector on the operator's subspace (a block), applied to restart vectors.
    ``constrain(v, lead)``: pins vectors (``lead=0``) and the basis (``lead=1``) to one sharding.
    """
    pin = (lambda v, lead=0: v) if constrain is None else constrain
    m = check_count("num_steps", num_steps, 1)
    check_reorth(reorthogonalise)
    n = tree.size(v0)
    if m > n:
        raise ValueError(
            f"`num_steps` must be at most the dimension {n} (Lanczos finds at most {n} orthogonal "
            f"vectors), got {m}."
        )
    key = jax.random.key(0) if key is None else check_key(key)
    dtype = jnp.result_type(*jax.tree.leaves(v0))
    eps = jnp.finfo(dtype).eps
    full = reorthogonalise == "full"
    if precision is None:
        precision = [*jax.tree.leaves(jax.eval_shape(matvec, v0)), *jax.tree.leaves(v0)]
    else:
        precision = [jnp.zeros((), precision)]
    op_eps = max(float(eps), *(float(jnp.finfo(a.dtype).eps) for a in precision))
    # Simon's rounding term: what one step adds to the loss of orthogonality. His bound has a
    # factor sqrt(n); the measured loss per step is a few eps (2.1e-7 in float32 with full
    # reorthogonalisation on the test MLP), and eps halved the passes (float32: 35 -> 18 of 90)
    # while the basis stayed semi-orthogonal (max |q_i^T q_k| 1.1e-5 < sqrt(eps) = 3.5e-4)
    noise = jnp.asarray(op_eps, dtype)
    q0 = tree.scale(1 / tree.norm(v0), v0)
    basis = pin(tree.set_row(pin(tree.zeros_basis(v0, m + 1, dtype), 1), 0, q0), 1)
    ks = jnp.arange(m + 1)
    zero = jnp.zeros((), dtype)

    def restart(i, basis):  # a random unit vector orthogonal to the basis (two passes)
        r = tree.normal(jax.random.fold_in(key, i), v0, dtype)
        r, _ = tree.orthogonalise(basis, r if restrict is None else restrict(r))
        return tree.scale(1 / tree.norm(r), r)

    def whole_pass(basis, w):  # one classical Gram-Schmidt pass against every vector (rows > i are 0)
        coefs = tree.project(basis, w)
        return pin(tree.sub(w, pin(tree.combine(coefs, basis)))), coefs

    def omega_next(i, diag, offdiag, alpha, beta, b_prev, om_prev, om_cur):
        """Simon's recurrence: estimates of q_{i+1}^T q_k, k <= i, from those of q_i and q_{i-1}.

        beta_i w_{i+1,k} = beta_k w_{i,k+1} + (alpha_k - alpha_i) w_{i,k} + beta_{k-1} w_{i,k-1}
        - beta_{i-1} w_{i-1,k} (+ rounding), with w_{i,i} = 1.
        """
        beta_k = jnp.where(ks < i, offdiag, zero)
        beta_km1 = jnp.where((ks >= 1) & (ks <= i), jnp.roll(offdiag, 1), zero)
        up = jnp.where(ks < i, jnp.roll(om_cur, -1), zero)
        down = jnp.where((ks >= 1) & (ks <= i), jnp.roll(om_cur, 1), zero)
        t = beta_k * up + (diag - alpha) * om_cur + beta_km1 * down - b_prev * om_prev
        t = t + jnp.where(t >= 0, noise, -noise) * (beta_k + beta)
        om = jnp.where(ks < i, t / jnp.maximum(beta, jnp.finfo(dtype).tiny), zero)
        return jnp.where(ks == i, noise, jnp.where(ks == i + 1, jnp.ones((), dtype), om))

    def step(i, carry):
        basis, diag, offdiag, size, om_prev, om_cur, again, passes = carry
        q = tree.row(basis, i)
        j = jnp.maximum(i - 1, 0)
        b_prev = jnp.where(i > 0, offdiag[j], zero)
        q_prev = tree.row(basis, j)
        # the three-term recurrence: w = H q_i - beta_{i-1} q_{i-1} - alpha_i q_i
        w = tree.sub(tree.astype(matvec(q), dtype), tree.scale(b_prev, q_prev))
        alpha = tree.dot(q, w)
        w = tree.sub(w, tree.scale(alpha, q))
        if full:
            # one pass against all vectors: it removes the recurrence's rounding errors, which are
            # small next to w, so one pass is enough
            w, coefs = whole_pass(basis, w)
            alpha = alpha + coefs[i]
            due = jnp.ones((), bool)
        else:
            # a second local pass (two vectors): keeps |q_{i+1}^T q_i| and |q_{i+1}^T q_{i-1}| at eps
            c = tree.dot(q, w)
            w = tree.sub(w, tree.scale(c, q))
            alpha = alpha + c
            w = tree.sub(w, tree.scale(jnp.where(i > 0, tree.dot(q_prev, w), zero), q_prev))
            om = omega_next(i, diag.at[i].set(alpha), offdiag, alpha, tree.norm(w), b_prev, om_prev, om_cur)
            due = again | (jnp.max(jnp.abs(jnp.where(ks < i, om, zero))) > op_eps**0.5)
            # the pass's operands are only read, so the basis is not copied when it does not run
            w, coefs = jax.lax.cond(due, whole_pass, lambda basis, w: (w, jnp.zeros(m + 1, dtype)), basis, w)
            alpha = alpha + coefs[i]
            # after a pass q_{i+1} is orthogonal to working precision; Simon reorthogonalises the
            # next vector too, since the recurrence carries the old error of q_i into it
            om = jnp.where(due & (ks <= i), noise, om)
            again = due & ~again
        beta = tree.norm(w)
        size = jnp.maximum(size, jnp.abs(alpha) + beta)
        lost = beta <= eps**0.75 * size
        q = jax.lax.cond(lost, restart, lambda i, basis: tree.scale(1 / beta, w), i, basis)
        basis = pin(tree.set_row(basis, i + 1, pin(q)), 1)
        diag = diag.at[i].set(alpha)
        offdiag = offdiag.at[i].set(jnp.where(lost, jnp.zeros_like(beta), beta))
        if not full:  # a restart vector is orthogonalised twice against the basis
            om_prev, om_cur = om_cur, jnp.where(lost & (ks <= i), noise, om)
        report(progress, task, i + 1, m)
        return basis, diag, offdiag, size, om_prev, om_cur, again, passes + due.astype(jnp.int32)

    om0 = jnp.zeros(m + 1, dtype).at[0].set(1)
    init = (basis, jnp.zeros(m + 1, dtype), jnp.zeros(m + 1, dtype), zero, jnp.zeros(m + 1, dtype), om0,
            jnp.zeros((), bool), jnp.zeros((), jnp.int32))  # fmt: skip
    basis, diag, offdiag, _, _, _, _, passes = jax.lax.fori_loop(0, m, step, init)
    t = Tridiagonal(diag[:m], offdiag[: m - 1], jax.tree.map(lambda a: a[:m], basis))
    return t, passes


def select(values: jax.Array, k: int, which: str) -> jax.Array:
    """Indices of the ``k`` wanted eigenvalues, in order: largest first ("LA"), or largest |.|."""
    order = jnp.argsort(-values if which == "LA" else -jnp.abs(values))
    return order[:k]


def eigenvalues(
    loss: Callable[..., jax.Array],
    params: PyTree,
    *args: Any,
    key: jax.Array,
    k: int = 1,
    which: Literal["LA", "LM"] = "LA",
    num_steps: int | None = None,
    return_eigenvectors: bool = False,
    blocks: Sequence[PyTree] | None = None,
    data: Iterable[Any] | None = None,
    mode: Mode = "fwd_rev",
    dtype: Any = None,
    progress: Progress = False,
    reorthogonalise: Reorth = "partial",
    curvature: Curvature = "hessian",
) -> jax.Array | tuple[jax.Array, PyTree]:
    """The top ``k`` eigenvalues of the Hessian of ``loss`` at ``params``, by Lanczos.

    Runs ``num_steps`` Lanczos steps (with partial reorthogonalisation) from a random start vector
    and returns the ``k`` extreme Ritz values: the largest (``which="LA"``, largest algebraic) or
    those of largest magnitude (``which="LM"``, which may be negative, as power iteration finds).
    Without reorthogonalisation, ghost copies of the top eigenvalue would hide the next ones.
    One HVP per step, compiled once; the cost is ``num_steps`` HVPs plus ``O(num_steps^2 n)``
    for the reorthogonalisation, and memory for ``num_steps + 1`` vectors of ``n`` parameters.

    Args:
      loss: ``loss(params, *args) -> scalar``.
      params: the point (any pytree of float arrays; sharded :class:`pipejax.StageParams` work).
      *args: one batch; or pass ``data=`` (see :func:`hvp`).
      key: a PRNG key for the start vector.
      k: how many eigenvalues, ``1 <= k <= num_steps``.
      which: ``"LA"`` (largest algebraic, default) or ``"LM"`` (largest magnitude).
      num_steps: Lanczos steps; default ``min(n, max(90, 4 k))`` for ``n`` parameters. With full
        reorthogonalisation, 90 steps gave the top 5 eigenvalues of a 3,000-parameter MLP to
        1e-10 relative.
      return_eigenvectors: also return the Ritz vectors.
      blocks: a list of masks (see :func:`pipejax.hessian.stage_blocks`): the top eigenvalues of
        each diagonal block ``H_bb`` of the Hessian, all in one call (``num_steps`` HVPs each).
      data: a list of batches, instead of ``*args``.
      mode: the HVP, ``"fwd_rev"`` or ``"rev_rev"`` (see :func:`hvp`).
      dtype: the dtype Lanczos accumulates in (e.g. ``jnp.float64`` for float32 parameters);
        default the parameters' dtype. The HVP itself runs in the parameters' dtypes.
      progress: ``True`` reports progress on stderr; or a function ``f(task, done, total)``.
      reorthogonalise: ``"partial"`` (default) or ``"full"`` (see :func:`lanczos`).
      curvature: ``"hessian"`` (default), ``"ggn"`` or ``"fisher"`` (for a
        :func:`pipejax.hessian.composite` loss; see :func:`pipejax.hessian.hvp`).

    Returns:
      ``values`` of shape ``(k,)`` (largest first, by ``which``), or ``(values, vectors)`` where
      ``vectors`` is a pytree like ``params`` with a leading axis of size ``k``. With ``blocks``,
      each has a further leading axis, one entry per block.

    Raises:
      ValueError: ``k`` larger than the number of parameters or than ``num_steps``; a non-scalar
        loss; an unknown ``which``.
      TypeError: a ``key`` that is not a PRNG key.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.hessian import eigenvalues
      >>> loss = lambda w: 0.5 * jnp.sum(jnp.array([5.0, 2.0, -7.0, 1.0]) * w**2)
      >>> eigenvalues(loss, jnp.zeros(4), key=jax.random.key(0), k=2).round(4).tolist()
      [5.0, 2.0]
      >>> eigenvalues(loss, jnp.zeros(4), key=jax.random.key(0), which="LM").round(4).tolist()
      [-7.0]

    References:
      Lanczos, *An iteration method for the solution of the eigenvalue problem of linear
      differential and integral operators*, 1950. Golub and Van Loan, *Matrix Computations*, 4th
      ed., section 10.1. Ghorbani, Krishnan and Xiao, *An Investigation into Neural Net
      Optimization via Hessian Eigenvalue Density*, ICML 2019.
    """
    op = make_operator(loss, params, args, data, mode, dtype, curvature)
    key = check_key(key)
    masks, n = dimension(params, blocks)
    k = check_count("k", k, 1)
    if k > n:
        raise ValueError(f"`k` must be at most the number of parameters {n}, got k={k}.")
    if which not in ("LA", "LM"):
        raise ValueError(
            f"`which` must be 'LA' (largest algebraic) or 'LM' (largest magnitude), got {which!r}."
        )
    m = min(n, max(90, 4 * k)) if num_steps is None else check_count("num_steps", num_steps, 1)
    if m < k:
        raise ValueError(
            f"`num_steps` must be at least `k` (Lanczos gives num_steps Ritz values), got "
            f"num_steps={m} < k={k}. Use num_steps >= 4 * k for accurate eigenvalues."
        )
    if m > n:
        raise ValueError(f"`num_steps` must be at most the number of parameters {n}, got {m}.")
    check_reorth(reorthogonalise)
    return _eigenvalues_jit(
        op.loss, op.mode, op.dtype, k, which, m, bool(return_eigenvectors), progress, reorthogonalise,
        tree.layout(params), params, args, op.groups, masks, key,
    )  # fmt: skip


def _eigenvalues_impl(
    loss, mode, dtype, k, which, m, vectors, progress, reorth, flat, params, args, groups, masks, key
):
    op = Operator(loss, params, args, groups, mode, dtype, flat)

    def one(mask, key):
        op.mask = mask
        k_start, k_restart = jax.random.split(key)
        v0 = op.restrict(tree.normal(k_start, op.like, op.dtype))
        t = _lanczos(op.matvec, v0, m, k_restart, progress, "eigenvalues", reorth, op.precision, op.restrict)[
            0
        ]
        theta, s = jnp.linalg.eigh(t.matrix())
        idx = select(theta, k, which)
        if not vectors:
            return theta[idx]
        return theta[idx], op.unpack(tree.combine(s[:, idx], t.basis))

    return map_blocks(one, masks, key)


_eigenvalues_jit = jax.jit(
    _eigenvalues_impl,
    static_argnames=("loss", "mode", "dtype", "k", "which", "m", "vectors", "progress", "reorth", "flat"),
)

__all__ = ["Tridiagonal", "eigenvalues", "lanczos"]
