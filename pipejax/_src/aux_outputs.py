"""Auxiliary outputs of stages (``pipeline(..., aux=...)``): aux losses, router statistics, sown
values, collected per (stage, micro-batch) and returned beside the output.

One channel carries them: the stats channel of stateful stages. A stage of an ``aux`` pipeline
returns ``(y, aux)`` (stateful: ``(y, stats, aux)``); the loops see ``(y, aux)`` (stateful:
``(y, (stats, aux))``) as a stage's output and stats, so both tick loops record ``aux`` per
(stage, micro-batch) where they record stats, only on ticks that run a real micro-batch, with
no mechanism of their own. The pipeline splits the records after the loop (:func:`split`) and
reduces them as ``aux`` says (:func:`reduce`).

The weight of micro-batch ``i`` is ``w_i = n_i / B``: its real rows over the batch size (padding
rows of an uneven last micro-batch do not count). ``aux="mean"`` returns ``sum_i w_i aux_i``,
and a training step's aux loss (:func:`terms`) is ``sum_s sum_i w_i aux_loss(aux_si)``: the
mean over micro-batches for an even split, each micro-batch weighted by its real examples
otherwise, exactly as the main loss weighs examples. With a weighted main loss (``loss_fn``
returns ``(losses, weights)``) it is added to ``sum(losses) / W`` under every schedule; the
training schedules, which divide their sums by ``W`` only at the end, scale each term by ``W``
computed up front (``train._total_weight``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pipejax._src import compat
from pipejax._src.training.loss import check_float_loss

PyTree = Any

MODES = ("stack", "sum", "mean")


def check_mode(aux) -> str | None:
    """``aux`` (``None``, ``"stack"``, ``"sum"`` or ``"mean"``), or a message naming the fix."""
    if aux is None:
        return None
    modes = ", ".join(repr(m) for m in MODES)
    if not isinstance(aux, str):
        raise TypeError(
            f"`aux` must be None (stages return only their output) or one of {modes} (stages "
            f"return `(y, aux)`), but got {type(aux).__name__} {aux!r}."
        )
    if aux not in MODES:
        raise ValueError(
            f"`aux` must be None or one of {modes}, but got {aux!r}: 'stack' returns every "
            "(stage, micro-batch) value, 'sum' their sum over micro-batches, 'mean' their mean "
            "weighted by each micro-batch's real rows."
        )
    return aux


def call(stage, stateful: bool, aux: bool, p, x, key, state, mask, kwargs):
    """``(y, stats)`` of one stage call as the loops see it: with ``aux``, the stats channel
    carries ``aux`` (stateful stages: ``(stats, aux)``)."""
    if stateful:
        out = tuple(stage(p, x, key, state, mask, **kwargs))
    else:
        out = stage(p, x, key, **kwargs)
    if not aux:
        return out if stateful else (out, None)
    if stateful:
        y, stats, a = out
        return y, (stats, a)
    y, a = out
    return y, a


def split_output(out, s: int, stateful: bool, aux: bool):
    """``(y, stats)`` of stage ``s``'s output (shape-inferred), checked against the stage form."""
    if not aux and not stateful:
        return out, None
    want, example = "a pair `(y, stats)`", "`return y, None`"
    if aux:
        want, example = "a pair `(y, aux)`", "`return y, {'loss': aux_loss}`"
        if stateful:
            want, example = "a triple `(y, stats, aux)`", "`return y, None, {'loss': aux_loss}`"
    size = 3 if aux and stateful else 2
    if not isinstance(out, (tuple, list)) or len(out) != size:
        why = "is stateful" if not aux else f"has `aux=` set{' and is stateful' if stateful else ''}"
        raise ValueError(
            f"Stage {s} returned {out!r}, but the pipeline {why}, so every stage must return "
            f"{want}: the activation for the next stage and pytrees of per-micro-batch values "
            f"without the batch axis (None if it has none), e.g. {example}."
        )
    if size == 3:
        return out[0], (out[1], out[2])
    return out[0], out[1]


