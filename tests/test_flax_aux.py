"""The Flax adapters' auxiliary outputs (``aux=``, issue 24): a Switch-style MoE block whose
load-balancing loss trains through the pipeline (NNX, GPipe and 1F1B), outputs that ``carry=``
does not pass on, and sown values (NNX ``nnx.Intermediate``, Linen ``self.sow``), collected per
micro-batch and compared with the layers run in sequence on each micro-batch (float64)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline

F = jnp.float64
D, E, BATCH, CHUNKS, MICRO = 4, 3, 8, 2, 4
COEF = 0.5
TOL = dict(rtol=1e-10, atol=1e-12)


class MoE(nnx.Module):
    """Top-1 routing over ``E`` experts with a Switch-Transformer load-balancing loss
    ``E * sum_e f_e P_e`` (``f_e``: the fraction of rows routed to expert ``e``, ``P_e``: its mean
    router probability), sown as ``"balance"``, or returned beside the output (``returns``)."""

    def __init__(self, seed: int, returns: bool = False):
        rngs = nnx.Rngs(seed)
        self.router = nnx.Linear(D, E, param_dtype=F, rngs=rngs)
        self.experts = nnx.Param(0.3 * jax.random.normal(rngs.params(), (E, D, D), F))
        self.returns = returns

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x), axis=-1)
        routed = jax.nn.one_hot(jnp.argmax(probs, axis=-1), E, dtype=F)
        gate = jnp.sum(probs * routed, axis=-1, keepdims=True)
        out = jnp.einsum("be,edf,bd->bf", routed, self.experts[...], x)
        y = x + gate * out
        balance = E * jnp.sum(jnp.mean(routed, axis=0) * jnp.mean(probs, axis=0))
        if self.returns:
            return y, balance
        self.sow(nnx.Intermediate, "balance", balance)
        return y


def layers(returns=False):
    return [
        nnx.Linear(D, D, param_dtype=F, rngs=nnx.Rngs(0)),
        MoE(1, returns),
        MoE(2, returns),
        nnx.Linear(D, D, param_dtype=F, rngs=nnx.Rngs(3)),
    ]


X = jax.random.normal(jax.random.key(0), (BATCH, D), F)
T = jax.random.normal(jax.random.key(1), (BATCH, D), F)


def per_example(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def aux_loss(aux):  # one layer's aux: sown (a tuple of the values sown) or returned
    if "intermediates" in aux:
        return COEF * aux["intermediates"]["balance"][0]
    if "outputs" in aux:
        return COEF * aux["outputs"][0]
    return None


def reference_loss(seq, x, t):
    """The un-pipelined model on each micro-batch: the mean loss plus the mean over micro-batches
    of every MoE layer's balance loss."""
    ys, extra = [], 0.0
    for start in range(0, x.shape[0], MICRO):
        h = x[start : start + MICRO]
        for layer in seq:
            if isinstance(layer, MoE):
                h, balances = nnx.capture(layer, nnx.Intermediate)(h)
                extra = extra + COEF * balances["balance"][0] * (h.shape[0] / x.shape[0])
            else:
                h = layer(h)
        ys.append(h)
    return jnp.mean(per_example(jnp.concatenate(ys), t)) + extra


def router_grad(pipe, grads, layer):
    """The router kernel's gradient, read through a copy of ``pipe`` that holds ``grads``."""
    holder = nnx.clone(pipe)
    nnx.update(holder, grads)
    return holder.to_sequential()[layer].router.kernel[...]


