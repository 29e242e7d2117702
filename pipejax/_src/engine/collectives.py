"""The collectives of the tick loop on a mesh: ring sends (:func:`shift`), slot writes
(:func:`put`), exact sums (:func:`sum_exact`) and the varying casts they need."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from pipejax._src import compat


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _lead(tree):
    """Every leaf with a leading axis of 1 (accumulators are written as ``acc[0, i]``)."""
    return jax.tree.map(lambda a: a[None], tree)


def _unlead(tree):
    return jax.tree.map(lambda a: a[0], tree)


def _unstack(tree, n):
    return [jax.tree.map(lambda a, d=d: a[d], tree) for d in range(n)]


def shift(tree, axis_name, n, ring=False, back=False):
    """Sends every device's value to the next device along the stage axis (last to first:
    ``ring``); ``back``: to the previous one (first to last: ``ring``). Activations go forward,
    cotangents of the training schedules back."""
    if n == 1:
        return tree
    step = -1 if back else 1
    perm = [(s, s + step) for s in range(n) if 0 <= s + step < n]
    if ring:
        perm.append((n - 1, 0) if not back else (0, n - 1))
    return lax.ppermute(tree, axis_name, perm)


def put(buf, value, slot, enabled):
    """``buf[slot] = value`` where ``enabled``; unchanged otherwise (``buf`` leaves ``(K, ...)``).

    A scatter whose index is out of range (``K``, dropped) where not ``enabled``, which XLA
    updates in place. Selecting between ``value`` and the slot's old value instead made XLA:CPU
    read the old value into a buffer of its own, live across the tick's F: one stash entry more
    of temp memory (``docs/decisions/0035-stash-write-as-dropped-scatter.md``)."""

    def one(a, v):
        return a.at[jnp.where(enabled, slot, a.shape[0])].set(v, mode="drop")

    return jax.tree.map(one, buf, value)


def sum_exact(tree, axis_name):
    """The ``psum`` of buffers that every device but one holds as zeros: exact (booleans: or)."""

    def one(a):
        if a.dtype == jnp.bool_:
            return lax.psum(a.astype(jnp.int32), axis_name) > 0
        if jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
            # bfloat16 / float16 summed as float32 (exact: one term is not zero). XLA:CPU
            # crashed compiling a bfloat16 all-reduce in a shard_map manual over some axes
            # only (``param_specs``): "Invalid binary instruction opcode copy".
            return lax.psum(a.astype(jnp.float32), axis_name).astype(a.dtype)
        return lax.psum(a, axis_name)

    return jax.tree.map(one, tree)


def _as_varying(tree, template, axes):
    """``tree`` with the sharding type of ``template`` (varying), values unchanged.

    Used inside branches, where ``pcast`` must not appear. A stage output that depends on no
    device-varying value is written into a varying buffer; ``dynamic_update_slice`` is exact and
    its transpose has no collective. (Everything a stage reads is cast to vary along every axis
    before the loop, so only constants get here.)
    """

    def fix(v, t):
        if set(axes) <= compat.varying_axes(v):
            return v
        return lax.dynamic_update_slice(t, v.astype(t.dtype), (0,) * t.ndim)

    return jax.tree.map(fix, tree, template)


def _gather_stages(tree, s, n, axis_name):
    """Every device's ``tree`` stacked on a new leading device axis, replicated on every device.

    Device ``s`` writes its value into row ``s`` of zeros and a ``psum`` adds the rows: every
    other term is an exact zero, so each row is bitwise its device's value.
    """
    place = lambda a: lax.dynamic_update_index_in_dim(jnp.zeros((n, *a.shape), a.dtype), a, s, 0)
    return sum_exact(jax.tree.map(place, tree), axis_name)
