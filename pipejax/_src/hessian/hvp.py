"""Hessian-vector products of ``loss(params, *args)``, on one batch or averaged over a dataset.

Also the checks every entry point of :mod:`pipejax.hessian` shares (a scalar loss, a PRNG key,
counts) and the :class:`Operator` they drive: the HVP of one loss at one point, as a traceable
``matvec`` that Lanczos and the trace estimators call inside one ``lax.fori_loop``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks
from pipejax._src.hessian import tree

PyTree = Any
Mode = Literal["fwd_rev", "rev_rev"]
MODES = ("fwd_rev", "rev_rev")


Curvature = Literal["hessian", "ggn", "fisher"]
CURVATURES = ("hessian", "ggn", "fisher")


class CompositeLoss:
    """``loss(params, *args) = output_loss(outputs(params, *args), *args)``: a loss with its model's
    outputs exposed, so the Gauss-Newton and Fisher matrices can be formed (see :func:`composite`)."""

    def __init__(self, outputs: Callable[..., PyTree], output_loss: Callable[..., jax.Array]):
        if not (callable(outputs) and callable(output_loss)):
            raise TypeError(
                "`composite(outputs, output_loss)` takes two functions, `outputs(params, *args) -> z` "
                f"and `output_loss(z, *args) -> scalar`, got {outputs!r} and {output_loss!r}."
            )
        self.outputs, self.output_loss = outputs, output_loss

    def __call__(self, params: PyTree, *args: Any) -> jax.Array:
        return self.output_loss(self.outputs(params, *args), *args)

    def __eq__(self, other: Any) -> bool:  # a static argument of the compiled programs
        return (
            type(other) is CompositeLoss
            and self.outputs is other.outputs
            and self.output_loss is other.output_loss
        )

    def __hash__(self) -> int:
        return hash((id(self.outputs), id(self.output_loss)))


def composite(outputs: Callable[..., PyTree], output_loss: Callable[..., jax.Array]) -> CompositeLoss:
    """A loss written as ``output_loss(outputs(params, *args), *args)``, for ``curvature="ggn"|"fisher"``.

    The Hessian of such a loss is ``J^T H_z J + sum_i (dL/dz_i) d^2 z_i/dparams^2`` with ``J`` the
    Jacobian of the outputs ``z`` and ``H_z`` the Hessian of ``output_loss`` in ``z``. The
    generalised Gauss-Newton matrix keeps the first term, ``G = J^T H_z J``: positive semi-definite
    whenever ``output_loss`` is convex in ``z`` (softmax cross-entropy, squared error). The
    empirical Fisher is ``F = (1/N) sum_i g_i g_i^T`` with ``g_i`` the gradient of example ``i``'s
    loss; it assumes ``output_loss`` is a mean over the leading (batch) axis of ``z`` of
    per-example terms. Both products cost one linearisation of ``outputs`` and its transpose (no
    second derivative of the model). The result is also an ordinary loss (``curvature="hessian"``).

    Args:
      outputs: ``outputs(params, *args) -> z``, e.g. a model's logits (a pytree whose leaves share
        the leading batch axis, for the Fisher).
      output_loss: ``output_loss(z, *args) -> scalar``, e.g. the mean cross-entropy against labels
        taken from ``args``.

    Returns:
      A callable ``loss(params, *args)`` that every function of :mod:`pipejax.hessian` accepts.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pipejax.hessian import composite, hvp
      >>> loss = composite(lambda w, x: x @ w, lambda z, x: 0.5 * jnp.sum(z**2) + jnp.sum(z**4))
      >>> x = jnp.array([[1.0, 0.0], [1.0, 1.0]])
      >>> hvp(loss, jnp.zeros(2), jnp.array([1.0, 0.0]), x, curvature="ggn").tolist()  # x^T x v
      [2.0, 1.0]

    References:
      Schraudolph, *Fast Curvature Matrix-Vector Products for Second-Order Gradient Descent*,
      Neural Computation 14, 2002. Martens, *New Insights and Perspectives on the Natural Gradient
      Method*, JMLR 21, 2020. Kunstner, Hennig and Balles, *Limitations of the empirical Fisher
      approximation for natural gradient descent*, NeurIPS 2019.
    """
    return CompositeLoss(outputs, output_loss)


class GradientLoss:
    """A loss that brings its own gradient (see :func:`from_value_and_grad`)."""

    def __init__(self, value_and_grad: Callable[..., tuple[jax.Array, PyTree]]):
        if not callable(value_and_grad):
            raise TypeError(
                "`from_value_and_grad` takes a function `value_and_grad(params, *args) -> (loss, "
                f"grads)`, got {value_and_grad!r}."
            )
        self.value_and_grad = value_and_grad

    def _pair(self, params: PyTree, *args: Any) -> tuple[jax.Array, PyTree]:
        out = self.value_and_grad(params, *args)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            if isinstance(out, tuple | list):
                got = f"a {type(out).__name__} of length {len(out)}"
            elif hasattr(out, "shape"):
                got = f"one array of shape {tuple(out.shape)}"
            else:
                got = f"{type(out).__name__} {out!r}"
            raise TypeError(
                "`value_and_grad` of from_value_and_grad must return a pair `(loss, grads)`, with `grads` "
                f"like `params`, but it returned {got}. Pass `jax.value_and_grad(loss)` (or a pipeline's "
                "`value_and_grad`), not the loss itself; for a plain loss, pass it to the functions of "
                "pipejax.hessian directly."
            )
        return out[0], out[1]

    def __call__(self, params: PyTree, *args: Any) -> jax.Array:
        return self._pair(params, *args)[0]

    def grad(self, params: PyTree, *args: Any) -> PyTree:
        return self._pair(params, *args)[1]

    def __eq__(self, other: Any) -> bool:  # a static argument of the compiled programs
        return type(other) is GradientLoss and self.value_and_grad is other.value_and_grad

    def __hash__(self) -> int:
        return hash(id(self.value_and_grad))


def from_value_and_grad(value_and_grad: Callable[..., tuple[jax.Array, PyTree]]) -> GradientLoss:
    """A loss given by a function that computes its gradient itself, for every function here.

    ``value_and_grad(params, *args) -> (loss, grads)``, e.g. what
    :meth:`pipejax.Pipeline.value_and_grad` returns for the ``"1f1b"`` and ``"zb-h1"``
    schedules, whose gradient is not ``jax.grad`` of a forward program. Hessian-vector products
    are then ``jax.jvp`` of that gradient function (``mode="fwd_rev"``) or the gradient of its
    inner product with ``v`` (``"rev_rev"``), so the curvature of a model trained with a
    schedule is computed with the same schedule. Only ``curvature="hessian"`` applies.

    Args:
      value_and_grad: ``value_and_grad(params, *args) -> (loss, grads)``, ``grads`` like ``params``.

    Returns:
      A callable ``loss(params, *args)`` (the value) that :func:`hvp`, :func:`lanczos`,
      :func:`eigenvalues`, :func:`trace` and :func:`density` accept.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.hessian import from_value_and_grad, hvp
      >>> f = jax.value_and_grad(lambda w, x: jnp.sum((x @ w) ** 2))  # H = 2 x^T x
      >>> x = jnp.array([[1.0, 2.0], [0.0, 1.0]])
      >>> hvp(from_value_and_grad(f), jnp.zeros(2), jnp.array([1.0, 0.0]), x).tolist()
      [2.0, 4.0]
    """
    return GradientLoss(value_and_grad)


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


def batch_size(batch: tuple, index: int | None = None, shared: bool = True) -> int:
    """The size of the leading batch axis of ``batch`` (with ``shared``: that every leaf shares)."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    which = "Every batch of `data`" if index is None else f"`data[{index}]`"
    if not leaves or jnp.ndim(leaves[0][1]) == 0:
        raise ValueError(
            f"{which} needs a leading batch axis, to weight the batches by their size; "
            f"got a batch with leaves {[jnp.shape(a) for _, a in leaves]}."
        )
    size = jnp.shape(leaves[0][1])[0]
    for path, leaf in leaves[1:] if shared else ():
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != size:
            raise ValueError(
                f"{which} must hold leaves that share a leading batch axis (its size weights the batch), "
                f"but leaf {jax.tree_util.keystr(leaves[0][0])} has shape {jnp.shape(leaves[0][1])} and leaf "
                f"{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}. Give every argument of a batch "
                "the same number of examples on axis 0; close over arguments that are not per-example "
                "(e.g. `data=[(x, y), ...]` with `lambda w, x, y: loss(w, x, y, temperature)`)."
            )
    return int(size)


