"""The loss contract of ``Pipeline.value_and_grad``, one rule for every schedule.

``loss_fn(outputs, targets)`` returns one loss per example, ``f[batch]`` (the loss is their mean
over the real examples), or a pair ``(losses, weights)`` of per-example sums and weights (the
loss is ``sum(losses) / sum(weights)`` over the mini-batch: per-token sums and token counts of a
padded or packed batch). GPipe and circular apply it to the whole batch; the training schedules
to each micro-batch, adding up the sums and dividing by the mini-batch's total at the end, so
every schedule gives the un-pipelined model's loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pipejax._src import microbatch


def mean_loss(loss_fn, outputs, targets) -> jax.Array:
    """The loss of the whole batch under the loss contract (see :func:`per_example`): the mean of
    the per-example losses, or their sum over the sum of the weights when ``loss_fn`` returns
    ``(losses, weights)``."""
    size = microbatch.batch_size(outputs, name="outputs")
    losses, weights = per_example(loss_fn, outputs, targets, size, size)
    if weights is None:
        return jnp.sum(losses) / losses.shape[0]
    return jnp.sum(losses) / jnp.sum(lax.stop_gradient(weights))


def per_example(loss_fn, outputs, targets, size: int, batch: int):
    """``(losses f[size], weights f[size] or None)``: what ``loss_fn(outputs, targets)`` returned,
    checked against the loss contract.

    ``loss_fn`` returns either one loss per example, ``f[size]`` (the loss is their mean over the
    real examples of the batch), or a pair ``(losses, weights)`` of two ``f[size]`` (the loss is
    ``sum(losses) / sum(weights)`` over the batch: per-token sums and token counts, for example).
    The weights are data: no gradient flows through them. ``size`` is the rows ``loss_fn`` saw
    (a micro-batch under the training schedules), ``batch`` the user's batch (for messages).
    """
    out = loss_fn(outputs, targets)
    weights = None
    if isinstance(out, (tuple, list)) and len(out) == 2:
        out, weights = out
    where = f"one per example of the batch of {batch}: shape ({size},)"
    if size != batch:
        where += (
            f" per call, as `loss_fn` sees the batch of {batch} in micro-batches of {size} "
            "examples under this schedule"
        )
    for name, a in (("losses", out), ("weights", weights)):
        if a is None:
            continue
        if jnp.shape(a) != (size,):
            raise ValueError(
                f"`loss_fn(outputs, targets)` must return {name} {where}, but returned shape "
                f"{jnp.shape(a)}. Return the per-example losses (e.g. `jnp.sum((y - t) ** 2, "
                "axis=-1)`), or a pair `(losses, weights)` of per-example sums and weights, not a "
                "mean: the pipeline divides by the batch's total (its size, or the sum of the "
                "weights), padding rows excluded."
            )
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            raise TypeError(
                f"`loss_fn(outputs, targets)` returned {name} of dtype {jnp.result_type(a)}, but a "
                "loss must be floating point to have a gradient (every schedule refuses integer and "
                "boolean losses). Return a float loss, e.g. cast with `.astype(jnp.float32)`."
            )
    return out, weights


def check_float_params(params) -> None:
    """Every schedule differentiates every parameter leaf, so each must be floating point (the
    rule of ``jax.grad``, which GPipe's backward applies; one message for every schedule)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"`params` leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}, but "
                "`value_and_grad` differentiates every parameter, so every leaf must be floating "
                "point (`jax.grad`'s rule, under every schedule). Make it a float (e.g. `2.0`, "
                "`jnp.asarray(p, jnp.float32)`), or move integer constants out of `params` (into "
                "the stage function, or `context=`)."
            )


def check_targets(targets, batch: int) -> None:
    """``targets`` must have ``x``'s batch (one check for every schedule)."""
    t_size = microbatch.batch_size(targets, name="targets")
    if t_size != batch:
        raise ValueError(
            f"`targets` has a batch of {t_size} examples but `x` has {batch}; `loss_fn` pairs each "
            "output row with its target row (and the training schedules cut targets into "
            "micro-batches with `x`), so the leaves of `targets` need `x`'s leading batch axis."
        )
