"""Lanczos tridiagonalisation with partial, full or no reorthogonalisation.

After ``m`` steps from a unit vector ``q_0``, Lanczos has an orthonormal basis ``Q = [q_0 ..
q_{m-1}]`` of the Krylov space ``span(q_0, H q_0, ..., H^{m-1} q_0)`` and the tridiagonal
``T = Q^T H Q``. The eigenvalues of ``T`` (Ritz values) converge to the extreme eigenvalues of
``H`` first. In floating point the plain three-term recurrence loses orthogonality as Ritz values
converge, and converged eigenvalues come back as "ghost" copies that hide the next ones. So a new
vector goes through a Gram-Schmidt pass against the previous ones: at every step (full
reorthogonalisation), or only where Simon's estimate of the lost orthogonality asks for it
(partial, the default). A pass is a memory-bound product with the stored basis (it reads up to
``m n`` numbers), next to the HVP's ``O(batch n)``. Quadrature (:func:`pipejax.hessian.density`)
needs no pass and no basis at all (``reorthogonalise="none"``, ``_lanczos_none``): ghost copies
share one eigenvalue's weight.

The loop is two nested ``lax.while_loop`` (plain steps inside, the rare passes outside, see
``_lanczos``) whose inner body calls the HVP, so the HVP is traced and compiled once, whatever
``m`` is. The top eigenvalues by Lanczos are in :mod:`~pipejax._src.hessian.eigenvalues`, the
progress reports in :mod:`~pipejax._src.hessian.progress`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks
from pipejax._src.hessian import tree
from pipejax._src.hessian.hvp import check_key
from pipejax._src.hessian.progress import Progress, report

PyTree = Any


class Tridiagonal(NamedTuple):
    """The result of :func:`lanczos`."""

    diag: jax.Array  # (m,): alpha_i = q_i^T H q_i
    offdiag: jax.Array  # (m - 1,): beta_i = q_{i+1}^T H q_i; 0 where Lanczos restarted
    basis: PyTree  # the vectors q_0 .. q_{m-1}: every leaf of shape (m, *leaf.shape); None for "none"

    def matrix(self) -> jax.Array:
        """``T`` as a dense ``(m, m)`` matrix."""
        return jnp.diag(self.diag) + jnp.diag(self.offdiag, 1) + jnp.diag(self.offdiag, -1)


Reorth = Literal["partial", "full", "none"]
REORTHS = ("partial", "full", "none")


def check_reorth(reorthogonalise: Any, *, eigenvalues: bool = False) -> None:
    if reorthogonalise not in REORTHS:
        raise ValueError(
            f"`reorthogonalise` must be one of {REORTHS}, got {reorthogonalise!r}. 'partial' "
            "reorthogonalises only when Simon's estimate of the lost orthogonality passes sqrt(eps); "
            "'full' does it at every step (about twice the cost at small batches, for comparison); "
            "'none' stores no basis (for `density` and `lanczos`: ghost copies of converged "
            "eigenvalues stay in T)."
        )
    if eigenvalues and reorthogonalise == "none":
        raise ValueError(
            "`reorthogonalise='none'` is for `density` and `lanczos`, not `eigenvalues`: without a basis, "
            "converged eigenvalues come back in T as ghost copies that hide the next ones in the top k, "
            "and telling them from true ones (Cullum-Willoughby) is not reliable in float32. Use "
            "'partial' (default) or 'full'."
        )


def check_none_basis(reorthogonalise: Any, basis_dtype: Any) -> None:
    if reorthogonalise == "none" and basis_dtype is not None:
        raise ValueError(
            f"`basis_dtype` must be None with `reorthogonalise='none'`, which stores no basis, got "
            f"{basis_dtype!r}. Drop `basis_dtype`, or use 'partial' to store the basis in that dtype."
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
    basis_dtype: Any = None,
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
    - ``reorthogonalise="none"``: the plain three-term recurrence, no pass of any kind and no
      basis (``basis`` is ``None``): memory for three vectors whatever ``m``. Orthogonality is lost as
      Ritz values converge, so converged eigenvalues come back in ``T`` as ghost copies (and a
      few spurious values appear near them). Gauss quadrature is robust to that (Paige 1980,
      Greenbaum 1989; Golub and Meurant 2010): a ghost's eigenvector of ``T`` has a first
      component of about zero, so copies share one eigenvalue's weight and spurious values get
      none. So this is for stochastic Lanczos quadrature (:func:`pipejax.hessian.density`), not
      for reading off the top ``k`` eigenvalues.

    If the Krylov space is exhausted (a new vector is numerically zero: ``beta <= eps^(3/4)
    ||T||``), Lanczos restarts with a random vector orthogonalised twice against the basis and
    records ``beta = 0``, so ``T`` splits into blocks and stays exact; ``num_steps`` may then reach
    the dimension.

    Cost per step: one ``matvec``; with ``"full"`` also two products with the basis, which read it
    from memory (bandwidth-bound; on a 2-core CPU with ``m = 90`` and 77k parameters about as long
    as an HVP at batch 256); with ``"partial"`` those reads happen at the steps where they are due
    only (see ``benchmarks/hessian.py`` for the counts). Memory: the ``(m + 1) x n`` basis with
    ``"partial"`` and ``"full"``; three vectors with ``"none"``.

    Args:
      matvec: the symmetric linear map, ``v -> H v``, traceable.
      v0: the start vector (need not be normalised, must not be zero: a zero ``v0`` whose value
        is known raises a ``ValueError``; under ``jax.jit``, where it is not, Lanczos starts from
        a random vector drawn from ``key`` instead).
      num_steps: ``m``, the number of matvecs and the size of ``T``.
      key: draws restart vectors; ``None``: a fixed key.
      progress: ``True`` prints a line about every tenth step; a function ``f(task, done, total)``
        is called after each step.
      task: the name passed to ``progress``.
      reorthogonalise: ``"partial"`` (default), ``"full"`` or ``"none"``.
      basis_dtype: the dtype the basis is stored in; ``None`` (default): the vectors' dtype. A
        narrower one (``jnp.float32`` for float64 vectors) halves the basis's memory: the
        recurrence keeps ``q_i`` and ``q_{i-1}`` in the vectors' dtype, and the passes convert
        the stored rows back a block at a time. The rows' rounding errors (``eps_b``) leave
        ``q_{i+1}^T q_k`` at about ``eps_b / sqrt(12 n)`` after a pass, which must be at most
        ``sqrt(eps)`` (a ``ValueError`` says so otherwise); Simon's estimate starts from that level,
        so passes come more often. The returned ``basis`` is in ``basis_dtype``.

    Returns:
      A :class:`Tridiagonal` with ``diag``, ``offdiag`` and the ``basis`` (``None`` for ``"none"``).

    Raises:
      TypeError: ``matvec`` not callable, a ``v0`` that is not floating point, a ``key`` that is
        not a PRNG key, ``progress`` neither a bool nor a function.
      ValueError: a zero, empty or non-finite ``v0``; ``matvec`` changing the vector's shapes;
        ``num_steps`` below 1 or above the dimension.

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
      Paige, *Accuracy and effective use of the Lanczos algorithm for the symmetric eigenproblem*,
      Linear Algebra Appl. 34, 1980. Greenbaum, *Behavior of slightly perturbed Lanczos and
      conjugate-gradient recurrences*, Linear Algebra Appl. 113, 1989.
    """
    check_none_basis(reorthogonalise, basis_dtype)
    check_start(matvec, v0)
    return _lanczos(matvec, v0, num_steps, key, progress, task, reorthogonalise, basis_dtype=basis_dtype)[0]


