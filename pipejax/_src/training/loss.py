"""The loss contract of ``Pipeline.value_and_grad``, one rule for every schedule.

``loss_fn(outputs, targets)`` returns either

* one loss per example, ``f[batch]``: the loss is their mean over the real examples; or
* :class:`LossSums` ``(sums, weights)`` (or a plain pair): per-example loss sums and what each
  example adds to the divisor; the loss is ``sum(sums) / sum(weights)`` over the mini-batch
  (per-token sums and token counts of a padded or packed batch). The weights only normalise:
  they do not multiply the sums. For a weighted mean of per-example losses, return
  :func:`weighted_mean` ``(losses, weights)``, which multiplies first.

GPipe and circular apply it to the whole batch; the training schedules to each micro-batch,
adding up the sums and dividing by the mini-batch's total at the end, so every schedule gives the
un-pipelined model's loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pipejax._src import microbatch


class LossSums(NamedTuple):
    """A loss given as sums and a divisor: ``loss = sum(sums) / sum(weights)`` over the batch.

    What ``loss_fn(outputs, targets)`` returns for a loss normalised by something other than
    the number of examples: each example's summed loss and the weight it adds to the divisor,
    e.g. a sequence's summed token losses and its number of real tokens, which gives the mean
    loss per token of the whole mini-batch under every schedule (a mean inside each micro-batch
    would not). ``weights`` only normalise: an example of weight 0 whose sum is not 0 still adds
    its sum. To weight per-example losses (a weighted mean), use :func:`weighted_mean`.

    The weights are data: no gradient flows through them, and integer or boolean weights (token
    counts, masks) are cast to the sums' dtype. A batch whose weights add up to 0 has no loss
    (``0 / 0``): the step returns NaN (or an infinite loss with nonzero sums) and NaN or
    infinite gradients, as ``jnp.sum(sums) / jnp.sum(weights)`` would.

    Examples:
      >>> import jax.numpy as jnp
      >>> import pipejax as pj
      >>> def token_loss(logits, t):  # t: (labels int[b, L], mask bool[b, L])
      ...     labels, mask = t
      ...     nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
      ...     return pj.LossSums(jnp.sum(nll * mask, axis=-1), jnp.sum(mask, axis=-1))
    """

    sums: jax.Array  # f[b]: each example's summed loss (any weighting already applied)
    weights: jax.Array  # f[b] (or int / bool): what each example adds to the divisor


def weighted_mean(losses: jax.Array, weights: jax.Array) -> LossSums:
    """The weighted mean ``sum(w * l) / sum(w)`` of per-example losses, as :class:`LossSums`.

    Return it from ``loss_fn`` when each example's loss counts with a weight (rows of weight 0
    drop out). A plain pair ``(losses, weights)`` means ``sum(l) / sum(w)`` instead: the weights
    there only normalise.

    Args:
      losses: ``f[b]``, one loss per example.
      weights: ``[b]``, one weight per example (float, int or bool; no gradient flows through it).

    Returns:
      ``LossSums(losses * w, w)``, ``w`` the weights in the losses' dtype.

    Raises:
      TypeError: ``losses`` not a floating array, ``weights`` not numeric.
      ValueError: the shapes are not both ``(b,)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import pipejax as pj
      >>> pj.weighted_mean(jnp.array([1.0, 3.0], jnp.float32), jnp.array([1, 0]))
      LossSums(sums=Array([1., 0.], dtype=float32), weights=Array([1., 0.], dtype=float32))
    """
    losses, weights = _array("losses", losses, "weighted_mean"), _array("weights", weights, "weighted_mean")
    check_float_loss(losses, "`weighted_mean(losses, weights)`: `losses` has dtype")
    if jnp.ndim(losses) != 1 or jnp.shape(weights) != jnp.shape(losses):
        raise ValueError(
            f"`weighted_mean(losses, weights)` takes one loss and one weight per example, two arrays "
            f"of shape (b,), but got losses of shape {jnp.shape(losses)} and weights of shape "
            f"{jnp.shape(weights)}. Reduce each example's loss over its other axes first (e.g. "
            "`jnp.sum(..., axis=-1)`)."
        )
    w = lax.stop_gradient(_numeric_weights(weights, losses.dtype, "`weighted_mean(losses, weights)`"))
    return LossSums(losses * w, w)


def check_float_loss(value, what: str) -> None:
    """Raises unless ``value`` is floating point: the one rule for every loss (``loss_fn``'s, an
    aux loss, ``weighted_mean``'s); ``what`` says whose, up to its dtype."""
    dtype = jnp.result_type(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{what} {dtype}, but a loss must be floating point to have a gradient (every schedule "
            "refuses integer and boolean losses). Return a float loss, e.g. cast with "
            "`.astype(jnp.float32)`."
        )


def mean_loss(loss_fn, outputs, targets) -> jax.Array:
    """The loss of the whole batch under the loss contract (see :func:`per_example`): the mean of
    the per-example losses, or their sum over the sum of the weights when ``loss_fn`` returns
    ``(sums, weights)``."""
    size = microbatch.batch_size(outputs, name="outputs")
    losses, weights = per_example(loss_fn, outputs, targets, size, size)
    if weights is None:
        return jnp.sum(losses) / losses.shape[0]
    return jnp.sum(losses) / jnp.sum(lax.stop_gradient(weights))


_CONTRACT = (
    "Return one loss per example (e.g. `jnp.sum((y - t) ** 2, axis=-1)`), or `pj.LossSums(sums, "
    "weights)` (a pair) of per-example loss sums and the weights that divide their total (e.g. "
    "token counts); for a weighted mean of per-example losses return `pj.weighted_mean(losses, "
    "weights)`."
)


def per_example(loss_fn, outputs, targets, size: int, batch: int):
    """``(losses f[size], weights f[size] or None)``: what ``loss_fn(outputs, targets)`` returned,
    checked against the loss contract (see the module); weights come in the losses' dtype.

    ``size`` is the rows ``loss_fn`` saw (a micro-batch under the training schedules), ``batch``
    the user's batch (for messages).
    """
    out = loss_fn(outputs, targets)
    weights = None
    if isinstance(out, (tuple, list)):
        kind = type(out).__name__
        # `(losses, None)`: no weights (a mean), as one array alone
        if len(out) != 2 or not (_is_array(out[0]) and (out[1] is None or _is_array(out[1]))):
            what = ", ".join(_describe(a) for a in out) or "nothing"
            raise TypeError(
                f"`loss_fn(outputs, targets)` returned a {kind} of {len(out)} ({what}), but a "
                f"{kind} is read as a pair `(sums, weights)` of two arrays (make a list an array "
                f"with `jnp.asarray`). {_CONTRACT}"
            )
        out, weights = out
        read = f" (`loss_fn` returned a {kind} of 2, read as the pair `(sums, weights)`)"
    else:
        read = ""
    if not _is_array(out):
        raise TypeError(
            f"`loss_fn(outputs, targets)` returned {_describe(out)}, but it must return an array of "
            f"per-example losses or a pair of arrays. {_CONTRACT}"
        )
    where = f"one per example of the batch of {batch}: shape ({size},)"
    if size != batch:
        where += (
            f" per call, as `loss_fn` sees the batch of {batch} in micro-batches of {size} "
            "examples under this schedule"
        )
    for name, a in (("losses", out), ("weights", weights)):
        if a is not None and jnp.shape(a) != (size,):
            raise ValueError(
                f"`loss_fn(outputs, targets)` must return {name} {where}, but returned shape "
                f"{jnp.shape(a)}{read}. {_CONTRACT} Do not return a mean: the pipeline divides by the "
                "batch's total (its size, or the sum of the weights), padding rows excluded."
            )
    check_float_loss(out, "`loss_fn(outputs, targets)` returned losses of dtype")
    if weights is not None:  # data: any numeric dtype, read in the losses' dtype
        weights = _numeric_weights(weights, jnp.result_type(out), "`loss_fn(outputs, targets)` returned")
    return out, weights


def _is_array(a) -> bool:
    """An array, a tracer or a numpy / Python scalar (not a list, tuple, dict or None)."""
    return isinstance(a, (jax.Array, np.ndarray, np.generic, int, float, complex))


def _describe(a) -> str:
    if _is_array(a):
        return f"an array of shape {jnp.shape(a)}"
    if isinstance(a, (list, tuple)):
        return f"a {type(a).__name__} of {len(a)}"
    return f"{type(a).__name__} {a!r}" if not isinstance(a, dict) else f"a dict with keys {list(a)}"


def _array(name, a, fn):
    if not _is_array(a):
        raise TypeError(
            f"`{fn}(losses, weights)`: `{name}` must be an array, but got {_describe(a)}. Build it "
            "with `jnp.asarray`."
        )
    return jnp.asarray(a)


def _numeric_weights(weights, dtype, where: str):
    """``weights`` in ``dtype``: float, integer and boolean weights are data (counts, masks)."""
    wdtype = jnp.result_type(weights)
    if not (jnp.issubdtype(wdtype, jnp.number) or wdtype == jnp.bool_) or jnp.issubdtype(
        wdtype, jnp.complexfloating
    ):
        raise TypeError(
            f"{where} weights of dtype {wdtype}, but weights must be real numbers (float, integer "
            "or boolean: token counts, masks). Return real weights."
        )
    return jnp.asarray(weights).astype(dtype)


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
