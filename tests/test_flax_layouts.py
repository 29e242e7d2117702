"""Flax train states that move between layouts (issue 24): ``pipejax.flax.to_layers``,
``layers_target``, ``from_layers`` on ``NNXPipeline`` and ``LinenPipeline``.

A model and its Adam state train 2 steps under layout A, are saved in layer form with orbax,
restored into a module built with layout B, and train 2 more steps; the reference trains those
2 steps under A. Same layout: bitwise. Another layout (stage count, balance, no mesh, layers
split over a "model" axis): float64 to 1e-10 relative (the layers compute the same sums, but
XLA may fuse a stage of 2 layers differently from 2 stages of 1; observed differences are at
the last bits or zero).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline, from_layers, layers_target, to_layers
from tests.test_flax_recompile import Counter

ocp = pytest.importorskip("orbax.checkpoint")  # the optional extra pipejax[checkpoint]
optax = pytest.importorskip("optax")

F = jnp.float64
L, W, BATCH = 4, 4, 8  # layers, width, batch
RTOL = 1e-10  # float64, another layout (see the module docstring)
TX = optax.adam(1e-2)  # one optax object: nnx.Optimizer's graph definition holds it


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int and float
        yield


def layout(name):
    """The adapter options of layout ``name``."""
    devs = jax.devices()
    stage = lambda n: jax.make_mesh((n,), ("stage",), devices=devs[:n])
    return {
        "4": dict(num_stages=4, mesh=stage(4)),
        "2": dict(num_stages=2, mesh=stage(2)),
        "[1,3]": dict(balance=[1, 3], mesh=stage(2)),
        "[2,2]": dict(balance=[2, 2], mesh=stage(2)),
        "none": dict(num_stages=2, mesh=None),
        "2 x model": dict(
            num_stages=2,
            mesh=jax.make_mesh((2, 2), ("stage", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2),
        ),
    }[name]


def data():
    x = jax.random.normal(jax.random.key(0), (BATCH, W), F)
    return x, jnp.cos(x)


def assert_close(got, want, same):
    if same:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=RTOL)


def check_restored(restored, target):
    """Every restored array carries its target's sharding, each device holding its own shard."""
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, len(want.shape))
        for shard in got.addressable_shards:
            assert shard.data.shape == want.sharding.shard_shape(want.shape)


# --- NNX ----------------------------------------------------------------------------------------


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(W, W, param_dtype=F, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.linear(h))


def nnx_build(name, seed=0, num_layers=L):
    model = NNXPipeline([NBlock(nnx.Rngs(seed + i)) for i in range(num_layers)], chunks=2, **layout(name))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


