"""MultiScale: Glow/RealNVP's multi-scale architecture, factoring out half the channels per level."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pipejax._src.invertible.base import Layer, PyTree, check_key, check_layer, fold, zero_logdet


@dataclasses.dataclass(frozen=True)
class MultiScale:
    """Levels of a multi-scale flow; after every level but the last, half the channels leave.

    Level ``i`` maps the current ``h`` to ``h'`` (typically ``Squeeze`` then K steps of flow); then
    the first half of ``h'``'s channels is factored out as the latent ``z_i`` -- it goes straight
    to the base distribution -- and the second half continues to level ``i + 1``. The output is the
    tuple ``(z_0, ..., z_{L-2}, h_final)``: a pytree latent whose shapes carry everything the
    inverse needs. :class:`Flow` sums the base log-density over its leaves.

    Factoring out halves the work of every later level, and gives early latents a short path to
    the data (RealNVP). Glow also learns a conditional prior for each ``z_i``; here every latent
    is standard normal.

    Args:
      levels: the invertible layers of the levels, in order (each often a :class:`Chain`).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax.invertible as inv
      >>> def level(k):
      ...     steps = inv.Chain([inv.ActNorm(), inv.Inv1x1Conv(), inv.AffineCoupling(hidden=8)], repeat=k)
      ...     return inv.Chain([inv.Squeeze(), steps], memory="linear")
      >>> flow = inv.MultiScale([level(2), level(2)])
      >>> x = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))
      >>> params = jax.jit(flow.init)(jax.random.key(1), x)
      >>> z, logdet = jax.jit(flow.forward)(params, x)
      >>> [a.shape for a in z]
      [(4, 4, 4, 2), (4, 2, 2, 8)]

    References:
      Dinh, Sohl-Dickstein, Bengio, "Density estimation using Real NVP", 2017.
      Kingma, Dhariwal, "Glow: Generative Flow with Invertible 1x1 Convolutions", 2018.
    """

    levels: Sequence[Layer]

    def __post_init__(self):
        if not isinstance(self.levels, Sequence) or not self.levels:
            raise TypeError(
                f"`levels` of MultiScale must be a non-empty sequence of layers, but got {self.levels!r}."
            )
        object.__setattr__(self, "levels", tuple(self.levels))
        for i, level in enumerate(self.levels):
            check_layer(level, f"`levels[{i}]` of MultiScale")

    def _split(self, h: jax.Array, i: int) -> tuple[jax.Array, jax.Array]:
        c = h.shape[-1]
        if c % 2:
            raise ValueError(
                f"MultiScale factors out half the channels after level {i}, so that level must output an "
                f"even number of channels, but it outputs shape {h.shape}; change that level's channel "
                "count (e.g. end it with a Squeeze, which multiplies the channels by 4)."
            )
        return h[..., : c // 2], h[..., c // 2 :]

    def init(self, key: jax.Array, x: jax.Array) -> tuple[PyTree, ...]:
        """One parameter entry per level, each initialised on the data that reaches it."""
        check_key(key, "MultiScale.init")
        params, h = [], x
        for i, (level, k) in enumerate(
            zip(self.levels, jax.random.split(key, len(self.levels)), strict=True)
        ):
            p = level.init(k, h)
            h, _ = level.forward(p, h)
            if i < len(self.levels) - 1:
                h = self._split(h, i)[1]
            params.append(p)
        return tuple(params)

    def _check_params(self, params: PyTree, where: str) -> None:
        if not isinstance(params, tuple | list) or len(params) != len(self.levels):
            raise ValueError(
                f"`params` of MultiScale.{where} must be the tuple returned by MultiScale.init, one entry "
                f"per level ({len(self.levels)}), but got {type(params).__name__}"
                + (f" of length {len(params)}." if isinstance(params, tuple | list) else ".")
            )

    def forward(self, params: PyTree, x: jax.Array, key: jax.Array | None = None) -> tuple[tuple, jax.Array]:
        """``((z_0, ..., z_{L-2}, h_final), logdet)``; level ``i`` gets ``fold_in(key, i)``."""
        check_key(key, "MultiScale.forward")
        self._check_params(params, "forward")
        latents, h, logdet = [], x, zero_logdet(x)
        for i, (level, p) in enumerate(zip(self.levels, params, strict=True)):
            h, ld = level.forward(p, h, fold(key, i))
            logdet = logdet + ld
            if i < len(self.levels) - 1:
                z, h = self._split(h, i)
                latents.append(z)
        return (*latents, h), logdet

    def inverse(self, params: PyTree, z: tuple, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(x, logdet)`` from the tuple of latents that :meth:`forward` returns."""
        check_key(key, "MultiScale.inverse")
        self._check_params(params, "inverse")
        if not isinstance(z, tuple | list) or len(z) != len(self.levels):
            raise ValueError(
                f"`z` of MultiScale.inverse must be a tuple of {len(self.levels)} latents (one per level, as "
                f"forward returns them), but got {type(z).__name__}"
                + (f" of length {len(z)}." if isinstance(z, tuple | list) else ".")
            )
        h, logdet = z[-1], zero_logdet(z[-1])
        for i in reversed(range(len(self.levels))):
            if i < len(self.levels) - 1:
                h = jnp.concatenate([z[i], h], axis=-1)
            h, ld = self.levels[i].inverse(params[i], h, fold(key, i))
            logdet = logdet + ld
        return h, logdet
