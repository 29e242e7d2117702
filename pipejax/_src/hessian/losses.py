"""Losses with more structure than ``loss(params, *args)``, for every function of :mod:`pipejax.hessian`.

:func:`composite` exposes a model's outputs (for the Gauss-Newton and Fisher curvatures);
:func:`from_value_and_grad` brings its own gradient (a pipeline schedule's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

PyTree = Any


class CompositeLoss:
    """``loss(params, *args) = output_loss(outputs(params, *args), *args)``: a loss with its model's
    outputs exposed, so the Gauss-Newton and Fisher matrices can be formed (see :func:`composite`)."""

    def __init__(self, outputs: Callable[..., PyTree], output_loss: Callable[..., jax.Array]):
        if not (callable(outputs) and callable(output_loss)):
            raise TypeError(
                "`composite(outputs, output_loss)` takes two functions, `outputs(params, *args) -> z` "
                f"and `output_loss(z, *args) -> scalar`, got {outputs!r} and {output_loss!r}."
            )
        self.outputs, self.output_loss = outputs, output_loss

    def __call__(self, params: PyTree, *args: Any) -> jax.Array:
        return self.output_loss(self.outputs(params, *args), *args)

    def __eq__(self, other: Any) -> bool:  # a static argument of the compiled programs
        return (
            type(other) is CompositeLoss
            and self.outputs is other.outputs
            and self.output_loss is other.output_loss
        )

    def __hash__(self) -> int:
        return hash((id(self.outputs), id(self.output_loss)))


def composite(outputs: Callable[..., PyTree], output_loss: Callable[..., jax.Array]) -> CompositeLoss:
    """A loss written as ``output_loss(outputs(params, *args), *args)``, for ``curvature="ggn"|"fisher"``.

    The Hessian of such a loss is ``J^T H_z J + sum_i (dL/dz_i) d^2 z_i/dparams^2`` with ``J`` the
    Jacobian of the outputs ``z`` and ``H_z`` the Hessian of ``output_loss`` in ``z``. The
    generalised Gauss-Newton matrix keeps the first term, ``G = J^T H_z J``: positive semi-definite
    whenever ``output_loss`` is convex in ``z`` (softmax cross-entropy, squared error). The
    empirical Fisher is ``F = (1/N) sum_i g_i g_i^T`` with ``g_i`` the gradient of example ``i``'s
    loss; it assumes ``output_loss`` is a mean over the leading (batch) axis of ``z`` of
    per-example terms. Both products cost one linearisation of ``outputs`` and its transpose (no
    second derivative of the model). The result is also an ordinary loss (``curvature="hessian"``).

    Args:
      outputs: ``outputs(params, *args) -> z``, e.g. a model's logits (a pytree whose leaves share
        the leading batch axis, for the Fisher).
      output_loss: ``output_loss(z, *args) -> scalar``, e.g. the mean cross-entropy against labels
        taken from ``args``.

    Returns:
      A callable ``loss(params, *args)`` that every function of :mod:`pipejax.hessian` accepts.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pipejax.hessian import composite, hvp
      >>> loss = composite(lambda w, x: x @ w, lambda z, x: 0.5 * jnp.sum(z**2) + jnp.sum(z**4))
      >>> x = jnp.array([[1.0, 0.0], [1.0, 1.0]])
      >>> hvp(loss, jnp.zeros(2), jnp.array([1.0, 0.0]), x, curvature="ggn").tolist()  # x^T x v
      [2.0, 1.0]

    References:
      Schraudolph, *Fast Curvature Matrix-Vector Products for Second-Order Gradient Descent*,
      Neural Computation 14, 2002. Martens, *New Insights and Perspectives on the Natural Gradient
      Method*, JMLR 21, 2020. Kunstner, Hennig and Balles, *Limitations of the empirical Fisher
      approximation for natural gradient descent*, NeurIPS 2019.
    """
    return CompositeLoss(outputs, output_loss)


class GradientLoss:
    """A loss that brings its own gradient (see :func:`from_value_and_grad`)."""

    def __init__(self, value_and_grad: Callable[..., tuple[jax.Array, PyTree]]):
        if not callable(value_and_grad):
            raise TypeError(
                "`from_value_and_grad` takes a function `value_and_grad(params, *args) -> (loss, "
                f"grads)`, got {value_and_grad!r}."
            )
        self.value_and_grad = value_and_grad

    def _pair(self, params: PyTree, *args: Any) -> tuple[jax.Array, PyTree]:
        out = self.value_and_grad(params, *args)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            if isinstance(out, tuple | list):
                got = f"a {type(out).__name__} of length {len(out)}"
            elif hasattr(out, "shape"):
                got = f"one array of shape {tuple(out.shape)}"
            else:
                got = f"{type(out).__name__} {out!r}"
            raise TypeError(
                "`value_and_grad` of from_value_and_grad must return a pair `(loss, grads)`, with `grads` "
                f"like `params`, but it returned {got}. Pass `jax.value_and_grad(loss)` (or a pipeline's "
                "`value_and_grad`), not the loss itself; for a plain loss, pass it to the functions of "
                "pipejax.hessian directly."
            )
        return out[0], out[1]

    def __call__(self, params: PyTree, *args: Any) -> jax.Array:
        return self._pair(params, *args)[0]

    def grad(self, params: PyTree, *args: Any) -> PyTree:
        return self._pair(params, *args)[1]

    def __eq__(self, other: Any) -> bool:  # a static argument of the compiled programs
        return type(other) is GradientLoss and self.value_and_grad is other.value_and_grad

    def __hash__(self) -> int:
        return hash(id(self.value_and_grad))


def from_value_and_grad(value_and_grad: Callable[..., tuple[jax.Array, PyTree]]) -> GradientLoss:
    """A loss given by a function that computes its gradient itself, for every function here.

    ``value_and_grad(params, *args) -> (loss, grads)``, e.g. what
    :meth:`pipejax.Pipeline.value_and_grad` returns for the ``"1f1b"`` and ``"zb-h1"``
    schedules, whose gradient is not ``jax.grad`` of a forward program. Hessian-vector products
    are then ``jax.jvp`` of that gradient function (``mode="fwd_rev"``) or the gradient of its
    inner product with ``v`` (``"rev_rev"``), so the curvature of a model trained with a
    schedule is computed with the same schedule. Only ``curvature="hessian"`` applies.

    Args:
      value_and_grad: ``value_and_grad(params, *args) -> (loss, grads)``, ``grads`` like ``params``.

    Returns:
      A callable ``loss(params, *args)`` (the value) that :func:`hvp`, :func:`lanczos`,
      :func:`eigenvalues`, :func:`trace` and :func:`density` accept.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.hessian import from_value_and_grad, hvp
      >>> f = jax.value_and_grad(lambda w, x: jnp.sum((x @ w) ** 2))  # H = 2 x^T x
      >>> x = jnp.array([[1.0, 2.0], [0.0, 1.0]])
      >>> hvp(from_value_and_grad(f), jnp.zeros(2), jnp.array([1.0, 0.0]), x).tolist()
      [2.0, 4.0]
    """
    return GradientLoss(value_and_grad)
