"""Memory reports from the compiled program: what a step needs, and what backward keeps."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pipejax._src import checks, compat


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

    Raises:
      TypeError: ``fn`` not callable, ``backward`` not a bool; with ``backward=True``, a first
        argument that is not floating point (``jax.grad`` differentiates with respect to it).
      ValueError: with ``backward=True``, an ``fn`` that does not return a real scalar, or no
        arguments. An error raised by ``fn`` itself, or by JAX differentiating it (a
        ``lax.while_loop`` in reverse mode), keeps its type and gains a note saying what
        ``memory_report`` was doing and that ``backward=False`` measures the forward program.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
      >>> report = pj.memory_report(loss, jnp.ones((4, 4)), jnp.ones((8, 4)))
      >>> [r.shape for r in report.residuals if not r.source.startswith("from the argument")]
      [(8, 4), (8, 4)]
    """
    _check(fn, args, backward)
    program = jax.jit(jax.grad(fn) if backward else fn)
    try:
        analysis = program.lower(*args).compile().memory_analysis()
    except Exception as err:  # fn itself traced (see _check): this is the differentiation failing
        if backward:
            err.add_note(
                "pipejax.memory_report: raised while compiling jax.grad(fn) (backward=True), i.e. "
                "reverse-mode differentiation of fn failed (e.g. a lax.while_loop cannot be "
                "differentiated in reverse mode). Pass backward=False to measure fn's forward program."
            )
        raise
    try:
        saved = compat.saved_residuals(fn, *args)
    except Exception as err:
        err.add_note(
            "pipejax.memory_report: raised while listing the residuals reverse-mode autodiff of fn "
            "saves; fn must be differentiable in reverse mode (no lax.while_loop) for that list."
        )
        raise
    residuals = []
    for aval, source in saved:
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


def _check(fn: Any, args: tuple, backward: Any) -> None:
    """What ``memory_report`` needs, checked by tracing ``fn`` once (no compilation)."""
    checks.check_callable(fn, "fn", "fn(*args)", "memory_report")
    checks.check_bool(backward, "backward", "memory_report")
    structs = jax.tree.map(_struct, args)
    try:
        out = jax.eval_shape(fn, *args)
    except Exception as err:  # the user's own error keeps its type
        err.add_note(f"pipejax.memory_report: raised by fn(*args) with args {structs}.")
        raise
    if not backward:
        return
    if not args:
        raise ValueError(
            "memory_report with backward=True measures jax.grad(fn), which differentiates with respect "
            "to the first argument, but no argument was given. Pass the arguments, or backward=False."
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(structs[0]):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                f"memory_report with backward=True measures jax.grad(fn), which differentiates with "
                f"respect to the first argument, but its leaf {jax.tree_util.keystr(path) or '<root>'} has "
                f"dtype {leaf.dtype}. Pass the floating-point parameters first, or backward=False to "
                "measure fn's forward program."
            )
    scalar = isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
    if not (scalar and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(
            f"memory_report with backward=True measures jax.grad(fn), so fn must return a real scalar "
            f"(a loss), but it returns {out}. Reduce the output (e.g. `jnp.sum(...)`), or pass "
            "backward=False to measure fn itself."
        )


def _struct(a: Any) -> jax.ShapeDtypeStruct:
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # Python scalars
