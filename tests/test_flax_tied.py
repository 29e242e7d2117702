"""Tied weights through the Flax adapters: ``tied=`` names layers, e.g. an embedding table on the
first layer and its copy in the head on the last (issue 24: Gemma's tied embedding).

A 4-layer model on a 2-stage mesh: an embedding (table ``E``), two residual blocks, and a head
whose logits are ``h @ E'^T`` with its own copy ``E'``. With ``tied=[[(0, "table"), (3,
"table")]]`` the two copies' gradients are each the gradient of the model that uses one ``E``,
so they are bitwise equal to each other, under GPipe (``nnx.value_and_grad`` / ``jax.grad`` of the
call) and 1F1B (the adapter's ``value_and_grad``), NNX and Linen. Without ``tied=`` each copy gets
only its own layer's part: the check can fail.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from pipejax.flax import LinenPipeline, NNXPipeline
from tests import models

F = jnp.float64
V, D, BATCH = 7, 5, 8
TOL = {"rtol": 1e-10, "atol": 1e-12}
TIED = [[(0, "table"), (3, "table")]]


def tokens_and_targets():
    r = np.random.default_rng(0)
    return jnp.asarray(r.integers(0, V, BATCH), jnp.int32), jnp.asarray(r.integers(0, V, BATCH), jnp.int32)


def xent(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)[:, 0]


# --- NNX ---------------------------------------------------------------------------------------


class NEmbed(nnx.Module):
    def __init__(self, table):
        self.table = nnx.Param(table)

    def __call__(self, ids):
        return self.table[ids]


class NBlock(nnx.Module):
    def __init__(self, seed):
        self.w = nnx.Param(jnp.asarray(np.random.default_rng(seed).normal(size=(D, D)) / 3, F))

    def __call__(self, h):
        return h + jnp.tanh(h @ self.w)


class NHead(nnx.Module):  # the unembedding: logits against its own copy of the table
    def __init__(self, table):
        self.table = nnx.Param(table)

    def __call__(self, h):
        return h @ self.table.T


def table():
    return jnp.asarray(np.random.default_rng(1).normal(size=(V, D)), F)


def nnx_model(schedule, tied):
    e = table()
    layers = [NEmbed(e), NBlock(2), NBlock(3), NHead(e)]  # both copies start equal
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Auto,))  # eager autodiff
    return NNXPipeline(layers, num_stages=2, chunks=4, mesh=mesh, schedule=schedule, tied=tied)


def one_table_reference(e, w1, w2, ids, labels):
    h = e[ids]
    for w in (w1, w2):
        h = h + jnp.tanh(h @ w)
    return jnp.mean(xent(h @ e.T, labels))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_nnx_tied_copies_get_the_one_table_gradient(schedule):
    ids, labels = tokens_and_targets()
    model = nnx_model(schedule, TIED)
    if schedule == "gpipe":
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(xent(m(ids), labels)))(model)
    else:
        loss, grads = model.value_and_grad(xent)(ids, labels)
    per_layer = _nnx_layer_grads(model, grads)
    w1, w2 = (jnp.asarray(NBlock(s).w[...]) for s in (2, 3))
    want_loss, (de, dw1, dw2) = jax.value_and_grad(one_table_reference, argnums=(0, 1, 2))(
        table(), w1, w2, ids, labels
    )
    np.testing.assert_allclose(loss, want_loss, **TOL)
    np.testing.assert_array_equal(per_layer[0]["table"], per_layer[3]["table"])  # bitwise
    models.assert_trees_close(
        (per_layer[0]["table"], per_layer[1]["w"], per_layer[2]["w"]), (de, dw1, dw2), **TOL
    )


def _nnx_layer_grads(model, grads):
    """The gradient as one dict of arrays per layer."""
    return [nnx.to_pure_dict(layer) for layer in model.layer_params(grads)]


def test_nnx_without_tied_each_copy_gets_its_own_part():
    ids, labels = tokens_and_targets()
    model = nnx_model("gpipe", None)
    _, grads = nnx.value_and_grad(lambda m: jnp.mean(xent(m(ids), labels)))(model)
    per_layer = _nnx_layer_grads(model, grads)
    assert np.max(np.abs(per_layer[0]["table"] - per_layer[3]["table"])) > 1e-3


# --- Linen -------------------------------------------------------------------------------------


class LEmbed(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return self.param("table", lambda k: table())[ids]


class LBlock(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(h @ self.param("w", lambda k: jnp.eye(D, dtype=F) / 2))


class LHead(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h @ self.param("table", lambda k: table()).T


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_linen_tied_copies_get_the_one_table_gradient(schedule):
    ids, labels = tokens_and_targets()
    mesh = jax.make_mesh((2,), ("stage",))
    pipe = LinenPipeline(
        [LEmbed(), LBlock(), LBlock(), LHead()],
        num_stages=2,
        chunks=4,
        mesh=mesh,
        schedule=schedule,
        tied=TIED,
    )
    variables = pipe.init(jax.random.key(0), ids)
    if schedule == "gpipe":
        loss, grads = jax.jit(jax.value_and_grad(lambda v: jnp.mean(xent(pipe.apply(v, ids), labels))))(
            variables
        )
    else:
        loss, grads = pipe.value_and_grad(xent)(variables, ids, labels)
    per_layer = pipe.to_sequential(grads if "params" in grads else {"params": grads})["params"]
    w = jnp.eye(D, dtype=F) / 2
    want_loss, (de, dw1, dw2) = jax.value_and_grad(one_table_reference, argnums=(0, 1, 2))(
        table(), w, w, ids, labels
    )
    np.testing.assert_allclose(loss, want_loss, **TOL)
    layers = [per_layer[k] for k in sorted(per_layer, key=lambda k: int(k.split("_")[-1]))]
    np.testing.assert_array_equal(layers[0]["table"], layers[3]["table"])
    models.assert_trees_close((layers[0]["table"], layers[1]["w"], layers[2]["w"]), (de, dw1, dw2), **TOL)


def test_adapter_tied_names_layers_and_refuses_copies_in_one_stage():
    e = table()
    layers = [NEmbed(e), NBlock(2), NBlock(3), NHead(e)]
    with pytest.raises(ValueError, match=r"`tied\[0\]` of NNXPipeline ties layers \[0, 1\].*one stage"):
        NNXPipeline(layers, num_stages=2, chunks=4, tied=[[(0, "table"), (1, "w")]])
    with pytest.raises(IndexError, match=r"there are 4 stages(.|\n)*names layers, not stages"):
        NNXPipeline(layers, num_stages=2, chunks=4, tied=[[(0, "table"), (9, "table")]])
