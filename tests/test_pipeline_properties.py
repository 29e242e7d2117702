"""Property tests: for random stage counts (1-4), chunk counts (1-9), batch sizes (1-17), stage
widths, checkpoint modes, homogeneous or heterogeneous stages, with or without a mesh, the
pipeline's output and its gradient equal those of composing the stages on the whole batch.

Every example compiles a pipeline and its gradient, so the example count is small; the explicit
``@example``s pin the edge cases (one stage, one chunk, one example, batch < chunks).

Tolerances (float64) as in ``test_pipeline_contract.py``: forward rtol 1e-12; gradients rtol 1e-10
and atol 1e-12 (micro-batching reorders sums over <= 17 examples).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pipejax as pj
from tests import models

FWD_TOL = {"rtol": 1e-12, "atol": 1e-14}
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}


def dense(p, x, key):
    return jnp.tanh(x @ p["w"] + p["b"][None])


@st.composite
def configs(draw):
    num_stages = draw(st.integers(1, 4))
    return {
        "num_stages": num_stages,
        "chunks": draw(st.integers(1, 9)),
        "batch": draw(st.integers(1, 17)),
        "mesh": draw(st.booleans()),
        "homogeneous": draw(st.booleans()),
        # Heterogeneous stages change the width at every boundary.
        "widths": draw(st.lists(st.integers(1, 4), min_size=num_stages + 1, max_size=num_stages + 1)),
        "checkpoint": draw(st.sampled_from(["always", "except_last", "never"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _edge(num_stages, chunks, batch, mesh, homogeneous, checkpoint="except_last"):
    return {
        "num_stages": num_stages,
        "chunks": chunks,
        "batch": batch,
        "mesh": mesh,
        "homogeneous": homogeneous,
        "widths": [2, 3, 1, 2, 3][: num_stages + 1],
        "checkpoint": checkpoint,
        "seed": 0,
    }


@settings(max_examples=5, deadline=None)
@given(configs())
@example(_edge(1, 1, 1, mesh=True, homogeneous=False))
@example(_edge(4, 9, 5, mesh=False, homogeneous=True, checkpoint="always"))
def test_pipeline_equals_composition(cfg):
    n, r = cfg["num_stages"], np.random.default_rng(cfg["seed"])
    mesh = jax.make_mesh((n,), ("stage",)) if cfg["mesh"] else None
    kw = {"chunks": cfg["chunks"], "checkpoint": cfg["checkpoint"], "mesh": mesh}
    if cfg["homogeneous"]:
        width = cfg["widths"][0]
        params = {
            "w": jnp.asarray(r.normal(size=(n, width, width))),
            "b": jnp.asarray(r.normal(size=(n, width))),
        }
        apply = pj.pipeline(dense, num_stages=n, **kw)
        stages, per_stage = (dense,) * n, models.unstack(params, n)
        reference = lambda p, x: models.compose(stages, models.unstack(p, n), x)
    else:
        widths = cfg["widths"]
        params = [
            {"w": jnp.asarray(r.normal(size=(a, b))), "b": jnp.asarray(r.normal(size=(b,)))}
            for a, b in itertools.pairwise(widths)
        ]
        apply = pj.pipeline([dense] * n, **kw)
        per_stage = params
        reference = lambda p, x: models.compose((dense,) * n, p, x)
    x = jnp.asarray(r.normal(size=(cfg["batch"], cfg["widths"][0])))

    y = apply(params, x)
    expected = models.compose((dense,) * n, per_stage, x)
    assert y.shape == expected.shape
    models.assert_trees_close(y, expected, **FWD_TOL)

    loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
    grads = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(params, x)
    ref_grads = jax.jit(jax.grad(loss(reference), argnums=(0, 1)))(params, x)
    models.assert_trees_close(grads, ref_grads, **GRAD_TOL)
