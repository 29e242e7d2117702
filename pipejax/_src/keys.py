"""Key derivation: which PRNG key each (micro-batch, stage) pair receives.

The rule, which users may rely on to reproduce any draw::

    key_for(i, s) = jax.random.fold_in(jax.random.fold_in(key, i), s)

for micro-batch ``i`` (0-based, in the order of the batch) and stage ``s``. It depends only on the
caller's key and the two indices: not on the device that runs the stage, on the checkpoint mode,
or on whether the segment is being recomputed. So recomputation replays the same dropout masks by
construction, and a run with or without a mesh draws the same numbers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pipejax._src import checks


def check_index(value: Any, name: str, where: str) -> None:
    """Raises unless ``value`` is an integer index in ``[0, 2**32)`` (what ``fold_in`` folds in).

    A traced index is not known at trace time; only its dtype is checked.
    """
    dtype = jnp.result_type(value) if hasattr(value, "dtype") or isinstance(value, int) else None
    if isinstance(value, bool) or dtype is None or not jnp.issubdtype(dtype, jnp.integer) or jnp.ndim(value):
        raise TypeError(
            f"`{name}` of {where} must be an integer index (a Python int or an integer scalar), but got "
            f"{type(value).__name__} {value!r}."
        )
    known = checks.index_value(value)
    if known is not None and not 0 <= known < 2**32:
        raise ValueError(
            f"`{name}` of {where} must be a 0-based index in [0, 2**32), but got {known}. Count "
            "micro-batches, stages and layers from 0 (the last stage of 4 is 3, not -1)."
        )


def key_for(key: jax.Array | None, microbatch: Any, stage: Any) -> jax.Array | None:
    """The key that ``stage`` receives for ``microbatch``; ``None`` when ``key`` is ``None``.

    Raises:
      TypeError: ``key`` is not one PRNG key, or an index is not an integer.
      ValueError: a negative index (indices count from 0).
    """
    checks.check_key(key)
    check_index(microbatch, "microbatch", "stage_key")
    check_index(stage, "stage", "stage_key")
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, microbatch), stage)


def example_keys_for(key: jax.Array | None, microbatch: Any, micro_size: int, stage: Any) -> jax.Array | None:
    """Per-example keys for ``stage`` on ``microbatch``: one key per row, shape ``(micro_size,)``.

    Row ``r`` of micro-batch ``i`` is example ``e = i * micro_size + r`` of the mini-batch, and
    receives ``fold_in(fold_in(key, e), stage)``. The key depends on the example and the stage
    only, not on how the batch was cut, so results do not change with ``chunks``. (Padding rows
    of an uneven batch get indices ``e >= B``; their outputs are dropped.)
    """
    if key is None:
        return None
    examples = microbatch * micro_size + jnp.arange(micro_size, dtype=jnp.int32)
    return jax.vmap(lambda e: jax.random.fold_in(jax.random.fold_in(key, e), stage))(examples)


def layer_key(stage_key: jax.Array | None, j: int) -> jax.Array | None:
    """The key layer ``j`` of a partitioned stage receives: ``jax.random.fold_in(stage_key, j)``.

    ``j`` counts the layers of the stage from 0. ``None`` stays ``None`` (a pipeline called
    without a key). A batch of keys (what a stage receives with ``per_example_keys=True``) is
    folded key by key, so every example keeps its own stream.

    Args:
      stage_key: the key the stage received (one key, a batch of keys, or ``None``).
      j: the layer's index within the stage.

    Returns:
      The layer's key (same shape as ``stage_key``), or ``None``.

    Examples:
      >>> import jax
      >>> import pipejax as pj
      >>> k = pj.layer_key(jax.random.key(0), 1)
      >>> bool(jax.random.key_data(k).tolist() == jax.random.key_data(
      ...     jax.random.fold_in(jax.random.key(0), 1)).tolist())
      True
      >>> pj.layer_key(None, 1) is None
      True
    """
    check_index(j, "j", "layer_key")
    if stage_key is None:
        return None
    purpose = "A batch of keys (what a stage receives with `per_example_keys=True`) is folded key by key."
    typed = checks.check_keys(stage_key, "stage_key", "layer_key", purpose)
    batch_dims = stage_key.ndim if typed else stage_key.ndim - 1  # raw keys are uint32[..., 2]

    def fold(k):
        return jax.random.fold_in(k, j)

    for _ in range(batch_dims):
        fold = jax.vmap(fold)
    return fold(stage_key)
