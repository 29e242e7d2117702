"""Checkpoints of pipelined Flax models with orbax-checkpoint (``pipejax[checkpoint]``).

Saved: the placed parameters (``StageParams`` in its sharding box) and the optax state of a
4-stage pipeline on a 4-device mesh. Restored:

* onto the same mesh, with a target carrying the shardings: bitwise the same arrays, each stage
  on its own device again;
* with ``mesh=None`` (a target on one device): the same arrays, and the pipeline computes the
  same outputs;
* onto a 2 x 2 data x stage mesh (2 stages): through ``to_sequential`` / ``from_sequential``,
  parameters and optimizer moments alike; the outputs equal those of the saved model;
* without a target: the pipeline's message says how to restore, instead of a stage count error.

NNX: ``nnx.state(model)`` saved on the mesh and restored into a model built without one.
"""

from __future__ import annotations

import gc

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

from pipejax.flax import LinenPipeline, NNXPipeline, on_mesh, restore_target
from tests.test_flax_recompile import Counter

ocp = pytest.importorskip("orbax.checkpoint")  # the optional extra pipejax[checkpoint]

F = jnp.float64
W, BATCH = 6, 8
TOL = dict(rtol=1e-12, atol=1e-12)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(W, param_dtype=F)(h))


def pipe_for(mesh, stages=4, **kw):
    return LinenPipeline([Block() for _ in range(4)], num_stages=stages, chunks=4, mesh=mesh, **kw)


def on_one_device(tree):
    """An abstract target of ``tree``'s shape on device 0 (a restore without a mesh)."""
    device = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), tree)


def test_linen_save_and_restore_on_three_meshes(tmp_path):
    mesh4 = jax.make_mesh((4,), ("stage",))
    x = jax.random.normal(jax.random.key(0), (BATCH, W), F)
    pipe = pipe_for(mesh4)
    opt = optax.adam(1e-2)
    params = jax.jit(pipe.init)(jax.random.key(1), x)["params"]
    # (optax's bias correction raises a python float to an int32 power: standard promotion)
    with jax.set_mesh(mesh4), jax.numpy_dtype_promotion("standard"):
        state = {"params": params, "opt_state": opt.init(params)}
        grads = jax.grad(lambda p: jnp.sum(pipe.apply({"params": p}, x) ** 2))(params)
        _, state["opt_state"] = opt.update(grads, state["opt_state"], params)  # moments not zero
    y = jax.jit(pipe.apply)({"params": params}, x)

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()

    # 1. The same mesh: the target carries each array's sharding.
    same = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    jax.tree.map(np.testing.assert_array_equal, same, state)
    assert same["params"]["stages"].value.buffers[0].sharding.spec == P("stage", None)

    # 2. No mesh: a target of the mesh-less pipeline's shapes on one device.
    pipe0 = pipe_for(None)
    abstract = jax.eval_shape(
        lambda: {"params": pipe0.init(jax.random.key(1), x)["params"], "opt_state": None}
    )
    abstract["opt_state"] = jax.eval_shape(opt.init, abstract["params"])
    local = ckpt.restore(tmp_path / "state", on_one_device(abstract))
    for got, saved in zip(jax.tree.leaves(local), jax.tree.leaves(state), strict=True):  # (boxes differ)
        np.testing.assert_array_equal(got, saved)
        assert got.sharding.device_set == {jax.devices()[0]}
    np.testing.assert_allclose(jax.jit(pipe0.apply)({"params": local["params"]}, x), y, **TOL)

    # 3. A 2 x 2 data x stage mesh with 2 stages: the layers' parameters and moments re-cut.
    mesh22 = jax.make_mesh((2, 2), ("data", "stage"))
    pipe22 = pipe_for(mesh22, stages=2, data_axis_name="data")

    def recut(tree):  # a params-shaped subtree {"stages": ...} of the 4-stage pipeline
        return pipe22.from_sequential(pipe0.to_sequential({"params": tree}))["params"]

    is_params = lambda t: isinstance(t, dict) and set(t) == {"stages"}
    moved = jax.tree.map(lambda t: recut(t) if is_params(t) else t, local, is_leaf=is_params)
    moved = on_mesh(moved, mesh22)  # (and adam's step count)
    assert moved["params"]["stages"].value.buffers[0].sharding.spec[0] == "stage"
    with jax.set_mesh(mesh22):
        np.testing.assert_allclose(jax.jit(pipe22.apply)({"params": moved["params"]}, x), y, **TOL)
        mu = pipe22.to_sequential({"params": moved["opt_state"][0].mu})
    jax.tree.map(np.testing.assert_array_equal, mu, pipe0.to_sequential({"params": local["opt_state"][0].mu}))

    # 4. Without a target orbax returns plain dicts and lists: the pipeline says what to do.
    raw = ckpt.restore(tmp_path / "state")
    with pytest.raises(ValueError, match=r"must be a pipejax.StageParams.*restored without a target"):
        pipe.apply({"params": raw["params"]}, x)


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(W, W, param_dtype=F, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.linear(h))


