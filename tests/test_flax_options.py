"""Every option of ``pj.pipeline`` reaches both Flax adapters, checked against the plain model.

The adapters forward their keyword arguments to ``pj.pipeline`` unchanged, so the pipeline's own
options work through them: the circular schedule (4 stages on 2 devices, ``repeats=2``), a data
axis (a 2 x 2 data x stage mesh) and per-example keys. The reference is the same layers run in
sequence on the whole batch (parameters mapped out with ``to_sequential``), in float64
(``rtol=1e-12``: micro-batch vs whole-batch rounding only).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline

F = jnp.float64
W, BATCH = 6, 8
TOL = dict(rtol=1e-12, atol=1e-12)


def options(kind):
    """The pipeline options of each case, and its number of stages."""
    if kind == "circular":  # 4 stages on 2 devices, each micro-batch goes round twice
        mesh = jax.make_mesh((2,), ("stage",))
        return {"mesh": mesh, "schedule": "circular", "repeats": 2, "chunks": 4}, 4
    mesh = jax.make_mesh((2, 2), ("data", "stage"))  # data x pipeline
    return {"mesh": mesh, "data_axis_name": "data", "chunks": 4}, 2


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        h = jnp.tanh(nn.Dense(W, param_dtype=F)(h))
        return nn.Dropout(0.5)(h, deterministic=deterministic)


def data():
    kx, kw = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (BATCH, W), F), jax.random.normal(kw, (BATCH, W), F)


@pytest.mark.parametrize("kind", ["circular", "data"])
def test_linen_options_match_the_plain_model(kind):
    opts, stages = options(kind)
    layers = [Block() for _ in range(4)]
    pipe = LinenPipeline(layers, num_stages=stages, **opts)
    x, w = data()
    variables = jax.jit(pipe.init)(jax.random.key(1), x)
    seq = pipe.to_sequential(variables)

    def loss(v):
        return jnp.sum(pipe.apply(v, x) * w)

    def loss_ref(seq):
        return jnp.sum(nn.Sequential(layers).apply(seq, x) * w)

    with jax.set_mesh(opts["mesh"]):
        value, grads = jax.jit(jax.value_and_grad(loss))(variables)
        ref, ref_grads = jax.jit(jax.value_and_grad(loss_ref))(seq)
    np.testing.assert_allclose(value, ref, **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), pipe.to_sequential(grads), ref_grads)
    spec = variables["params"]["stages"].value.buffers[0].sharding.spec
    assert "stage" in spec and "data" not in spec  # stage-sharded, replicated over the data axis


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(W, W, param_dtype=F, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h):
        return self.dropout(jnp.tanh(self.linear(h)))


@pytest.mark.parametrize("kind", ["circular", "data"])
def test_nnx_options_match_the_plain_model(kind):
    opts, stages = options(kind)
    pipe = NNXPipeline(
        [NBlock(nnx.Rngs(i)) for i in range(4)],
        num_stages=stages,
        deterministic=True,
        rngs=nnx.Rngs(9),
        **opts,
    )
    layers = pipe.to_sequential()
    x, w = data()

    def loss(pipe):
        return jnp.sum(pipe(x) * w)

    def loss_ref(layers):
        h = x
        for layer in layers:
            layer.eval()
            h = layer(h)
        return jnp.sum(h * w)

    with jax.set_mesh(opts["mesh"]):
        value, grads = nnx.jit(nnx.value_and_grad(loss))(pipe)
        ref, ref_grads = nnx.jit(nnx.value_and_grad(loss_ref))(layers)
    np.testing.assert_allclose(value, ref, **TOL)
    for got, want in zip(pipe.layer_params(grads), ref_grads, strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)


def test_per_example_keys_make_dropout_independent_of_chunks():
    """Linen and NNX: with per-example keys, dropout masks follow the example, not ``chunks``."""
    x, _ = data()
    key = jax.random.key(3)
    layers = [Block() for _ in range(3)]
    pipe = LinenPipeline(layers, balance=[2, 1], chunks=4, per_example_keys=True)
    variables = pipe.init(jax.random.key(1), x)
    y = jax.jit(lambda v, x, k: pipe.apply(v, x, deterministic=False, rngs={"dropout": k}))(variables, x, key)
    # By hand, one example at a time (so no `chunks` at all): example e, layer j of stage s draws
    # from fold_in(fold_in(fold_in(k, e), s), j).
    pipe_key = nn.apply(lambda m: m.make_rng("dropout"), pipe)(variables, rngs={"dropout": key})
    seq = pipe.to_sequential(variables)["params"]

    @jax.jit
    def by_hand(seq, x, pipe_key):
        rows = []
        for e in range(BATCH):
            h = x[e : e + 1]
            for index, (s, j) in enumerate([(0, 0), (0, 1), (1, 0)]):
                k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(pipe_key, e), s), j)
                h = Block().apply({"params": seq[f"layers_{index}"]}, h, False, rngs={"dropout": k})
            rows.append(h)
        return jnp.concatenate(rows)

    np.testing.assert_allclose(y, by_hand(seq, x, pipe_key), **TOL)
    assert (y == 0).any()  # dropout was on

    nouts = []
    for chunks in (2, 4):
        npipe = NNXPipeline(
            [NBlock(nnx.Rngs(i)) for i in range(3)], balance=[2, 1], chunks=chunks, per_example_keys=True
        )
        nouts.append(nnx.jit(lambda p, x, k: p(x, deterministic=False, rngs=k))(npipe, x, key))
    # The same masks (the same zeros); values to rounding (other micro-batch sizes round differently).
    np.testing.assert_array_equal(nouts[0] == 0, nouts[1] == 0)
    np.testing.assert_allclose(nouts[0], nouts[1], **TOL)
    assert (nouts[0] == 0).any()  # dropout was on


def test_options_are_checked_by_the_pipeline():
    layers = [Block() for _ in range(4)]
    with pytest.raises(TypeError, match=r"unknown argument `chunk`.*chunks, checkpoint, mesh"):
        LinenPipeline(layers, num_stages=2, chunk=2)
    with pytest.raises(TypeError, match=r"does not take `stateful`.*deferred_batch_norm"):
        NNXPipeline([NBlock(nnx.Rngs(0))], num_stages=1, stateful=True)
    with pytest.raises(ValueError, match=r"`schedule` must be one of"):  # pj.pipeline's own check
        LinenPipeline(layers, num_stages=2, schedule="zigzag")
    with pytest.raises(ValueError, match=r"repeats=2.*multiple of 2"):
        NNXPipeline([NBlock(nnx.Rngs(i)) for i in range(3)], num_stages=3, schedule="circular", repeats=2)
    with pytest.raises(NotImplementedError, match="per_example_keys"):
        LinenPipeline(layers, num_stages=2, per_example_keys=True, deferred_batch_norm=True)
