"""Checkpoint modes of the pipeline: which stage computations are re-materialised in backward.

``"always"``       every stage computation is checkpointed: a device keeps only the activations
                   that enter its stage (one per tick), and recomputes the stage in backward.
``"except_last"``  GPipe/torchgpipe's default. The first ``m - 1`` ticks are checkpointed; the last
                   ``n`` ticks (the drain, which include the last micro-batch on every stage)
                   keep their activations, because their backward starts at once.
``"never"``        no recomputation once the pipeline is full: ticks ``n - 1`` onwards keep the
                   stage's internal activations. The first ``n - 1`` ticks are checkpointed all
                   the same (see :func:`phases` for why).
a policy           a ``jax.checkpoint`` policy (e.g. ``jax.checkpoint_policies.dots_saveable``)
                   applied to every stage computation from tick ``n - 1`` on; the first ``n - 1``
                   ticks are fully checkpointed.

All modes compute bitwise-identical results: recomputation replays the same operations on the
same inputs, including the same PRNG keys (see :mod:`pipejax._src.keys`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

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


class Phase(NamedTuple):
    """A range of ticks run as one ``lax.scan``."""

    start: int
    stop: int
    remat: Remat  # how each stage computation is wrapped
    skip_bubbles: bool  # True: bubble ticks run no stage (lax.cond); False: every tick computes


def phases(checkpoint: Any, schedule: Schedule) -> list[Phase]:
    """Splits the schedule's ticks into phases, each run as a separate ``lax.scan``.

    Two facts of JAX shape this. (1) A stage that has not yet received its first micro-batch
    (ticks ``t < s``) has no valid input, so those ticks must skip the stage with ``lax.cond``.
    (2) Reverse-mode autodiff of a ``lax.cond`` saves the cond's operands that the backward pass
    needs -- the stage parameters among them -- as per-tick outputs, so an un-checkpointed cond in
    a scan stores the parameters once per tick. So the first ``n - 1`` ticks (the only ones where a
    stage can be unfilled) always run the cond under full checkpointing, whose saved inputs are
    loop-invariant and hoisted out of the scan; later ticks that are not fully checkpointed run
    every stage without a cond. There a stage with no micro-batch recomputes on a real input (stage
    0 re-reads micro-batch 0; a later stage reads what its predecessor last produced, itself real),
    so it still sees only values it was written for, and its output is discarded. On a mesh those
    ticks are ones the device would idle anyway; with ``mesh=None`` they cost ``n (n - 1) / 2``
    extra stage executions per call.

    Every mode cuts the ticks at the same places -- ``n - 1`` and ``max(m, n) - 1`` -- and differs
    only in how each phase computes. The backward pass sums each phase's parameter cotangents
    separately, so equal cuts make those floating-point sums, and hence the gradients, bitwise
    identical across modes.
    """
    n, m, ticks = schedule.num_stages, schedule.num_micro, schedule.num_ticks
    fill = min(n - 1, ticks)  # ticks before this one may have unfilled stages
    drain = max(m, n) - 1  # "except_last" keeps the activations of the ticks from here on
    full, plain = _remat(), _identity
    if checkpoint == "always":
        kinds = [(full, True), (full, True), (full, True)]
    elif checkpoint == "never":
        kinds = [(full, True), (plain, False), (plain, False)]
    elif checkpoint == "except_last":
        kinds = [(full, True), (full, True), (plain, False)]
    else:
        policy = _remat(checkpoint)
        kinds = [(full, True), (policy, False), (policy, False)]
    cuts = [0, fill, drain, ticks]
    bounds = itertools.pairwise(cuts)
    ranges = [Phase(a, b, remat, skip) for (a, b), (remat, skip) in zip(bounds, kinds, strict=True)]
    return [p for p in ranges if p.stop > p.start]