def group_batches(data: Iterable[Any]) -> list[tuple[tuple, jax.Array]]:
    """Batches of equal shapes stacked together: ``[(stacked_args, weights), ...]``.

    Each group is scanned over inside the compiled program, so the HVP is traced once per
    distinct batch shape (a dataset with a shorter last batch: twice). The weights are the batch
    sizes divided by the total, so the HVP is the batch-size-weighted mean, as in PyHessian.
    """
    if isinstance(data, tuple) or iter(data) is data:
        raise TypeError(
            f"`data` must be a re-iterable collection of batches (a list), got {type(data).__name__}. "
            "Each HVP runs over all batches, so pass `list(batches)`, or stream them without holding "
            "them: `data=pipejax.hessian.stream(make_iterator, num_batches)`; a batch is a tuple of "
            "the `*args` of `loss`."
        )
    batches = [b if isinstance(b, tuple) else (b,) for b in data]
    if not batches:
        raise ValueError("`data` is empty: pass at least one batch.")
    sizes = [batch_size(b, i) for i, b in enumerate(batches)]
    total = sum(sizes)
    groups: dict[Any, list[int]] = {}
    for i, b in enumerate(batches):
        sig = jax.tree.structure(b), tuple((jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(b))
        groups.setdefault(sig, []).append(i)
    out = []
    for idx in groups.values():
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[batches[i] for i in idx])
        out.append((stacked, jnp.asarray([sizes[i] / total for i in idx])))
    return out