def test_nnx_state_restores_without_the_mesh(tmp_path):
    mesh4 = jax.make_mesh((4,), ("stage",))
    x = jax.random.normal(jax.random.key(0), (BATCH, W), F)
    model = NNXPipeline([NBlock(nnx.Rngs(i)) for i in range(4)], num_stages=4, chunks=4, mesh=mesh4)
    y = nnx.jit(lambda m, x: m(x))(model, x)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "nnx", nnx.state(model))
    ckpt.wait_until_finished()

    fresh = NNXPipeline([NBlock(nnx.Rngs(10 + i)) for i in range(4)], num_stages=4, chunks=4)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(jax.devices()[0])),
        nnx.state(fresh),
    )
    nnx.update(fresh, ckpt.restore(tmp_path / "nnx", abstract))
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(fresh, x), y, **TOL)
    jax.tree.map(np.testing.assert_array_equal, fresh.layer_params(), model.layer_params())


# The restore refused below leaves orbax's reads of the checkpoint's arrays unfinished; their
# coroutines raise when they are collected (collected here, not in whichever test comes next).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_nnx_model_and_optimizer_restore_onto_the_mesh(tmp_path):
    """The recipe of docs/flax_checkpoints.md: the train state's shapes from ``nnx.eval_shape`` of the
    builder (nothing materialised), made a target on the mesh with ``restore_target``; restored,
    every array is bitwise the saved one with the saved sharding, and training continues bitwise
    as the uninterrupted run, without compiling the train step again."""
    # (optax's bias correction raises a python float to an int32 power: standard promotion)
    with jax.numpy_dtype_promotion("standard"):
        mesh4 = jax.make_mesh((4,), ("stage",))
        tx = optax.adam(1e-2)  # one optax object: nnx.Optimizer's graphdef holds it

        def build(seed):
            model = NNXPipeline(
                [NBlock(nnx.Rngs(seed + i)) for i in range(4)], num_stages=4, chunks=4, mesh=mesh4
            )
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, x, t):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - t) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        x = jax.random.normal(jax.random.key(0), (BATCH, W), F)
        t = jnp.cos(x)
        model, optimizer = build(0)
        for _ in range(2):  # the second step runs the steady-state program (the first reads the
            step(model, optimizer, x, t)  # state as built, some of it off the mesh: see on_mesh)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp_path / "nnx", nnx.state((model, optimizer)))
        ckpt.wait_until_finished()

        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(10)))
        with pytest.raises(ValueError, match="AbstractMesh") as refused:  # why the helper exists
            ckpt.restore(tmp_path / "nnx", abstract)
        del refused  # its traceback holds the reads the refusal left unfinished
        gc.collect()
        restored = ckpt.restore(tmp_path / "nnx", restore_target(abstract, mesh4))
        model2, optimizer2 = nnx.merge(graphdef, restored)
        saved = jax.tree.leaves(nnx.state((model, optimizer)))
        got = jax.tree.leaves(nnx.state((model2, optimizer2)))
        assert len(saved) == len(got)
        for a, b in zip(saved, got, strict=True):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
            assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
        stage_leaf = jax.tree.leaves(nnx.state(model2, nnx.Param))[0]
        assert stage_leaf.sharding.spec[0] == "stage"
        # training continues as the uninterrupted run, with the train step compiled already
        compiles = Counter()  # XLA compilations from here on
        compiles.active = True
        for _ in range(2):
            assert float(step(model2, optimizer2, x, t)) == float(step(model, optimizer, x, t))
        compiles.active = False
        assert compiles.count == 0


def test_restore_target_refuses_a_state_built_for_another_mesh():
    mesh2 = jax.make_mesh((2,), ("pipe",))
    mesh4 = jax.make_mesh((4,), ("stage",))
    shapes = {
        "w": jax.ShapeDtypeStruct((4, 3), F, sharding=jax.NamedSharding(mesh4.abstract_mesh, P("stage")))
    }
    with pytest.raises(ValueError, match=r"\['w'\].*no axis 'stage'.*\('pipe',\)"):
        restore_target(shapes, mesh2)
    with pytest.raises(TypeError, match=r"must be a jax\.sharding\.Mesh"):
        restore_target(shapes, "stage")
