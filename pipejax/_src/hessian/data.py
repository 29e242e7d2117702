"""The datasets of ``data=``: a list of batches (grouped by shape and weighted by size) or a
:func:`stream` read from the host during each product, and :func:`reading`, which raises a
stream's own error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks
from pipejax._src.hessian import tree

PyTree = Any


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
