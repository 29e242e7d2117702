"""Stage parameters laid out so that each device holds only its own stage's parameters.

Homogeneous stages already have this layout: every parameter leaf is stacked on a leading stage
axis, which a mesh shards with ``P(axis_name)``. Heterogeneous stages have a different parameter
tree per stage, so :class:`StageParams` packs each stage's leaves into one flat buffer per dtype
(see :mod:`pipejax._src.containers`) and stacks the stages: ``buffers[k]`` has shape
``(num_stages, size_k)`` and is sharded along the stage axis. A device then stores
``sum_k size_k * itemsize_k`` bytes, where ``size_k`` is the largest stage's demand on dtype ``k``:
its own stage's parameters, padded to the largest stage.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pipejax._src import compat
from pipejax._src.containers import Container, Layout


def per_stage(tree):
    """Heterogeneous stage parameters as a per-stage list: a StageParams unpacked, another form
    as it is."""
    return tree.unpack() if isinstance(tree, StageParams) else tree


@jax.tree_util.register_pytree_node_class
class StageParams:
    """Heterogeneous stage parameters, packed and stacked on a leading stage axis.

    A pytree whose leaves are the packed buffers, so ``jax.grad`` returns gradients of the same
    type and optax updates it in place of the per-stage list. Make one with
    :meth:`pipejax.Pipeline.place`; read it back with :meth:`unpack`.
    """

    def __init__(self, buffers: tuple[jax.Array, ...], container: Container, layouts: tuple[Layout, ...]):
        self.buffers = tuple(buffers)  # one (num_stages, size_k) array per dtype of `container`
        # (or (repeats, n, size_k), stage r n + d at [r, d], as a circular pipeline places them)
        self.container = container
        self.layouts = layouts  # one Layout per stage

    def tree_flatten(self):
        return self.buffers, (self.container, self.layouts)

    @classmethod
    def tree_unflatten(cls, aux, buffers):
        return cls(tuple(buffers), *aux)

    @property
    def num_stages(self) -> int:
        return len(self.layouts)

    def stage(self, s: int) -> Any:
        """The parameter pytree of stage ``s``.

        Buffers laid out for the circular schedule, ``(repeats, n, size)``, hold stage ``s`` at
        ``[s // n, s % n]``.
        """
        s = stage_index(s, self.num_stages)
        buffers = compat.replicate(self.buffers)
        rows = tuple(
            b[s] if not major else b[s // b.shape[1], s % b.shape[1]]
            for b, major in zip(buffers, self.device_major(), strict=True)
        )
        return self.container.unpack(rows, self.layouts[s])

    def unpacked_structs(self) -> list[Any]:
        """The per-stage parameter pytrees' shapes and dtypes (``jax.ShapeDtypeStruct``)."""
        return [layout.structs() for layout in self.layouts]

    def device_major(self) -> tuple[bool, ...]:
        """Per buffer, whether it is laid out ``(repeats, n, ...)`` (circular) or ``(S, ...)``."""
        return tuple(
            jnp.ndim(b) == len(shape) + 2
            for b, shape in zip(self.buffers, self.container.slot_shapes(), strict=True)
        )

    def unpack(self) -> list[Any]:
        """The per-stage parameter pytrees, as a list."""
        return [self.stage(s) for s in range(self.num_stages)]

    def bytes_per_stage(self) -> int:
        """Bytes of one stage's row: what each device stores."""
        return self.container.nbytes()

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{b.dtype}{list(b.shape)}" if hasattr(b, "shape") and hasattr(b, "dtype") else repr(b)
            for b in self.buffers
        )
        return f"StageParams(num_stages={self.num_stages}, buffers=({shapes}))"


def stage_index(s: Any, num_stages: int, name: str = "s") -> int:
    """``s`` as a stage index in ``[0, num_stages)`` (negative counts from the end), or a clear error.

    JAX clamps out-of-range indices of traced arrays silently, so they are checked here.
    """
    if isinstance(s, bool):
        index = None
    else:
        try:
            index = operator.index(s)
        except TypeError:
            index = None
    if index is None:
        raise TypeError(f"`{name}` must be an int stage index, but got {type(s).__name__} {s!r}.")
    if not -num_stages <= index < num_stages:
        raise IndexError(
            f"`{name}` is {index}, but there are {num_stages} stages: a stage index lies in "
            f"[0, {num_stages - 1}] (or [-{num_stages}, -1] from the end)."
        )
    return index % num_stages


