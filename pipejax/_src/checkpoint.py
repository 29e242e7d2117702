"""Checkpoint modes of the pipeline: which stage computations are re-materialised in backward.

``"always"``       every stage computation is checkpointed: a device keeps only the activations
                   that enter its stage (one per tick), and recomputes the stage in backward.
``"except_last"``  GPipe/torchgpipe's default. Ticks of the fill phase are checkpointed; the drain
                   phase (the last ``n`` ticks, which include the last micro-batch on every stage)
                   keeps its activations, because its backward starts at once.
``"never"``        plain autodiff: every tick keeps the stage's internal activations.
a policy           a ``jax.checkpoint`` policy (e.g. ``jax.checkpoint_policies.dots_saveable``)
                   applied to every stage computation.

All modes compute bitwise-identical results: recomputation replays the same operations on the
same inputs, including the same PRNG keys (see :mod:`pipejax._src.keys`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from pipejax._src.schedule import Schedule

MODES = ("always", "except_last", "never")

Remat = Callable[[Callable[..., Any]], Callable[..., Any]]


def check_mode(checkpoint: Any) -> None:
    """Raises unless ``checkpoint`` is one of :data:`MODES` or a callable policy."""
    if isinstance(checkpoint, str):
        if checkpoint not in MODES:
            raise ValueError(
                f"`checkpoint` must be one of {', '.join(repr(m) for m in MODES)} or a "
                f"jax.checkpoint policy, but got {checkpoint!r}."
            )
        return
    if not callable(checkpoint):
        raise TypeError(
            f"`checkpoint` must be one of {', '.join(repr(m) for m in MODES)} or a "
            "jax.checkpoint policy such as `jax.checkpoint_policies.dots_saveable`, but got "
            f"{type(checkpoint).__name__} {checkpoint!r}."
        )


def _remat(policy: Any = None) -> Remat:
    # prevent_cse=False: every checkpointed call sits inside lax.scan, where CSE cannot merge the
    # recomputation with the forward pass (jax.checkpoint's docs recommend False there).
    return functools.partial(jax.checkpoint, prevent_cse=False, policy=policy)


def _identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


def phases(checkpoint: Any, schedule: Schedule) -> list[tuple[int, int, Remat]]:
    """Splits the schedule's ticks into ``(start, stop, remat)`` ranges run as separate scans."""
    ticks = schedule.num_ticks
    if checkpoint == "always":
        ranges = [(0, ticks, _remat())]
    elif checkpoint == "never":
        ranges = [(0, ticks, _identity)]
    elif checkpoint == "except_last":
        fill = schedule.fill_ticks
        ranges = [(0, fill, _remat()), (fill, ticks, _identity)]
    else:
        ranges = [(0, ticks, _remat(checkpoint))]
    return [(a, b, r) for a, b, r in ranges if b > a]
