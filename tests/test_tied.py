"""Weights tied across stages (``pipeline(..., tied=...)``): an embedding table on stage 0 whose
transpose gives the logits on stage 3, one copy per holding stage.

* Loss and gradients equal the un-pipelined model with ONE table, whose gradient every copy
  receives, under GPipe (``jax.grad``) and 1F1B / ZB-H1 (``value_and_grad``), on a mesh and
  without one, for per-stage lists, placed ``StageParams`` and homogeneous stacked stages.
* Optimizer steps keep the copies bitwise equal (and without ``tied=`` they drift apart).
* ``jax.jvp`` of the gradient (Hessian-vector products) equals ``jax.hessian`` of the one-table
  model.
* The tie changes no bit of the parameters (``-0.0`` included), and bad ``tied=`` is refused.

Tolerances (float64): the pipeline sums micro-batch losses and cotangents in another order than
the reference, so results agree to rounding, rtol 1e-10 / atol 1e-12 as in
test_schedules_training.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import pipejax as pj
from pipejax._src.params import forms as stage_forms

TOL = {"rtol": 1e-10, "atol": 1e-12}
V, D, T, B = 7, 3, 2, 6  # vocabulary, width, tokens per example, batch
TIED = [[(0, "table"), (3, "unembed/table")]]


def embed(p, x, key):
    return p["table"][x]  # int[b, T] -> f[b, T, D]


def hidden(p, x, key):
    return jnp.tanh(x @ p["w"])


def logits(p, x, key):
    return x @ p["unembed"]["table"].T + p["bias"][None, None]  # f[b, T, V]


STAGES = [embed, hidden, hidden, logits]


def xent(y, t):
    """Per-example cross entropy, summed over the tokens: f[b]."""
    logp = jax.nn.log_softmax(y, axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0], axis=-1)


def one_table(flat):
    """The model with one table: {"table", "w1", "w2", "bias"}."""
    return {"table": flat["table"], "w1": flat["w1"], "w2": flat["w2"], "bias": flat["bias"]}


def reference_loss(q, x, t):
    h = q["table"][x]
    h = jnp.tanh(jnp.tanh(h @ q["w1"]) @ q["w2"])
    return jnp.mean(xent(h @ q["table"].T + q["bias"][None, None], t))


def to_stages(q):
    return [
        {"table": q["table"]},
        {"w": q["w1"]},
        {"w": q["w2"]},
        {"unembed": {"table": q["table"]}, "bias": q["bias"]},
    ]


def from_stages(g):
    """The per-stage gradients as the one-table model's, checking that both copies got one."""
    np.testing.assert_array_equal(g[0]["table"], g[3]["unembed"]["table"])  # summed: bitwise equal
    return {"table": g[0]["table"], "w1": g[1]["w"], "w2": g[2]["w"], "bias": g[3]["bias"]}


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(0), 6)
    q = {
        "table": jax.random.normal(k[0], (V, D)),
        "w1": jax.random.normal(k[1], (D, D)),
        "w2": jax.random.normal(k[2], (D, D)),
        "bias": 0.1 * jax.random.normal(k[3], (V,)),
    }
    x = jax.random.randint(k[4], (B, T), 0, V)
    t = jax.random.randint(k[5], (B, T), 0, V)
    return q, x, t


def _mesh():
    return jax.make_mesh((4,), ("stage",))


def _close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, **TOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("on_mesh", [True, False], ids=["mesh", "no-mesh"])
def test_loss_and_grads_equal_one_table(data, schedule, on_mesh):
    q, x, t = data
    loss_ref, g_ref = jax.value_and_grad(reference_loss)(q, x, t)
    mesh = _mesh() if on_mesh else None
    pipe = pj.pipeline(STAGES, chunks=3, mesh=mesh, schedule=schedule, tied=TIED)
    with jax.set_mesh(mesh) if on_mesh else contextlib.nullcontext():  # the docs' mesh context
        loss, g = pipe.value_and_grad(xent)(to_stages(q), x, t)
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    _close(from_stages(g), g_ref)
    if schedule == "gpipe":  # the forward call under plain `jax.grad`
        loss_of = lambda p: jnp.mean(xent(pipe(p, x), t))
        _close(from_stages(jax.jit(jax.grad(loss_of))(to_stages(q))), g_ref)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_placed_params(data, schedule):
    """``place``d parameters (a ``StageParams`` sharded over the stages) tie the same way."""
    q, x, t = data
    _, g_ref = jax.value_and_grad(reference_loss)(q, x, t)
    pipe = pj.pipeline(STAGES, chunks=3, mesh=_mesh(), schedule=schedule, tied=TIED)
    _, g = pipe.value_and_grad(xent)(pipe.place(to_stages(q)), x, t)
    _close(from_stages(g.unpack()), g_ref)


