"""Coupling layers: half of the features is transformed by a network of the other half.

The last axis of ``x`` is cut in two: ``x_a = x[..., :C // 2]`` and ``x_b = x[..., C // 2:]``.
The conditioning half passes through unchanged and feeds a network whose output transforms the
other half elementwise, so the Jacobian is triangular and the inverse needs the network only in
the forward direction. The network is an MLP for vectors ``(batch, C)`` and a small CNN for NHWC
images (3x3 conv, 1x1 conv, 3x3 conv, SAME padding); its last layer starts at zero, so every
coupling starts as the identity map.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pipejax._src import checks
from pipejax._src.invertible.base import (
    PyTree,
    channels,
    check_input,
    check_key,
    check_number,
    fold,
    log_scale_bound,
    per_example_sum,
)
from pipejax._src.random import dropout

_CONV_DIMS = ("NHWC", "HWIO", "NHWC")


def _net_shapes(rank: int, c_in: int, hidden: int, c_out: int) -> list[tuple[int, ...]]:
    if rank == 2:
        return [(c_in, hidden), (hidden, hidden), (hidden, c_out)]
    return [(3, 3, c_in, hidden), (1, 1, hidden, hidden), (3, 3, hidden, c_out)]


def init_net(key: jax.Array, cond: jax.Array, hidden: int, c_out: int) -> list[PyTree]:
    """Three layers ``{"w", "b"}``: LeCun-uniform hidden weights and a zero last layer.

    Uniform on ``[-sqrt(3 / fan_in), sqrt(3 / fan_in)]`` has LeCun-normal's variance. All hidden
    weights come from one flat ``jax.random.uniform`` draw: on CPU each random draw compiles its
    own threefry kernel, and multi-axis normal draws compile several times slower still.
    """
    shapes = _net_shapes(cond.ndim, cond.shape[-1], hidden, c_out)
    sizes = [math.prod(shape) for shape in shapes[:-1]]
    draw = jax.random.uniform(key, (sum(sizes),), cond.dtype, -1.0, 1.0)
    net, start = [], 0
    for shape, size in zip(shapes[:-1], sizes, strict=True):
        bound = jnp.asarray(math.sqrt(3.0 / math.prod(shape[:-1])), cond.dtype)
        w = draw[start : start + size].reshape(shape) * bound
        net.append({"w": w, "b": jnp.zeros(shape[-1:], cond.dtype)})
        start += size
    last = shapes[-1]
    net.append({"w": jnp.zeros(last, cond.dtype), "b": jnp.zeros(last[-1:], cond.dtype)})
    return net


def apply_net(
    net: list[PyTree],
    h: jax.Array,
    key: jax.Array | None,
    activation: Callable[[jax.Array], jax.Array],
    drop_rate: float,
) -> jax.Array:
    """The network; hidden layer ``i`` drops units with ``fold_in(key, i)`` (none without a key)."""
    for i, p in enumerate(net):
        if h.ndim == 2:
            h = h @ p["w"] + p["b"][None]
        else:
            h = jax.lax.conv_general_dilated(h, p["w"], (1, 1), "SAME", dimension_numbers=_CONV_DIMS)
            h = h + channels(p["b"], 4)
        if i < len(net) - 1:
            h = dropout(activation(h), fold(key, i), drop_rate)
    return h


@dataclasses.dataclass(frozen=True)
class _Coupling:
    hidden: int
    flip: bool = dataclasses.field(default=False, kw_only=True)
    drop_rate: float = dataclasses.field(default=0.0, kw_only=True)
    activation: Callable[[jax.Array], jax.Array] = dataclasses.field(default=jax.nn.gelu, kw_only=True)

    def __post_init__(self):
        name = type(self).__name__
        hidden = checks.check_int(
            self.hidden,
            "hidden",
            where=name,
            what=f"the width of its network's hidden layers, e.g. {name}(hidden=64)",
        )
        object.__setattr__(self, "hidden", hidden)
        flip = checks.check_bool(
            self.flip, "flip", where=name, alternative=" (transform the first half instead of the second)"
        )
        object.__setattr__(self, "flip", flip)
        drop_rate = check_number(
            self.drop_rate,
            "drop_rate",
            name,
            rule="a number in [0, 1)",
            ok=lambda v: 0.0 <= v < 1.0,
            about="is the probability of dropping a hidden unit",
            example=f"{name}(hidden=64, drop_rate=0.1)",
        )
        object.__setattr__(self, "drop_rate", drop_rate)
        if not callable(self.activation):
            raise TypeError(f"`activation` of {name} must be callable, but got {self.activation!r}.")

    # Subclasses: how many network outputs per transformed channel, and the elementwise map.
    _outputs_per_channel = 1

    def _transform(self, out: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def _untransform(self, out: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def _split(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(conditioning half, transformed half)``."""
        a = x.shape[-1] // 2
        first, second = x[..., :a], x[..., a:]
        return (second, first) if self.flip else (first, second)

    def _join(self, cond: jax.Array, trans: jax.Array) -> jax.Array:
        return jnp.concatenate([trans, cond] if self.flip else [cond, trans], axis=-1)

    def _check(self, x: jax.Array, where: str, arg: str, params: PyTree | None = None) -> None:
        name = type(self).__name__
        check_input(x, name, where, (2, 4), arg=arg)
        if x.shape[-1] < 2:
            raise ValueError(
                f"`{arg}` of {name}.{where} must have at least 2 features on its last axis to split in "
                f"half, but got shape {x.shape}."
            )
        if params is not None:
            w = params["net"][0]["w"]
            cond = self._split(x)[0].shape[-1]
            if w.ndim != x.ndim or w.shape[-2] != cond:
                raise ValueError(
                    f"`params` of {name}.{where} were made by init for inputs of another shape "
                    f"(first weight {w.shape}), but `{arg}` has shape {x.shape}; call init with a batch "
                    f"like `{arg}`."
                )

    def init(self, key: jax.Array, x: jax.Array) -> PyTree:
        """``{"net": [three layers {"w", "b"}]}``; the last layer is zero, so the map is the identity."""
        check_key(key, f"{type(self).__name__}.init", optional=False)
        self._check(x, "init", "x")
        cond, trans = self._split(x)
        return {"net": init_net(key, cond, self.hidden, self._outputs_per_channel * trans.shape[-1])}

    def forward(
        self, params: PyTree, x: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(y, logdet)``: the conditioning half unchanged, the other half transformed."""
        check_key(key, f"{type(self).__name__}.forward")
        self._check(x, "forward", "x", params)
        cond, trans = self._split(x)
        out = apply_net(params["net"], cond, key, self.activation, self.drop_rate)
        y, logdet = self._transform(out, trans)
        return self._join(cond, y), logdet

    def inverse(
        self, params: PyTree, y: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``(x, logdet)``; the forward's ``key`` gives the same dropout masks, hence the exact inverse."""
        check_key(key, f"{type(self).__name__}.inverse")
        self._check(y, "inverse", "y", params)
        cond, trans = self._split(y)
        out = apply_net(params["net"], cond, key, self.activation, self.drop_rate)
        x, logdet = self._untransform(out, trans)
        return self._join(cond, x), logdet


@dataclasses.dataclass(frozen=True)
class AdditiveCoupling(_Coupling):
    """NICE's additive coupling: ``y_b = x_b + t(x_a)``, volume preserving (logdet 0).

    With ``flip=True`` the halves swap roles (``x_b`` conditions, ``x_a`` is shifted). Alternate
    ``flip`` or put an :class:`InvertibleLinear` between couplings so every feature gets
    transformed. With dropout (``drop_rate > 0`` and a key) the inverse needs the forward's key.

    Attributes:
      hidden: width of the network's hidden layers (channels for images).
      flip: transform the first half instead of the second.
      drop_rate: probability of dropping a hidden unit of the network (only when a key is given).
      activation: the network's nonlinearity (smooth by default, so Hessians are informative).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> layer = inv.AdditiveCoupling(hidden=16)
      >>> x = jax.random.normal(jax.random.key(0), (8, 4))
      >>> params = layer.init(jax.random.key(1), x)
      >>> y, logdet = layer.forward(params, x)  # the identity at initialisation
      >>> bool(jnp.all(y == x)), logdet.shape
      (True, (8,))

    References:
      Dinh, Krueger, Bengio, "NICE: Non-linear Independent Components Estimation", 2015.
      Gomez, Ren, Urtasun, Grosse, "The Reversible Residual Network", 2017.
    """

    def _transform(self, out, x):
        return x + out, jnp.zeros(x.shape[:1], x.dtype)

    def _untransform(self, out, y):
        return y - out, jnp.zeros(y.shape[:1], y.dtype)


@dataclasses.dataclass(frozen=True)
class AffineCoupling(_Coupling):
    """RealNVP's affine coupling with a bounded scale: ``y_b = x_b * exp(s(x_a)) + t(x_a)``.

    The network outputs a shift ``t`` and a raw scale ``r``; the log-scale is soft-clamped,
    ``s = scale_bound * tanh(r / scale_bound)``, so each coupling's Lipschitz constant stays below
    ``exp(scale_bound)`` times that of the network (this bounds the reconstruction drift of
    ``memory="constant"`` chains). ``logdet = sum(s)`` over the transformed entries; it depends on
    ``x_a`` through the network, and the gradient includes that dependence.

    Attributes:
      hidden: width of the network's hidden layers (channels for images).
      scale_bound: the bound on ``|s|``; a finite number > 0 that the input's dtype holds with
        ``exp(+-scale_bound)`` normal (at most 43.67 in float32, 354 in float64; checked at trace).
      flip: transform the first half instead of the second.
      drop_rate: probability of dropping a hidden unit of the network (only when a key is given).
      activation: the network's nonlinearity.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> layer = inv.AffineCoupling(hidden=16, flip=True)
      >>> x = jax.random.normal(jax.random.key(0), (8, 5))
      >>> params = layer.init(jax.random.key(1), x)
      >>> params = jax.tree.map(lambda p: p + 0.1, params)  # away from the identity
      >>> y, logdet = layer.forward(params, x)
      >>> x_back, minus_logdet = layer.inverse(params, y)
      >>> bool(jnp.allclose(x_back, x, atol=1e-5)), bool(jnp.allclose(minus_logdet, -logdet))
      (True, True)

    References:
      Dinh, Sohl-Dickstein, Bengio, "Density estimation using Real NVP", 2017.
      Ardizzone et al., "Guided Image Generation with Conditional Invertible Neural Networks"
      (soft clamping of the scale), 2019.
    """

    scale_bound: float = dataclasses.field(default=2.0, kw_only=True)
    _outputs_per_channel = 2

    def __post_init__(self):
        super().__post_init__()
        bound = check_number(
            self.scale_bound,
            "scale_bound",
            "AffineCoupling",
            rule="a positive finite number",
            ok=lambda v: v > 0,
            about="bounds |log-scale|",
            example="AffineCoupling(hidden=64, scale_bound=2.0)",
        )
        object.__setattr__(self, "scale_bound", bound)

    def _check(self, x: jax.Array, where: str, arg: str, params: PyTree | None = None) -> None:
        super()._check(x, where, arg, params)
        # The bound is used in x's dtype: it must not round to 0 (0 / 0 in tanh(r / bound)), and
        # exp(+-s) must stay normal numbers, or the inverse multiplies inf by 0.
        low, high = float(jnp.finfo(x.dtype).tiny), log_scale_bound(x.dtype)
        if not low <= self.scale_bound <= high:
            why = (
                "rounds to 0 or a subnormal there and tanh(r / scale_bound) is 0 / 0 = NaN"
                if self.scale_bound < low
                else "lets exp(s) overflow and exp(-s) underflow to 0 there, so the inverse gives NaN"
            )
            raise ValueError(
                f"`scale_bound={self.scale_bound!r}` of AffineCoupling does not fit the {x.dtype} of `{arg}` "
                f"in {type(self).__name__}.{where}: it {why}. Use a scale_bound in [{low:.3g}, {high:.4g}] "
                f"for {x.dtype} (the same bound ActNorm and InvertibleLinear put on their log-scales), "
                "e.g. 2.0, the default."
            )

    def _log_scale_shift(self, out: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = out.shape[-1] // 2
        shift, raw = out[..., :c], out[..., c:]
        bound = jnp.asarray(self.scale_bound, out.dtype)
        return bound * jnp.tanh(raw / bound), shift

    def _transform(self, out, x):
        log_scale, shift = self._log_scale_shift(out)
        return x * jnp.exp(log_scale) + shift, per_example_sum(log_scale)

    def _untransform(self, out, y):
        log_scale, shift = self._log_scale_shift(out)
        return (y - shift) * jnp.exp(-log_scale), -per_example_sum(log_scale)