@pytest.fixture(scope="module")
def reference():
    pipe = NNXPipeline(layers(), balance=[2, 2], chunks=CHUNKS, aux="mean")
    seq = pipe.to_sequential()
    loss, grads = nnx.value_and_grad(lambda m: reference_loss(m, X, T))(nnx.List(seq))
    return loss, [grads[1].router.kernel[...], grads[2].router.kernel[...]]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_moe_balance_loss_reaches_the_router(schedule, reference):
    """The load-balancing loss's gradient reaches the routers, equal to the un-pipelined
    model's; the balance values come back per micro-batch's mean."""
    pipe = NNXPipeline(layers(), balance=[2, 2], chunks=CHUNKS, aux="mean", schedule=schedule)
    (loss, aux), grads = pipe.value_and_grad(per_example, aux_loss=aux_loss)(X, T)
    np.testing.assert_allclose(loss, reference[0], **TOL)
    for k, layer in enumerate((1, 2)):
        g = router_grad(pipe, grads, layer)
        np.testing.assert_allclose(g, reference[1][k], **TOL)
    assert aux[0] == {} and aux[3] == {}
    without = NNXPipeline(layers(), balance=[2, 2], chunks=CHUNKS, aux="mean", schedule=schedule)
    _, plain = without.value_and_grad(per_example)(X, T)
    assert not np.allclose(router_grad(pipe, grads, 1), router_grad(without, plain, 1))


def test_moe_balance_loss_trains_under_1f1b():
    """Only the balance loss, a few SGD steps: it decreases."""
    pipe = NNXPipeline(layers(), balance=[2, 2], chunks=CHUNKS, aux="mean", schedule="1f1b")
    opt = nnx.Optimizer(pipe, optax.sgd(0.5), wrt=nnx.Param)
    zero = lambda y, t: 0.0 * per_example(y, t)
    step = pipe.value_and_grad(zero, aux_loss=aux_loss)
    losses = []
    for _ in range(6):
        (loss, _), grads = step(X, T)
        opt.update(pipe, grads)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1e-3, losses


def test_returned_aux_with_carry_equals_sown():
    """``carry=0`` with ``aux=``: the rest of ``(y, balance)`` is collected as ``"outputs"``,
    equal to the sown values of the same model ("stack": per micro-batch)."""
    sown = NNXPipeline(layers(), balance=[2, 2], chunks=CHUNKS, aux="stack")
    returned = NNXPipeline(layers(returns=True), balance=[2, 2], chunks=CHUNKS, aux="stack", carry=0)
    y1, a1 = sown(X)
    y2, a2 = returned(X)
    np.testing.assert_allclose(y1, y2, **TOL)
    for layer in (1, 2):
        np.testing.assert_allclose(a1[layer]["intermediates"]["balance"][0], a2[layer]["outputs"][0], **TOL)
        assert a2[layer]["outputs"][0].shape == (BATCH // MICRO,)


def test_aux_loss_needs_aux_option():
    pipe = NNXPipeline(layers(), balance=[2, 2], chunks=CHUNKS)
    with pytest.raises(ValueError, match=r"`aux_loss` was given, but NNXPipeline was built without `aux=`"):
        pipe.value_and_grad(per_example, aux_loss=aux_loss)
    with pytest.raises(TypeError, match=r"`aux_loss` of NNXPipeline.value_and_grad must be a callable"):
        NNXPipeline(layers(), balance=[2, 2], aux="sum").value_and_grad(per_example, aux_loss=1.0)


class SowDense(nn.Module):
    """A Linen layer that sows its mean squared output."""

    @nn.compact
    def __call__(self, x):
        y = jnp.tanh(nn.Dense(D, param_dtype=F)(x))
        self.sow("intermediates", "sq", jnp.mean(y**2))
        return y


def test_linen_sown_values_per_micro_batch():
    """Linen ``self.sow('intermediates', ...)``: "sum" gives the sum over micro-batches of the
    values the layers run in sequence on each micro-batch sow."""
    pipe = LinenPipeline([SowDense() for _ in range(4)], num_stages=2, chunks=CHUNKS, aux="sum")
    variables = pipe.init(jax.random.key(0), X)
    y, aux = pipe.apply(variables, X)
    seq = pipe.to_sequential(variables)
    want = [0.0] * 4
    for start in range(0, BATCH, MICRO):
        h = X[start : start + MICRO]
        for layer in range(4):
            h, sown = SowDense().apply(
                {"params": seq["params"][f"layers_{layer}"]}, h, mutable=["intermediates"]
            )
            want[layer] += sown["intermediates"]["sq"][0]
    for layer in range(4):
        np.testing.assert_allclose(aux[layer]["intermediates"]["sq"][0], want[layer], **TOL)
    np.testing.assert_allclose(y, pipe.apply(variables, X)[0], **TOL)
