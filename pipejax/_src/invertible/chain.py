"""Chain: a sequence of invertible layers, repeated K times, with a choice of backward memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pipejax._src import checks, compat
from pipejax._src.checkpoint import checkpoint_sequential
from pipejax._src.containers import Layout
from pipejax._src.invertible.base import (
    Layer,
    PyTree,
    check_key,
    check_layer,
    first_leaf,
    fold,
    match_varying,
    reconstruction_gap,
    zero_logdet,
)
from pipejax._src.invertible.reversible import reversible_scan, scan, scan_steps

MEMORY_MODES = ("linear", "sqrt", "constant")


@dataclasses.dataclass(frozen=True)
class Chain:
    """Layers applied in sequence, the sequence repeated ``repeat`` times; itself an invertible layer.

    ``repeat=K`` applies the layers K times with independent parameters, stacked on a leading axis
    of length K and run with ``lax.scan`` (Glow's K steps of flow): the program is traced and
    compiled once, whatever K is. ``memory`` chooses what the backward pass keeps:

    ``"linear"``    plain autodiff through the scan: every repeat's activations are stored
                    (memory O(K), no extra compute).
    ``"sqrt"``      :func:`pipejax.checkpoint_sequential` over the repeats: the inputs of about
                    ``sqrt(K)`` segments are stored and each segment is recomputed in backward
                    (memory O(sqrt K), about one extra forward pass).
    ``"constant"``  (default) nothing is stored but the chain's output: the backward pass rebuilds
                    each repeat's input from its output through the inverse and back-propagates
                    through that repeat alone (RevNet). Memory O(1) in K, for about one extra forward
                    pass (the inverse) -- in exchange, gradients are computed at *reconstructed*
                    inputs, which drift from the true ones in floating point with depth and with
                    the layers' Lipschitz constants; check with :meth:`reconstruction_errors`.

    All three run the same forward code, so forward results are bitwise identical; gradients of
    every order agree up to reconstruction error. ``jax.grad``, ``jax.hessian``,
    ``jax.jvp(jax.grad(f))`` and ``jax.grad(jax.grad(f))`` work in every mode. Pure forward mode of
    the chain itself (``jax.jvp(chain.forward)``, ``jax.jacfwd``) is refused under ``"constant"``
    (it is a ``jax.custom_vjp``) with a ``TypeError`` that says so: use ``"linear"`` or ``"sqrt"``
    there. ``inverse`` has the same
    memory modes, run in the other direction.

    Randomness: layer ``i`` of repeat ``r`` gets ``fold_in(fold_in(key, r), i)``, in forward,
    inverse and the rebuilding backward pass alike, so dropout masks replay exactly.

    With ``repeat > 1`` the layers must map ``x`` to an array of the same shape and dtype; put
    shape-changing layers (``Squeeze``) in a chain with ``repeat=1``.

    Args:
      layers: the invertible layers of one repeat (``Chain`` and ``MultiScale`` included).
      repeat: how many times to apply them, each time with its own parameters; ``>= 1``.
      memory: ``"linear"``, ``"sqrt"`` or ``"constant"``.
      segments: for ``"sqrt"``, the number of checkpointed segments (default about ``sqrt(K)``).

    Raises:
      TypeError, ValueError: for a layer without ``init``/``forward``/``inverse``, a bad
        ``repeat``, ``memory`` or ``segments`` (at construction), or parameters and inputs that do
        not fit (at trace time).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> step = [inv.ActNorm(), inv.InvertibleLinear(), inv.AffineCoupling(hidden=32)]
      >>> chain = inv.Chain(step, repeat=8, memory="constant")
      >>> x = jax.random.normal(jax.random.key(0), (128, 4))
      >>> params = jax.jit(chain.init)(jax.random.key(1), x)
      >>> params[0]["bias"].shape  # ActNorm's bias, one per repeat
      (8, 4)
      >>> loss = lambda p, x: -jnp.mean(chain.forward(p, x)[1])  # depends on logdet alone
      >>> grads = jax.jit(jax.grad(loss))(params, x)

    References:
      Gomez, Ren, Urtasun, Grosse, "The Reversible Residual Network: Backpropagation Without
      Storing Activations", 2017.
      Kingma, Dhariwal, "Glow: Generative Flow with Invertible 1x1 Convolutions", 2018.
      Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016.
    """

    layers: Sequence[Layer]
    repeat: int = dataclasses.field(default=1, kw_only=True)
    memory: str = dataclasses.field(default="constant", kw_only=True)
    segments: int | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.layers, Sequence) or isinstance(self.layers, str) or not self.layers:
            raise TypeError(
                f"`layers` of Chain must be a non-empty sequence of invertible layers, but got "
                f"{self.layers!r}; "
                "e.g. Chain([ActNorm(), InvertibleLinear(), AffineCoupling(hidden=64)], repeat=8)."
            )
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, layer in enumerate(self.layers):
            check_layer(layer, f"`layers[{i}]` of Chain")
        object.__setattr__(self, "repeat", checks.check_int(self.repeat, "repeat", 1, "Chain"))
        if self.memory not in MEMORY_MODES:
            raise ValueError(
                f"`memory` of Chain must be one of {', '.join(map(repr, MEMORY_MODES))}, but got "
                f"{self.memory!r}."
            )
        if self.segments is not None:
            segments = checks.check_int(self.segments, "segments", 1, "Chain", " (or None)")
            object.__setattr__(self, "segments", segments)
            if self.memory != "sqrt":
                raise ValueError(
                    f"`segments` of Chain only applies to memory='sqrt', but memory={self.memory!r}; "
                    "drop `segments` or pass memory='sqrt'."
                )

    # --- one repeat -------------------------------------------------------------------------------

    def _block_forward(
        self, params_r: PyTree, x: PyTree, key_r: jax.Array | None
    ) -> tuple[PyTree, jax.Array]:
        logdet = zero_logdet(x)
        for i, (layer, p) in enumerate(zip(self.layers, params_r, strict=True)):
            x, ld = layer.forward(p, x, fold(key_r, i))
            logdet = logdet + ld
        return x, logdet

    def _block_inverse(
        self, params_r: PyTree, y: PyTree, key_r: jax.Array | None
    ) -> tuple[PyTree, jax.Array]:
        logdet = zero_logdet(y)
        for i in reversed(range(len(self.layers))):
            y, ld = self.layers[i].inverse(params_r[i], y, fold(key_r, i))
            logdet = logdet + ld
        return y, logdet

    def _keys(self, key: jax.Array | None) -> jax.Array | None:
        """Per-repeat keys ``fold_in(key, r)``, stacked (``None`` without a key)."""
        if key is None:
            return None
        return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(self.repeat, dtype=jnp.uint32))

    # --- checks -----------------------------------------------------------------------------------

    def _check_x(self, x: PyTree, where: str, arg: str) -> None:
        for leaf in jax.tree.leaves(x):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise TypeError(
                    f"`{arg}` of Chain.{where} must hold floating arrays, but got dtype "
                    f"{jnp.result_type(leaf)}; "
                    "cast it (for integer image data use pipejax.invertible.dequantize)."
                )
        first_leaf(x)

    def _check_type_kept(self, block, params_r: Any, x: PyTree, key_r: Any, where: str, arg: str) -> None:
        if self.repeat == 1:
            return
        before = Layout.of(x)
        after = Layout.of(jax.eval_shape(lambda p, h, k: block(p, h, k)[0], params_r, x, key_r))
        if after.strong() != before.strong():  # weak types aside
            raise ValueError(
                f"With repeat={self.repeat} the layers of a Chain must map `{arg}` to a value of the same "
                f"shape and dtype, but in Chain.{where} they map {before.describe()} to {after.describe()}. "
                "Put shape-changing layers such as Squeeze in a chain of their own with repeat=1, e.g. "
                "Chain([Squeeze(), Chain(steps, repeat=K)])."
            )

    def _check_params(self, params: PyTree, where: str) -> PyTree:
        """Checks the structure; returns the first repeat's parameters as ShapeDtypeStructs."""
        if not isinstance(params, tuple | list) or len(params) != len(self.layers):
            got = (
                f"a {type(params).__name__} of length {len(params)}"
                if isinstance(params, tuple | list)
                else (type(params).__name__)
            )
            raise ValueError(
                f"`params` of Chain.{where} must be the tuple returned by Chain.init, one entry per layer "
                f"({len(self.layers)}), but got {got}."
            )
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            shape = jnp.shape(leaf)
            if not shape or shape[0] != self.repeat:
                raise ValueError(
                    f"Every leaf of `params` of Chain.{where} needs a leading axis of length repeat="
                    f"{self.repeat} (one entry per repeat), but params{jax.tree_util.keystr(path)} has shape "
                    f"{shape}. Make the parameters with this chain's init."
                )
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), params)

    def _prepare(self, params, x, key, where, arg):
        check_key(key, f"Chain.{where}")
        self._check_x(x, where, arg)
        params_r = self._check_params(params, where)
        keys = self._keys(key)
        key_r = None if keys is None else jax.ShapeDtypeStruct(keys.shape[1:], keys.dtype)
        block = self._block_forward if where == "forward" else self._block_inverse
        self._check_type_kept(block, params_r, x, key_r, where, arg)
        return keys

    # --- the layer interface ----------------------------------------------------------------------

    def init(self, key: jax.Array, x: PyTree) -> tuple[PyTree, ...]:
        """Parameters: a tuple with one entry per layer, each stacked on a leading axis of length ``repeat``.

        Layers are initialised in order on the batch as transformed by the layers before them, so
        data-dependent initialisation (``ActNorm``) sees the activations it will normalise.
        """
        check_key(key, "Chain.init", optional=False)
        self._check_x(x, "init", "x")

        def body(h, keys_r):
            params = []
            for i, layer in enumerate(self.layers):
                k_i = keys_r[i]
                p = layer.init(k_i, h)
                h, _ = layer.forward(p, h)
                params.append(p)
            return h, tuple(params)

        keys = jax.random.split(key, (self.repeat, len(self.layers)))  # one draw: compiles once
        if self.repeat > 1:
            before, after = Layout.of(x), Layout.of(jax.eval_shape(body, x, keys[0])[0])
            if after.strong() != before.strong():  # weak types aside
                raise ValueError(
                    f"With repeat={self.repeat} the layers of a Chain must map `x` to a value of the same "
                    f"shape and dtype, but they map {before.describe()} to {after.describe()}. Put "
                    "shape-changing layers such as Squeeze in a chain of their own with repeat=1, e.g. "
                    "Chain([Squeeze(), Chain(steps, repeat=K)])."
                )
        return scan(body, x, keys, self.repeat, False)[1]

    def forward(self, params: PyTree, x: PyTree, key: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
        """``(y, logdet)``: the layers in order, ``repeat`` times; ``logdet`` of shape ``(batch,)``."""
        keys = self._prepare(params, x, key, "forward", "x")
        return self._run(self._block_forward, self._block_inverse, params, x, keys, reverse=False)

    def inverse(self, params: PyTree, y: PyTree, key: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
        """``(x, logdet)``: the inverse layers in reverse order; ``logdet`` is minus forward's."""
        keys = self._prepare(params, y, key, "inverse", "y")
        return self._run(self._block_inverse, self._block_forward, params, y, keys, reverse=True)

    def _run(self, step, unstep, params, x, keys, reverse):
        if self.memory == "linear":
            return scan_steps(step, params, x, keys, self.repeat, reverse)
        if self.memory == "constant":
            method = "inverse" if reverse else "forward"
            if compat.in_forward_mode((params, x)):  # JAX would refuse it later, with no context
                raise TypeError(_forward_mode_message(method))
            try:
                return reversible_scan(step, unstep, self.repeat, reverse)(params, x, keys)
            except TypeError as err:  # JAX refuses forward mode of a custom_vjp
                if "forward-mode" not in str(err):
                    raise
                raise TypeError(_forward_mode_message(method)) from err

        def layer(pk, carry, _):  # "sqrt": the keys travel with the parameters, in scan order
            (p, k), (h, logdet) = pk, carry
            y, ld = step(p, h, k)
            return y, logdet + ld

        stacked = (params, keys)
        carry = match_varying((x, zero_logdet(x)), params, keys)
        if self.repeat == 1:
            first = jax.tree.map(lambda a: a[0], stacked)
            return jax.checkpoint(layer)(first, carry, None)
        if reverse:
            stacked = jax.tree.map(lambda a: a[::-1], stacked)
        return checkpoint_sequential(layer, segments=self.segments)(stacked, carry)

    def reconstruction_errors(self, params: PyTree, x: PyTree, key: jax.Array | None = None) -> jax.Array:
        """How far the inputs that ``memory="constant"`` rebuilds are from the true ones, per repeat.

        Runs the chain forward, keeping every repeat's input, then rebuilds them backwards from the
        output through the inverse, as the constant-memory backward pass does. Entry ``r`` is
        ``max |rebuilt input of repeat r - true input|`` over the batch; entry 0 is the error of
        reconstructing ``x`` itself. The errors grow towards entry 0. This diagnostic stores every
        activation (it is not constant-memory); run it on one batch.

        Args:
          params: the chain's parameters.
          x: a batch of inputs.
          key: the key, if the layers use randomness.

        Returns:
          An array of shape ``(repeat,)``.

        Examples:
          >>> import jax, jax.numpy as jnp
          >>> import pipejax.invertible as inv
          >>> chain = inv.Chain([inv.AffineCoupling(hidden=8, flip=True), inv.AffineCoupling(hidden=8)],
          ...                   repeat=16)
          >>> x = jax.random.normal(jax.random.key(0), (32, 4))
          >>> params = jax.jit(chain.init)(jax.random.key(1), x)
          >>> jax.jit(chain.reconstruction_errors)(params, x).shape
          (16,)
        """
        keys = self._prepare(params, x, key, "forward", "x")

        def forward(h, xs):
            p, k = xs
            return self._block_forward(p, h, k)[0], h

        y, inputs = scan(forward, x, (params, keys), self.repeat, False)

        def backward(h, xs):
            p, k, true = xs
            rebuilt, _ = self._block_inverse(p, h, k)
            errors = [
                jnp.max(reconstruction_gap(a, b))
                for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(true), strict=True)
            ]
            return rebuilt, jnp.max(jnp.stack(errors))

        return scan(backward, y, (params, keys, inputs), self.repeat, True)[1]


def _forward_mode_message(method: str) -> str:
    return (
        f"Chain(memory='constant').{method} cannot be differentiated in forward mode alone (jax.jvp, "
        "jax.jacfwd): its backward pass is a jax.custom_vjp, which JAX refuses to differentiate "
        "forwards. Build the chain with memory='linear' or memory='sqrt' for forward mode (jax.grad, "
        "jax.hessian and jax.jvp(jax.grad(f)) work in every memory mode)."
    )
