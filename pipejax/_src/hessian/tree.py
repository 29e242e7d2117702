"""Linear algebra on pytrees, so vectors keep the structure and the sharding of the parameters.

A *vector* is a pytree of arrays (like the parameters). A *basis* of ``m`` vectors is the same
pytree with every leaf stacked on a new leading axis of size ``m``. Inner products are
``lax.dot_general`` contractions, one per leaf, so projecting on a basis is a matrix-vector
product that reads the basis once. (A broadcast product and a sum, the obvious alternative, ran
about 30x slower in float64 on XLA's CPU backend.) Axes that a leaf's sharding splits over a mesh
are *batch* axes of the contraction, summed afterwards: on a mesh with Explicit axes JAX refuses
to guess the sharding of a contraction over a sharded axis, while a batched contraction followed
by a sum is well defined.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def size(tree: PyTree) -> int:
    """The number of scalars in ``tree`` (static)."""
    return sum(int(leaf.size) for leaf in jax.tree.leaves(tree))


def _sharded_axes(a: jax.Array, lead: int) -> set[int]:
    """The axes of ``a`` after its ``lead`` leading ones that its typed sharding splits over a mesh."""
    spec = tuple(getattr(jax.typeof(a).sharding, "spec", None) or ())
    return {d - lead for d, s in enumerate(spec[: a.ndim]) if d >= lead and s is not None}


def is_sharded(v: PyTree) -> bool:
    """Whether a leaf of ``v`` is split over devices: by its typed (Explicit) sharding or, for a
    concrete array, by a sharding over more than one device that is not a full replica."""
    for a in jax.tree.leaves(v):
        if _sharded_axes(a, 0):
            return True
        sharding = None if isinstance(a, jax.core.Tracer) else getattr(a, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
            return True
    return False


def ravel(v: PyTree, dtype: Any) -> jax.Array:
    """The leaves of ``v`` in one flat array of ``dtype``."""
    return jnp.concatenate([a.reshape(-1).astype(dtype) for a in jax.tree.leaves(v)])


def unravel(flat: jax.Array, like: PyTree) -> PyTree:
    """The inverse of :func:`ravel`: ``flat`` cut into leaves shaped like ``like``'s (dtype kept)."""
    leaves, treedef = jax.tree.flatten(like)
    ends = list(itertools.accumulate(int(leaf.size) for leaf in leaves))
    starts = [0, *ends[:-1]]
    return treedef.unflatten(
        [flat[a:b].reshape(leaf.shape) for a, b, leaf in zip(starts, ends, leaves, strict=True)]
    )


def _contract(q: jax.Array, lead_q: int, a: jax.Array, lead_a: int) -> jax.Array:
    """``sum_x q[i, x] a[j, x]`` over the vector axes ``x``: shape ``(*lead axes of q, *lead axes of a)``.

    ``q`` has ``lead_q`` leading axes before the vector's axes and ``a`` has ``lead_a``; sharded
    vector axes are batch axes, summed after the contraction.
    """
    rank = q.ndim - lead_q
    batch = sorted(_sharded_axes(q, lead_q) | _sharded_axes(a, lead_a))
    if batch:  # both split alike on the batch axes (newer JAX refuses to pick one of two shardings)
        q, a = _split_alike(q, lead_q, a, lead_a), _split_alike(a, lead_a, q, lead_q)
    con = [d for d in range(rank) if d not in batch]
    dims = (
        (tuple(lead_q + d for d in con), tuple(lead_a + d for d in con)),
        (tuple(lead_q + d for d in batch), tuple(lead_a + d for d in batch)),
    )
    out = jax.lax.dot_general(q, a.astype(q.dtype), dims)  # (*batch, *lead_q axes, *lead_a axes)
    return jnp.sum(out, axis=tuple(range(len(batch)))) if batch else out


