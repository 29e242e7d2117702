"""Linear algebra on pytrees, so vectors keep the structure and the sharding of the parameters.

A *vector* is a pytree of arrays (like the parameters). A *basis* of ``m`` vectors is the same
pytree with every leaf stacked on a new leading axis of size ``m``. Inner products multiply and sum
instead of contracting with ``dot``: on a mesh with Explicit axes, JAX refuses to guess the
sharding of a ``dot`` that contracts a sharded axis, while an elementwise product and a sum are
well defined.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def size(tree: PyTree) -> int:
    """The number of scalars in ``tree`` (static)."""
    return sum(int(leaf.size) for leaf in jax.tree.leaves(tree))


def dot(u: PyTree, v: PyTree) -> jax.Array:
    """The Euclidean inner product of two vectors of the same structure."""
    terms = [jnp.sum(a * b) for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(v), strict=True)]
    return sum(terms[1:], terms[0])


def norm(v: PyTree) -> jax.Array:
    return jnp.sqrt(dot(v, v))


def scale(c: jax.Array, v: PyTree) -> PyTree:
    return jax.tree.map(lambda a: a * c.astype(a.dtype), v)


def axpy(c: jax.Array, u: PyTree, v: PyTree) -> PyTree:
    """``c * u + v``."""
    return jax.tree.map(lambda a, b: a * c.astype(a.dtype) + b, u, v)


def cast(v: PyTree, like: PyTree) -> PyTree:
    """``v`` with the dtypes of ``like``."""
    return jax.tree.map(lambda a, b: a.astype(b.dtype), v, like)


def astype(v: PyTree, dtype: Any) -> PyTree:
    return jax.tree.map(lambda a: a.astype(dtype), v)


def zeros_basis(like: PyTree, m: int, dtype: Any) -> PyTree:
    """A basis of ``m`` zero vectors shaped (and sharded) like ``like``."""
    # repeat keeps the sharding of ``like`` on the trailing axes (broadcast_to would drop it)
    return jax.tree.map(lambda a: jnp.repeat(jnp.zeros_like(a, dtype)[None], m, axis=0), like)


def row(basis: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: a[i], basis)


def set_row(basis: PyTree, i: jax.Array, v: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: a.at[i].set(b.astype(a.dtype)), basis, v)


def project(basis: PyTree, v: PyTree) -> jax.Array:
    """The coefficients ``basis @ v``, shape ``(m,)``."""
    terms = [
        jnp.sum(q * a[None], axis=tuple(range(1, q.ndim)))
        for q, a in zip(jax.tree.leaves(basis), jax.tree.leaves(v), strict=True)
    ]
    return sum(terms[1:], terms[0])


def combine(coefs: jax.Array, basis: PyTree) -> PyTree:
    """The vector ``coefs @ basis``: a combination of the basis vectors."""
    return jax.tree.map(
        lambda q: jnp.sum(coefs.astype(q.dtype).reshape((-1,) + (1,) * (q.ndim - 1)) * q, axis=0), basis
    )


def combine_many(coefs: jax.Array, basis: PyTree) -> PyTree:
    """The basis ``coefs.T @ basis``: column ``j`` of ``coefs`` (shape ``(m, k)``) makes vector ``j``."""
    return jax.vmap(combine, in_axes=(1, None))(coefs, basis)


def orthogonalise(basis: PyTree, v: PyTree) -> tuple[PyTree, jax.Array]:
    """``v`` minus its projection on the (orthonormal or zero) rows of ``basis``, twice.

    Classical Gram-Schmidt repeated once more ("twice is enough", Giraud et al. 2005) is as
    accurate as modified Gram-Schmidt and is two matrix-vector products instead of a loop.
    Returns the new vector and the summed coefficients of the two passes.
    """
    c1 = project(basis, v)
    v = jax.tree.map(lambda a, b: a - b, v, combine(c1, basis))
    c2 = project(basis, v)
    v = jax.tree.map(lambda a, b: a - b, v, combine(c2, basis))
    return v, c1 + c2


def rademacher(key: jax.Array, like: PyTree, dtype: Any) -> PyTree:
    """A vector of independent +-1 entries shaped like ``like``."""
    leaves, treedef = jax.tree.flatten(like)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [
            _like(jax.random.rademacher(k, leaf.shape, dtype), leaf)
            for k, leaf in zip(keys, leaves, strict=True)
        ]
    )


def normal(key: jax.Array, like: PyTree, dtype: Any) -> PyTree:
    """A vector of independent standard normal entries shaped like ``like``."""
    leaves, treedef = jax.tree.flatten(like)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [_like(jax.random.normal(k, leaf.shape, dtype), leaf) for k, leaf in zip(keys, leaves, strict=True)]
    )


def _like(x: jax.Array, leaf: jax.Array) -> jax.Array:
    """``x`` laid out like ``leaf`` (adding a sharded zero gives it ``leaf``'s Explicit sharding)."""
    return x + jnp.zeros_like(leaf, x.dtype)
