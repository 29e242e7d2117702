"""Random helpers that take explicit keys (no hidden RNG state)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
      drop_rate: probability of dropping each entry, in ``[0, 1)``.

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
    if not 0.0 <= drop_rate < 1.0:
        raise ValueError(
            f"`drop_rate` is the probability of dropping an entry and must be in [0, 1), but got "
            f"{drop_rate!r}."
        )
    if key is None or drop_rate == 0.0:
        return x
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    single = key.shape == () if typed else key.shape == (2,)
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
    scale = jnp.where(keep, jnp.asarray(1.0 / (1.0 - drop_rate), x.dtype), jnp.asarray(0, x.dtype))
    return x * scale
