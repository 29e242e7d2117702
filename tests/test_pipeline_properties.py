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
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pipejax as pj
from pipejax._src import microbatch
from tests import models

FWD_TOL = {"rtol": 1e-12, "atol": 1e-14}
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}


def dense(p, x, key):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def model(cfg, r, **kw):
    """``(pipeline, params, reference)``: ``cfg["num_stages"]`` dense stages, homogeneous
    (stacked parameters, one width) or heterogeneous (``cfg["widths"]`` at the boundaries), and
    the composition of the same stages on the whole batch."""
    n = cfg["num_stages"]
    if cfg["homogeneous"]:
        width = cfg["widths"][0]
        params = {
            "w": jnp.asarray(r.normal(size=(n, width, width))),
            "b": jnp.asarray(r.normal(size=(n, width))),
        }
        reference = lambda p, x: models.compose((dense,) * n, models.unstack(p, n), x)
        return pj.pipeline(dense, num_stages=n, **kw), params, reference
    params = [
        {"w": jnp.asarray(r.normal(size=(a, b))), "b": jnp.asarray(r.normal(size=(b,)))}
        for a, b in itertools.pairwise(cfg["widths"])
    ]
    reference = lambda p, x: models.compose((dense,) * n, p, x)
    return pj.pipeline([dense] * n, **kw), params, reference


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
    apply, params, reference = model(cfg, r, **kw)
    per_stage = models.unstack(params, n) if cfg["homogeneous"] else params
    x = jnp.asarray(r.normal(size=(cfg["batch"], cfg["widths"][0])))

    y = apply(params, x)
    expected = models.compose((dense,) * n, per_stage, x)
    assert y.shape == expected.shape
    models.assert_trees_close(y, expected, **FWD_TOL)

    loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
    grads = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(params, x)
    ref_grads = jax.jit(jax.grad(loss(reference), argnums=(0, 1)))(params, x)
    models.assert_trees_close(grads, ref_grads, **GRAD_TOL)


# --- every schedule: drawn schedules, repeats and data axes -----------------------------------

SCHEDULES = ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b", "v-half", "zb-v")


@st.composite
def training_configs(draw):
    """A schedule, its repeats (stages per device: 2 or 3 for circular and interleaved 1F1B, 2 for
    V-Half and ZB-V), a
    data axis or not, and a stage mesh or not; then stages, chunks and a batch as above."""
    name = draw(st.sampled_from(SCHEDULES))
    repeats = draw(st.sampled_from([2, 3])) if name in ("circular", "interleaved-1f1b") else 1
    repeats = 2 if name in ("v-half", "zb-v") else repeats  # a V: two stages per device
    data = draw(st.booleans())
    mesh = data or draw(st.booleans())
    devices = draw(st.integers(1, 2 if data or repeats == 3 else 4))
    num_stages = devices * repeats
    modes = (
        ["always", "never"]
        if name in ("1f1b", "zb-h1", "interleaved-1f1b", "v-half", "zb-v")
        else ["always", "except_last"]
    )
    return {
        "name": name,
        "repeats": repeats,
        "data": data,
        "mesh": mesh,
        "devices": devices,
        "num_stages": num_stages,
        "chunks": draw(st.integers(1, 6)),
        "batch": draw(st.integers(1, 12)),
        "homogeneous": draw(st.booleans()),
        "widths": draw(st.lists(st.integers(1, 3), min_size=num_stages + 1, max_size=num_stages + 1)),
        "checkpoint": draw(st.sampled_from(modes)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _refused(cfg) -> str | None:
    """The documented rule a drawn configuration breaks (the pipeline must refuse it), or None."""
    num_micro = microbatch.plan(cfg["batch"], cfg["chunks"]).num_micro
    p = 2 if cfg["data"] else 1
    if num_micro % p:
        return "data axis"
    if cfg["name"] == "interleaved-1f1b" and cfg["mesh"] and (num_micro // p) % cfg["devices"]:
        return "groups of"
    return None


def _pinned(name, repeats, data, devices, homogeneous, checkpoint):
    n = devices * repeats
    return {
        "name": name,
        "repeats": repeats,
        "data": data,
        "mesh": True,
        "devices": devices,
        "num_stages": n,
        "chunks": 4,
        "batch": 8,
        "homogeneous": homogeneous,
        "widths": [2, 3, 1, 2, 3, 2, 1][: n + 1],
        "checkpoint": checkpoint,
        "seed": 0,
    }


@settings(max_examples=8, deadline=None)
@given(training_configs())
@example(_pinned("interleaved-1f1b", 2, data=False, devices=2, homogeneous=False, checkpoint="never"))
@example(_pinned("circular", 2, data=True, devices=2, homogeneous=True, checkpoint="except_last"))
@example(_pinned("zb-h1", 1, data=True, devices=2, homogeneous=False, checkpoint="always"))
@example(_pinned("v-half", 2, data=False, devices=3, homogeneous=False, checkpoint="never"))
@example(_pinned("zb-v", 2, data=True, devices=2, homogeneous=False, checkpoint="always"))
def test_value_and_grad_equals_composition_under_every_schedule(cfg):
    """``Pipeline.value_and_grad`` under a drawn schedule equals ``jax.value_and_grad`` of the
    composed stages on the whole batch (the loss: the mean of per-example losses); a drawn
    configuration that breaks a documented rule is refused with a message naming it."""
    r = np.random.default_rng(cfg["seed"])
    mesh = None
    if cfg["mesh"]:
        shape, names = (
            ((2, cfg["devices"]), ("data", "stage")) if cfg["data"] else ((cfg["devices"],), ("stage",))
        )
        mesh = jax.make_mesh(shape, names)
    kw = {"chunks": cfg["chunks"], "checkpoint": cfg["checkpoint"], "mesh": mesh, "repeats": cfg["repeats"]}
    kw["schedule"] = cfg["name"]
    if cfg["data"]:
        kw["data_axis_name"] = "data"
    pipe, params, reference = model(cfg, r, **kw)
    out_width = cfg["widths"][0] if cfg["homogeneous"] else cfg["widths"][-1]
    x = jnp.asarray(r.normal(size=(cfg["batch"], cfg["widths"][0])))
    t = jnp.asarray(r.normal(size=(cfg["batch"], out_width)))
    loss_fn = lambda y, t: jnp.sum(jnp.sin(y) * t, axis=-1)

    rule = _refused(cfg)
    if rule is not None:
        with pytest.raises(ValueError, match=rule):
            pipe.value_and_grad(loss_fn)(params, x, t)
        return
    got = pipe.value_and_grad(loss_fn)(params, x, t)
    want = jax.value_and_grad(lambda p: jnp.mean(loss_fn(reference(p, x), t)))(params)
    models.assert_trees_close(got, want, **GRAD_TOL)
