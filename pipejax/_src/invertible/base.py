"""The invertible-layer protocol and the helpers every layer shares.

A layer is a static description (a frozen dataclass: hyper-parameters only) with three pure
functions::

    params = layer.init(key, x)                  # x: an example batch (data-dependent init)
    y, logdet = layer.forward(params, x, key)    # logdet: log|det dy/dx| per example, shape (batch,)
    x, logdet = layer.inverse(params, y, key)    # logdet: log|det dx/dy| = -forward's logdet

``key`` is ``None`` or one PRNG key; layers with randomness (dropout in a coupling network) draw
from it, so a forward and an inverse called with the same key use the same masks.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks, compat

PyTree = Any


@runtime_checkable
class Layer(Protocol):
    """What :class:`Chain`, :class:`MultiScale` and :class:`Flow` need of a layer."""

    def init(self, key: jax.Array, x: PyTree) -> PyTree:
        """Parameters for inputs like ``x`` (a batch); may depend on ``x`` (ActNorm)."""
        ...

    def forward(self, params: PyTree, x: PyTree, key: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
        """``(y, logdet)`` with ``logdet`` of shape ``(batch,)``."""
        ...

    def inverse(self, params: PyTree, y: PyTree, key: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
        """``(x, logdet)`` with ``logdet`` the negated log-determinant of ``forward``."""
        ...


def check_layer(layer: Any, where: str) -> None:
    """Raises a ``TypeError`` unless ``layer`` has ``init``, ``forward`` and ``inverse``."""
    missing = [m for m in ("init", "forward", "inverse") if not callable(getattr(layer, m, None))]
    if missing:
        raise TypeError(
            f"{where} must be an invertible layer with methods init(key, x), forward(params, x, key) "
            f"and inverse(params, y, key), but got {type(layer).__name__} {layer!r}, which lacks "
            f"{', '.join(missing)}. Use the layers of pipejax.invertible or write a class with those methods."
        )


def real_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (numpy's and a concrete 0-d array included;
    not a bool), else ``None``."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    dtype = getattr(value, "dtype", None)
    if dtype is None or np.ndim(value) != 0 or not jnp.issubdtype(dtype, jnp.number):
        return None
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    known = checks.concrete(value)
    return None if known is None else float(known)


def check_number(
    value: Any, name: str, where: str, *, rule: str, ok: Callable[[float], bool], about: str, example: str
) -> float:
    """Returns the hyper-parameter ``value`` as a float if it is a finite real number (not a bool)
    for which ``ok`` holds; else a ``TypeError`` (not a number) or ``ValueError`` (NaN, an
    infinity, or outside the rule) that names ``name`` of ``where``, ``about`` (what it does),
    the ``rule``, the value and an ``example``."""
    number = real_number(value)
    text = f"`{name}` of {where} {about} and must be {rule}"
    if number is None:
        raise TypeError(f"{text}, but got {type(value).__name__} {value!r}; e.g. {example}.")
    if not (math.isfinite(number) and ok(number)):
        raise ValueError(f"{text}, but got {value!r}; e.g. {example}.")
    return number


def log_scale_bound(dtype: Any) -> float:
    """``-log(tiny) / 2`` of a floating ``dtype`` (43.7 in float32, 354 in float64, 4.85 in
    float16): for ``|s|`` up to it, ``exp(s)`` and ``exp(-s)`` are both normal numbers, with room
    to spare for the values they multiply."""
    return -0.5 * float(np.log(jnp.finfo(dtype).tiny))


def fold(key: jax.Array | None, index: int | jax.Array) -> jax.Array | None:
    """``jax.random.fold_in(key, index)``, or ``None`` without a key."""
    return None if key is None else jax.random.fold_in(key, index)


def check_key(key: Any, where: str, optional: bool = True, name: str = "key") -> Any:
    """Raises unless ``key`` is one PRNG key (or ``None`` when ``optional``); returns it."""
    return checks.check_key(
        key,
        name=name,
        where=where,
        optional=optional,
        batch_fix="Pass one PRNG key (e.g. jax.random.key(0)): the layers derive per-layer keys with "
        "jax.random.fold_in; map over a batch of keys with jax.vmap.",
    )


def first_leaf(x: PyTree) -> jax.Array:
    leaves = jax.tree.leaves(x)
    if not leaves:
        raise ValueError("The input has no arrays; pass a batch whose leading axis is the example axis.")
    return leaves[0]


def zero_logdet(x: PyTree) -> jax.Array:
    """Zeros of shape ``(batch,)`` in the dtype of ``x``'s (first) array."""
    leaf = first_leaf(x)
    return jnp.zeros(leaf.shape[:1], leaf.dtype)


def match_varying(tree: PyTree, *others: PyTree) -> PyTree:
    """Casts ``tree``'s leaves to vary along every mesh axis that any leaf of ``tree`` or ``others`` does.

    Inside ``jax.shard_map`` a scan carry must keep its type, so a carry that starts replicated
    (a zero log-determinant) but meets stage-sharded parameters must start "varying". Outside
    ``shard_map`` nothing varies and this returns ``tree`` unchanged.
    """
    axes: set[str] = set()
    for leaf in jax.tree.leaves((tree, others)):
        if hasattr(leaf, "dtype"):
            axes |= compat.varying_axes(leaf)
    if not axes:
        return tree
    names = tuple(sorted(axes))

    def cast(leaf):
        missing = tuple(a for a in names if a not in compat.varying_axes(leaf))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, tree)


