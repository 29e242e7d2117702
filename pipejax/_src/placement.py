"""Stage parameters laid out so that each device holds only its own stage's parameters.

Homogeneous stages already have this layout: every parameter leaf is stacked on a leading stage
axis, which a mesh shards with ``P(axis_name)``. Heterogeneous stages have a different parameter
tree per stage, so :class:`StageParams` packs each stage's leaves into one flat buffer per dtype
(see :mod:`pipejax._src.layout`) and stacks the stages: ``buffers[k]`` has shape
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
from pipejax._src.layout import Container, Layout


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
        rows = tuple(b[s] if b.ndim == 2 else b[s // b.shape[1], s % b.shape[1]] for b in buffers)
        return self.container.unpack(rows, self.layouts[s])

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


def pack(params: Sequence[Any]) -> StageParams:
    """Packs a list of per-stage parameter pytrees into a :class:`StageParams`."""
    params = [jax.tree.map(jnp.asarray, p) for p in params]
    layouts = tuple(Layout.of(p) for p in params)
    container = Container.for_layouts(layouts)
    rows = [container.pack(p) for p in params]
    buffers = tuple(jnp.stack([row[k] for row in rows]) for k in range(len(container.dtypes)))
    return StageParams(buffers, container, layouts)