def check_basis_dtype(basis_dtype: Any, dtype: Any, n: int) -> Any:
    """The dtype the basis of ``n``-vectors is stored in: ``basis_dtype``, or ``dtype`` (that of the
    vectors) for ``None``. A pass against rows rounded to eps_b leaves ``q^T q_k`` at about
    ``eps_b / sqrt(n)`` (the rounding errors are random), which must stay below ``sqrt(eps)``."""
    if basis_dtype is None:
        return jnp.dtype(dtype)
    try:
        bdt = jnp.dtype(basis_dtype)
    except TypeError:
        bdt = None
    if bdt is None or not jnp.issubdtype(bdt, jnp.floating):
        raise ValueError(
            f"`basis_dtype` must be None or a real floating dtype (jnp.float32, jnp.bfloat16, ...), got "
            f"{basis_dtype!r}. Use None to store the basis in the vectors' dtype {jnp.dtype(dtype).name}."
        )
    eps, eps_b = float(jnp.finfo(dtype).eps), float(jnp.finfo(bdt).eps)
    if eps_b < eps:
        raise ValueError(
            f"`basis_dtype` must not be more precise than the vectors' dtype {jnp.dtype(dtype).name}, got "
            f"{bdt.name}: the stored vectors cannot be more accurate than the computed ones. Use None, or "
            "`dtype=` to accumulate in a wider dtype."
        )
    if eps_b / n**0.5 > eps**0.5:
        raise ValueError(
            f"`basis_dtype` {bdt.name} is too coarse for {n} {jnp.dtype(dtype).name} parameters: a pass "
            f"against rows stored with eps {eps_b:.1e} leaves them orthogonal to about eps / sqrt(n) = "
            f"{eps_b / n**0.5:.1e}, and Lanczos needs at most sqrt(eps) = {eps**0.5:.1e} of the vectors' "
            "dtype. Use None, or a finer dtype (jnp.float32 for float64 vectors, jnp.bfloat16 for float32 "
            "ones once n >= 512)."
        )
    return bdt