class Stream:
    """Batches read from the host one at a time, inside the compiled loop (see :func:`stream`)."""

    def __init__(self, source: Any, num_batches: int):
        self.source, self.num_batches = source, num_batches
        self.error: Exception | None = None  # what the last fetch raised (see `reading`)
        size = len(source) if hasattr(source, "__len__") else None
        if size is not None and 0 < size < num_batches:
            raise ValueError(
                f"`source` of stream holds {size} batches, fewer than num_batches={num_batches}; pass "
                f"num_batches={size} or a longer source."
            )
        try:
            first = next(self._fresh())
        except StopIteration:
            raise ValueError(
                f"`source` of stream gave no batch: it is empty (num_batches={num_batches}). Pass a "
                "function returning a fresh iterator of batches each time (e.g. `lambda: loader.epoch()`) "
                "or a non-empty re-iterable; a one-shot iterator that was already read is empty."
            ) from None
        self.example = first if isinstance(first, tuple) else (first,)
        self.struct = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), self.example
        )
        batch_size(self.example, shared=False)  # equal weights: only a leading axis is needed
        self._it: Any = None
        self._next = 0

    def _fresh(self):
        return iter(self.source() if callable(self.source) else self.source)

    def _fetch(self, j: np.ndarray) -> Any:
        try:
            return self._read(int(j))
        except Exception as err:  # io_callback wraps it in a runtime error; `reading` re-raises it
            self.error = err
            raise

    def _read(self, j: int) -> Any:
        if j == 0:  # every pass over the dataset (one per product) starts a fresh iterator
            self._it, self._next = self._fresh(), 0
        if j != self._next:
            raise RuntimeError(f"pipejax.hessian.stream: batch {j} requested, batch {self._next} expected.")
        try:
            batch = next(self._it)
        except StopIteration:
            raise ValueError(
                f"`stream` was told num_batches={self.num_batches}, but its source ended after {j} batches. "
                "Pass the number of batches one pass of the source gives, or a source that gives a fresh "
                "iterator on every pass (a function, or a list): each product reads the whole dataset."
            ) from None
        self._next += 1
        batch = batch if isinstance(batch, tuple) else (batch,)
        got = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), batch)
        want = jax.tree.map(lambda s: (s.shape, s.dtype), self.struct)
        if got != want:
            raise ValueError(
                f"Every batch of a `stream` must have the shapes and dtypes of the first, {want}; batch {j} "
                f"has {got}. Drop or pad a shorter last batch."
            )
        return jax.tree.map(np.asarray, batch)

    def scan(self, hvp: Callable[[tuple], PyTree], init: PyTree, dtype: Any) -> PyTree:
        """The mean of ``hvp(batch)`` over the batches, each fetched from the host in turn."""
        weight = jnp.asarray(1 / self.num_batches, dtype)

        def body(acc, j):
            # the fetch depends on the running sum, so XLA runs the fetches in order
            token = jnp.isnan(tree.norm(acc)).astype(j.dtype) * jnp.zeros((), j.dtype)
            batch = jax.experimental.io_callback(self._fetch, self.struct, j + token)
            return tree.axpy(weight, tree.astype(hvp(batch), dtype), acc), None

        return jax.lax.scan(body, init, jnp.arange(self.num_batches, dtype=jnp.int32))[0]