@pytest.mark.parametrize(
    ("schedule", "repeats"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("v-half", 2)]
)
def test_homogeneous_stages(schedule, repeats):
    """Homogeneous stages: the stage picks the row of the stacked leaf; rows 0 and 3 of ``w``
    are one weight: the model with row 3 replaced by row 0. With ``repeats=2`` on 2 devices the
    parameters are ``place``d device-major, ``(2, 2, ...)``, stage ``r n + d`` at ``[r, d]``."""
    k = jax.random.split(jax.random.key(1), 3)
    w = jax.random.normal(k[0], (4, D, D))
    w = w.at[3].set(w[0])
    x, t = jax.random.normal(k[1], (B, D)), jax.random.normal(k[2], (B, D))
    layer = lambda p, h, key: jnp.tanh(h @ p["w"])
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)

    def reference(w012):
        h = x
        for r in (0, 1, 2, 0):
            h = jnp.tanh(h @ w012[r])
        return jnp.mean(sq(h, t))

    g_ref = jax.grad(reference)(w[:3])
    mesh = jax.make_mesh((4 // repeats,), ("stage",), devices=jax.devices()[: 4 // repeats])
    pipe = pj.pipeline(
        layer,
        num_stages=4,
        chunks=2,
        mesh=mesh,
        schedule=schedule,
        repeats=repeats,
        tied=[[(0, "w"), (3, ("w",))]],
    )
    params = {"w": w} if repeats == 1 else pipe.place({"w": w})
    _, g = pipe.value_and_grad(sq)(params, x, t)
    g = np.asarray(g["w"]).reshape(w.shape)
    np.testing.assert_array_equal(g[0], g[3])
    _close(g[:3], g_ref)


@pytest.mark.parametrize("tied", [TIED, None], ids=["tied", "untied"])
def test_optimizer_keeps_copies_bitwise_equal(data, tied):
    """Three Adam steps under 1F1B: tied copies stay bitwise equal; untied ones drift apart
    (which shows the first check can fail)."""
    q, x, t = data
    pipe = pj.pipeline(STAGES, chunks=3, mesh=_mesh(), schedule="1f1b", tied=tied)
    opt = optax.adam(0.1)
    params = to_stages(q)
    state = opt.init(params)
    step = pipe.value_and_grad(xent)
    for _ in range(3):
        _, g = step(params, x, t)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int and float
            updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
    first, last = np.asarray(params[0]["table"]), np.asarray(params[3]["unembed"]["table"])
    if tied:
        np.testing.assert_array_equal(first, last)
    else:
        assert np.max(np.abs(first - last)) > 1e-2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hessian_vector_products(data, schedule):
    """``jax.jvp`` of the gradient through the tied pipeline equals ``jax.hessian`` of the
    one-table model, the tangent of the table given to one copy (and zero to the other): the tie
    makes a tangent of either copy a tangent of the one weight."""
    q, x, t = data
    x, t = x[:4], t[:4]
    pipe = pj.pipeline(STAGES, chunks=2, mesh=None, schedule=schedule, tied=TIED)
    grad = lambda p: pipe.value_and_grad(xent)(p, x, t)[1]
    v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), q)
    v_stages = to_stages(v)
    v_stages[3]["unembed"]["table"] = jnp.zeros_like(v["table"])  # the tangent on copy 0 only
    _, hv = jax.jvp(grad, (to_stages(q),), (v_stages,))
    flat, unravel = ravel_pytree(q)
    h = jax.jit(jax.hessian(lambda f: reference_loss(unravel(f), x, t)))(flat)  # one compile
    _close(from_stages(hv), unravel(h @ ravel_pytree(v)[0]))


