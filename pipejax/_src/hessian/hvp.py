"""Hessian-vector products of ``loss(params, *args)``, on one batch or averaged over a dataset.

Also the checks every entry point of :mod:`pipejax.hessian` shares (a scalar loss, a PRNG key,
counts) and the :class:`Operator` they drive: the HVP of one loss at one point, as a traceable
``matvec`` that Lanczos and the trace estimators call inside one ``lax.fori_loop``. The losses
with more structure are in :mod:`~pipejax._src.hessian.losses`, the datasets of ``data=`` in
:mod:`~pipejax._src.hessian.data`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from pipejax._src import checks
from pipejax._src.hessian import tree
from pipejax._src.hessian.data import Stream, group_batches, reading
from pipejax._src.hessian.losses import CompositeLoss, GradientLoss

PyTree = Any
Mode = Literal["fwd_rev", "rev_rev"]
MODES = ("fwd_rev", "rev_rev")


Curvature = Literal["hessian", "ggn", "fisher"]
CURVATURES = ("hessian", "ggn", "fisher")


def _hvp_one(loss: Callable[..., jax.Array], mode: str, params: PyTree, v: PyTree, args: tuple) -> PyTree:
    if isinstance(loss, _Product) and loss.curvature != "hessian":
        return _gauss_newton(loss.fn, loss.curvature, mode, params, v, args)
    fn = loss.fn if isinstance(loss, _Product) else loss

    def grad(p):
        if isinstance(fn, GradientLoss):
            return fn.grad(p, *args)
        return jax.grad(fn)(p, *args)

    if mode == "fwd_rev":  # a JVP of the gradient: about 2-3 gradients of cost
        return jax.jvp(grad, (params,), (v,))[1]
    # reverse-over-reverse: the gradient of <grad, v>; works where forward mode cannot pass
    return jax.grad(lambda p: tree.dot(grad(p), v))(params)


def _gauss_newton(loss: CompositeLoss, curvature: str, mode: str, params: PyTree, v: PyTree, args: tuple):
    """``J^T H_z J v`` (GGN) or ``(1/N) sum_i g_i g_i^T v`` (empirical Fisher), with ``J = dz/dparams``."""
    model = lambda p: loss.outputs(p, *args)
    z, pullback = jax.vjp(model, params)
    if mode == "fwd_rev":
        jv = jax.jvp(model, (params,), (v,))[1]
    else:  # J v as the transpose of the pullback (reverse mode only, for layers without a JVP rule)
        jv = jax.vjp(lambda c: pullback(c)[0], jax.tree.map(jnp.zeros_like, z))[1](v)[0]
    grad_z = jax.grad(lambda z: loss.output_loss(z, *args))
    if curvature == "ggn":
        if mode == "fwd_rev":
            cot = jax.jvp(grad_z, (z,), (jv,))[1]
        else:
            cot = jax.grad(lambda z: tree.dot(grad_z(z), jv))(z)
        return pullback(cot)[0]
    # the Fisher: the per-example gradients in z are N dL/dz_i when L is a mean over the batch
    leaves = jax.tree.leaves(z)
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "curvature='fisher' needs outputs whose leaves share a leading batch axis (the loss a mean "
            f"of per-example terms over it), got output shapes {[jnp.shape(a) for a in leaves]}."
        )
    (n,) = sizes
    e = grad_z(z)  # e_i / N, with e_i the gradient of example i's loss in z_i
    per_example = lambda a, b: jnp.sum((a * b.astype(a.dtype)).reshape(n, -1), axis=1)
    u = sum(per_example(a, b) for a, b in zip(jax.tree.leaves(e), jax.tree.leaves(jv), strict=True))
    # (1/N) sum_i g_i (g_i . v) = J^T [(e_i . (J v)_i) e_i / N]_i = J^T [N (e/N . Jv)_i (e/N)_i]_i
    scale = lambda a: a * (n * u).astype(a.dtype).reshape((n,) + (1,) * (a.ndim - 1))
    cot = jax.tree.map(scale, e)
    return pullback(cot)[0]


class _Product:
    """The loss and the curvature its operator multiplies by (hashable: a static argument)."""

    def __init__(self, fn: Callable[..., jax.Array], curvature: str):
        self.fn, self.curvature = fn, curvature

    def __call__(self, params: PyTree, *args: Any) -> jax.Array:
        return self.fn(params, *args)

    def __eq__(self, other: Any) -> bool:
        return type(other) is _Product and self.fn == other.fn and self.curvature == other.curvature

    def __hash__(self) -> int:
        return hash((self.fn, self.curvature))


def check_curvature(loss: Any, curvature: Any) -> _Product:
    checks.check_callable(loss, "loss", "loss(params, *args) -> scalar")
    if isinstance(loss, _Product):
        return loss
    if curvature not in CURVATURES:
        raise ValueError(
            f"`curvature` must be one of {CURVATURES}, got {curvature!r}: the Hessian, the generalised "
            "Gauss-Newton matrix or the empirical Fisher."
        )
    if curvature != "hessian" and not isinstance(loss, CompositeLoss):
        raise TypeError(
            f"curvature={curvature!r} needs the loss split into a model and a loss of its outputs, got "
            f"{loss!r}. Write it as `loss = pipejax.hessian.composite(outputs, output_loss)` with "
            "`outputs(params, *args) -> z` (e.g. logits) and `output_loss(z, *args) -> scalar`."
        )
    return _Product(loss, curvature)


def check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(
            f"`mode` must be one of {MODES}, got {mode!r}. Use 'fwd_rev' (forward-over-reverse, the "
            "fast default) or 'rev_rev' (reverse-over-reverse, for layers without forward mode)."
        )


KEY_PURPOSE = "Random probes and start vectors are drawn from it; pass a fresh key, not a seed or an array."


def check_key(key: Any, name: str = "key") -> jax.Array:
    """A single PRNG key (typed, or a legacy ``uint32[2]`` one, which is wrapped)."""
    return checks.typed_key(checks.check_key(key, name=name, optional=False, purpose=KEY_PURPOSE))


def check_loss(loss: Callable[..., jax.Array], params: PyTree, args: tuple) -> None:
    """The loss must return one real floating-point scalar, and params must be floating point."""
    checks.check_callable(loss, "loss", "loss(params, *args) -> scalar")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"`params` must hold floating-point arrays, but leaf {jax.tree_util.keystr(path)} has "
                f"dtype {jnp.result_type(leaf)}. Take the Hessian with respect to the float leaves "
                "only (close over the others in `loss`)."
            )
    try:
        out = jax.eval_shape(loss, params, *args)
    except Exception as err:  # the user's own error keeps its type; say what it was called with
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), params)
        err.add_note(
            f"pipejax.hessian: raised by `loss(params, *args)` called with params {shapes} and "
            f"{len(args)} batch argument(s). Check that `params` is the tree `loss` reads (its keys and "
            "shapes) and that the batch matches `loss`'s arguments."
        )
        raise
    scalar = isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
    if not (scalar and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(
            f"`loss(params, *args)` must return a real scalar, got {out}. Reduce it to one number, "
            "e.g. the mean over the batch."
        )


def check_vector(v: PyTree, params: PyTree, name: str = "v") -> None:
    """``v`` must be a vector of the parameters' space: their structure and leaf shapes."""
    if jax.tree.structure(v) != jax.tree.structure(params):
        raise ValueError(
            f"`{name}` must have the pytree structure of `params`, got {jax.tree.structure(v)} for "
            f"params {jax.tree.structure(params)}. Build it from the params, e.g. "
            f"`jax.tree.map(jnp.ones_like, params)`, or `unravel(flat)` with "
            "`flat, unravel = jax.flatten_util.ravel_pytree(params)`."
        )
    for (path, a), p in zip(jax.tree_util.tree_leaves_with_path(v), jax.tree.leaves(params), strict=True):
        if jnp.shape(a) != jnp.shape(p):
            raise ValueError(
                f"`{name}` must have the leaf shapes of `params`, but leaf {jax.tree_util.keystr(path)} "
                f"has shape {jnp.shape(a)} where the parameter has shape {jnp.shape(p)}."
            )
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            raise TypeError(
                f"`{name}` must hold floating-point arrays, but leaf {jax.tree_util.keystr(path)} has "
                f"dtype {jnp.result_type(a)}; cast it to the parameters' dtype."
            )


