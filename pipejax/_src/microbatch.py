"""Micro-batching: cut a pytree batch into micro-batches along axis 0, and merge them back.

A batch of ``B`` examples and ``chunks`` requested micro-batches gives micro-batches of
``b = ceil(B / chunks)`` examples, and ``m = ceil(B / b) <= chunks`` of them (the counts
``torch.chunk`` gives). The last micro-batch is completed with ``m * b - B < b`` padding rows
that copy the batch's last example, so that a stage never sees values it was not written for
(zeros would make ``log``/``sqrt`` stages produce ``inf``, and ``0 * inf = nan`` in the backward
pass). Padding rows are dropped again by :func:`merge`, so they receive zero cotangents and never
contribute to gradients. :func:`split` also returns a mask of the real rows for stages that
compute statistics over the micro-batch.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks


class Plan(NamedTuple):
    """How a batch is cut. All fields are Python ints, fixed at trace time."""

    batch: int  # B, examples in the mini-batch
    num_micro: int  # m, micro-batches actually run (<= chunks)
    micro_size: int  # b, examples per micro-batch
    padding: int  # m * b - B, copied rows appended to the last micro-batch


_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, int, float, complex)


def batch_size(x: Any, *, name: str = "x") -> int:
    """The shared leading-axis size of the leaves of ``x``; raises if they disagree."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(x)
    if not leaves:
        raise ValueError(
            f"`{name}` has no array leaves (got {x!r}). Pass an array or a pytree of arrays "
            "whose leaves share a leading batch axis."
        )
    sizes = {}
    for path, leaf in leaves:
        if not isinstance(leaf, _ARRAYS):
            raise TypeError(
                f"`{name}` leaf {jax.tree_util.keystr(path) or '<root>'} is {type(leaf).__name__} "
                f"{leaf!r}; `{name}` must be an array or a pytree of arrays whose leaves share a "
                "leading batch axis (e.g. `{'mask': mask}` with `mask.shape == (batch, ...)`)."
            )
        shape = jnp.shape(leaf)
        if len(shape) == 0:
            raise ValueError(
                f"`{name}` leaf {jax.tree_util.keystr(path) or '<root>'} is a scalar; every leaf "
                "needs a leading batch axis. Add one (e.g. `x[None]`) or move the value into the "
                "stage parameters."
            )
        sizes[jax.tree_util.keystr(path) or "<root>"] = shape[0]
    if len(set(sizes.values())) != 1:
        listing = ", ".join(f"{p}: {n}" for p, n in sizes.items())
        raise ValueError(
            f"The leaves of `{name}` must share the leading batch axis, but their sizes differ "
            f"({listing}). Give every leaf the same number of examples along axis 0."
        )
    (size,) = set(sizes.values())
    if size == 0:
        raise ValueError(f"`{name}` has an empty batch (leading axis 0); pass at least one example.")
    return size


def check_side_batch(context: Any, batch: int) -> None:
    """Side inputs (``context=``) are cut into micro-batches with ``x``: they need its batch."""
    size = batch_size(context, name="context")
    if size != batch:
        raise ValueError(
            f"`context` has a batch of {size} examples but `x` has {batch}; side inputs "
            "are cut into micro-batches with `x`, so their leaves need `x`'s leading batch "
            "axis (one row per example)."
        )


def plan(batch: int, chunks: int) -> Plan:
    """The micro-batch plan for ``batch`` examples and ``chunks`` requested micro-batches.

    >>> plan(10, 4)
    Plan(batch=10, num_micro=4, micro_size=3, padding=2)
    """
    batch = checks.count(batch, "batch", what="the examples in the mini-batch")
    chunks = checks.count(chunks, "chunks", what="the number of micro-batches per mini-batch")
    micro_size = math.ceil(batch / chunks)
    num_micro = math.ceil(batch / micro_size)
    return Plan(batch, num_micro, micro_size, num_micro * micro_size - batch)


def split(x: Any, chunks: int) -> tuple[Any, jax.Array, Plan]:
    """Cuts ``x`` into micro-batches.

    Returns:
      ``(xs, mask, plan)``: ``xs`` has the structure of ``x`` with leaves of shape
      ``(m, b, *rest)``; ``mask`` is a ``bool[m, b]`` array, ``True`` on real examples.
    """
    p = plan(batch_size(x), chunks)
    return cut(x, p), row_mask(p), p


def cut(x: Any, p: Plan) -> Any:
    """Cuts ``x`` (whose batch is ``p.batch``) into micro-batches as ``p`` says: leaves ``(m, b,
    *rest)``, the last micro-batch padded with copies of the last row."""

    def one(leaf):
        leaf = jnp.asarray(leaf)
        if p.padding:
            fill = jnp.repeat(leaf[-1:], p.padding, axis=0)
            leaf = jnp.concatenate([leaf, fill], axis=0)
        return leaf.reshape((p.num_micro, p.micro_size, *leaf.shape[1:]))

    return jax.tree.map(one, x)


def row_mask(p: Plan) -> jax.Array:
    """``bool[m, b]``: ``True`` on the real examples of the micro-batches, ``False`` on padding."""
    return (jnp.arange(p.num_micro * p.micro_size) < p.batch).reshape(p.num_micro, p.micro_size)


def merge(ys: Any, p: Plan) -> Any:
    """Inverse of :func:`split`: ``(m, b, *rest)`` leaves back to ``(B, *rest)``, padding dropped."""
    if not isinstance(p, Plan):
        raise TypeError(
            f"`p` must be the Plan that `split` returned (or `plan(batch, chunks)`), but got "
            f"{type(p).__name__} {p!r}."
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(ys)[0]:
        if tuple(jnp.shape(leaf)[:2]) != (p.num_micro, p.micro_size):
            raise ValueError(
                f"`ys` leaf {jax.tree_util.keystr(path) or '<root>'} has shape {jnp.shape(leaf)}, but "
                f"the plan cuts a batch of {p.batch} into {p.num_micro} micro-batches of "
                f"{p.micro_size}, so every leaf needs the leading axes ({p.num_micro}, "
                f"{p.micro_size}). Merge with the plan that `split` returned for these "
                f"micro-batches (`plan(batch, chunks)` of their batch)."
            )

    def join(leaf):
        return leaf.reshape((p.num_micro * p.micro_size, *leaf.shape[2:]))[: p.batch]

    return jax.tree.map(join, ys)
