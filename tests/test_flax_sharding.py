"""Sharding metadata of the Flax adapters: what Flax's own sharding recipes read.

* Linen: ``nn.get_partition_spec`` on the variables of a model with a ``LinenPipeline`` reports
  ``P("stage", None)`` for the packed stages (not ``P()``), so the lm1b recipe (abstract
  variables -> ``get_partition_spec`` -> ``logical_to_mesh_sharding`` -> ``jax.jit(init,
  out_shardings=...)``) keeps each stage on its device; the layers' own logical axis names stay
  reachable through ``to_sequential``.
* NNX: ``nnx.get_partition_spec(nnx.state(model))`` reports ``P("stage", None)`` for the packed
  parameters; the layers' metadata survives ``to_sequential``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from pipejax.flax import LinenPipeline, NNXPipeline, StagePartitioned

F = jnp.float64
W, BATCH = 4, 6
# Logical axes: replicated here; "stage" (the pipeline's axis name) maps to the mesh axis "stage".
RULES = [("embed", None), ("mlp", None), ("vocab", None), ("stage", "stage")]


class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return jnp.tanh(nn.Dense(W, kernel_init=kernel, param_dtype=F)(h))


def test_linen_partition_spec_reports_the_stage_axis():
    mesh = jax.make_mesh((2,), ("stage",))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
            h = nn.Embed(7, W, embedding_init=embed, param_dtype=F)(tokens)
            return LinenPipeline(
                [Block() for _ in range(4)], balance=[2, 2], chunks=2, mesh=mesh, name="pipe"
            )(h)

    model = Model()
    tokens = jnp.arange(BATCH) % 7
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
    specs = nn.get_partition_spec(abstract)
    assert specs["params"]["pipe"]["stages"] == P("stage", None)
    assert specs["params"]["Embed_0"]["embedding"] == P("vocab", "embed")  # the model's own, untouched
    # lm1b's recipe: the stages come out stage-sharded, each device holding its own row.
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), tokens)
    box = variables["params"]["pipe"]["stages"]
    assert isinstance(box, StagePartitioned)
    for buf in box.value.buffers:
        assert buf.sharding.spec == P("stage", None)
        assert {shard.data.shape for shard in buf.addressable_shards} == {(1, buf.shape[1])}

    # The layers' logical axis names are reachable through to_sequential.
    stack = LinenPipeline([Block() for _ in range(4)], balance=[2, 2], mesh=mesh)
    seq = stack.to_sequential({"params": variables["params"]["pipe"]})
    kernel_spec = nn.get_partition_spec(seq)["params"]["layers_3"]["Dense_0"]["kernel"]
    assert kernel_spec == P("embed", "mlp")

    # And the model computes what the plain layers compute on the unboxed variables.
    plain = nn.Sequential([Block() for _ in range(4)])
    h = nn.Embed(7, W, param_dtype=F).apply({"params": nn.unbox(variables["params"]["Embed_0"])}, tokens)
    with jax.set_mesh(mesh):
        y = jax.jit(model.apply)(variables, tokens)
        ref = jax.jit(plain.apply)(nn.unbox(seq), h)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(
            W, W, param_dtype=F, kernel_metadata={"out_sharding": ("embed", "mlp")}, rngs=rngs
        )

    def __call__(self, h):
        return jnp.tanh(self.linear(h))


def test_nnx_partition_spec_reports_the_stage_axis():
    mesh = jax.make_mesh((2,), ("stage",))
    with nnx.use_eager_sharding(False):  # the layers' logical names are not mesh axes
        layers = [NBlock(nnx.Rngs(i)) for i in range(4)]
    pipe = NNXPipeline(layers, balance=[2, 2], chunks=2, mesh=mesh)
    specs = nnx.get_partition_spec(nnx.state(pipe))
    assert specs["packed"][0].get_value() == P("stage", None)
    back = pipe.to_sequential()
    assert nnx.get_partition_spec(nnx.state(back[0]))["linear"]["kernel"].get_value() == P("embed", "mlp")
    x = jax.random.normal(jax.random.key(1), (BATCH, W), F)
    h = x
    with jax.set_mesh(mesh):
        for layer in back:
            h = layer(h)
    np.testing.assert_allclose(nnx.jit(lambda p, x: p(x))(pipe, x), h, rtol=1e-12, atol=1e-12)


def test_nnx_column_parallel_layers_on_explicit_axes_train_under_1f1b():
    """``nnx.Linear`` layers split by columns (``nnx.with_partitioning``) on an Explicit
    ``("stage", "model")`` mesh: each layer's output is typed split over ``"model"``. 1F1B with
    ``checkpoint="never"`` (the F slot keeps the vjp's residuals) gives the un-pipelined loss and
    gradients, and GPipe's gradients. (Before, its B slot seeded the vjp with a cotangent typed
    whole, and JAX refused.)"""
    mesh = jax.make_mesh((2, 2), ("stage", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    bias = nnx.with_partitioning(nnx.initializers.zeros, ("model",))
    x = jax.random.normal(jax.random.key(1), (8, W), F)
    t = jnp.flip(x, axis=0)
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)
    got = {}
    with jax.set_mesh(mesh):
        for schedule in ("gpipe", "1f1b"):
            layers = [
                nnx.Linear(W, W, kernel_init=kernel, bias_init=bias, param_dtype=F, rngs=nnx.Rngs(s))
                for s in range(2)
            ]
            want_loss = jnp.mean(sq(layers[1](layers[0](x)), t))
            model = NNXPipeline(
                layers, num_stages=2, chunks=4, mesh=mesh, schedule=schedule, checkpoint="never"
            )
            got[schedule] = model.value_and_grad(sq)(x, t)
            np.testing.assert_allclose(got[schedule][0], want_loss, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(got["1f1b"][1]), jax.tree.leaves(got["gpipe"][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