class Operator:
    """The Hessian of ``loss`` at ``params`` as a traceable matvec.

    ``groups`` is ``None`` for one batch (``args``), or stacked batches with weights (see
    :func:`~pipejax._src.hessian.data.group_batches`); they are arguments of the compiled program,
    not constants in it.

    With ``flat=True`` the vectors ``matvec`` takes and returns are flat arrays of ``dtype`` (the
    leaves of ``params`` concatenated): XLA then compiles one instruction per vector operation
    instead of one per leaf, which made Lanczos compile about twice as fast on a 6-leaf MLP. Leaves
    sharded over devices need ``flat=False`` (vectors are pytrees like ``params``, each leaf sharded
    like its parameter, so nothing is gathered onto one device).
    """

    def __init__(self, loss, params, args, groups, mode, dtype, flat=False):
        self.loss, self.params, self.args, self.groups, self.mode = loss, params, args, groups, mode
        self.dtype = dtype  # the dtype of the vectors Lanczos keeps (accumulation)
        self.flat = flat is True
        self.shardings = flat if isinstance(flat, tuple) else None  # see tree.layout
        self.mask = None  # a block: a pytree of 0/1 like params (leaves broadcastable); None: all

    def constrain(self, v: PyTree, lead: int = 0) -> PyTree:
        """``v`` pinned to the parameters' shardings (nothing for flat vectors)."""
        return v if self.flat else tree.constrain(v, self.shardings, lead)

    def restrict(self, v: PyTree) -> PyTree:
        """``v`` with the entries outside the block (``mask``) set to zero."""
        if self.mask is None:
            return v
        full = jax.tree.map(lambda m, p: jnp.broadcast_to(m, jnp.shape(p)), self.mask, self.params)
        if self.flat:
            return v * tree.ravel(full, v.dtype)
        return jax.tree.map(lambda a, m: a * m.astype(a.dtype), v, self.mask)

    @property
    def precision(self) -> Any:
        """The least precise dtype the HVP runs in (that of the parameters; Lanczos may accumulate
        in a wider one)."""
        return max((jnp.result_type(a) for a in jax.tree.leaves(self.params)), key=lambda d: jnp.finfo(d).eps)

    @property
    def like(self) -> PyTree:
        """A vector of the operator's space (its shape, dtype and sharding; values unspecified)."""
        if self.flat:
            return jnp.zeros(tree.size(self.params), self.dtype)
        return tree.astype(self.params, self.dtype)

    def unpack(self, v: PyTree) -> PyTree:
        """A vector of the operator's space as a pytree like ``params`` (leading axes kept)."""
        if not self.flat:
            return v
        unravel = lambda x: tree.unravel(x, self.params)
        for _ in range(v.ndim - 1):
            unravel = jax.vmap(unravel)
        return unravel(v)

    def matvec(self, v: PyTree) -> PyTree:
        """``H v`` (or ``P H P v`` for a block with projector ``P``)."""
        return self.constrain(self.restrict(self._matvec(self.restrict(v))))

    def _matvec(self, v: PyTree) -> PyTree:
        v = tree.cast(tree.unravel(v, self.params) if self.flat else v, self.params)
        if self.groups is None:
            hv = _hvp_one(self.loss, self.mode, self.params, v, self.args)
        elif isinstance(self.groups, Stream):
            zero = tree.scale(jnp.zeros((), self.dtype), tree.astype(v, self.dtype))
            hv = self.groups.scan(
                lambda b: _hvp_one(self.loss, self.mode, self.params, v, b), zero, self.dtype
            )
        else:
            hv = tree.scale(jnp.zeros((), self.dtype), tree.astype(v, self.dtype))
            for stacked, weights in self.groups:

                def body(acc, xs):
                    batch, w = xs
                    h = _hvp_one(self.loss, self.mode, self.params, v, batch)
                    return tree.axpy(w, tree.astype(h, self.dtype), acc), None

                hv, _ = jax.lax.scan(body, hv, (stacked, weights.astype(self.dtype)))
        return tree.ravel(hv, self.dtype) if self.flat else tree.astype(hv, self.dtype)