def pack(params: Sequence[Any], splits: Sequence[Any] | None = None) -> StageParams:
    """Packs a list of per-stage parameter pytrees into a :class:`StageParams`.

    ``splits``: per stage, the leaves' splits over the non-stage mesh axes (:func:`leaf_splits`);
    ``None``: no leaf is split.
    """
    params = [jax.tree.map(jnp.asarray, p) for p in params]
    layouts = tuple(Layout.of(p) for p in params)
    if splits is not None:
        layouts = tuple(
            lay._replace(splits=sp) if any(sp) else lay for lay, sp in zip(layouts, splits, strict=True)
        )
    container = Container.for_layouts(layouts)
    rows = [container.pack(p, lay) for p, lay in zip(params, layouts, strict=True)]
    buffers = tuple(jnp.stack([row[k] for row in rows]) for k in range(len(container.dtypes)))
    return StageParams(buffers, container, layouts)


def leaf_splits(specs: Any, params: Any, mesh: Any, axis_name: str, where: str = "specs") -> tuple[Any, ...]:
    """Per leaf of ``params`` (one stage's pytree), its split over the non-stage mesh axes.

    ``specs`` is a pytree prefix of ``params`` whose leaves are ``PartitionSpec`` (one entry per
    leading dimension of the parameter, without the stage axis) or ``None`` (whole). Returns, per
    leaf, ``((dim, axes, size), ...)`` for its sharded dimensions, or a clear error.
    """
    is_spec = lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec)
    try:
        per_leaf = jax.tree.leaves(jax.tree.broadcast(specs, params, is_leaf=is_spec), is_leaf=is_spec)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"`{where}` must be a pytree prefix of the stage's parameters whose leaves are "
            "`PartitionSpec`s (or None for a whole leaf); its structure does not match the "
            f"parameters': {err}"
        ) from None
    sizes = dict(mesh.shape)
    paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    out = []
    for spec, leaf, path in zip(per_leaf, jax.tree.leaves(params), paths, strict=True):
        if not is_spec(spec):
            raise TypeError(
                f"`{where}` for parameter {path} is {spec!r}; each entry must be a "
                "`jax.sharding.PartitionSpec` over the mesh axes other than the stage axis, or None."
            )
        shape = jnp.shape(leaf)
        entries = tuple(spec) if spec is not None else ()
        if len(entries) > len(shape):
            raise ValueError(
                f"`{where}` gives parameter {path} of shape {shape} the spec {spec}, with more "
                f"entries than the parameter has dimensions ({len(shape)}); a spec names the "
                "sharding of one stage's parameter, without the stage axis."
            )
        split, used = [], set()
        for dim, entry in enumerate(entries):
            if entry is None:
                continue
            axes = (entry,) if isinstance(entry, str) else tuple(entry)
            for a in axes:
                if a not in sizes:
                    raise ValueError(
                        f"`{where}` shards parameter {path} over {a!r}, which is not an axis of the "
                        f"mesh {sizes}. Name one of {sorted(set(sizes) - {axis_name})}."
                    )
                if a == axis_name:
                    raise ValueError(
                        f"`{where}` shards parameter {path} over the stage axis {a!r}; the pipeline "
                        "already shards every parameter over it by stage. Give only the other axes "
                        f"(e.g. {sorted(set(sizes) - {axis_name}) or ['model']})."
                    )
                if a in used:
                    raise ValueError(f"`{where}` uses mesh axis {a!r} twice in the spec {spec} of {path}.")
                used.add(a)
            t = 1
            for a in axes:
                t *= sizes[a]
            if shape[dim] % t:
                raise ValueError(
                    f"`{where}` shards dimension {dim} of parameter {path} (shape {shape}) over "
                    f"{axes} ({t} devices), which does not divide {shape[dim]}. Pad the parameter "
                    "or shard another dimension."
                )
            if t > 1:
                split.append((dim, axes, t))
        out.append(tuple(split))
    return tuple(out)
