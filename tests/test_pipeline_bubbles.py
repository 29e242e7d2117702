"""Bubble safety: ticks on which a stage has no micro-batch never feed NaN or Inf anywhere.

The stages take ``log``, ``sqrt`` and ``1 / x``, which are undefined (or have infinite derivatives)
at 0: a pipeline that ran them on zero-filled bubble buffers and masked the result with
``jnp.where`` would still produce ``0 * inf = nan`` in the backward pass. Inputs are strictly
positive and every stage keeps them so. The batches are uneven (the last micro-batch has padding
rows) and ``chunks`` is small against the number of stages, so most stage-ticks are bubbles.

Outputs, gradients and Hessian-vector products (with respect to params and x) must be finite and
equal those of the composition, for every checkpoint mode, with and without a mesh.

Tolerances (float64): as in ``test_pipeline_contract.py``: forward rtol 1e-12; gradients and HVPs
rtol 1e-10 / atol 1e-12 (sums over the batch are reordered by micro-batching).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from tests import models

FWD_TOL = {"rtol": 1e-12, "atol": 1e-14}
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}
BATCH, CHUNKS = 7, 3  # 3 micro-batches of 3, the last with 2 padding rows


# Heterogeneous: f64[b, 2] -> log -> f64[b, 3] -> sqrt -> (f64[b, 3], f64[b, 3]) -> 1/x -> f64[b, 2].
def log_stage(p, x, key):
    return jnp.log(x) @ p["w"]  # x > 1 and w > 0, so the output is > 0


def sqrt_stage(p, h, key):
    return jnp.sqrt(h) * p["a"][None], h


def reciprocal_stage(p, hs, key):
    a, h = hs
    return (1.0 / a) @ p["w"] + (1.0 / h) @ p["v"]


HETERO = (log_stage, sqrt_stage, reciprocal_stage)


def hetero_params():
    r = np.random.default_rng(0)
    pos = lambda *shape: jnp.asarray(r.uniform(0.5, 1.5, size=shape))
    return [{"w": pos(2, 3)}, {"a": pos(3)}, {"w": pos(3, 2), "v": pos(3, 2)}]


def hetero_inputs():
    return jnp.asarray(np.random.default_rng(1).uniform(1.5, 3.0, size=(BATCH, 2)))


# Homogeneous: all three singularities in one stage. For x > 0 and w >= 1,
# w * sqrt(x) + 1/x + log(x) >= sqrt(x) + 1/x + log(x) > 1.9, so every stage's input is positive.
def singular_stage(p, x, key):
    return p["w"][None] * jnp.sqrt(x) + 1.0 / x + jnp.log(x)


NUM_HOMO = 4


def homo_params():
    return {"w": jnp.asarray(np.random.default_rng(2).uniform(1.0, 2.0, size=(NUM_HOMO, 3)))}


def homo_inputs():
    return jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, size=(BATCH, 3)))


def setup(layout, checkpoint, placement):
    ckpt = models.CHECKPOINTS[checkpoint]
    if layout == "heterogeneous":
        mesh = models.make_mesh(placement, 3)
        pipe = pj.pipeline(list(HETERO), chunks=CHUNKS, checkpoint=ckpt, mesh=mesh)
        return pipe, lambda p, x: models.compose(HETERO, p, x), hetero_params(), hetero_inputs()
    mesh = models.make_mesh(placement, NUM_HOMO)
    pipe = pj.pipeline(singular_stage, num_stages=NUM_HOMO, chunks=CHUNKS, checkpoint=ckpt, mesh=mesh)
    ref = lambda p, x: models.compose((singular_stage,) * NUM_HOMO, models.unstack(p, NUM_HOMO), x)
    return pipe, ref, homo_params(), homo_inputs()


def cases():
    # Homogeneous (cheap to compile): every checkpoint mode with and without a mesh.
    for checkpoint in models.CHECKPOINTS:
        for placement in ("none", "explicit"):
            yield "homogeneous", checkpoint, placement
    # Heterogeneous: every checkpoint mode once, placements alternating.
    yield "heterogeneous", "always", "explicit"
    yield "heterogeneous", "except_last", "none"
    yield "heterogeneous", "never", "auto"
    yield "heterogeneous", "dots_saveable", "explicit"


def derivatives(apply):
    """One jitted program: ``(y, grads, HVP)`` of ``sum(log(y))`` at ``(params, x)``."""

    def loss(p, x):
        y = apply(p, x)
        return jnp.sum(jnp.log(y)), y

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)

    def run(p, x, vp, vx):
        (grads, y), (hvp, _) = jax.jvp(grad, (p, x), (vp, vx))
        return y, grads, hvp

    return jax.jit(run)


@pytest.mark.parametrize("layout,checkpoint,placement", list(cases()))
def test_singular_stages_stay_finite_and_match_composition(layout, checkpoint, placement):
    pipe, ref, params, x = setup(layout, checkpoint, placement)
    r = np.random.default_rng(4)
    vp = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape)), params)
    vx = jnp.asarray(r.normal(size=x.shape))
    y, grads, hvp = derivatives(pipe)(params, x, vp, vx)
    y_ref, grads_ref, hvp_ref = derivatives(ref)(params, x, vp, vx)
    models.assert_trees_finite((y, grads, hvp))
    models.assert_trees_close(y, y_ref, **FWD_TOL)
    models.assert_trees_close(grads, grads_ref, **GRAD_TOL)
    models.assert_trees_close(hvp, hvp_ref, **GRAD_TOL)


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_plain_forward_is_finite_with_a_single_example(placement):
    """One example and more chunks than examples: one micro-batch, all other ticks are bubbles."""
    pipe, ref, params, x = setup("heterogeneous", "except_last", placement)
    pipe = pj.pipeline(list(HETERO), chunks=5, mesh=pipe.mesh)
    y = pipe(params, x[:1])
    models.assert_trees_finite(y)
    models.assert_trees_close(y, ref(params, x[:1]), **FWD_TOL)


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("layout", ["heterogeneous", "homogeneous"])
@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_no_stage_execution_is_wasted(layout, checkpoint, placement):
    """A forward call runs each (stage, micro-batch) pair exactly once: no discarded
    re-execution computes a stage (counted with a callback inside the stage). Bubble ticks skip
    the stage, except homogeneous stages on a mesh: there a bubble runs the stage on a micro-batch
    of ``x`` (which the one stage function is written for) and discards it, which keeps no
    guard's residuals (see docs/pipeline_guarantees.md, bubble safety)."""
    n, m = 3, 4
    log: list[tuple[int, int]] = []

    def stage(p, x, key):
        jax.debug.callback(lambda s, i: log.append((int(s), int(i))), p["idx"], x[0, 0])
        return x * p["w"]

    stages = stage if layout == "homogeneous" else [stage] * n
    apply = pj.pipeline(
        stages,
        num_stages=n if layout == "homogeneous" else None,
        chunks=m,
        checkpoint=checkpoint,
        mesh=models.make_mesh(placement, n),
    )
    per_stage = [{"idx": jnp.asarray(s), "w": jnp.asarray(1.0)} for s in range(n)]
    params = jax.tree.map(lambda *a: jnp.stack(a), *per_stage) if layout == "homogeneous" else per_stage
    x = jnp.repeat(jnp.arange(m, dtype=jnp.float64), 2)[:, None] * jnp.ones((1, 2))  # rows carry ids
    jax.block_until_ready(apply(apply.place(params), x))
    jax.effects_barrier()
    pairs = sorted((s, i) for s in range(n) for i in range(m))
    if layout == "homogeneous" and placement != "none":
        bubbles = n * apply.schedule(x.shape[0]).num_ticks - n * m
        assert len(log) == n * m + bubbles and set(log) == set(pairs)
        return
    assert sorted(log) == pairs
