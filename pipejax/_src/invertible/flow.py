"""Flow: a normalizing flow with a standard-normal base distribution."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks
from pipejax._src.invertible.base import Layer, PyTree, check_key, check_layer, per_example_sum


def standard_normal_log_prob(z: PyTree) -> jax.Array:
    """Log-density of a standard normal, summed over every leaf of ``z`` and every non-batch axis.

    Args:
      z: an array, or a pytree of arrays (a multi-scale latent) sharing the leading batch axis.

    Returns:
      Shape ``(batch,)``: ``sum(-z**2 / 2 - log(2 pi) / 2)`` per example.

    Examples:
      >>> import jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> float(inv.standard_normal_log_prob(jnp.zeros((1, 2)))[0])  # -log(2 pi)
      -1.837877...
    """
    terms = []
    for leaf in jax.tree.leaves(z):
        half_log_2pi = jnp.asarray(0.5 * math.log(2 * math.pi), leaf.dtype)
        terms.append(per_example_sum(-0.5 * leaf * leaf - half_log_2pi))
    return sum(terms[1:], terms[0])


def dequantize(x: jax.Array, key: jax.Array, *, num_bins: int = 256, dtype: Any = jnp.float32) -> jax.Array:
    """Uniform dequantisation of integer data: ``(x + u) / num_bins - 1/2`` with ``u ~ U[0, 1)``.

    Discrete data (pixels in ``{0, ..., num_bins - 1}``) has no density; adding uniform noise
    gives a continuous variable whose log-likelihood bounds the discrete one from below
    (Theis et al. 2016). The result lies in ``[-1/2, 1/2)``; :meth:`Flow.bits_per_dim` accounts
    for the ``1 / num_bins`` rescaling.

    Args:
      x: integer-valued data in ``[0, num_bins)``: the levels themselves (e.g. 8-bit pixels),
        in an integer dtype or a float dtype holding whole numbers, not data already scaled to
        ``[0, 1)``.
      key: the PRNG key of the noise.
      num_bins: the number of levels of the data (256 for 8-bit images).
      dtype: the floating dtype of the result.

    Returns:
      A floating array of ``x``'s shape. Under ``jax.jit``, where the values of ``x`` are not
      known when the checks run, entries that are not whole numbers in ``[0, num_bins)`` come out
      NaN (so a wrong input cannot give a plausible number).

    Raises:
      TypeError: ``x`` is not a real array, ``key`` not a PRNG key.
      ValueError: ``num_bins < 2``; an ``x`` whose values are known and are not whole numbers
        in ``[0, num_bins)`` (e.g. images scaled to ``[0, 1)``: pass the levels instead).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> y = inv.dequantize(jnp.array([[0, 255]]), jax.random.key(0))
      >>> bool(jnp.all((y >= -0.5) & (y < 0.5)))
      True
    """
    check_key(key, "dequantize", optional=False)
    num_bins = checks.check_int(num_bins, "num_bins", 2, "dequantize")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"`dtype` of dequantize must be a floating dtype (the result's), but got {dtype!r}.")
    valid = check_levels(x, num_bins, "dequantize")
    noise = jax.random.uniform(key, jnp.shape(x), dtype)
    y = (jnp.asarray(x).astype(dtype) + noise) / jnp.asarray(num_bins, dtype) - jnp.asarray(0.5, dtype)
    return y if valid is None else jnp.where(valid, y, jnp.asarray(jnp.nan, dtype))


def check_levels(x: Any, num_bins: int, where: str) -> jax.Array | None:
    """Checks that ``x`` holds whole numbers in ``[0, num_bins)`` (the data's levels).

    Known values are checked now (``ValueError``); for traced ones the check is returned as a
    boolean array (``None`` when nothing is left to check), for the caller to turn into NaN.
    """
    dtype = jnp.result_type(x) if hasattr(x, "dtype") or isinstance(x, int | float | list) else None
    if dtype is None or not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(
            f"`x` of {where} must be a real array of integer levels in [0, {num_bins}), but got "
            f"{type(x).__name__}{f' of dtype {dtype}' if dtype is not None else ''}."
        )
    value = checks.concrete(x)
    if value is None:
        x = jnp.asarray(x)
        valid = (x >= 0) & (x < num_bins)
        return valid & (jnp.floor(x) == x) if jnp.issubdtype(dtype, jnp.floating) else valid
    bad = ~((value >= 0) & (value < num_bins) & (np.floor(value) == value))
    if np.any(bad):
        whole = bool(np.all(np.floor(value[np.isfinite(value)]) == value[np.isfinite(value)]))
        low, high = np.min(value), np.max(value)
        hint = (
            f" Data scaled to [0, 1) must be passed as levels: `jnp.round(x * {num_bins})`."
            if not whole and 0 <= low and high <= 1
            else f" Pass the levels (integers 0 .. {num_bins - 1}), or the `num_bins` of your data."
        )
        raise ValueError(
            f"`x` of {where} must hold whole numbers in [0, {num_bins}) (the levels of num_bins={num_bins} "
            f"data), but its values range over [{low}, {high}]"
            f"{'' if whole else ' and are not all whole numbers'}.{hint}"
        )
    return None


@dataclasses.dataclass(frozen=True)
class Flow:
    """A normalizing flow: an invertible ``layer`` that maps data to a standard-normal latent.

    ``log p(x) = log N(z; 0, I) + log|det dz/dx|`` with ``(z, logdet) = layer.forward(params, x)``;
    ``sample`` draws ``z`` and returns ``layer.inverse(params, z)``. The latent may be a pytree
    (:class:`MultiScale`). Train by minimising ``-mean(log_prob)`` (or ``mean(bits_per_dim)`` for
    images); use a ``Chain`` with ``memory="constant"`` to train deep flows in constant memory.

    Args:
      layer: the invertible map from data to latent.
      event_shape: the shape of one example (``(2,)`` for 2-D points, ``(8, 8, 1)`` for images).
      dtype: the floating dtype of samples and dequantised data (a ``TypeError`` otherwise);
        ``None`` (the default) takes the dtype of the parameters (float32 for a flow without
        floating parameters).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> step = [inv.InvertibleLinear(), inv.AffineCoupling(hidden=16)]
      >>> flow = inv.Flow(inv.Chain(step, repeat=4), event_shape=(2,))
      >>> x = jax.random.normal(jax.random.key(0), (64, 2))
      >>> params = jax.jit(flow.init)(jax.random.key(1), x)
      >>> jax.jit(flow.log_prob)(params, x).shape
      (64,)
      >>> jax.jit(flow.sample, static_argnums=2)(params, jax.random.key(2), 5).shape
      (5, 2)
    """

    layer: Layer
    event_shape: tuple[int, ...]
    dtype: Any = None

    def __post_init__(self):
        check_layer(self.layer, "`layer` of Flow")
        shape = self.event_shape
        dims = [checks.integer(d) for d in shape] if isinstance(shape, tuple | list) else [None]
        if None in dims:  # a bool is not a size
            bad = shape if not isinstance(shape, tuple | list) else shape[dims.index(None)]
            raise TypeError(
                f"`event_shape` of Flow must be a tuple of positive ints (the shape of one example, e.g. "
                f"(2,) or (8, 8, 1)), but got {shape!r}, holding {type(bad).__name__} {bad!r}."
            )
        if not all(d >= 1 for d in dims):
            raise ValueError(
                f"`event_shape` of Flow must be a tuple of positive ints (the shape of one example, e.g. "
                f"(2,) or (8, 8, 1)), but got {shape!r}."
            )
        object.__setattr__(self, "event_shape", tuple(dims))
        if self.dtype is not None:
            try:
                dtype = jnp.dtype(self.dtype)
            except (TypeError, ValueError):
                dtype = None
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(
                    f"`dtype` of Flow must be None (the dtype of the parameters) or a floating dtype "
                    f"(of samples and dequantised data), but got {self.dtype!r}; e.g. "
                    "Flow(layer, event_shape, dtype=jnp.float32)."
                )

    def _dtype(self, params: PyTree) -> Any:
        if self.dtype is not None:
            return self.dtype
        for leaf in jax.tree.leaves(params):
            if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                return jnp.result_type(leaf)
        return jnp.float32

    def _check_x(self, x: jax.Array, where: str) -> None:
        if tuple(jnp.shape(x)[1:]) != self.event_shape:
            raise ValueError(
                f"`x` of Flow.{where} must have shape (batch, *event_shape) = (batch, "
                f"{', '.join(map(str, self.event_shape))}), but got shape {jnp.shape(x)}."
            )

    def _check_params(self, params: PyTree, where: str) -> None:
        """``params`` must have the structure and shapes ``init`` makes for ``event_shape``."""
        x = jax.ShapeDtypeStruct((2, *self.event_shape), self._dtype(params))
        expected = jax.eval_shape(self.layer.init, jax.random.key(0), x)
        fix = (
            "Make `params` with `flow.init(key, x)` on a batch of shape (batch, *event_shape), or build "
            "the Flow with the `event_shape` the params were made for."
        )
        if jax.tree.structure(params) != jax.tree.structure(expected):
            raise ValueError(
                f"`params` of Flow.{where} do not have the structure that `layer.init` makes for "
                f"event_shape={self.event_shape}: got {jax.tree.structure(params)}, expected "
                f"{jax.tree.structure(expected)}. {fix}"
            )
        got = jax.tree_util.tree_leaves_with_path(params)
        for (path, leaf), want in zip(got, jax.tree.leaves(expected), strict=True):
            if tuple(jnp.shape(leaf)) != want.shape:
                raise ValueError(
                    f"`params` of Flow.{where} were not made for event_shape={self.event_shape}: leaf "
                    f"{jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(leaf))}, but `layer.init` "
                    f"makes shape {want.shape} for that event shape. {fix}"
                )

    def init(self, key: jax.Array, x: jax.Array) -> PyTree:
        """The layer's parameters, initialised on the batch ``x`` (data-dependent layers use it)."""
        self._check_x(x, "init")
        return self.layer.init(key, x)

    def log_prob(self, params: PyTree, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """Log-density of each example, shape ``(batch,)``; ``key`` feeds the layers' randomness."""
        self._check_x(x, "log_prob")
        check_key(key, "Flow.log_prob")
        self._check_params(params, "log_prob")
        z, logdet = self.layer.forward(params, x, key)
        return standard_normal_log_prob(z) + logdet

    def sample(
        self,
        params: PyTree,
        key: jax.Array,
        num_samples: int,
        *,
        temperature: float = 1.0,
        layer_key: jax.Array | None = None,
    ) -> jax.Array:
        """``num_samples`` draws: ``inverse(params, temperature * z)`` with ``z`` standard normal.

        ``temperature`` is a finite scalar ``>= 0``; ``< 1`` trades diversity for sample quality
        (Glow's reduced-temperature sampling). ``layer_key`` feeds the layers' randomness
        (``None``: no dropout).
        """
        check_key(key, "Flow.sample", optional=False)
        check_key(layer_key, "Flow.sample", name="layer_key")
        num_samples = checks.check_int(num_samples, "num_samples", 1, "Flow.sample")
        numeric = isinstance(temperature, int | float) or hasattr(temperature, "dtype")
        numeric = numeric and not isinstance(temperature, bool) and jnp.ndim(temperature) == 0
        known = checks.concrete(temperature) if numeric else None
        if not numeric or (known is not None and not (np.isfinite(known) and known >= 0)):
            raise (ValueError if numeric else TypeError)(
                f"`temperature` of Flow.sample must be a finite scalar >= 0 (the scale of the base samples; "
                f"1 samples the model), but got {temperature!r}."
            )
        self._check_params(params, "sample")
        dtype = self._dtype(params)
        if known is not None and known > float(jnp.finfo(dtype).max):
            raise ValueError(
                f"`temperature={temperature!r}` of Flow.sample overflows the {jnp.dtype(dtype)} of the "
                f"samples (at most {float(jnp.finfo(dtype).max):.3g}), so every sample would be inf; use "
                "a temperature near 1 (1 samples the model, below 1 trades diversity for quality)."
            )
        x_struct = jax.ShapeDtypeStruct((num_samples, *self.event_shape), dtype)
        z_struct = jax.eval_shape(lambda p, x: self.layer.forward(p, x)[0], params, x_struct)
        leaves, treedef = jax.tree.flatten(z_struct)
        keys = jax.random.split(key, len(leaves))
        z = [
            jax.random.normal(k, s.shape, s.dtype) * jnp.asarray(temperature, s.dtype)
            for k, s in zip(keys, leaves, strict=True)
        ]
        return self.layer.inverse(params, jax.tree.unflatten(treedef, z), layer_key)[0]

    def bits_per_dim(
        self,
        params: PyTree,
        x: jax.Array,
        key: jax.Array,
        *,
        num_bins: int = 256,
        layer_key: jax.Array | None = None,
    ) -> jax.Array:
        """Bits per dimension of integer data, with uniform dequantisation; shape ``(batch,)``.

        ``x`` holds integers in ``[0, num_bins)`` (the levels, not data scaled to ``[0, 1)``: see
        :func:`dequantize` for what is refused, and for the NaN a traced wrong input gives). It is
        dequantised with ``key`` (:func:`dequantize`), and
        ``bpd = -(log p(x') - D log(num_bins)) / (D log 2)`` where ``D`` is the number of
        dimensions of one example: the ``D log(num_bins)`` undoes the scaling by ``1 / num_bins``,
        so this is an upper bound (in expectation over the noise) on the discrete data's code
        length. A model that is uniform over all ``num_bins`` levels scores
        ``log2(num_bins)`` bits (8 for 8-bit images).
        """
        self._check_x(x, "bits_per_dim")
        check_key(layer_key, "Flow.bits_per_dim", name="layer_key")
        num_bins = checks.check_int(num_bins, "num_bins", 2, "Flow.bits_per_dim")
        check_levels(x, num_bins, "Flow.bits_per_dim")  # named here; dequantize NaNs traced bad values
        dims = math.prod(self.event_shape)
        dtype = self._dtype(params)
        x_cont = dequantize(x, key, num_bins=num_bins, dtype=dtype)
        log_p = self.log_prob(params, x_cont, layer_key) - jnp.asarray(dims * math.log(num_bins), dtype)
        return -log_p / jnp.asarray(dims * math.log(2.0), dtype)
