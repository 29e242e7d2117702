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

from pipejax._src import compat


class Layout(NamedTuple):
    """The static type of a pytree of arrays: structure, shapes and dtypes.

    ``splits`` (stage parameters only): per leaf, how it is sharded over mesh axes other than the
    stage axis, as ``((dim, axes, size), ...)`` (``size``: the product of the ``axes``' sizes),
    ``()`` for a whole leaf; ``None`` when no leaf is split. See :class:`Container`.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    splits: tuple[tuple[tuple[int, tuple[str, ...], int], ...], ...] | None = None
    weak: tuple[bool, ...] | None = None  # per leaf, weakly typed (a Python scalar's type); None: none

    def leaf_splits(self) -> tuple[tuple[tuple[int, tuple[str, ...], int], ...], ...]:
        return self.splits if self.splits is not None else ((),) * len(self.shapes)

    def leaf_weak(self) -> tuple[bool, ...]:
        return self.weak if self.weak is not None else (False,) * len(self.shapes)

    @classmethod
    def of(cls, tree: Any) -> Layout:
        leaves, treedef = jax.tree.flatten(tree)
        weak = tuple(is_weak(x) for x in leaves)
        return cls(
            treedef,
            tuple(tuple(jnp.shape(x)) for x in leaves),
            tuple(_dtype_of(x) for x in leaves),
            None,
            weak if any(weak) else None,
        )

    def strong(self) -> Layout:
        """The layout with every leaf strongly typed."""
        return self._replace(weak=None)

    def structs(self) -> Any:
        """The layout as a pytree of ``jax.ShapeDtypeStruct`` (weak types included)."""
        leaves = [
            jax.ShapeDtypeStruct(s, d, weak_type=w)
            for s, d, w in zip(self.shapes, self.dtypes, self.leaf_weak(), strict=True)
        ]
        return jax.tree.unflatten(self.treedef, leaves)

    def cast(self, tree: Any) -> Any:
        """``tree`` (of this layout's dtypes, any leading axes) with exactly its weak types."""
        leaves, treedef = jax.tree.flatten(tree)
        leaves = [
            compat.weakly_typed(a) if w else lax.convert_element_type(a, a.dtype)
            for a, w in zip(leaves, self.leaf_weak(), strict=True)
        ]
        return jax.tree.unflatten(treedef, leaves)

    def retype(self, tree: Any) -> Any:
        """``tree`` (of this layout's shapes and dtypes) with this layout's weak types."""
        if self.weak is None:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        leaves = [compat.weakly_typed(a) if w else a for a, w in zip(leaves, self.weak, strict=True)]
        return jax.tree.unflatten(treedef, leaves)

    def demand(self) -> dict[tuple[np.dtype, Any], int]:
        """Elements needed per slot, ``(storage dtype, split)``, per shard of the slot's split;
        typed PRNG keys are stored as their key data."""
        need: dict[tuple[np.dtype, Any], int] = {}
        for shape, dtype, split in zip(self.shapes, self.dtypes, self.leaf_splits(), strict=True):
            shape, dtype = _stored(shape, dtype)
            slot = (dtype, _slot_split(split))
            need[slot] = need.get(slot, 0) + math.prod(shape) // math.prod(t for _, _, t in split)
        return need

    def describe(self) -> str:
        parts = [
            f"{'~' if w else ''}{d.name}{list(s)}"  # `~`: weakly typed, as JAX writes it
            for s, d, w in zip(self.shapes, self.dtypes, self.leaf_weak(), strict=True)
        ]
        return f"{jax.tree.unflatten(self.treedef, parts)}"


class Container(NamedTuple):
    """One flat buffer per dtype, big enough for every layout it was sized for.

    Stage parameters sharded over other mesh axes inside their stage (tensor or FSDP sharding,
    :attr:`Layout.splits`) get a buffer per ``(dtype, split)`` slot, where a split is the tuple
    ``((axes, size), ...)`` of the sharded dimensions: shape ``(size_1, ..., size_k, n)``, sharded
    ``P(axes_1, ..., axes_k)``. A leaf is stored with its sharded dimensions cut into
    ``size`` blocks that lead, so each device's shard of the buffer holds exactly its shards of
    the leaves, and unpacking is a slice, reshapes and transposes that XLA partitions in place.
    ``splits`` is ``None`` when no slot is split.
    """

    dtypes: tuple[np.dtype, ...]
    sizes: tuple[int, ...]
    splits: tuple[tuple[tuple[tuple[str, ...], int], ...], ...] | None = None

    @classmethod
    def for_layouts(cls, layouts: Sequence[Layout]) -> Container:
        need: dict[tuple[np.dtype, Any], int] = {}
        for layout in layouts:
            for slot, n in layout.demand().items():
                need[slot] = max(need.get(slot, 0), n)
        slots = sorted(need, key=lambda k: (k[0].name, k[1]))
        splits = tuple(split for _, split in slots)
        return cls(tuple(d for d, _ in slots), tuple(need[k] for k in slots), splits if any(splits) else None)

    def slot_splits(self) -> tuple[tuple[tuple[tuple[str, ...], int], ...], ...]:
        return self.splits if self.splits is not None else ((),) * len(self.dtypes)

    def slot_shapes(self, leading: tuple[int, ...] = ()) -> tuple[tuple[int, ...], ...]:
        return tuple(
            (*leading, *(t for _, t in split), n)
            for n, split in zip(self.sizes, self.slot_splits(), strict=True)
        )

    def slot_specs(self, leading: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        """The ``PartitionSpec`` of each buffer, with ``leading`` entries for its leading axes."""
        return tuple(
            jax.sharding.PartitionSpec(*leading, *(_axes(a) for a, _ in split))
            for split in self.slot_splits()
        )

    def zeros(self, leading: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
        return tuple(
            jnp.zeros(shape, d) for d, shape in zip(self.dtypes, self.slot_shapes(leading), strict=True)
        )

    def nbytes(self) -> int:
        """Bytes of one row of every buffer on one device (a split slot's shard)."""
        return sum(n * d.itemsize for d, n in zip(self.dtypes, self.sizes, strict=True))

    def _slot(self, dtype, split) -> int:
        return list(zip(self.dtypes, self.slot_splits(), strict=True)).index(
            (np.dtype(dtype), _slot_split(split))
        )

    def pack(self, tree: Any, layout: Layout | None = None) -> tuple[jax.Array, ...]:
        """The leaves of ``tree``, flattened and concatenated into one zero-padded buffer per slot
        (``layout``'s splits say which leaves are split; ``None``: none).

        Built from ``concatenate`` and ``pad`` only: these accept operands of mixed sharding types
        under an Explicit mesh, where ``dynamic_update_slice`` does not.
        """
        leaves = jax.tree.leaves(tree)
        splits = layout.leaf_splits() if layout is not None else ((),) * len(leaves)
        parts: list[list[jax.Array]] = [[] for _ in self.dtypes]
        for leaf, split in zip(leaves, splits, strict=True):
            leaf = jnp.asarray(leaf)
            if _is_key(leaf.dtype):
                leaf = jax.random.key_data(leaf)
            leaf = lax.convert_element_type(leaf, leaf.dtype)  # buffers are strongly typed
            parts[self._slot(leaf.dtype, split)].append(_to_blocks(leaf, split))
        buffers = []
        for dtype, shape, chunk in zip(self.dtypes, self.slot_shapes(), parts, strict=True):
            if not chunk:
                buffers.append(jnp.zeros(shape, dtype))
                continue
            flat = jnp.concatenate(chunk, axis=-1) if len(chunk) > 1 else chunk[0]
            pad = [(0, 0)] * (flat.ndim - 1) + [(0, shape[-1] - flat.shape[-1])]
            buffers.append(jnp.pad(flat, pad) if flat.shape[-1] < shape[-1] else flat)
        return tuple(buffers)

    def unpack(self, buffers: tuple[jax.Array, ...], layout: Layout) -> Any:
        """Reads a value of ``layout`` back out of ``buffers`` (one row of each slot).

        Each slot is cut with one ``lax.split``, whose transpose is one ``concatenate``: the
        backward pass assembles a slot's cotangent in one operation (a slice per leaf would
        transpose to a ``pad`` per leaf and a sum of them, one XLA kernel each).
        """
        wanted = []  # per leaf: (slot, size, stored shape)
        sizes: list[list[int]] = [[] for _ in self.dtypes]
        for shape, dtype, split in zip(layout.shapes, layout.dtypes, layout.leaf_splits(), strict=True):
            stored_shape, stored = _stored(shape, dtype)
            k = self._slot(stored, split)
            n = math.prod(stored_shape) // math.prod(t for _, _, t in split)
            wanted.append((k, len(sizes[k]), stored_shape))
            sizes[k].append(n)
        pieces = []
        for k, buffer in enumerate(buffers):
            if not sizes[k]:
                pieces.append([])
                continue
            rest = buffer.shape[-1] - sum(sizes[k])
            cut = sizes[k] + ([rest] if rest else [])
            parts = lax.split(buffer, cut, axis=buffer.ndim - 1) if len(cut) > 1 else [buffer]
            pieces.append(parts)
        leaves = []
        splits = layout.leaf_splits()
        for (k, j, stored_shape), dtype, split in zip(wanted, layout.dtypes, splits, strict=True):
            leaf = _from_blocks(pieces[k][j], stored_shape, split)
            if _is_key(dtype):
                leaf = jax.random.wrap_key_data(leaf, impl=dtype._impl)
            leaves.append(leaf)
        return layout.retype(jax.tree.unflatten(layout.treedef, leaves))


def _axes(names: tuple[str, ...]) -> Any:
    return names[0] if len(names) == 1 else names


def _slot_split(split) -> tuple[tuple[tuple[str, ...], int], ...]:
    """A leaf's split without its dimensions: the slot it is stored in."""
    return tuple((axes, t) for _, axes, t in split)


def _to_blocks(leaf: jax.Array, split) -> jax.Array:
    """``leaf`` as ``(t_1, ..., t_k, rest)``: block ``[i_1, ..., i_k]`` is the shard the devices
    at those positions of the split axes hold (sharded dimensions cut into ``t`` blocks, in order)."""
    if not split:
        return leaf.reshape(-1)
    dims = [d for d, _, _ in split]
    others = [d for d in range(leaf.ndim) if d not in dims]
    x = jnp.transpose(leaf, dims + others)  # sharded dimensions first
    cut = []
    for d, _, t in split:
        cut += [t, leaf.shape[d] // t]
    x = x.reshape((*cut, *(leaf.shape[d] for d in others)))
    k = len(split)
    x = jnp.transpose(
        x, [2 * i for i in range(k)] + [2 * i + 1 for i in range(k)] + list(range(2 * k, x.ndim))
    )
    return x.reshape((*(t for _, _, t in split), -1))


def _from_blocks(block: jax.Array, shape: tuple[int, ...], split) -> jax.Array:
    """The inverse of :func:`_to_blocks`: ``(t_1, ..., t_k, rest)`` back to a leaf of ``shape``."""
    if not split:
        return block.reshape(shape)
    dims = [d for d, _, _ in split]
    others = [d for d in range(len(shape)) if d not in dims]
    k = len(split)
    x = block.reshape(
        (*(t for _, _, t in split), *(shape[d] // t for d, _, t in split), *(shape[d] for d in others))
    )
    order = []
    for i in range(k):
        order += [i, k + i]
    x = jnp.transpose(x, order + list(range(2 * k, x.ndim)))
    x = x.reshape((*(shape[d] for d in dims), *(shape[d] for d in others)))
    inverse = np.argsort(dims + others)
    return jnp.transpose(x, list(inverse))


def is_weak(x) -> bool:
    """Whether a leaf (array, tracer, ``ShapeDtypeStruct`` or Python scalar) is weakly typed."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(x.weak_type)
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float, complex)):
        return True
    return bool(getattr(jax.typeof(x), "weak_type", False))


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