def per_example_sum(a: jax.Array) -> jax.Array:
    """Sums every axis but the leading (example) axis."""
    return jnp.sum(a, axis=tuple(range(1, a.ndim)))


def constant_logdet(value: jax.Array, x: jax.Array) -> jax.Array:
    """The same log-determinant ``value`` (a scalar) for every example of ``x``."""
    return jnp.broadcast_to(value.astype(x.dtype), x.shape[:1])


def channels(v: jax.Array, ndim: int) -> jax.Array:
    """A per-channel vector ``(C,)`` shaped to broadcast against a rank-``ndim`` array (no implicit ranks)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


def check_input(x: Any, name: str, where: str, ranks: Sequence[int] | None = None, arg: str = "x") -> None:
    """Raises unless ``x`` is a floating array of one of ``ranks`` (any rank >= 2 if ``None``)."""
    checks.check_float_array(
        x,
        arg,
        f"{name}.{where}",
        "cast it, e.g. with x.astype(jnp.float32) (for integer image data use pipejax.invertible.dequantize)",
    )
    if ranks is None:
        if x.ndim < 2:
            raise ValueError(
                f"`{arg}` of {name}.{where} must have a leading batch axis and a channel axis (rank >= 2), "
                f"but got shape {x.shape}; add a batch axis, e.g. x[None]."
            )
    elif x.ndim not in ranks:
        expected = " or ".join(
            {2: "2 (batch, features)", 4: "4 (batch, height, width, channels)"}.get(r, str(r)) for r in ranks
        )
        raise ValueError(f"`{arg}` of {name}.{where} must have rank {expected}, but got shape {x.shape}.")


def reconstruction_error(layer: Layer, params: PyTree, x: PyTree, key: jax.Array | None = None) -> jax.Array:
    """Per-example reconstruction error ``max |inverse(forward(x)) - x|`` of an invertible layer.

    In exact arithmetic it is zero; in floating point it grows with depth and with the layers'
    Lipschitz constants. A ``memory="constant"`` chain computes its gradients at reconstructed
    inputs, so this error bounds how far those gradients can drift from plain autodiff's (see
    :meth:`Chain.reconstruction_errors` for the error at every depth of a chain).

    Args:
      layer: any invertible layer (a :class:`Chain` included).
      params: its parameters.
      x: a batch of inputs.
      key: the key for layers with randomness (the same key is used both ways), or ``None``.

    Returns:
      An array of shape ``(batch,)``: the largest absolute error over each example's entries;
      ``inf`` for an example whose reconstruction is not finite (an overflow or a NaN in the
      inverse), so a broken layer is flagged, not hidden behind a NaN.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> layer = inv.InvertibleLinear()
      >>> x = jnp.arange(12.0).reshape(4, 3)
      >>> params = layer.init(jax.random.key(0), x)
      >>> inv.reconstruction_error(layer, params, x).shape
      (4,)
    """
    check_layer(layer, "`layer`")
    y, _ = layer.forward(params, x, key)
    back, _ = layer.inverse(params, y, key)
    errors = [
        jnp.max(reconstruction_gap(a, b).reshape(a.shape[0], -1), axis=1)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(x), strict=True)
    ]
    return jnp.max(jnp.stack(errors), axis=0)


def reconstruction_gap(back: jax.Array, x: jax.Array) -> jax.Array:
    """``|back - x|``, and ``inf`` where the reconstruction is not finite (NaN would hide in a max)."""
    return jnp.where(jnp.isfinite(back), jnp.abs(back - x), jnp.asarray(jnp.inf, back.dtype))


def as_stage(layer: Layer):
    """Adapts an invertible layer to a :func:`pipejax.pipeline` stage that carries the log-determinant.

    The stage maps ``(x, logdet) -> (y, logdet + forward's logdet)``, where ``logdet`` has shape
    ``(batch,)``, so a flow (or any chain, e.g. one with ``memory="constant"``) can be cut into
    pipeline stages: feed the pipeline ``(x, jnp.zeros(batch))``.

    Args:
      layer: an invertible layer, e.g. a :class:`Chain`.

    Returns:
      ``stage(params, (x, logdet), key) -> (y, logdet)``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> import pipejax.invertible as inv
      >>> chain = inv.Chain([inv.AdditiveCoupling(hidden=8)], repeat=4)
      >>> x = jnp.ones((6, 4))
      >>> params = [chain.init(jax.random.key(s), x) for s in range(2)]
      >>> pipe = pj.pipeline([inv.as_stage(chain)] * 2, chunks=3)
      >>> y, logdet = pipe(params, (x, jnp.zeros(6)))
      >>> y.shape, logdet.shape
      ((6, 4), (6,))
    """
    check_layer(layer, "`layer`")

    def stage(params: PyTree, carry: tuple[PyTree, jax.Array], key: jax.Array | None = None):
        if not (isinstance(carry, tuple | list) and len(carry) == 2):
            got = (
                f"a {type(carry).__name__} of {len(carry)}"
                if isinstance(carry, tuple | list)
                else f"an array of shape {jnp.shape(carry)}"
            )
            raise TypeError(
                f"A stage made by as_stage({type(layer).__name__}) takes the pair `(x, logdet)`, but "
                f"got {got}. Start the pipeline with the pair: `pipe(params, (x, jnp.zeros(x.shape[0])))`."
            )
        x, logdet = carry
        y, ld = layer.forward(params, x, key)
        return y, logdet + ld

    return stage