jax.tree_util.register_pytree_node(Stream, lambda s: ((), s), lambda s, _: s)


def reading(groups: Any, program: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``program(*args, **kwargs)``, waited for; when it reads a :class:`Stream` whose source
    failed (ended early, a batch of other shapes), the source's own error is raised, not the
    runtime error that carried it out of the compiled loop."""
    if not isinstance(groups, Stream):
        return program(*args, **kwargs)
    groups.error = None
    try:
        return jax.block_until_ready(program(*args, **kwargs))
    except jax.errors.JaxRuntimeError as err:
        if groups.error is None:
            raise
        raise groups.error from err


def stream(source: Any, num_batches: int) -> Stream:
    """A dataset read batch by batch during each product, for ``data=``: nothing is held in memory.

    Each curvature-vector product is a pass over the whole dataset (``H v = (1/B) sum_b H_b v``
    over ``num_batches`` batches ``B``), and Lanczos makes one pass per step: so the source must
    be readable once per product. ``source`` is a function that returns a fresh iterator of
    batches (e.g. ``lambda: loader.epoch()``), or a re-iterable (a list, a ``tf.data`` dataset);
    a one-shot iterator serves one product only. Inside the compiled loop every batch comes from
    the host by ``jax.experimental.io_callback``, so the HVP is still traced and compiled once.

    Args:
      source: a function returning an iterator of batches, or a re-iterable of batches. A batch
        is a tuple of the ``*args`` of ``loss`` (or one array); every batch has the same shapes
        (drop or pad a shorter last batch: batches are weighted equally).
      num_batches: how many batches one pass reads (the source may hold more: the rest are not read).

    Returns:
      A value for the ``data=`` argument of every function of :mod:`pipejax.hessian`.

    Raises:
      TypeError: ``num_batches`` not an int.
      ValueError: ``num_batches < 1``; an empty source, or one with a length below
        ``num_batches``; while a product runs, a source that ends early or a batch whose shapes
        differ from the first (raised by the function that was given ``data=``, as itself).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.hessian import hvp, stream
      >>> x = jnp.arange(12.0).reshape(6, 2)
      >>> batches = lambda: (x[i : i + 2] for i in range(0, 6, 2))  # 3 batches of 2
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> v = jnp.array([1.0, 0.0])
      >>> streamed = hvp(loss, jnp.zeros(2), v, data=stream(batches, 3))
      >>> bool(jnp.allclose(streamed, hvp(loss, jnp.zeros(2), v, x)))
      True
    """
    num_batches = checks.check_int(num_batches, "num_batches")
    if not (callable(source) or hasattr(source, "__iter__")):
        raise TypeError(
            f"`source` of stream must be a function returning an iterator of batches or a re-iterable, "
            f"got {type(source).__name__}."
        )
    return Stream(source, num_batches)


class Operator:
    """The Hessian of ``loss`` at ``params`` as a traceable matvec.

    ``groups`` is ``None`` for one batch (``args``), or stacked batches with weights (see
    :func:`group_batches`); they are arguments of the compiled program, not constants in it.

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
