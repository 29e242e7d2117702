"""Training schedules through the Flax adapters: ``LinenPipeline.value_and_grad`` and
``NNXPipeline.value_and_grad``.

* Heterogeneous layers (3 -> 6 -> 6 -> 6 -> 2 features, two dropout blocks) on an uneven batch
  (7 rows in 4 micro-batches of 2): every schedule's step ("1f1b", "zb-h1",
  "interleaved-1f1b", and "gpipe" through the same entry point) gives the loss and gradients of
  ``jax.value_and_grad`` of the adapter's own GPipe forward call with the same layers, balance,
  chunks, dropout key and flags (so the same dropout masks), on a 2-device mesh and without a
  mesh. The gradients are compared layer by layer (``to_sequential`` / ``layer_params``), since
  the interleaved schedule lays its parameters out as ``(repeats, devices, ...)``; their form is
  checked against ``jax.grad`` of ``apply`` / ``nnx.grad``. The steps on a mesh run inside
  ``jax.set_mesh``.
* A homogeneous stack (Flax's ``nn.scan`` / ``nnx.vmap`` layer stacks, pipelined with
  ``from_stacked`` / ``unstack``), deterministic, against ``jax.value_and_grad`` of the plain
  scanned model, with an optax step.
* Side inputs (``context=``): a mask that every block reads, through "1f1b" on a mesh (Linen)
  and "zb-h1" without one (NNX), against ``jax.value_and_grad`` of the call with the context.
* Errors: deferred BatchNorm, parameters split over another mesh axis, a loss that is not per
  example, a ``loss_fn`` that is not callable.

Float64; tolerance ``rtol=1e-10, atol=1e-12``: the schedules sum the micro-batches' parameter
cotangents and losses in another order than GPipe's ``jax.grad``.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline, unstack

F = jnp.float64
TOL = dict(rtol=1e-10, atol=1e-12)
BATCH, CHUNKS = 7, 4  # 4 micro-batches of 2 rows, the last one half padding


def sq(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)  # one loss per example


def data():
    x = jax.random.normal(jax.random.key(0), (BATCH, 3), F)
    t = jax.random.normal(jax.random.key(1), (BATCH, 2), F)
    return x, t


# (mesh devices or None, schedule, pipeline options): each training schedule with and without a
# mesh across the two adapters; interleaved on a mesh runs 4 stages on 2 devices (repeats=2), and
# so does V-Half (two stages per device in a V)
CASES = {
    "1f1b-mesh": (2, {"schedule": "1f1b", "balance": [2, 2]}),
    "zb-h1-none": (None, {"schedule": "zb-h1", "balance": [1, 2, 1]}),
    "interleaved-mesh": (2, {"schedule": "interleaved-1f1b", "repeats": 2, "balance": [1, 1, 1, 1]}),
    "1f1b-none": (None, {"schedule": "1f1b", "balance": [1, 2, 1]}),
    "zb-h1-mesh": (2, {"schedule": "zb-h1", "balance": [2, 2], "checkpoint": "never"}),
    "interleaved-none": (None, {"schedule": "interleaved-1f1b", "balance": [1, 1, 1, 1]}),
    "gpipe-none": (None, {"schedule": "gpipe", "balance": [1, 2, 1], "checkpoint": "never"}),
    "v-half-mesh": (2, {"schedule": "v-half", "balance": [1, 1, 1, 1]}),
}


def options(case):
    devices, opts = CASES[case]
    mesh = None if devices is None else jax.make_mesh((devices,), ("stage",))
    return dict(opts, chunks=CHUNKS, mesh=mesh)


def mesh_context(mesh):
    """``jax.set_mesh(mesh)``, or nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def reference_options(opts):
    """The same cut, chunks and keys, run by GPipe without a mesh ("never": the cheapest compile;
    the checkpoint modes give bitwise the same results, tests/test_pipeline*.py)."""
    return {"balance": opts["balance"], "chunks": CHUNKS, "checkpoint": "never"}