def make_operator(loss, params, args, data, mode, dtype=None, curvature="hessian") -> Operator:
    """Validates the inputs and builds the :class:`Operator`; ``dtype=None``: the params' dtype."""
    check_mode(mode)
    loss = check_curvature(loss, curvature)
    if data is not None and args:
        raise ValueError(
            f"Pass either one batch as `*args` or a dataset as `data=`, not both; got {len(args)} "
            "positional argument(s) and `data`."
        )
    if isinstance(data, Stream):
        groups, example = data, data.example
    else:
        groups = None if data is None else group_batches(data)
        example = args if groups is None else jax.tree.map(lambda a: a[0], groups[0][0])
    check_loss(loss, params, example)
    if not jax.tree.leaves(params):
        raise ValueError("`params` has no arrays: there is no Hessian to take.")
    if dtype is None:
        dtype = jnp.result_type(*jax.tree.leaves(params))
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`dtype` must be a floating-point dtype, got {dtype}.")
    if dtype == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "`dtype=float64` needs 64-bit JAX: call `jax.config.update('jax_enable_x64', True)` "
            "at start-up, or leave `dtype=None` to accumulate in the parameters' dtype."
        )
    return Operator(loss, params, args, groups, mode, dtype)


def hvp(
    loss: Callable[..., jax.Array],
    params: PyTree,
    v: PyTree,
    *args: Any,
    data: Iterable[Any] | None = None,
    mode: Mode = "fwd_rev",
    curvature: Curvature = "hessian",
) -> PyTree:
    """The Hessian-vector product ``H v`` of ``loss`` with respect to ``params``.

    ``H = d^2 loss(params, *args) / d params^2``. With ``data`` (a list of batches, each a tuple of
    ``*args``) the product is the mean of the per-batch products weighted by batch size, as
    PyHessian computes it: ``H v = sum_b (n_b / N) H_b v``.

    Forward-over-reverse (``mode="fwd_rev"``, ``jax.jvp`` of ``jax.grad``) costs about 2-3
    gradients and no more memory than one. Reverse-over-reverse (``"rev_rev"``) differentiates
    ``<grad, v>`` and works for layers with no forward-mode rule (a ``jax.custom_vjp``), at more
    time and memory. Both pass through :func:`pipejax.pipeline`, its checkpoints and ``jax.jit``.

    Args:
      loss: ``loss(params, *args) -> scalar``.
      params: the point where the Hessian is taken (any pytree of float arrays, e.g. a
        :class:`pipejax.StageParams`).
      v: the vector, a pytree like ``params``.
      *args: one batch, the remaining arguments of ``loss``.
      data: instead of ``*args``, a list of batches; each batch is a tuple of ``*args`` (or one
        argument) whose leaves share a leading batch axis.
      mode: ``"fwd_rev"`` (default) or ``"rev_rev"``.
      curvature: ``"hessian"`` (default), or for a :func:`composite` loss ``"ggn"`` (the
        generalised Gauss-Newton ``J^T H_z J``) or ``"fisher"`` (the empirical Fisher).

    Returns:
      ``H v``, a pytree like ``params`` with its dtypes.

    Raises:
      ValueError: a non-scalar loss, an unknown ``mode``, both ``*args`` and ``data``, a batch
        of ``data`` whose leaves do not share a leading batch axis.
      TypeError: non-float parameters, ``data`` that is an iterator.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pipejax.hessian import hvp
      >>> loss = lambda w, x: jnp.sum((x @ w) ** 2)  # H = 2 x^T x
      >>> x = jnp.array([[1.0, 2.0], [0.0, 1.0]])
      >>> hvp(loss, jnp.zeros(2), jnp.array([1.0, 0.0]), x).tolist()
      [2.0, 4.0]
    """
    check_vector(v, params)  # before the loss runs: a mismatch is shown as both trees
    op = make_operator(loss, params, args, data, mode, curvature=curvature)
    out = reading(op.groups, _hvp_jit, op.loss, op.mode, params, v, args, op.groups, op.dtype)
    return tree.cast(out, params)


def _hvp_impl(loss, mode, params, v, args, groups, dtype):
    return Operator(loss, params, args, groups, mode, dtype).matvec(v)


_hvp_jit = jax.jit(_hvp_impl, static_argnames=("loss", "mode", "dtype"))