# rows of the basis per block of a pass against it (see _lanczos.passes)
BLOCK = 8


def _recurrence(matvec, q, q_prev, b_prev, first, dtype, pin, local=True):
    """One Lanczos step before any pass against the basis: ``w = H q_i - beta_{i-1} q_{i-1} - alpha_i
    q_i``, then (``local``) a second local pass: classical Gram-Schmidt against ``q_i`` and
    ``q_{i-1}``, which keeps ``|q_{i+1}^T q_i|`` and ``|q_{i+1}^T q_{i-1}|`` at eps, as Simon's
    estimate assumes. Returns ``w``, ``alpha_i`` and ``||w||``. ``first``: ``i = 0`` (``q_{i-1}``
    is a placeholder)."""
    w = tree.sub(tree.astype(matvec(q), dtype), tree.scale(b_prev, q_prev))
    alpha = tree.dot(q, w)
    w = tree.sub(w, tree.scale(alpha, q))
    if not local:
        return pin(w), alpha, tree.norm(w)
    c, d = tree.dot(q, w), jnp.where(first, jnp.zeros((), dtype), tree.dot(q_prev, w))
    w = pin(tree.sub(w, tree.axpy(c, q, tree.scale(d, q_prev))))
    return w, alpha + c, tree.norm(w)


def check_start(matvec: Any, v0: PyTree) -> None:
    """``matvec`` callable, ``v0`` a non-empty pytree of float arrays, finite and non-zero where concrete,
    and ``matvec(v0)`` of ``v0``'s structure and shapes."""
    checks.check_callable(matvec, "matvec", "matvec(v) -> H v", "lanczos")
    leaves = jax.tree.leaves(v0)
    if not leaves:
        raise ValueError("`v0` of lanczos has no arrays; pass the start vector, e.g. `jnp.ones(n)`.")
    for leaf in leaves:
        checks.check_float_array(leaf, "v0", "lanczos")
    values = [checks.concrete(a) for a in leaves]
    if all(v is not None for v in values):
        if not all(np.all(np.isfinite(v)) for v in values):
            raise ValueError("`v0` of lanczos has NaN or infinite entries; pass a finite start vector.")
        if not any(np.any(v != 0) for v in values):
            raise ValueError(
                "`v0` of lanczos is zero, so it spans no Krylov space (its normalisation would be NaN). "
                "Pass a non-zero start vector, e.g. a random one: `jax.random.normal(key, (n,))`."
            )
    out = jax.eval_shape(matvec, v0)
    shapes = lambda t: jax.tree.map(jnp.shape, t)
    if jax.tree.structure(out) != jax.tree.structure(v0) or shapes(out) != shapes(v0):
        raise ValueError(
            f"`matvec` of lanczos must map a vector like `v0` to one like it, but maps {shapes(v0)} to "
            f"{shapes(out)}."
        )


def _start(v0: PyTree, key: jax.Array, m: int, dtype: Any, restrict: Any) -> PyTree:
    """``q_0 = v0 / ||v0||``; a random unit vector (from ``fold_in(key, m)``, a key no restart
    uses) when ``v0`` is zero, which a traced ``v0`` cannot be checked for."""
    norm = tree.norm(v0)

    def drawn():
        r = tree.normal(jax.random.fold_in(key, m), v0, dtype)
        r = r if restrict is None else restrict(r)
        return tree.scale(1 / jnp.maximum(tree.norm(r), jnp.finfo(dtype).tiny), r)

    return jax.lax.cond(norm > 0, lambda: tree.scale(1 / jnp.where(norm > 0, norm, 1), v0), drawn)