# --- Linen --------------------------------------------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        y = jnp.tanh(nn.Dense(6, param_dtype=F)(h))
        return h + nn.Dropout(0.3)(y, deterministic=deterministic)


def linen_layers():
    return [nn.Dense(6, param_dtype=F), Block(), Block(), nn.Dense(2, param_dtype=F)]


@pytest.mark.parametrize("case", ["1f1b-mesh", "zb-h1-none", "interleaved-mesh", "gpipe-none", "v-half-mesh"])
def test_linen_schedules_match_gpipe_forward(case):
    opts = options(case)
    x, t = data()
    pipe = LinenPipeline(linen_layers(), **opts)
    variables = pipe.init(jax.random.key(2), x)
    rngs = {"dropout": jax.random.key(3)}
    step = pipe.value_and_grad(sq)
    with mesh_context(opts["mesh"]):  # on a mesh: inside the context the docs recommend
        loss, grads = jax.jit(lambda v, x, t, r: step(v, x, t, rngs=r, deterministic=False))(
            variables, x, t, rngs
        )

    ref = LinenPipeline(linen_layers(), **reference_options(opts))
    ref_vars = ref.init(jax.random.key(2), x)  # the same layer parameters (the same rng)

    def ref_loss(p):
        y = ref.apply({"params": p}, x, rngs=rngs, deterministic=False)
        return sq(y, t).mean()

    loss_ref, grads_ref = jax.jit(jax.value_and_grad(ref_loss))(ref_vars["params"])
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    assert jax.tree.structure(grads) == jax.tree.structure(variables["params"])  # jax.grad's form
    got = pipe.to_sequential({"params": grads})["params"]
    want = ref.to_sequential({"params": grads_ref})["params"]
    assert sorted(got) == [f"layers_{i}" for i in range(4)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
    if case == "1f1b-mesh":  # dropout is on: without it the loss differs (masks can be told apart)
        assert abs(float(sq(ref.apply(ref_vars, x), t).mean()) - float(loss)) > 1e-3


class StackBlock(nn.Module):  # a layer of the stack, as the pipeline calls it
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(5, param_dtype=F)(h))


class ScanBlock(StackBlock):  # the carry form nn.scan needs, the same parameters
    def __call__(self, h, _):
        return super().__call__(h), None


Scanned = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)


class PlainStack(nn.Module):
    @nn.compact
    def __call__(self, h):
        return Scanned(name="stack")(h, None)[0]


def test_linen_scan_stack_1f1b_matches_plain_model_and_trains():
    x = jax.random.normal(jax.random.key(0), (BATCH, 5), F)
    t = jax.random.normal(jax.random.key(1), (BATCH, 5), F)
    plain = PlainStack()
    stacked = plain.init(jax.random.key(2), x)
    pipe = LinenPipeline(
        [StackBlock() for _ in range(4)],
        num_stages=4,
        chunks=CHUNKS,
        schedule="1f1b",
        mesh=jax.make_mesh((4,), ("stage",)),
    )
    variables = pipe.from_stacked({"params": stacked["params"]["stack"]})
    step = jax.jit(pipe.value_and_grad(sq))
    loss, grads = step(variables, x, t)
    loss_ref, grads_ref = jax.value_and_grad(lambda p: sq(plain.apply({"params": p}, x), t).mean())(
        stacked["params"]
    )
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    got = pipe.to_stacked({"params": grads})["params"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, dict(grads_ref["stack"]))
    # an optax step on the grads as they come (the form of variables["params"])
    opt = optax.sgd(0.1)
    params = variables["params"]
    updates, _ = opt.update(grads, opt.init(params), params)
    new_loss, _ = step({"params": optax.apply_updates(params, updates)}, x, t)
    assert float(new_loss) < float(loss)


