"""Blocks of the curvature: the operator restricted to a subset of the parameters.

A block is a *mask*: a pytree with the structure of ``params`` whose leaves hold 1 inside the
block and 0 outside, each broadcastable to its parameter (so a stage's mask of a
:class:`pipejax.StageParams` leaf ``(num_stages, size)`` is a one-hot ``(num_stages, 1)``). The
block's operator is ``P H P`` with ``P`` the mask: on the block's subspace it is the diagonal
block ``H_bb`` of the Hessian, whose trace, top eigenvalues and spectral density the tools
return for every block in one call (a ``lax.map`` over the stacked masks, so the HVP is traced
and compiled once, whatever the number of blocks). Each block costs what the whole operator
costs: a block's product is a full HVP, masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def stage_blocks(params: PyTree, support: PyTree | None = None) -> list[PyTree]:
    """One block per stage, for parameters whose leaves share a leading stage axis.

    Args:
      params: e.g. the :class:`pipejax.StageParams` that ``apply.place`` returns (every leaf of
        shape ``(num_stages, ...)``).
      support: optionally a pytree like ``params`` that is nonzero at the real entries and zero
        at padding: ``apply.place(jax.tree.map(jnp.ones_like, per_stage_params))``. A stage's
        packed row is padded to the longest stage; the loss does not depend on the padding, so
        it adds zero eigenvalues to the stage's spectrum unless masked out.

    Returns:
      A list of ``num_stages`` masks, for the ``blocks=`` argument.

    Raises:
      ValueError: leaves without a common leading axis; a ``support`` not shaped like ``params``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pipejax.hessian import stage_blocks
      >>> masks = stage_blocks({"w": jnp.zeros((3, 5))})
      >>> len(masks), masks[1]["w"].ravel().tolist()
      (3, [0.0, 1.0, 0.0])
    """
    leaves = jax.tree.leaves(params)
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "`params` of stage_blocks must have one leading stage axis on every leaf, got leaf shapes "
            f"{[jnp.shape(a) for a in leaves]}; build the blocks by hand (masks like `params`)."
        )
    (num,) = sizes

    def mask(s, a, keep):
        dtype = jnp.result_type(a)
        one_hot = (jnp.arange(num) == s).astype(dtype).reshape((num,) + (1,) * (jnp.ndim(a) - 1))
        return one_hot if keep is None else one_hot * (jnp.asarray(keep) != 0).astype(dtype)

    if support is None:
        return [jax.tree.map(lambda a, s=s: mask(s, a, None), params) for s in range(num)]
    if jax.tree.structure(support) != jax.tree.structure(params):
        raise ValueError(
            f"`support` of stage_blocks must have the pytree structure of `params` "
            f"({jax.tree.structure(params)}), but got {jax.tree.structure(support)}. Build it like "
            "`params`: `apply.place(jax.tree.map(jnp.ones_like, per_stage_params))`."
        )
    for (path, k), a in zip(jax.tree_util.tree_leaves_with_path(support), leaves, strict=True):
        try:
            ok = np.broadcast_shapes(jnp.shape(k), jnp.shape(a)) == jnp.shape(a)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"`support` of stage_blocks leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(k)}, "
                f"which does not broadcast to the parameter's shape {jnp.shape(a)}. Build `support` "
                "like `params`: `apply.place(jax.tree.map(jnp.ones_like, per_stage_params))`."
            )
    return [jax.tree.map(lambda a, k, s=s: mask(s, a, k), params, support) for s in range(num)]


def prepare(blocks: Any, params: PyTree) -> tuple[PyTree, list[int | None]]:
    """Checks ``blocks`` and stacks them: ``(masks with a leading block axis, entries per block)``.

    The entries are counted where the masks are concrete (``None`` under a trace).
    """
    if not isinstance(blocks, Sequence) or isinstance(blocks, str) or not blocks:
        raise TypeError(
            "`blocks` must be a non-empty list of masks (pytrees like `params`, 1 inside the block, 0 "
            f"outside), got {type(blocks).__name__}. For one block per pipeline stage use "
            "`pipejax.hessian.stage_blocks(params)`."
        )
    structure = jax.tree.structure(params)
    shapes = [jnp.shape(p) for p in jax.tree.leaves(params)]
    for b, mask in enumerate(blocks):
        if jax.tree.structure(mask) != structure:
            raise ValueError(
                f"`blocks[{b}]` must have the pytree structure of `params` ({structure}), got "
                f"{jax.tree.structure(mask)}."
            )
        for (path, m), shape in zip(jax.tree_util.tree_leaves_with_path(mask), shapes, strict=True):
            try:
                np.broadcast_shapes(jnp.shape(m), shape)
                ok = len(jnp.shape(m)) <= len(shape) and np.broadcast_shapes(jnp.shape(m), shape) == shape
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"`blocks[{b}]` leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(m)}, which does "
                    f"not broadcast to the parameter's shape {shape}."
                )
    sizes = []
    for b, mask in enumerate(blocks):
        if any(isinstance(m, jax.core.Tracer) for m in jax.tree.leaves(mask)):
            sizes.append(None)
            continue
        count = sum(
            int(np.count_nonzero(np.broadcast_to(np.asarray(m), shape)))
            for m, shape in zip(jax.tree.leaves(mask), shapes, strict=True)
        )
        if count == 0:
            raise ValueError(f"`blocks[{b}]` is empty (all zeros): a block needs at least one parameter.")
        sizes.append(count)

    def stack(*ms):
        shape = np.broadcast_shapes(*(jnp.shape(m) for m in ms))
        return jnp.stack([jnp.broadcast_to(jnp.asarray(m), shape) for m in ms])

    return jax.tree.map(stack, *blocks), sizes


def map_blocks(fn, masks: PyTree | None, key: jax.Array):
    """``fn(mask, key)`` for the whole operator (``masks=None``) or stacked over every block."""
    if masks is None:
        return fn(None, key)
    count = jax.tree.leaves(masks)[0].shape[0]
    return jax.lax.map(lambda xs: fn(xs[0], jax.random.fold_in(key, xs[1])), (masks, jnp.arange(count)))


def dimension(params: PyTree, blocks: Any) -> tuple[PyTree | None, int]:
    """The stacked masks (``None`` without blocks) and the smallest dimension of the operators."""
    n = sum(int(np.prod(jnp.shape(p))) for p in jax.tree.leaves(params))
    if blocks is None:
        return None, n
    masks, sizes = prepare(blocks, params)
    return masks, min([s for s in sizes if s is not None], default=n)
