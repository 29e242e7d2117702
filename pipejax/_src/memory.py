"""Memory reports from the compiled program: what a step needs, and what backward keeps."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from pipejax._src import compat


class Residual(NamedTuple):
    """One value that reverse-mode autodiff saves for the backward pass."""

    shape: tuple[int, ...]
    dtype: Any  # numpy dtype, or JAX's key dtype for PRNG keys
    nbytes: int
    source: str  # where it comes from: "from the argument w", "output of tanh from file:line"


class MemoryReport(NamedTuple):
    """Memory of a compiled program (bytes, per device for SPMD programs) and its residuals."""

    temp_bytes: int  # XLA temporaries: activations kept for backward live here
    argument_bytes: int
    output_bytes: int
    residuals: tuple[Residual, ...]  # what autodiff of `fn` saves, arguments included

    @property
    def residual_bytes(self) -> int:
        """Bytes of the saved residuals that are not arguments of ``fn``."""
        return sum(r.nbytes for r in self.residuals if not r.source.startswith("from the argument"))

    def __str__(self) -> str:
        lines = [
            f"temp      {self.temp_bytes:>14,} bytes",
            f"arguments {self.argument_bytes:>14,} bytes",
            f"outputs   {self.output_bytes:>14,} bytes",
            f"residuals {self.residual_bytes:>14,} bytes in {len(self.residuals)} values:",
        ]
        lines += [
            f"  {getattr(r.dtype, 'name', r.dtype)}{list(r.shape)} {r.nbytes:,} bytes {r.source}"
            for r in self.residuals
        ]
        return "\n".join(lines)


def memory_report(fn: Callable[..., Any], *args: Any, backward: bool = True) -> MemoryReport:
    """Compiles ``fn`` and reports its memory, from XLA's compiled memory analysis.

    With ``backward=True`` (the default) ``fn`` must return a scalar (a loss) and the program
    measured is a training step's, ``jax.jit(jax.grad(fn))``; ``backward=False`` measures
    ``jax.jit(fn)``. ``residuals`` always lists what reverse-mode autodiff of ``fn`` saves for the
    backward pass, with shapes and sources: checkpointing shows up as fewer, smaller residuals.

    On CPU the numbers are deterministic, so they compare checkpoint modes, ``chunks`` or
    partitions exactly; for a ``shard_map`` program (a pipeline on a mesh) they are per device.

    Args:
      fn: the function to measure, e.g. ``lambda p, x: loss(pipe(p, x))``.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      backward: measure ``jit(grad(fn))`` (True) or ``jit(fn)`` (False).

    Returns:
      A :class:`MemoryReport`; ``print(report)`` gives a table.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
      >>> report = pj.memory_report(loss, jnp.ones((4, 4)), jnp.ones((8, 4)))
      >>> [r.shape for r in report.residuals if not r.source.startswith("from the argument")]
      [(8, 4), (8, 4)]
    """
    program = jax.jit(jax.grad(fn) if backward else fn)
    analysis = program.lower(*args).compile().memory_analysis()
    residuals = []
    for aval, source in compat.saved_residuals(fn, *args):
        shape = tuple(getattr(aval, "shape", ()))
        dtype = aval.dtype  # a numpy dtype, or an extended one (PRNG keys)
        itemsize = getattr(dtype, "itemsize", 0)
        residuals.append(Residual(shape, dtype, math.prod(shape) * itemsize, source))
    return MemoryReport(
        temp_bytes=int(analysis.temp_size_in_bytes),
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        residuals=tuple(residuals),
    )