# --- NNX ----------------------------------------------------------------------------------------


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(6, 6, param_dtype=F, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, h):
        return h + self.dropout(jnp.tanh(self.linear(h)))


def nnx_layers(seed=0):
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    return [
        nnx.Linear(3, 6, param_dtype=F, rngs=rngs),
        NBlock(rngs),
        NBlock(rngs),
        nnx.Linear(6, 2, param_dtype=F, rngs=rngs),
    ]


@pytest.mark.parametrize("case", ["1f1b-none", "zb-h1-mesh", "interleaved-none", "v-half-mesh"])
def test_nnx_schedules_match_gpipe_forward(case):
    opts = options(case)
    x, t = data()
    pipe = NNXPipeline(nnx_layers(), **opts)
    key = jax.random.key(3)

    @nnx.jit
    def step(model, x, t):
        return model.value_and_grad(sq)(x, t, rngs=key, deterministic=False)

    with mesh_context(opts["mesh"]):  # on a mesh: inside the context the docs recommend
        loss, grads = step(pipe, x, t)
    ref = NNXPipeline(nnx_layers(), **reference_options(opts))  # the same parameters (same seeds)
    loss_ref, grads_ref = nnx.jit(
        nnx.value_and_grad(lambda m: sq(m(x, rngs=key, deterministic=False), t).mean())
    )(ref)
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(pipe, nnx.Param))  # nnx.grad's
    for got, want in zip(pipe.layer_params(grads), ref.layer_params(grads_ref), strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
    if case == "zb-h1-mesh":  # dropout is on: without it the loss differs (masks can be told apart)
        assert abs(float(sq(ref(x, deterministic=True, rngs=key), t).mean()) - float(loss)) > 1e-3


class SBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(5, 5, param_dtype=F, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.linear(h))


@nnx.split_rngs(splits=4)
@nnx.vmap(in_axes=(0,), out_axes=0)
def create_stack(rngs):
    return SBlock(rngs)


@nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
def run_stack(block, h):
    return block(h)


def test_nnx_vmap_stack_zb_h1_matches_plain_model_and_trains():
    x = jax.random.normal(jax.random.key(0), (BATCH, 5), F)
    t = jax.random.normal(jax.random.key(1), (BATCH, 5), F)
    stack = create_stack(nnx.Rngs(0))
    loss_ref, grads_ref = nnx.value_and_grad(lambda s: sq(run_stack(s, x), t).mean())(stack)
    pipe = NNXPipeline(unstack(stack), num_stages=2, chunks=CHUNKS, schedule="zb-h1")
    optimizer = nnx.Optimizer(pipe, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = model.value_and_grad(sq)(x, t)
        optimizer.update(model, grads)
        return loss, grads

    loss, grads = train_step(pipe, optimizer)
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    per_layer = pipe.layer_params(grads)
    for name in ("kernel", "bias"):
        got = np.stack([np.asarray(g["linear"][name][...]) for g in per_layer])
        np.testing.assert_allclose(got, grads_ref["linear"][name][...], **TOL)
    new_loss, _ = train_step(pipe, optimizer)  # the optimizer moved the pipeline's parameters
    assert float(new_loss) < float(loss)


# --- side inputs -------------------------------------------------------------------------------


class MaskedBlock(nn.Module):
    @nn.compact
    def __call__(self, h, mask=None):
        return h + jnp.tanh(nn.Dense(h.shape[-1], param_dtype=F)(h)) * mask[:, None]


class NMaskedBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 3, param_dtype=F, rngs=rngs)

    def __call__(self, h, mask=None):
        return h + jnp.tanh(self.linear(h)) * mask[:, None]


@pytest.mark.parametrize("adapter", ["linen-1f1b-mesh", "nnx-zb-h1-none"])
def test_side_inputs(adapter):
    x, _ = data()
    t = jnp.flip(x, axis=0)
    context = {"mask": jnp.linspace(0.0, 1.0, BATCH, dtype=F)}  # the rows differ: order matters
    if adapter.startswith("linen"):
        mesh = jax.make_mesh((2,), ("stage",))
        pipe = LinenPipeline(
            [MaskedBlock() for _ in range(4)], num_stages=2, chunks=CHUNKS, mesh=mesh, schedule="1f1b"
        )
        variables = pipe.init(jax.random.key(0), x, context=context)
        step = pipe.value_and_grad(sq)
        loss, grads = jax.jit(lambda v, c: step(v, x, t, context=c))(variables, context)
        # the reference differentiates the forward call, which a training schedule refuses: GPipe's
        gpipe = pipe.clone(schedule="gpipe")
        direct = lambda p, c: sq(gpipe.apply({"params": p}, x, context=c), t).mean()
        loss_ref, grads_ref = jax.jit(jax.value_and_grad(direct))(variables["params"], context)
        got, want = pipe.to_sequential({"params": grads}), pipe.to_sequential({"params": grads_ref})
    else:

        def build(schedule):  # the same parameters each time
            rngs = nnx.Rngs(0)
            layers = [NMaskedBlock(rngs) for _ in range(3)]
            return NNXPipeline(layers, num_stages=3, chunks=CHUNKS, schedule=schedule)

        pipe = build("zb-h1")
        loss, grads = pipe.value_and_grad(sq)(x, t, context=context)
        gpipe = build("gpipe")  # the reference differentiates the forward call: GPipe's
        loss_ref, grads_ref = nnx.value_and_grad(lambda m: sq(m(x, context=context), t).mean())(gpipe)
        got, want = pipe.layer_params(grads), pipe.layer_params(grads_ref)
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)