def _typed(a: jax.Array):
    """``a``'s typed sharding when it names a mesh, else None."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or mesh.empty else sharding


def _split_alike(a: jax.Array, lead: int, other: jax.Array, lead_other: int) -> jax.Array:
    """``a`` resharded so that its vector axes (after ``lead``) are split as ``other``'s are,
    where ``a`` leaves whole an axis that ``other`` splits (values unchanged: each device keeps
    its slice, no collective). Newer JAX refuses to choose between two shardings itself."""
    theirs = _typed(other)
    if theirs is None:
        return a
    ours = _typed(a)
    pad = lambda spec, n: (tuple(spec) + (None,) * n)[:n]
    want = pad(theirs.spec, other.ndim)[lead_other:]
    have = (None,) * (a.ndim - lead) if ours is None else pad(ours.spec, a.ndim)[lead:]
    if have == want or any(h is not None and h != w for h, w in zip(have, want, strict=True)):
        return a  # alike already, or split differently (not just less): left to JAX
    spec = jax.sharding.PartitionSpec(*([None] * lead), *want)
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(theirs.mesh, spec))


def _sum(terms: list[jax.Array]) -> jax.Array:
    return sum(terms[1:], terms[0])


def dot(u: PyTree, v: PyTree) -> jax.Array:
    """The Euclidean inner product of two vectors of the same structure."""
    return _sum([_contract(a, 0, b, 0) for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(v), strict=True)])


def norm(v: PyTree) -> jax.Array:
    return jnp.sqrt(dot(v, v))


def scale(c: jax.Array, v: PyTree) -> PyTree:
    return jax.tree.map(lambda a: a * c.astype(a.dtype), v)


def axpy(c: jax.Array, u: PyTree, v: PyTree) -> PyTree:
    """``c * u + v``."""
    return jax.tree.map(lambda a, b: a * c.astype(a.dtype) + b, u, v)


def sub(u: PyTree, v: PyTree) -> PyTree:
    """``u - v``."""
    return jax.tree.map(lambda a, b: a - b.astype(a.dtype), u, v)


def where(pred: jax.Array, u: PyTree, v: PyTree) -> PyTree:
    """``u`` if the scalar ``pred`` holds, else ``v``."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b.astype(a.dtype)), u, v)


def cast(v: PyTree, like: PyTree) -> PyTree:
    """``v`` with the dtypes of ``like``."""
    return jax.tree.map(lambda a, b: a.astype(b.dtype), v, like)


def astype(v: PyTree, dtype: Any) -> PyTree:
    return jax.tree.map(lambda a: a.astype(dtype), v)


def zeros_basis(like: PyTree, m: int, dtype: Any) -> PyTree:
    """A basis of ``m`` zero vectors shaped (and sharded) like ``like``."""

    def one(a):
        # JAX 0.10's repeat keeps the sharding of ``a`` on the trailing axes (broadcast_to would
        # drop it); 0.11's drops it there too, so it is put back
        basis = jnp.repeat(jnp.zeros_like(a, dtype)[None], m, axis=0)
        return _split_alike(basis, 1, a, 0)

    return jax.tree.map(one, like)


def row(basis: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: a[i], basis)


def set_row(basis: PyTree, i: jax.Array, v: PyTree) -> PyTree:
    def one(a, b):
        # a row split as the basis's rows are (newer JAX will not guess the update's sharding)
        b, a = _split_alike(b, 0, a, 1), _split_alike(a, 1, b, 0)
        return a.at[i].set(b.astype(a.dtype))

    return jax.tree.map(one, basis, v)


def stack(vectors: list[PyTree]) -> PyTree:
    """The basis whose rows are ``vectors``."""
    return jax.tree.map(lambda *a: jnp.stack(a), *vectors)


def project(basis: PyTree, v: PyTree) -> jax.Array:
    """The coefficients ``basis @ v``: shape ``(m,)`` for a vector, ``(m, k)`` for a basis of ``k``.

    One matrix-vector (or matrix-matrix) product per leaf: it reads the basis once, whatever ``k``.
    """
    leaves_q, leaves_v = jax.tree.leaves(basis), jax.tree.leaves(v)
    lead = leaves_v[0].ndim - (leaves_q[0].ndim - 1)
    return _sum([_contract(q, 1, a, lead) for q, a in zip(leaves_q, leaves_v, strict=True)])