def _lanczos_none(matvec, v0, m, key, progress, task, restrict, pin, dtype):
    """``reorthogonalise="none"``: the plain three-term recurrence, no basis (and no local pass:
    the quadrature does not need it, and it cost 0.03 of the HVPs' time at batch 256). A restart
    (Krylov space exhausted) draws a random vector orthogonalised twice against ``q_i`` and
    ``q_{i-1}`` only and records ``beta = 0``: ``T`` splits, and the new block's eigenvectors have
    a zero first component (no quadrature weight)."""
    eps, tiny = jnp.finfo(dtype).eps, jnp.finfo(dtype).tiny
    zero = jnp.zeros((), dtype)

    def against_neighbours(r, q, q_prev):  # r minus its projections on q and q_prev (unit or zero), twice
        for _ in range(2):
            r = tree.sub(r, tree.axpy(tree.dot(q, r), q, tree.scale(tree.dot(q_prev, r), q_prev)))
        return r

    def step(i, carry):
        q, q_prev, diag, offdiag, size = carry
        b_prev = jnp.where(i > 0, offdiag[jnp.maximum(i - 1, 0)], zero)
        w, alpha, beta = _recurrence(matvec, q, q_prev, b_prev, i == 0, dtype, pin, local=False)
        size = jnp.maximum(size, jnp.abs(alpha) + beta)
        lost = beta <= eps**0.75 * size

        def restart(w):
            r = tree.normal(jax.random.fold_in(key, i), v0, dtype)
            r = against_neighbours(r if restrict is None else restrict(r), q, q_prev)
            return tree.scale(1 / jnp.maximum(tree.norm(r), tiny), r)

        q_next = pin(jax.lax.cond(lost, restart, lambda w: tree.scale(1 / jnp.maximum(beta, tiny), w), w))
        report(progress, task, i + 1, m)
        return q_next, q, diag.at[i].set(alpha), offdiag.at[i].set(jnp.where(lost, zero, beta)), size

    q0 = pin(_start(v0, key, m, dtype, restrict))
    init = (q0, tree.scale(zero, q0), jnp.zeros(m, dtype), jnp.zeros(m, dtype), zero)
    _, _, diag, offdiag, _ = jax.lax.fori_loop(0, m, step, init)
    return Tridiagonal(diag, offdiag[: m - 1], None), jnp.zeros((), jnp.int32)