def test_tie_changes_no_bit():
    """The tied parameters are the user's bits: -0.0 (which ``x + 0.0`` would turn into +0.0)
    and large values included. (Subnormals are left out: XLA on CPU flushes them to zero in any
    arithmetic, the stages' own included.)"""
    pipe = pj.pipeline([lambda p, x, k: x] * 2, tied=[[(0, "a"), (1, "a")]])
    a = jnp.array([-0.0, 0.0, 2.2250738585072014e-308, -1e308, 1.0 / 3.0])
    for params in (
        [{"a": a}, {"a": a}],
        pj.pipeline([lambda p, x, k: x] * 2, mesh=None).place([{"a": a}] * 2),
    ):
        out = jax.jit(lambda p: stage_forms.tie(pipe, p))(params)
        for leaf, want in zip(jax.tree.leaves(out), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(leaf).view(np.uint64), np.asarray(want).view(np.uint64))


@pytest.mark.parametrize(
    ("tied", "error", "match"),
    [
        ("embed", TypeError, r"`tied` must be a list of groups"),
        ([[(0, "table")]], ValueError, r"`tied\[0\]` must be a list of at least two"),
        ([[(0, "table"), 3]], ValueError, r"`tied\[0\]\[1\]` must be a pair `\(stage, path\)`"),
        ([[(0, "table"), (4, "unembed/table")]], IndexError, r"`tied\[0\]\[1\]\[0\]` is 4, but there are 4"),
        ([[(0, "table"), (0, "unembed/table")]], ValueError, r"names stage 0 again"),
        ([[(0, "table"), (3, "")]], ValueError, r"path of a tied leaf must be a '/'-separated"),
        ([[(0, "table"), (3, "a")], [(3, "a"), (1, "w")]], ValueError, r"which `tied\[0\]` names too"),
    ],
)
def test_bad_tied_at_construction(tied, error, match):
    with pytest.raises(error, match=match):
        pj.pipeline(STAGES, tied=tied)


@pytest.mark.parametrize(
    ("tied", "match"),
    [
        ([[(0, "table"), (3, "unembed")]], r"names a subtree, not one array leaf"),
        ([[(0, "table"), (3, "unembed/tabel")]], r"'unembed/tabel', which names no leaf .*'unembed/table'"),
        ([[(0, "table"), (3, "bias")]], r"must have the same shape and dtype"),
    ],
)
def test_bad_tied_at_call(data, tied, match):
    q, x, _ = data
    with pytest.raises(ValueError, match=match):
        pj.pipeline(STAGES, tied=tied)(to_stages(q), x)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_place_refuses_copies_that_differ(on_mesh):
    """``place`` checks that a tied weight's copies are equal (the pipeline keeps them equal, it
    does not make them so), for heterogeneous and homogeneous stages; a traced ``place`` and a
    tree without the tied leaves (``state``) are not checked."""
    mesh = jax.make_mesh((2,), ("stage",)) if on_mesh else None
    ident = lambda p, x, k: x
    t = jnp.arange(6.0).reshape(2, 3)
    listed = pj.pipeline([ident, ident], tied=[[(0, "a"), (1, "b/a")]], mesh=mesh)
    stacked = pj.pipeline(ident, num_stages=2, tied=[[(0, "a"), (1, "a")]], mesh=mesh)
    for pipe, same, other in (
        (listed, [{"a": t}, {"b": {"a": t}}], [{"a": t}, {"b": {"a": t.at[1, 2].add(0.5)}}]),
        (stacked, {"a": jnp.stack([t, t])}, {"a": jnp.stack([t, 2 * t])}),
    ):
        pipe.place(same)
        with pytest.raises(ValueError, match=r"`tied\[0\]` ties stage 0's leaf 'a' to stage 1's .* differ"):
            pipe.place(other)
        jax.jit(pipe.place)(other)  # traced: not checked
    listed.place([{"c": t}, {"c": 2 * t}])  # no tied leaves (a state, say): not checked