def split(stats, stateful: bool, aux: bool, kind):
    """The loops' per-stage records -> ``(stats, aux)`` (each ``None`` when off); ``kind``: the
    stage kind (:mod:`pipejax._src.kinds`)."""
    if not aux:
        return stats, None
    if not stateful:
        return None, stats
    return kind.unzip(stats)


def weights(mask: jax.Array, batch: int) -> jax.Array:
    """``f[m]``: ``w_i = n_i / B``, micro-batch ``i``'s real rows over the batch size."""
    return jnp.sum(mask, axis=-1) / batch


def reduce(mode: str, aux, mask: jax.Array, batch: int, kind):
    """The stacked records ``(m, ...)`` per stage (homogeneous: ``(S, m, ...)``) reduced over
    the micro-batches as ``mode`` says (see the module docstring)."""
    if mode == "stack":
        return aux
    aux, mask = compat.replicate((aux, mask))  # a data axis splits the micro-batches (Explicit)
    w = weights(mask, batch)
    axis = kind.micro_axis

    def one(a):
        if mode == "sum":
            return jnp.sum(a, axis=axis)
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            raise TypeError(
                f"`aux='mean'` averages every aux leaf over the micro-batches, but a stage returned "
                f"a leaf of dtype {a.dtype}. Return floating-point aux values (e.g. "
                "`counts.astype(jnp.float32)`), or use `aux='sum'` for counts."
            )
        shape = (1,) * axis + w.shape + (1,) * (a.ndim - axis - 1)
        return jnp.sum(a * w.astype(a.dtype).reshape(shape), axis=axis)

    return jax.tree.map(one, aux)


def check_aux_loss(aux_loss, pipe) -> Callable[[PyTree], jax.Array] | None:
    """``aux_loss`` of ``value_and_grad``: ``None`` or a callable, and only with ``aux=``.

    ``aux_loss(aux)`` takes one (stage, micro-batch)'s aux and returns a float scalar, or
    ``None`` when that stage adds nothing."""
    if aux_loss is None:
        return None
    if not callable(aux_loss):
        raise TypeError(
            "`aux_loss` must be a callable `aux_loss(aux) -> scalar`, applied to the aux of each "
            f"(stage, micro-batch), but got {type(aux_loss).__name__} {aux_loss!r}."
        )
    if pipe.aux is None:
        raise ValueError(
            "`aux_loss` was given, but the pipeline was built without `aux=`, so its stages return "
            "no auxiliary outputs to take a loss of. Build it with `pj.pipeline(..., aux='mean')` "
            "(or 'sum', 'stack') and stages that return `(y, aux)`, or drop `aux_loss`."
        )
    return aux_loss


def term(aux_loss, a, mask: jax.Array, batch: int):
    """``w_i aux_loss(a)`` for one (stage, micro-batch) (``mask``: its ``bool[b]`` rows), or
    ``None`` when ``a`` holds no arrays (a stage without aux outputs adds nothing)."""
    if aux_loss is None or not jax.tree.leaves(a):
        return None
    value = aux_loss(a)
    if value is None:  # nothing to add for this stage
        return None
    if jnp.shape(value) != ():
        raise ValueError(
            f"`aux_loss(aux)` must return a scalar (the aux loss of one stage and micro-batch), but "
            f"returned shape {jnp.shape(value)} for aux {jax.tree.map(jnp.shape, a)}. Reduce it, "
            "e.g. `aux_loss=lambda aux: 0.01 * aux['balance']`."
        )
    check_float_loss(value, "`aux_loss(aux)` returned dtype")
    return value * (jnp.sum(mask) / batch).astype(jnp.result_type(value))


def total(aux_loss, aux, mask: jax.Array, batch: int, kind):
    """``sum_s sum_i w_i aux_loss(aux_si)`` from the stacked records (GPipe's training step);
    ``None`` when no stage has aux outputs."""
    aux, mask = compat.replicate((aux, mask))  # a data axis splits the micro-batches (Explicit)
    out = None
    for a, over in kind.record_groups(aux):  # (S, m, ...) stacked, or (m, ...) per stage
        if not jax.tree.leaves(a):
            continue
        values = over(lambda r, mk: term(aux_loss, r, mk, batch))(a, mask)
        if values is None:
            continue
        value = jnp.sum(values)
        out = value if out is None else out + value
    return out
