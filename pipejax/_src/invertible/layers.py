"""Invertible layers without a conditioning network: ActNorm, invertible linear maps, Squeeze."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from pipejax._src import checks
from pipejax._src.invertible.base import (
    PyTree,
    channels,
    check_input,
    check_key,
    check_number,
    constant_logdet,
    log_scale_bound,
)


def _positions(x: jax.Array) -> int:
    """Entries per channel of one example: 1 for vectors, ``H * W`` for images."""
    return int(np.prod(x.shape[1:-1], dtype=np.int64))


def bounded_log_scale(log_scale: jax.Array) -> jax.Array:
    """``log_scale`` clipped to ``[-b, b]`` with ``b = -log(tiny) / 2`` of its dtype (43.7 in float32).

    A diagonal ``exp(log_scale)`` and its reciprocal then both stay normal numbers: without the
    bound, float32's ``exp`` underflows to 0 below about -87, the inverse multiplies by ``inf``
    and returns NaN without an error (and a ``memory="constant"`` chain, which reconstructs its
    inputs through the inverse, gets NaN gradients). Inside the bound the clip is the identity
    (bitwise); past it the layer uses the bound in the map *and* in the log-determinant, so it
    stays exactly invertible with a consistent log-determinant, and the parameter gets a zero
    gradient there. :func:`pipejax.invertible.reconstruction_error` measures what is left.
    """
    bound = log_scale_bound(log_scale.dtype)
    return jnp.clip(log_scale, -bound, bound)


def _check_channels(name: str, where: str, expected: int, x: jax.Array, arg: str) -> None:
    if x.shape[-1] != expected:
        raise ValueError(
            f"`{arg}` of {name}.{where} has {x.shape[-1]} channels (last axis of shape {x.shape}), but "
            f"`params` were made by {name}.init for {expected} channels; call init with a batch like `{arg}`."
        )


@dataclasses.dataclass(frozen=True)
class ActNorm:
    """Per-channel affine normalisation with data-dependent initialisation (Glow's actnorm).

    ``y = (x + bias) * exp(log_scale)`` over the last (channel) axis. :meth:`init` sets ``bias``
    and ``log_scale`` so that the initial batch has zero mean and unit variance per channel; both
    are then ordinary trainable parameters. ``logdet = positions * sum(log_scale)``, where
    ``positions`` is ``H * W`` for images and 1 for vectors. ``log_scale`` is used clipped to
    ``[-b, b]`` (:func:`bounded_log_scale`; ``b`` = 43.7 in float32), so the scale and its
    reciprocal never under- or overflow.

    Attributes:
      eps: added to the initial standard deviation, so constant channels stay finite; a finite
        number > 0 that does not round to 0 or inf in the input's dtype.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (256, 4))
      >>> params = inv.ActNorm().init(jax.random.key(1), x)
      >>> y, logdet = inv.ActNorm().forward(params, x)
      >>> bool(jnp.allclose(y.mean(0), 0.0, atol=1e-5)), bool(jnp.allclose(y.std(0), 1.0, atol=1e-4))
      (True, True)

    References:
      Kingma, Dhariwal, "Glow: Generative Flow with Invertible 1x1 Convolutions", 2018.
    """

    eps: float = 1e-6

    def __post_init__(self):
        eps = check_number(
            self.eps,
            "eps",
            "ActNorm",
            rule="a finite number > 0",
            ok=lambda v: v > 0,
            about="is added to the initial standard deviation (so constant channels stay finite)",
            example="ActNorm(eps=1e-6)",
        )
        object.__setattr__(self, "eps", eps)

    def init(self, key: jax.Array, x: jax.Array) -> PyTree:
        """``{"bias": (C,), "log_scale": (C,)}`` that normalise the batch ``x`` per channel."""
        check_key(key, f"{type(self).__name__}.init")
        del key  # the initialisation is a function of the data alone
        check_input(x, "ActNorm", "init")
        with np.errstate(over="ignore", under="ignore"):
            rounded = float(np.asarray(self.eps).astype(x.dtype))
        if not 0 < rounded < np.inf:
            raise ValueError(
                f"`eps={self.eps!r}` of ActNorm rounds to {rounded} in the {x.dtype} of the input `x`, so "
                f"init would give an infinite log-scale; use an eps that {x.dtype} holds "
                f"(at most {float(jnp.finfo(x.dtype).max):.3g}, and above 0 once rounded), e.g. 1e-6, "
                "the default."
            )
        axes = tuple(range(x.ndim - 1))
        std = jnp.std(x, axis=axes)
        return {"bias": -jnp.mean(x, axis=axes), "log_scale": -jnp.log(std + jnp.asarray(self.eps, x.dtype))}

    def forward(
        self, params: PyTree, x: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``((x + bias) * exp(log_scale), positions * sum(log_scale))``."""
        check_key(key, f"{type(self).__name__}.forward")
        del key
        check_input(x, "ActNorm", "forward")
        _check_channels("ActNorm", "forward", params["bias"].shape[-1], x, "x")
        log_scale = bounded_log_scale(params["log_scale"])
        y = (x + channels(params["bias"], x.ndim)) * channels(jnp.exp(log_scale), x.ndim)
        return y, constant_logdet(jnp.sum(log_scale) * _positions(x), x)

    def inverse(
        self, params: PyTree, y: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(y * exp(-log_scale) - bias, -positions * sum(log_scale))``."""
        check_key(key, f"{type(self).__name__}.inverse")
        del key
        check_input(y, "ActNorm", "inverse", arg="y")
        _check_channels("ActNorm", "inverse", params["bias"].shape[-1], y, "y")
        log_scale = bounded_log_scale(params["log_scale"])
        x = y * channels(jnp.exp(-log_scale), y.ndim) - channels(params["bias"], y.ndim)
        return x, constant_logdet(-jnp.sum(log_scale) * _positions(y), y)


def _permutation(spec: str | int, size: int) -> np.ndarray:
    if spec == "reverse":
        return np.arange(size)[::-1].copy()
    if spec == "none":
        return np.arange(size)
    return np.random.default_rng(spec).permutation(size)


@dataclasses.dataclass(frozen=True)
class InvertibleLinear:
    """An invertible linear map of the features, ``y = W x``, in an LU parameterisation.

    ``W = P L (U + diag(exp(log_scale)))`` with ``P`` a fixed permutation, ``L`` unit lower
    triangular and ``U`` strictly upper triangular (Glow's LU-decomposed 1x1 convolution). The
    diagonal of the triangular factor is positive by construction and ``log|det W| =
    sum(log_scale)``: no determinant or inverse of ``W`` is ever formed, and ``W`` stays invertible
    whatever values training gives the parameters. The inverse uses two triangular solves of
    ``C x C`` matrices; the permutation is applied to the ``C x C`` matrices, never to the batch.
    ``log_scale`` is used clipped to ``[-b, b]`` (:func:`bounded_log_scale`; ``b`` = 43.7 in
    float32, 354 in float64): the diagonal stays bounded away from zero, where float32's ``exp``
    would underflow (below about -87) and the inverse would return NaN.

    ``P`` is not a parameter: it is fixed by ``permutation`` and the number of features, and
    ``init`` returns ``L = U = 0`` and ``log_scale = 0``, so the layer starts as the permutation
    ``P`` (orthogonal, log-determinant 0). The default ``"reverse"`` reverses the features, which
    lets couplings that follow alternate the half they transform (RealNVP).

    Attributes:
      permutation: ``"reverse"``, ``"none"``, or an integer seed for a fixed random permutation.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> x = jnp.array([[1.0, 2.0, 3.0]])
      >>> params = inv.InvertibleLinear().init(jax.random.key(0), x)
      >>> y, logdet = inv.InvertibleLinear().forward(params, x)
      >>> y.tolist(), logdet.tolist()
      ([[3.0, 2.0, 1.0]], [0.0])

    References:
      Kingma, Dhariwal, "Glow: Generative Flow with Invertible 1x1 Convolutions", 2018.
    """

    permutation: str | int = "reverse"
    _ranks = (2,)

    def __post_init__(self):
        p = self.permutation
        seed = None if isinstance(p, str) else checks.integer(p)
        if seed is not None and seed >= 0:
            object.__setattr__(self, "permutation", seed)
        elif p not in ("reverse", "none"):
            error = ValueError if isinstance(p, str) or seed is not None else TypeError
            raise error(
                f"`permutation` of {type(self).__name__} must be 'reverse', 'none' or a non-negative int "
                f"seed for a fixed random permutation, but got {type(p).__name__} {p!r}."
            )

    def init(self, key: jax.Array, x: jax.Array) -> PyTree:
        """``{"lower": (C, C), "upper": (C, C), "log_scale": (C,)}``, all zero: ``W = P``."""
        check_key(key, f"{type(self).__name__}.init")
        del key
        check_input(x, type(self).__name__, "init", self._ranks)
        c = x.shape[-1]
        return {
            "lower": jnp.zeros((c, c), x.dtype),
            "upper": jnp.zeros((c, c), x.dtype),
            "log_scale": jnp.zeros((c,), x.dtype),
        }

    def _factors(self, params: PyTree) -> tuple[jax.Array, jax.Array]:
        lower, upper, log_scale = params["lower"], params["upper"], bounded_log_scale(params["log_scale"])
        eye = jnp.eye(lower.shape[0], dtype=lower.dtype)
        return jnp.tril(lower, -1) + eye, jnp.triu(upper, 1) + jnp.diag(jnp.exp(log_scale))

    def _check(self, params: PyTree, x: jax.Array, where: str, arg: str) -> int:
        check_input(x, type(self).__name__, where, self._ranks, arg=arg)
        _check_channels(type(self).__name__, where, params["log_scale"].shape[-1], x, arg)
        return _positions(x)

    def forward(
        self, params: PyTree, x: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(W x, positions * sum(log_scale))`` applied to the last axis."""
        check_key(key, f"{type(self).__name__}.forward")
        del key
        positions = self._check(params, x, "forward", "x")
        lower, upper = self._factors(params)
        w = (lower @ upper)[_permutation(self.permutation, x.shape[-1])]  # P L U: rows of L U permuted
        log_scale = bounded_log_scale(params["log_scale"])
        return jnp.einsum("...c,dc->...d", x, w), constant_logdet(jnp.sum(log_scale) * positions, x)

    def inverse(
        self, params: PyTree, y: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(W^-1 y, -positions * sum(log_scale))``, by triangular solves."""
        check_key(key, f"{type(self).__name__}.inverse")
        del key
        positions = self._check(params, y, "inverse", "y")
        lower, upper = self._factors(params)
        eye = jnp.eye(lower.shape[0], dtype=lower.dtype)
        lower_inv = solve_triangular(lower, eye, lower=True, unit_diagonal=True)
        lu_inv = solve_triangular(upper, lower_inv, lower=False)  # U^-1 L^-1
        w_inv = lu_inv[:, _permutation(self.permutation, y.shape[-1])]  # (P L U)^-1 = U^-1 L^-1 P^T
        x = jnp.einsum("...d,cd->...c", y, w_inv)
        return x, constant_logdet(-jnp.sum(bounded_log_scale(params["log_scale"])) * positions, y)


@dataclasses.dataclass(frozen=True)
class Inv1x1Conv(InvertibleLinear):
    """Glow's invertible 1x1 convolution for NHWC images: :class:`InvertibleLinear` on the channels.

    Every pixel's channel vector is multiplied by the same ``W = P L (U + diag(exp(log_scale)))``,
    so ``logdet = H * W * sum(log_scale)``. Inputs must have rank 4 (batch, height, width,
    channels).

    Attributes:
      permutation: ``"reverse"``, ``"none"``, or an integer seed for a fixed random permutation.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> x = jax.random.normal(jax.random.key(0), (2, 4, 4, 3))
      >>> layer = inv.Inv1x1Conv()
      >>> params = layer.init(jax.random.key(1), x)
      >>> y, logdet = layer.forward(params, x)
      >>> bool(jnp.all(y == x[..., ::-1]))
      True

    References:
      Kingma, Dhariwal, "Glow: Generative Flow with Invertible 1x1 Convolutions", 2018.
    """

    _ranks = (4,)


@dataclasses.dataclass(frozen=True)
class Squeeze:
    """Trades space for channels: ``(N, H, W, C) -> (N, H/2, W/2, 4C)``, log-determinant 0.

    Each 2x2 block of pixels becomes one pixel with four times the channels (RealNVP's squeeze),
    ordered (row in block, column in block, channel). It is a permutation of the entries, so it is
    exactly invertible. It has no parameters (``init`` returns ``{}``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> y, logdet = inv.Squeeze().forward({}, jnp.zeros((2, 8, 8, 1)))
      >>> y.shape
      (2, 4, 4, 4)

    References:
      Dinh, Sohl-Dickstein, Bengio, "Density estimation using Real NVP", 2017.
    """

    def init(self, key: jax.Array, x: jax.Array) -> PyTree:
        """``{}``: the layer has no parameters (``x`` is checked)."""
        check_key(key, f"{type(self).__name__}.init")
        del key
        self._check(x, "init")
        return {}

    @staticmethod
    def _check(x: jax.Array, where: str, arg: str = "x") -> None:
        check_input(x, "Squeeze", where, (4,), arg=arg)
        if where != "inverse" and (x.shape[1] % 2 or x.shape[2] % 2):
            raise ValueError(
                f"`x` of Squeeze.{where} must have an even height and width, but got shape {x.shape}; "
                "pad or crop the images to even sizes first."
            )
        if where == "inverse" and x.shape[3] % 4:
            raise ValueError(
                f"`y` of Squeeze.inverse must have a multiple of 4 channels, but got shape {x.shape}."
            )

    def forward(
        self, params: PyTree, x: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(x with 2x2 blocks moved to channels, zeros)``."""
        check_key(key, f"{type(self).__name__}.forward")
        del params, key
        self._check(x, "forward")
        n, h, w, c = x.shape
        y = (
            x.reshape(n, h // 2, 2, w // 2, 2, c)
            .transpose(0, 1, 3, 2, 4, 5)
            .reshape(n, h // 2, w // 2, 4 * c)
        )
        return y, jnp.zeros((n,), x.dtype)

    def inverse(
        self, params: PyTree, y: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(y with channels moved back to 2x2 blocks, zeros)``."""
        check_key(key, f"{type(self).__name__}.inverse")
        del params, key
        self._check(y, "inverse", arg="y")
        n, h, w, c4 = y.shape
        c = c4 // 4
        x = y.reshape(n, h, w, 2, 2, c).transpose(0, 1, 3, 2, 4, 5).reshape(n, 2 * h, 2 * w, c)
        return x, jnp.zeros((n,), y.dtype)