def _lanczos(
    matvec, v0, num_steps, key, progress, task, reorthogonalise, precision=None, restrict=None,
    constrain=None, basis_dtype=None,
):  # fmt: skip
    """:func:`lanczos`, and the number of steps that ran a pass against the whole basis.

    ``precision``: the least precise dtype the operator computes in (the HVP's, when Lanczos
    accumulates float32 HVPs in float64); ``None``: the dtypes of ``matvec``'s output and ``v0``.
    The rounding of the operator, not of the accumulation, sets how fast orthogonality is lost.
    ``restrict``: the projector on the operator's subspace (a block), applied to restart vectors.
    ``constrain(v, lead)``: pins vectors (``lead=0``) and the basis (``lead=1``) to one sharding.
    ``basis_dtype``: the dtype the basis is stored in (see :func:`check_basis_dtype`).

    Layout of the loop (measured in ``benchmarks/hessian.py``): an inner ``lax.while_loop`` runs
    plain steps (the recurrence, a local pass against ``q_i`` and ``q_{i-1}``, Simon's estimate)
    and stops after a step that needs a pass against the whole basis (or a restart); an outer
    ``lax.while_loop`` runs that pass on the stopped step and re-enters the inner loop. So the
    inner loop holds no ``lax.cond``: a never-taken branch that read the basis cost as much per step
    as the rest of the step's vector work together on XLA's CPU backend. The current vector
    ``q_i`` and ``q_{i-1}`` are carried (in the vectors' dtype) rather than read back from the
    basis, which is only written, and read by the passes.
    """
    pin = (lambda v, lead=0: v) if constrain is None else constrain
    m = checks.check_int(num_steps, "num_steps", 1)
    check_reorth(reorthogonalise)
    n = tree.size(v0)
    if m > n:
        raise ValueError(
            f"`num_steps` must be at most the dimension {n} (Lanczos finds at most {n} orthogonal "
            f"vectors), got {m}."
        )
    key = jax.random.key(0) if key is None else check_key(key)
    dtype = jnp.result_type(*jax.tree.leaves(v0))
    if reorthogonalise == "none":
        return _lanczos_none(matvec, v0, m, key, progress, task, restrict, pin, dtype)
    bdtype = check_basis_dtype(basis_dtype, dtype, n)
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
    # after a pass against a basis stored in a lower precision, q_{i+1}^T q_k is left at the
    # product of q_{i+1} with the rounding error of row k: random, of standard deviation
    # eps_b / sqrt(12 n) for rounding to nearest (eps_b the storage's spacing), not at eps
    reset = jnp.asarray(max(op_eps, float(jnp.finfo(bdtype).eps) / (12 * n) ** 0.5), dtype)
    rows = -(-(m + 1) // BLOCK) * BLOCK  # whole blocks; rows past m stay zero
    ks = jnp.arange(m + 1)
    zero = jnp.zeros((), dtype)
    one = jnp.ones((), dtype)
    exact_rows = bdtype == jnp.dtype(dtype)  # the basis holds the vectors as computed
    tiny = jnp.finfo(dtype).tiny
    q0 = pin(_start(v0, key, m, dtype, restrict))
    # zeros: the first `settle` (a no-op otherwise) writes q_0 into row 0, as every one writes q_i
    basis = pin(tree.zeros_basis(v0, rows, bdtype), 1)

    def passes(basis, w, upto):
        """``w`` minus its projections on rows ``0 .. upto`` of the basis, and the coefficient of row
        ``upto``.

        One block of ``BLOCK`` rows at a time, each converted to the vectors' dtype and used at
        once (block modified Gram-Schmidt): the basis is read once (classical Gram-Schmidt reads
        it twice), only the blocks up to row ``upto`` are read, and a basis stored in a lower
        precision is never converted whole (that would be a temporary of its full size). Rows past
        ``upto`` must be zero.
        """

        def body(b, carry):
            w, last = carry
            blk = pin(jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, b * BLOCK, BLOCK), basis), 1)
            blk = tree.astype(blk, dtype)
            c = tree.project(blk, w)
            w = pin(tree.sub(w, pin(tree.combine(c, blk))))
            return w, last + jnp.sum(jnp.where(b * BLOCK + jnp.arange(BLOCK) == upto, c, zero))

        return jax.lax.fori_loop(0, upto // BLOCK + 1, body, (w, zero))

    def restart(s, basis):  # a random unit vector orthogonal to rows 0 .. s (two passes)
        r = tree.normal(jax.random.fold_in(key, s), v0, dtype)
        r = r if restrict is None else restrict(r)
        r, _ = passes(basis, passes(basis, r, s)[0], s)
        return tree.scale(1 / tree.norm(r), r)

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
        om = jnp.where(ks < i, t / jnp.maximum(beta, tiny), zero)
        return jnp.where(ks == i, noise, jnp.where(ks == i + 1, one, om))

    class State(NamedTuple):
        i: jax.Array  # steps done: q_0 .. q_i are known (q_i possibly pending a pass, see `due`)
        basis: PyTree
        q: PyTree  # q_i
        q_prev: PyTree  # q_{i-1} (zero for i = 0) if carried, else a placeholder (see `exact_rows`)
        diag: jax.Array
        offdiag: jax.Array
        size: jax.Array  # a running estimate of ||T||
        om_prev: jax.Array  # Simon's estimates of q_{i-1}^T q_k
        om_cur: jax.Array  # and of q_i^T q_k
        again: jax.Array  # the next step must run a pass (the one after a pass)
        due: jax.Array  # q_i still needs a pass against rows 0 .. i - 1
        lost: jax.Array  # the step that made q_i found (nearly) no new direction: restart
        passes: jax.Array

    def plain_step(st):
        """One step without a pass against the basis: the recurrence, a second pass against q_i and
        q_{i-1}, Simon's estimate; it writes q_{i+1} = w / beta and flags whether a pass is due."""
        i = st.i
        b_prev = jnp.where(i > 0, st.offdiag[jnp.maximum(i - 1, 0)], zero)
        # the three-term recurrence: w = H q_i - beta_{i-1} q_{i-1} - alpha_i q_i
        # q_{i-1} is read back from the basis when its rows are exact (a slice fused into its
        # uses); carrying it too made XLA copy both carried vectors at every step
        q_prev = tree.row(st.basis, jnp.maximum(i - 1, 0)) if exact_rows else st.q_prev
        w, alpha, beta = _recurrence(matvec, st.q, q_prev, b_prev, i == 0, dtype, pin)
        diag = st.diag.at[i].set(alpha)
        om = omega_next(i, diag, st.offdiag, alpha, beta, b_prev, st.om_prev, st.om_cur)
        due = st.again | (jnp.max(jnp.abs(jnp.where(ks < i, om, zero))) > op_eps**0.5)
        due = due | full
        size = jnp.maximum(st.size, jnp.abs(alpha) + beta)
        lost = beta <= eps**0.75 * size
        q = pin(tree.scale(1 / jnp.maximum(beta, tiny), w))
        report(progress, task, i + 1, m)
        return State(
            i + 1, pin(tree.set_row(st.basis, i + 1, q), 1), q, st.q_prev if exact_rows else st.q, diag,
            st.offdiag.at[i].set(beta), size,
            st.om_cur, om, due & ~st.again, due, lost, st.passes + due.astype(jnp.int32),
        )  # fmt: skip

    def settle(st):
        """Finishes a step that stopped the plain loop: q_i against rows 0 .. i - 1 if a pass is due
        (it is w / beta, so alpha and beta are corrected with the coefficients), a restart if lost.
        A no-op when neither is flagged (the first entry)."""
        s = st.i - 1  # the step that made q_i; at the first entry (i = 0) nothing is flagged
        at = jnp.where(st.i > 0, s, m)  # index m of diag and offdiag is never read
        alpha, beta = st.diag[at], st.offdiag[at]
        basis = pin(tree.set_row(st.basis, st.i, tree.scale(zero, st.q)), 1)  # rows past s are zero

        def with_pass(basis, q):
            q, c = passes(basis, q, s)
            return q, c, tree.norm(q)

        q, c, nrm = jax.lax.cond(st.due, with_pass, lambda basis, q: (q, zero, one), basis, st.q)
        alpha, beta = alpha + beta * c, beta * nrm
        size = jnp.maximum(st.size, jnp.abs(alpha) + beta)
        lost = st.lost | (st.due & (beta <= eps**0.75 * size))
        q = jax.lax.cond(lost, restart, lambda s, basis: tree.scale(1 / jnp.maximum(nrm, tiny), q), s, basis)
        q = pin(q)
        # after a pass q_i is orthogonal to working precision; Simon reorthogonalises the next vector
        # too (`again`), since the recurrence carries the old error of q_{i-1} into it
        om = jnp.where((st.due | lost) & (ks <= s), reset, st.om_cur)
        return st._replace(
            basis=pin(tree.set_row(basis, st.i, q), 1), q=q, diag=st.diag.at[at].set(alpha),
            offdiag=st.offdiag.at[at].set(jnp.where(lost, zero, beta)), size=size, om_cur=om,
            due=jnp.zeros((), bool), lost=jnp.zeros((), bool),
        )  # fmt: skip

    def plain_steps(st):
        return jax.lax.while_loop(lambda st: (st.i < m) & ~st.due & ~st.lost, plain_step, settle(st))

    false = jnp.zeros((), bool)
    init = State(
        jnp.zeros((), ks.dtype), basis, q0, zero if exact_rows else tree.scale(zero, q0),
        jnp.zeros(m + 1, dtype), jnp.zeros(m + 1, dtype), zero, jnp.zeros(m + 1, dtype),
        jnp.zeros(m + 1, dtype).at[0].set(1), false, false, false, jnp.zeros((), jnp.int32),
    )  # fmt: skip
    # the outer loop runs once, plus once per pass or restart; the last step's pass (if due) too
    st = jax.lax.while_loop(lambda st: (st.i < m) | st.due | st.lost, plain_steps, init)
    t = Tridiagonal(st.diag[:m], st.offdiag[: m - 1], jax.tree.map(lambda a: a[:m], st.basis))
    return t, st.passes


__all__ = ["Tridiagonal", "lanczos"]
