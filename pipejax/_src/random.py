"""Random helpers that take explicit keys (no hidden RNG state)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks


def dropout(x: jax.Array, key: jax.Array | None, drop_rate: float) -> jax.Array:
    """Inverted dropout: zeroes each entry with probability ``drop_rate``, rescales the rest.

    ``drop_rate`` is the probability of *dropping* an entry (not of keeping it). Kept entries are
    divided by ``1 - drop_rate`` so the expectation is unchanged. ``key=None`` or
    ``drop_rate == 0`` returns ``x`` unchanged (evaluation).

    ``key`` is one PRNG key, or an array of per-example keys whose shape is the leading axis of
    ``x`` (what a pipeline with ``per_example_keys=True`` hands its stages): row ``r`` of ``x`` is
    then masked with ``key[r]`` alone, so the mask of an example does not depend on which other
    examples share its micro-batch.

    Args:
      x: the activations.
      key: a PRNG key, a batch of keys matching ``x.shape[0]``, or ``None``.
      drop_rate: probability of dropping each entry, in ``[0, 1)``: a Python or numpy float, or a
        0-d float array. A traced rate (an argument of a jitted function) cannot be checked at
        trace time; it is clipped to ``[0, 1]``, and a rate of 1 drops every entry (zeros).

    Returns:
      ``x`` with dropped entries set to zero and kept ones scaled by ``1 / (1 - drop_rate)``
      (computed as ``x * mask / (1 - drop_rate)``, so a dropped ``inf`` or ``nan`` becomes ``nan``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> y = pj.dropout(jnp.ones((2, 1000)), jax.random.key(0), drop_rate=0.25)
      >>> bool(jnp.all((y == 0) | (y == 1 / 0.75)))
      True
    """
    traced = isinstance(drop_rate, jax.core.Tracer)
    if traced:
        if jnp.ndim(drop_rate) or not jnp.issubdtype(drop_rate.dtype, jnp.floating):
            raise TypeError(
                f"`drop_rate` of dropout must be a float scalar, but got a traced array of shape "
                f"{jnp.shape(drop_rate)} and dtype {drop_rate.dtype}."
            )
    else:
        rate = checks.concrete(drop_rate) if hasattr(drop_rate, "dtype") else None
        if isinstance(drop_rate, bool) or not (
            isinstance(drop_rate, numbers.Real)
            or (
                rate is not None
                and rate.ndim == 0
                and (np.issubdtype(rate.dtype, np.floating) or np.issubdtype(rate.dtype, np.integer))
            )
        ):
            raise TypeError(
                f"`drop_rate` of dropout must be a float in [0, 1) (the probability of dropping an "
                f"entry), but got {type(drop_rate).__name__} {drop_rate!r}; e.g. `drop_rate=0.1`."
            )
        if not 0.0 <= float(drop_rate) < 1.0:
            raise ValueError(
                f"`drop_rate` is the probability of dropping an entry and must be in [0, 1), but got "
                f"{drop_rate!r}."
            )
    if key is None or (not traced and float(drop_rate) == 0.0):
        return x
    typed = checks.check_keys(
        key, "key", "dropout", "Or pass one key per row of `x` (`jax.random.split(key, b)`)."
    )
    single = key.shape == () if typed else key.shape == (2,)
    if traced:
        drop_rate = jnp.clip(drop_rate, 0.0, 1.0)
    if single:
        keep = jax.random.bernoulli(key, 1.0 - drop_rate, x.shape)
    else:
        batch = key.shape[0]
        if batch != x.shape[0] or key.ndim != (1 if typed else 2):
            raise ValueError(
                f"`key` holds keys of shape {key.shape}, which is neither one key nor one key per "
                f"row of `x` (leading axis {x.shape[0]})."
            )
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - drop_rate, x.shape[1:]))(key)
    # x * (mask scaled by 1 / (1 - drop_rate)), not where(keep, x / (1 - drop_rate), 0): with the
    # latter, XLA on CPU fused the backward's product into a multiply-add (FMA) in some programs
    # and not in others, so checkpointed and plain gradients could differ in the last bit. This
    # form measured bitwise-equal in every checkpoint mode (tests/test_checkpoint_claims.py).
    if traced:  # rate 1 drops every entry: 1 / (1 - rate) is never used, and never inf
        kept = jnp.where(drop_rate < 1.0, 1.0 / jnp.where(drop_rate < 1.0, 1.0 - drop_rate, 1.0), 0.0)
        kept = kept.astype(x.dtype)
    else:
        kept = jnp.asarray(1.0 / (1.0 - float(drop_rate)), x.dtype)
    scale = jnp.where(keep, kept, jnp.asarray(0, x.dtype))
    return x * scale
