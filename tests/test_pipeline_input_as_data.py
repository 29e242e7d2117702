"""Stage 0 reads its micro-batch of ``x`` as data: no tangent of the activations reaches it.

On a mesh the micro-batch travels in the message that also carries the activations between
stages, which have a tangent whenever parameters are differentiated. A stage 0 that calls
``jax.pure_callback`` on its input (which has no JVP) then failed under ``jax.grad`` with
respect to the parameters alone, though no derivative flows through ``x`` (issue 22).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

from . import models


def host_double(x):
    """A host computation without a derivative rule (like a tokenizer or a data-side lookup)."""
    return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def first(p, x, key):
    return jnp.tanh(host_double(x) @ p["w"])


def rest(p, x, key):
    return jnp.tanh(x @ p["w"])


STAGES = [first, rest, rest]


def _params():
    r = np.random.default_rng(0)
    return [{"w": jnp.asarray(r.normal(size=(5, 5)) / 2, jnp.float32)} for _ in STAGES]


X = jnp.asarray(np.random.default_rng(1).normal(size=(7, 5)), jnp.float32)


def composed_grads(params):
    def loss(params):
        h = X
        for stage, p in zip(STAGES, params, strict=True):
            h = stage(p, h, None)
        return jnp.sum(h**2)

    return jax.grad(loss)(params)


@pytest.mark.parametrize(
    ("checkpoint", "placement"), [("always", "explicit"), ("never", "auto"), ("except_last", "none")]
)
def test_grad_wrt_params_with_a_callback_on_the_input(checkpoint, placement):
    mesh = models.make_mesh(placement, 3)
    pipe = pj.pipeline(STAGES, chunks=3, checkpoint=checkpoint, mesh=mesh)
    params = _params()
    placed = params if mesh is None else pipe.place(params)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(pipe(p, X) ** 2)))(placed)
    want = composed_grads(params)
    for s in range(3):
        got = grads[s] if mesh is None else pipe.stage_params(grads, s)
        # float32, one reduction order per micro-batch against the whole batch's
        np.testing.assert_allclose(got["w"], want[s]["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_training_schedules_read_the_input_as_data(schedule):
    pipe = pj.pipeline(STAGES, chunks=3, schedule=schedule, mesh=models.make_mesh("explicit", 3))
    params = _params()
    _, grads = jax.jit(pipe.value_and_grad(lambda y, t: jnp.sum(y**2, axis=-1)))(pipe.place(params), X, X)
    want = composed_grads(params)
    for s in range(3):
        np.testing.assert_allclose(pipe.stage_params(grads, s)["w"], want[s]["w"] / 7, rtol=1e-5, atol=1e-6)