# --- errors ---------------------------------------------------------------------------------------


def test_errors():
    x, t = data()
    # BatchNorm statistics: the step returns none
    with pytest.raises(
        ValueError, match=r"LinenPipeline.value_and_grad does not support `deferred_batch_norm"
    ):
        LinenPipeline([nn.Dense(2)], num_stages=1, deferred_batch_norm=True).value_and_grad(sq)
    bn = [nnx.BatchNorm(3, rngs=nnx.Rngs(0))]
    with pytest.raises(ValueError, match=r"NNXPipeline.value_and_grad does not support.*LayerNorm"):
        NNXPipeline(bn, num_stages=1, deferred_batch_norm=True).value_and_grad(sq)
    with pytest.raises(TypeError, match=r"`loss_fn` of NNXPipeline.value_and_grad must be a callable"):
        NNXPipeline(nnx_layers(), num_stages=2).value_and_grad("mse")

    # a loss that is not per example (the core's message)
    pipe = LinenPipeline(linen_layers(), num_stages=2, chunks=CHUNKS, schedule="zb-h1")
    variables = pipe.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"one per example of the batch of 7: shape \(2,\) per call"):
        pipe.value_and_grad(lambda y, t: sq(y, t).mean())(variables, x, t)

    # parameters split over another mesh axis by the layers' sharding metadata
    mesh = jax.make_mesh((2, 2), ("stage", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    split = [nn.Dense(4, param_dtype=F, kernel_init=init) for _ in range(2)]
    pipe = LinenPipeline(split, num_stages=2, chunks=CHUNKS, mesh=mesh, schedule="1f1b")
    variables = jax.jit(pipe.init)(jax.random.key(0), x)
    t = jnp.zeros((BATCH, 4), F)
    loss, grads = pipe.value_and_grad(sq)(variables, x, t)  # trains, split as the metadata says
    gpipe = pipe.clone(schedule="gpipe")
    ref = jax.jit(jax.value_and_grad(lambda p: sq(gpipe.apply({"params": p}, x), t).mean()))
    loss_ref, grads_ref = ref(variables["params"])
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    got, want = pipe.to_sequential({"params": grads}), pipe.to_sequential({"params": grads_ref})
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