def combine(coefs: jax.Array, basis: PyTree) -> PyTree:
    """``coefs.T @ basis``: the vector ``sum_i coefs[i] q_i`` for ``coefs`` of shape ``(m,)``, or
    for ``(m, k)`` a basis of ``k`` vectors (column ``j`` makes vector ``j``). Reads the basis once.
    """
    return jax.tree.map(
        lambda q: jax.lax.dot_general(coefs.astype(q.dtype), q, (((0,), (0,)), ((), ()))), basis
    )


def orthogonalise(basis: PyTree, v: PyTree) -> tuple[PyTree, jax.Array]:
    """``v`` minus its projection on the (orthonormal or zero) rows of ``basis``, twice.

    Classical Gram-Schmidt repeated once more ("twice is enough", Giraud et al. 2005) is as
    accurate as modified Gram-Schmidt and is four matrix-vector products instead of a loop.
    Returns the new vector and the summed coefficients of the two passes.
    """
    c1 = project(basis, v)
    v = sub(v, combine(c1, basis))
    c2 = project(basis, v)
    v = sub(v, combine(c2, basis))
    return v, c1 + c2


def rademacher(key: jax.Array, like: PyTree, dtype: Any) -> PyTree:
    """A vector of independent +-1 entries shaped like ``like``."""
    return _split(jax.random.rademacher(key, (size(like),), dtype), like)


def normal(key: jax.Array, like: PyTree, dtype: Any) -> PyTree:
    """A vector of independent standard normal entries shaped like ``like``."""
    return _split(jax.random.normal(key, (size(like),), dtype), like)


def _split(flat: jax.Array, like: PyTree) -> PyTree:
    """``flat`` cut into leaves shaped (and sharded) like ``like``'s.

    One draw for the whole vector, not one per leaf: a draw is hundreds of HLO instructions
    (threefry, erf_inv), and one per leaf made XLA's compile time grow with the number of leaves.
    """
    return jax.tree.map(_like, unravel(flat, like), like)


def _like(x: jax.Array, leaf: jax.Array) -> jax.Array:
    """``x`` laid out like ``leaf`` (adding a sharded zero gives it ``leaf``'s Explicit sharding)."""
    return x + jnp.zeros_like(leaf, x.dtype)


def layout(params: PyTree) -> bool | tuple:
    """How vectors of ``params``' space are kept: ``True`` for flat arrays (nothing is split over
    devices), else one sharding per leaf (``None`` where unknown, e.g. under a trace): the
    operator pins its vectors and its basis to these, so that XLA does not pick a different
    sharding for the basis and reshard it at every step (it printed "Involuntary full
    rematerialization" for the basis products of a pipelined Flax model on an Auto mesh)."""
    if not is_sharded(params):
        return True
    out = []
    for a in jax.tree.leaves(params):
        s = None if isinstance(a, jax.core.Tracer) else getattr(a, "sharding", None)
        # Explicit axes need nothing: the sharding is part of the arrays' types and follows them
        auto = isinstance(s, jax.sharding.NamedSharding) and all(
            t == jax.sharding.AxisType.Auto for t in s.mesh.axis_types
        )
        out.append(s if auto else None)
    return tuple(out)


def constrain(v: PyTree, shardings: tuple | None, lead: int = 0) -> PyTree:
    """``v`` (with ``lead`` leading axes before each leaf's own) pinned to ``shardings``."""
    if not shardings or all(s is None for s in shardings):
        return v
    leaves, treedef = jax.tree.flatten(v)

    def pin(a, s):
        if s is None:
            return a
        spec = jax.sharding.PartitionSpec(*([None] * lead), *s.spec)
        return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(s.mesh, spec))

    return treedef.unflatten([pin(a, s) for a, s in zip(leaves, shardings, strict=True)])
