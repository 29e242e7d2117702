"""The constant-memory backward pass: a scan whose VJP rebuilds each step's input by inversion.

A step is ``step(params_r, x, key_r) -> (y, logdet)`` and ``unstep(params_r, y, key_r) -> (x, _)``
its inverse. :func:`reversible_scan` runs the steps over parameters stacked on a leading axis and
saves only the parameters, the keys and the *final* output for the backward pass. The backward pass
is a ``lax.scan`` in the opposite direction that, at each step, rebuilds the step's input from its
output with ``unstep`` and back-propagates through that one step with ``jax.vjp`` -- so at any time
it holds one step's activations, whatever the number of steps (RevNet's algorithm).

Two details are essential, and are why this is a ``lax.scan`` and a hand-written ``custom_vjp``:

* The backward must be a scan over stacked parameters. Written as an unrolled Python loop, XLA's
  scheduler keeps the rebuilt inputs alive and memory still grows with depth.
* The ``fwd`` rule computes the primal with ordinary code (it does not call the ``custom_vjp``
  function itself). Then forward-over-reverse (``jax.jvp(jax.grad(f))``, ``jax.hessian``) works:
  it differentiates the ordinary code of ``fwd`` and ``bwd``. Reverse-over-reverse works too.
  Pure forward mode of the scan itself (``jax.jvp(f)``) is refused by JAX for any ``custom_vjp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pipejax._src.invertible.base import PyTree, match_varying, zero_logdet

Step = Callable[[PyTree, PyTree, Any], tuple[PyTree, jax.Array]]


def scan(body: Callable, carry: Any, xs: Any, length: int, reverse: bool) -> tuple[Any, Any]:
    """``lax.scan``; one step (``length == 1``) runs unscanned, so it may change the carry's type."""
    if length == 1:
        carry, out = body(carry, jax.tree.map(lambda a: a[0], xs))
        return carry, jax.tree.map(lambda a: a[None], out)
    return jax.lax.scan(body, carry, xs, length=length, reverse=reverse)


def scan_steps(
    step: Step, params: PyTree, x: PyTree, keys: Any, length: int, reverse: bool
) -> tuple[PyTree, jax.Array]:
    """Plain autodiff: the steps in a ``lax.scan`` (last to first if ``reverse``), logdets summed."""

    def body(carry, xs):
        h, logdet = carry
        p, k = xs
        y, ld = step(p, h, k)
        return (y, logdet + ld), None

    carry = match_varying((x, zero_logdet(x)), params, keys)
    return scan(body, carry, (params, keys), length, reverse)[0]


def reversible_scan(step: Step, unstep: Step, length: int, reverse: bool = False) -> Callable:
    """``apply(params, x, keys) -> (y, logdet)`` whose backward pass rebuilds inputs with ``unstep``.

    The forward result is bitwise that of :func:`scan_steps` (the same code runs). Gradients equal
    plain autodiff's up to the error of rebuilding each input (see ``reconstruction_error``).
    """

    def primal(params, x, keys):
        return scan_steps(step, params, x, keys, length, reverse)

    @jax.custom_vjp
    def apply(params, x, keys):
        return primal(params, x, keys)

    def fwd(params, x, keys):
        y, logdet = primal(params, x, keys)  # ordinary code: keeps forward-over-reverse working
        return (y, logdet), (params, y, keys)

    def bwd(residuals, cotangents):
        params, y, keys = residuals
        g_y, g_logdet = cotangents  # every step's logdet enters the sum, so each gets g_logdet

        def body(carry, xs):
            y, g_y = carry
            p, k = xs
            x, _ = unstep(p, y, k)
            _, vjp = jax.vjp(lambda p, x: step(p, x, k), p, x)
            g_p, g_x = vjp((g_y, g_logdet))
            return (x, g_x), g_p

        carry = match_varying((y, g_y), params, keys, g_logdet)
        (_, g_x), g_params = scan(body, carry, (params, keys), length, not reverse)
        return g_params, g_x, None  # keys: no cotangent

    apply.defvjp(fwd, bwd)
    return apply