@nnx.jit
def nnx_step(model, optimizer, x, t):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - t) ** 2))(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize(("a", "b"), [("4", "4"), ("4", "2"), ("[1,3]", "[2,2]"), ("2", "none")])
def test_nnx_train_state_moves_between_layouts(tmp_path, a, b):
    x, t = data()
    model, optimizer = nnx_build(a)
    for _ in range(2):
        nnx_step(model, optimizer, x, t)
    saved = to_layers(model, nnx.state((model, optimizer)))
    mesh = layout(a)["mesh"]
    stage_devices = mesh.size // len(model.stage_sizes())
    for layer in saved[0]["packed"]:  # each layer on its own stage's devices only
        for leaf in jax.tree.leaves(layer):
            assert len(leaf.sharding.device_set) == stage_devices
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", saved)
    ckpt.wait_until_finished()

    # layout B: the abstract model (nothing materialised) gives the target
    abstract_model, _ = abstract = nnx.eval_shape(lambda: nnx_build(b, seed=10))
    graphdef, shapes = nnx.split(abstract)
    target = layers_target(abstract_model, shapes)
    restored = ckpt.restore(tmp_path / "state", target)
    check_restored(restored, target)
    model2, optimizer2 = nnx.merge(graphdef, from_layers(abstract_model, restored))
    assert model2.stage_sizes() == nnx_build(b)[0].stage_sizes()
    for var in model2.packed:  # placed as the module places them
        buffer = var[...]
        if layout(b)["mesh"] is None:
            assert buffer.sharding.device_set == {jax.devices()[0]}
        else:
            assert tuple(buffer.sharding.spec)[:1] == ("stage",)
        for shard in buffer.addressable_shards:
            assert shard.data.shape == buffer.sharding.shard_shape(buffer.shape)

    losses = []
    counts = Counter().per_call(lambda i: losses.append(nnx_step(model2, optimizer2, x, t)), 2)
    assert counts[1] == 0, counts  # the restored shardings are the train step's steady state
    if a == b:  # the same layout: the program layout A compiled, reused
        assert counts == [0, 0], counts
    for got in losses:
        want = nnx_step(model, optimizer, x, t)
        assert_close(got, want, a == b)
    for got, want in zip(model2.layer_params(), model.layer_params(), strict=True):
        jax.tree.map(lambda g, w: assert_close(g, w, a == b), got, want)


def test_nnx_layer_form_errors():
    model, optimizer = nnx_build("2")
    saved = to_layers(model, nnx.state((model, optimizer)))
    three, _ = nnx_build("none", num_layers=3)
    with pytest.raises(ValueError, match=r"'packed' entry holds 4 layers, but the module has 3"):
        from_layers(three, saved)
    with pytest.raises(ValueError, match=r"to_layers found no stage entry of the NNXPipeline"):
        to_layers(model, {"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"from_layers found no stage entry.*a list of layers"):
        from_layers(model, nnx.state(model))
    with pytest.raises(TypeError, match=r"`pipe` of to_layers must be an NNXPipeline or a LinenPipeline"):
        to_layers(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), saved)


# --- Linen --------------------------------------------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        return h + jnp.tanh(nn.Dense(W, param_dtype=F, kernel_init=init)(h))


def linen_pipe(name, num_layers=L):
    return LinenPipeline([Block() for _ in range(num_layers)], chunks=2, **layout(name))


def linen_state(pipe, x):
    params = pipe.init(jax.random.key(1), x)["params"]
    return {"params": params, "opt_state": TX.init(params)}


def linen_step(pipe):
    @jax.jit
    def step(state, x, t):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((pipe.apply({"params": p}, x) - t) ** 2))(
            state["params"]
        )
        updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return step


@pytest.mark.parametrize(("a", "b"), [("4", "4"), ("4", "2"), ("[1,3]", "[2,2]"), ("2", "none")])
def test_linen_train_state_moves_between_layouts(tmp_path, a, b):
    x, t = data()
    pipe_a, pipe_b = linen_pipe(a), linen_pipe(b)
    step_a, step_b = linen_step(pipe_a), linen_step(pipe_b)
    state = jax.jit(lambda x: linen_state(pipe_a, x))(x)
    for _ in range(2):
        state, _ = step_a(state, x, t)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", to_layers(pipe_a, state))
    ckpt.wait_until_finished()

    like = jax.eval_shape(lambda x: linen_state(pipe_b, x), x)  # layout B's form, nothing made
    target = layers_target(pipe_b, like)
    restored = ckpt.restore(tmp_path / "state", target)
    check_restored(restored, target)
    state2 = from_layers(pipe_b, restored, like)
    assert jax.tree.structure(state2) == jax.tree.structure(like)
    packed = nn.unbox(state2["params"])["stages"]
    assert packed.num_stages == len(pipe_b.stage_sizes())
    carry = [state2]
    losses = []

    def one(i):
        carry[0], loss = step_b(carry[0], x, t)
        losses.append(loss)

    counts = Counter().per_call(one, 2)
    assert counts[1] == 0, counts  # the restored shardings are the train step's steady state
    for loss in losses:
        state, want = step_a(state, x, t)
        assert_close(loss, want, a == b)
    seq_b = pipe_b.to_sequential({"params": nn.unbox(carry[0]["params"])})
    seq_a = pipe_a.to_sequential({"params": nn.unbox(state["params"])})
    jax.tree.map(lambda g, w: assert_close(g, w, a == b), seq_b, seq_a)


def test_linen_layers_restore_split_over_a_model_axis(tmp_path):
    """Into 2 stages whose layers' kernels are split over a "model" axis (their
    ``nn.with_partitioning`` metadata): each process reads its devices' halves of its stage's
    layers, and the packed buffers are those the module's own placement gives (values and
    shardings). (Training this layout is checked in test_flax_schedules.py; a jitted optax step
    over it hung in XLA's CPU collectives on the shared test machine, not investigated.)"""
    x, _ = data()
    pipe_a, pipe_b = linen_pipe("4"), linen_pipe("2 x model")
    state = jax.jit(lambda x: linen_state(pipe_a, x))(x)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", to_layers(pipe_a, state))
    ckpt.wait_until_finished()
    like = jax.eval_shape(lambda x: linen_state(pipe_b, x), x)
    target = layers_target(pipe_b, like)
    restored = ckpt.restore(tmp_path / "state", target)
    check_restored(restored, target)
    kernel = nn.unbox(restored["params"]["stages"][0])["Dense_0"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(W, W // 2)}
    assert len(kernel.sharding.device_set) == 2  # stage 0's devices only
    moved = from_layers(pipe_b, restored, like)
    got, want = nn.unbox(moved["params"])["stages"], nn.unbox(like["params"])["stages"]
    assert got.container == want.container and got.layouts == want.layouts  # the module's own
    assert got.container.splits is not None  # (buffers per split: the kernels' "model" halves)
    for g, w in zip(got.buffers, want.buffers, strict=True):
        assert g.shape == w.shape
        assert g.sharding.spec[0] == "stage"
    # the same layers, bitwise: back in layer form on B, against A's
    back = to_layers(pipe_b, moved)["params"]["stages"]
    jax.tree.map(np.testing.assert_array_equal, back, to_layers(pipe_a, state)["params"]["stages"])


def test_linen_layer_form_errors():
    x, _ = data()
    pipe = linen_pipe("2")
    state = linen_state(pipe, x)
    saved = to_layers(pipe, state)
    with pytest.raises(TypeError, match=r"`like` of from_layers is None"):
        from_layers(pipe, saved)
    three = linen_pipe("none", num_layers=3)
    like = jax.eval_shape(lambda x: linen_state(three, x), x)
    with pytest.raises(ValueError, match=r"'stages' entry holds 4 layers, but the module has 3"):
        from_layers(three, saved, like)
    with pytest.raises(ValueError, match=r"holds a StageParams of 2 stages, but LinenPipeline has 4"):
        layers_target(linen_pipe("4"), jax.eval_shape(lambda x: linen_state(pipe, x), x))
