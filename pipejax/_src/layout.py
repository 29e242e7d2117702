"""Flat containers for values of different pytree structures, shapes and dtypes.

In SPMD code every device runs the same program, so the activation a device sends to the next
stage must have one type on every device, although stages differ in what they produce (token ids,
embeddings, logits, ``(h, skip)`` tuples). A :class:`Container` is one flat 1-D buffer per dtype,
as long as the largest demand on that dtype over all layouts it must hold; a value is packed by
writing its flattened leaves at fixed offsets and unpacked by slicing them back out. Both are exact
(no arithmetic) and linear, so autodiff of any order passes through them. Stage parameters use the
same containers, stacked on a leading stage axis, so that each device holds only its own stage's
parameters (padded to the largest stage).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class Layout(NamedTuple):
    """The static type of a pytree of arrays: structure, shapes and dtypes."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, tree: Any) -> Layout:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(
            treedef,
            tuple(tuple(jnp.shape(x)) for x in leaves),
            tuple(_dtype_of(x) for x in leaves),
        )

    def structs(self) -> Any:
        """The layout as a pytree of ``jax.ShapeDtypeStruct``."""
        leaves = [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)

    def demand(self) -> dict[np.dtype, int]:
        """Elements needed per (storage) dtype; typed PRNG keys are stored as their key data."""
        need: dict[np.dtype, int] = {}
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            shape, dtype = _stored(shape, dtype)
            need[dtype] = need.get(dtype, 0) + math.prod(shape)
        return need

    def describe(self) -> str:
        parts = [f"{d.name}{list(s)}" for s, d in zip(self.shapes, self.dtypes, strict=True)]
        return f"{jax.tree.unflatten(self.treedef, parts)}"


class Container(NamedTuple):
    """One flat buffer per dtype, big enough for every layout it was sized for."""

    dtypes: tuple[np.dtype, ...]
    sizes: tuple[int, ...]

    @classmethod
    def for_layouts(cls, layouts: Sequence[Layout]) -> Container:
        need: dict[np.dtype, int] = {}
        for layout in layouts:
            for dtype, n in layout.demand().items():
                need[dtype] = max(need.get(dtype, 0), n)
        dtypes = tuple(sorted(need, key=lambda d: d.name))
        return cls(dtypes, tuple(need[d] for d in dtypes))

    def zeros(self, leading: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros((*leading, n), d) for d, n in zip(self.dtypes, self.sizes, strict=True))

    def nbytes(self) -> int:
        return sum(n * d.itemsize for d, n in zip(self.dtypes, self.sizes, strict=True))

    def pack(self, tree: Any) -> tuple[jax.Array, ...]:
        """The leaves of ``tree``, flattened and concatenated into one zero-padded buffer per dtype.

        Built from ``concatenate`` and ``pad`` only: these accept operands of mixed sharding types
        under an Explicit mesh, where ``dynamic_update_slice`` does not.
        """
        parts: list[list[jax.Array]] = [[] for _ in self.dtypes]
        for leaf in jax.tree.leaves(tree):
            leaf = jnp.asarray(leaf)
            if _is_key(leaf.dtype):
                leaf = jax.random.key_data(leaf)
            parts[self.dtypes.index(np.dtype(leaf.dtype))].append(leaf.reshape(-1))
        buffers = []
        for dtype, size, chunk in zip(self.dtypes, self.sizes, parts, strict=True):
            if not chunk:
                buffers.append(jnp.zeros((size,), dtype))
                continue
            flat = jnp.concatenate(chunk) if len(chunk) > 1 else chunk[0]
            buffers.append(jnp.pad(flat, (0, size - flat.shape[0])) if flat.shape[0] < size else flat)
        return tuple(buffers)

    def unpack(self, buffers: tuple[jax.Array, ...], layout: Layout) -> Any:
        """Reads a value of ``layout`` back out of 1-D ``buffers``."""
        offsets = [0] * len(self.dtypes)
        leaves = []
        for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
            stored_shape, stored = _stored(shape, dtype)
            k = self.dtypes.index(stored)
            n = math.prod(stored_shape)
            leaf = lax.slice_in_dim(buffers[k], offsets[k], offsets[k] + n).reshape(stored_shape)
            if _is_key(dtype):
                leaf = jax.random.wrap_key_data(leaf, impl=dtype._impl)
            leaves.append(leaf)
            offsets[k] += n
        return jax.tree.unflatten(layout.treedef, leaves)


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _dtype_of(x) -> Any:
    """The dtype of a leaf: canonical for numbers, the key type itself for typed PRNG keys."""
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    if _is_key(dtype):
        return dtype
    return np.dtype(jax.dtypes.canonicalize_dtype(jnp.result_type(x)))


def _stored(shape, dtype) -> tuple[tuple[int, ...], np.dtype]:
    """How a leaf is stored in a container: typed PRNG keys as their ``uint32`` key data."""
    if not _is_key(dtype):
        return shape, dtype
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
    return tuple(data.shape), np.dtype(data.dtype)
