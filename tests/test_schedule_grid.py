"""Every schedule against every feature: one grid with a schedule dimension (issue 22).

Each cell runs ``Pipeline.value_and_grad`` under one schedule with one feature turned on and
compares the loss and gradients with a reference that does not pipeline the backward pass:

* without dropout, the stages composed on the whole batch in plain JAX (``jax.value_and_grad``
  of the loss contract on the un-pipelined model);
* with dropout (keys), GPipe's ``jax.value_and_grad`` of the same pipeline, which draws the same
  masks (the forward's key derivation is shared by every schedule) and is itself tested against
  the composition in ``test_pipeline_contract.py``.

Schedules: ``gpipe``, ``circular`` (2 stages per device), ``1f1b``, ``zb-h1``,
``interleaved-1f1b``, ``v-half`` and ``zb-v`` (2 stages per device). Features: ``mesh=None``
and a mesh; a data axis; ``context=`` side inputs; per-example keys; heterogeneous and
homogeneous stages; a token-weighted loss normalised by the batch's total weight (the loss
contract); a ``jax.checkpoint`` policy.
The cells on a mesh run inside ``jax.set_mesh`` (eagerly and under ``jax.jit``), the context the
docs recommend for eager autodiff on an Explicit mesh.
``param_specs`` (tensor and FSDP) under every schedule is in ``test_pipeline_sharded_stages.py``.

Every compile costs seconds, so features that add to a program without replacing a default share
a cell: ``mesh`` runs the stage mesh with ``context=`` and the weighted loss (the default
checkpoint mode), and ``data`` runs the data axis with the checkpoint policy. The cells that use
another pipeline as the reference (per-example keys, stateful stages) loop over the schedules in
one test, so each reference compiles once.

Tolerances (float64): the schedules add per-micro-batch sums in another order than autodiff of
the whole batch, and the weighted loss divides once at the end: agreement to rounding, rtol 1e-10
and atol 1e-12 (about 100x over the reordering of <= 16 O(1) terms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import pipejax as pj
from tests import models

TOL = {"rtol": 1e-10, "atol": 1e-12}
SCHEDULES = ("gpipe", "circular", "1f1b", "zb-h1", "zb-floor", "interleaved-1f1b", "v-half", "zb-v")
TRAINING = ("1f1b", "zb-h1", "zb-floor", "interleaved-1f1b", "v-half", "zb-v")
REPEATS = {"circular": 2, "interleaved-1f1b": 2, "v-half": 2, "zb-v": 2}
GPIPE_OF = {"circular": "circular", "interleaved-1f1b": "circular", "v-half": "circular", "zb-v": "circular"}
S, BATCH, CHUNKS, W = 4, 8, 4, 3  # 4 stages, micro-batches of 2


def first(p, x, key):
    """Heterogeneous stage 0: ``{"ids", "feats"}`` -> ``f64[b, W]``."""
    return p["table"][x["ids"]] + x["feats"] @ p["proj"]


def block(p, h, key, context=None):
    h = jnp.tanh(h @ p["w"] + p["b"][None])
    if context is not None:  # a side input every stage reads: a per-row scale
        h = h * context["scale"][:, None]
    if key is not None:  # dropout; per-example keys come as one key per row
        drop = jax.vmap(lambda k: jax.random.bernoulli(k, 0.25, (W,)))(key) if key.ndim else None
        if drop is None:
            drop = jax.random.bernoulli(key, 0.25, h.shape)
        h = jnp.where(drop, jnp.zeros_like(h), h / 0.75)
    return h


def first_with_context(p, x, key, context=None):
    return first(p, x, key)


def stage_params(seed):
    r = np.random.default_rng(seed)
    return {"w": jnp.asarray(r.normal(size=(W, W)) / 2), "b": jnp.asarray(r.normal(size=(W,)) / 4)}


def inputs():
    r = np.random.default_rng(7)
    x = {
        "ids": jnp.asarray(r.integers(0, 5, BATCH), jnp.int32),
        "feats": jnp.asarray(r.normal(size=(BATCH, 2))),
    }
    h = jnp.asarray(r.normal(size=(BATCH, W)))
    t = jnp.asarray(r.normal(size=(BATCH, W)))
    tokens = jnp.asarray(r.integers(0, 3, BATCH), jnp.float64)  # "tokens" per row, 0 = padding
    scale = jnp.linspace(0.5, 1.5, BATCH)
    return x, h, t, tokens, {"scale": scale}


def model(kind):
    """``(stages for pj.pipeline, kwargs, params, x)``: heterogeneous (an embedding, then 3 blocks)
    or homogeneous (4 blocks, stacked parameters)."""
    x, h, *_ = inputs()
    blocks = [stage_params(s) for s in range(S)]
    if kind == "homogeneous":
        return block, {"num_stages": S}, jax.tree.map(lambda *a: jnp.stack(a), *blocks), h
    r = np.random.default_rng(11)
    embed = {"table": jnp.asarray(r.normal(size=(5, W))), "proj": jnp.asarray(r.normal(size=(2, W)))}
    return [first_with_context, block, block, block], {}, [embed, *blocks[1:]], x


def composed(kind, params, x, context):
    """The un-pipelined model on the whole batch."""
    ctx = {} if context is None else {"context": context}
    if kind == "homogeneous":
        for s in range(S):
            x = block(jax.tree.map(lambda a, s=s: a[s], params), x, None, **ctx)
        return x
    x = first(params[0], x, None)
    for p in params[1:]:
        x = block(p, x, None, **ctx)
    return x


def per_example(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def weighted(tokens):
    """An lm1b-style loss: per-row sums of token losses and the row's token count; the pipeline
    divides the batch's summed losses by its summed weights (see docs/pipeline_training.md)."""

    def loss(y, t):
        w = t[1]
        return jnp.sum((y - t[0]) ** 2, axis=-1) * w, w

    return loss


def mesh_for(name, data):
    devices = S // REPEATS.get(name, 1)
    if data:  # 2 data shards x 2 stage devices: 4 stages as 2 x 2 (circular) or 2 stages
        return jax.make_mesh((2, 2), ("data", "stage"), axis_types=(AxisType.Explicit,) * 2)
    return jax.make_mesh((devices,), ("stage",))


# feature -> what it turns on: "mesh" a stage mesh with `context=` side inputs and the weighted
# loss; "data" a data axis beside the stage axis, with a checkpoint policy
FEATURES = ("no-mesh", "mesh", "data")


@pytest.mark.parametrize("kind", ["heterogeneous", "homogeneous"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("name", SCHEDULES)
def test_grid(name, feature, kind):
    stages, kw, params, x = model(kind)
    _, _, t, tokens, context = inputs()
    repeats = REPEATS.get(name, 1)
    num_stages = S
    if feature == "data" and repeats == 1:  # 2 stage devices: keep 2 stages
        stages = block if kind == "homogeneous" else stages[:2]
        params = jax.tree.map(lambda a: a[:2], params) if kind == "homogeneous" else params[:2]
        kw = {"num_stages": 2} if kind == "homogeneous" else {}
        num_stages = 2
    options = dict(chunks=CHUNKS, repeats=repeats, **kw)
    if feature != "no-mesh":
        options["mesh"] = mesh_for(name, feature == "data")
    if feature == "data":
        options["data_axis_name"] = "data"
        options["checkpoint"] = jax.checkpoint_policies.dots_saveable
    loss_fn, targets, side = per_example, t, {}
    if feature == "mesh":
        loss_fn, targets, side = weighted(tokens), (t, tokens), {"context": context}

    pipe = pj.pipeline(stages, schedule=name, **options)
    step = lambda p: pipe.value_and_grad(loss_fn)(p, x, targets, None, **side)
    if feature == "no-mesh":
        got = jax.jit(step)(params)
    else:  # inside the mesh context the docs recommend: eagerly ("mesh"), under jit ("data")
        with jax.set_mesh(options["mesh"]):
            got = step(params) if feature == "mesh" else jax.jit(step)(params)
    models.assert_trees_close(got, grid_reference(kind, feature, num_stages), **TOL)


@functools.cache
def grid_reference(kind, feature, num_stages):
    """``jax.value_and_grad`` of the composed model's loss for a cell of `test_grid`; it depends
    on the cell's stages and feature, not its schedule, so it is computed once for the 7."""
    _, _, params, x = model(kind)
    _, _, t, tokens, context = inputs()
    if num_stages == 2:
        params = jax.tree.map(lambda a: a[:2], params) if kind == "homogeneous" else params[:2]

    def reference(p):
        if num_stages == 2:  # the data-axis case of two stages
            return jnp.mean(per_example(composed_two(kind, p, x), t))
        if feature == "mesh":
            losses, weights = weighted(tokens)(composed(kind, p, x, context), (t, tokens))
            return jnp.sum(losses) / jnp.sum(weights)
        return jnp.mean(per_example(composed(kind, p, x, None), t))

    want = jax.value_and_grad(reference)(params)
    if feature == "mesh":  # the side input and the weights matter: a pipeline ignoring them differs
        plain = jax.value_and_grad(lambda p: jnp.mean(per_example(composed(kind, p, x, None), t)))(params)
        assert abs(float(plain[0]) - float(want[0])) > 1e-3
    return want


@pytest.mark.parametrize("kind", ["heterogeneous", "homogeneous"])
def test_a_policy_that_saves_everything_on_a_mesh(kind):
    """`jax.checkpoint_policies.everything_saveable` under the training schedules on a mesh: the
    residuals it saves depend on the types inside the `shard_map` (the last stage's loss scale
    is one there), so what F keeps is laid out there; an uneven batch (8 in 3 micro-batches)
    where the table allows it."""
    stages, kw, params, x = model(kind)
    _, _, t, _, _ = inputs()
    want = grid_reference(kind, "no-mesh", S)
    for name in TRAINING:
        chunks = CHUNKS if name == "interleaved-1f1b" else 3  # interleaved: a multiple of 2 devices
        pipe = pj.pipeline(
            stages,
            schedule=name,
            chunks=chunks,
            repeats=REPEATS.get(name, 1),
            mesh=mesh_for(name, False),
            checkpoint=jax.checkpoint_policies.everything_saveable,
            **kw,
        )
        got = jax.jit(pipe.value_and_grad(per_example))(params, x, t)
        models.assert_trees_close(got, want, **TOL)


@pytest.mark.parametrize("kind", ["heterogeneous", "homogeneous"])
def test_per_example_keys_under_every_schedule(kind):
    """Per-example keys on a stage mesh: every schedule draws the masks of GPipe's (or circular's)
    autodiff of the same pipeline. The reference is that schedule's own cell, compiled once
    (compiling the same program a second time to compare it with itself checked nothing)."""
    stages, kw, params, x = model(kind)
    _, _, t, _, _ = inputs()
    key = jax.random.key(5)
    wants = {}
    for name in SCHEDULES:  # "gpipe" and "circular" come before the schedules they serve
        options = dict(chunks=CHUNKS, repeats=REPEATS.get(name, 1), per_example_keys=True, **kw)
        options["mesh"] = mesh_for(name, False)
        pipe = pj.pipeline(stages, schedule=name, **options)
        got = jax.jit(lambda p, pipe=pipe: pipe.value_and_grad(per_example)(p, x, t, key))(params)
        ref_name = GPIPE_OF.get(name, "gpipe")
        if name == ref_name:  # the same masks: GPipe's (or circular's) autodiff is the reference
            wants[name] = got
            continue
        models.assert_trees_close(got, wants[ref_name], **TOL)


def composed_two(kind, params, x):
    if kind == "homogeneous":
        for s in range(2):
            x = block(jax.tree.map(lambda a, s=s: a[s], params), x, None)
        return x
    return block(params[1], first(params[0], x, None), None)


# --- the API cannot mislead --------------------------------------------------------------------


@pytest.mark.parametrize("name", TRAINING)
def test_differentiating_a_training_schedules_forward_is_refused(name):
    stages, kw, params, h = model("homogeneous")
    pipe = pj.pipeline(stages, schedule=name, repeats=REPEATS.get(name, 1), chunks=CHUNKS, **kw)
    y = pipe(params, h)  # the forward call alone runs
    np.testing.assert_allclose(y, composed("homogeneous", params, h, None), **TOL)
    message = rf"schedule='{name}'.*`pipe.value_and_grad\(loss_fn\)"
    with pytest.raises(TypeError, match=message):
        jax.grad(lambda p: jnp.sum(pipe(p, h)))(params)
    with pytest.raises(TypeError, match=message):
        jax.jvp(lambda p: pipe(p, h), (params,), (params,))


@pytest.mark.parametrize("name", TRAINING)
def test_except_last_is_refused_and_the_default_is_always(name):
    repeats = REPEATS.get(name, 1)
    with pytest.raises(ValueError, match=r"`checkpoint='except_last'`.*runs no drain phase.*dots_saveable"):
        pj.pipeline(block, num_stages=S, schedule=name, repeats=repeats, checkpoint="except_last")
    assert pj.pipeline(block, num_stages=S, schedule=name, repeats=repeats).checkpoint == "always"
    assert pj.pipeline(block, num_stages=S).checkpoint == "except_last"


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_message_for_every_schedule(name):
    stages, kw, params, h = model("homogeneous")
    _, _, t, _, _ = inputs()
    pipe = pj.pipeline(stages, schedule=name, repeats=REPEATS.get(name, 1), chunks=CHUNKS, **kw)
    with pytest.raises(TypeError, match=r"returned losses of dtype int\d+.*must be floating point"):
        pipe.value_and_grad(lambda y, t: jnp.argmax(y, -1))(params, h, t)
    with pytest.raises(ValueError, match=r"`targets` has a batch of 7 examples but `x` has 8"):
        pipe.value_and_grad(per_example)(params, h, t[:7])
    with pytest.raises(ValueError, match=r"must return weights one per example"):
        pipe.value_and_grad(lambda y, t: (per_example(y, t), jnp.ones(())))(params, h, t)


def test_never_with_weakly_typed_scalar_parameters():
    """``checkpoint="never"`` stashes the residuals of the stage's vjp; with weakly typed scalar
    parameters (``jnp.array(2.0)``) the dependency analysis once traced another program than F
    ran and read the wrong residuals (gradients off by 0.25)."""
    affine = lambda p, x, key: jnp.tanh(x * p["w"] + p["b"])
    params = [{"w": jnp.array(2.0 - s / 3), "b": jnp.array(0.1 * s)} for s in range(S)]
    x, t = jnp.linspace(-1.0, 1.0, BATCH), jnp.linspace(0.0, 1.0, BATCH)
    sq = lambda y, t: (y - t) ** 2
    want = pj.pipeline([affine] * S, chunks=CHUNKS).value_and_grad(sq)(params, x, t)
    for name in ("1f1b", "zb-h1", "v-half", "zb-v"):
        got = pj.pipeline([affine] * S, chunks=CHUNKS, schedule=name, checkpoint="never")
        models.assert_trees_close(got.value_and_grad(sq)(params, x, t), want, **TOL)


def test_interleaved_suggests_the_chunks_that_give_a_multiple():
    pipe = pj.pipeline(
        block,
        num_stages=8,
        chunks=6,
        schedule="interleaved-1f1b",
        repeats=2,
        mesh=jax.make_mesh((4,), ("stage",)),
    )
    params = jax.tree.map(lambda *a: jnp.stack(a), *[stage_params(s) for s in range(8)])
    h = jnp.ones((12, W))
    with pytest.raises(ValueError, match=r"a batch of 12 with `chunks=6` gives 6 .*`chunks=4`"):
        pipe.value_and_grad(per_example)(params, h, h)


# --- stateful stages (deferred BatchNorm) under every schedule -------------------------------------


def bn_stage(p, h, key, state, mask):
    """A stateful stage: dense, BatchNorm over the real rows of the micro-batch, tanh."""
    h, moments = pj.batch_norm(h @ p["w"], state, train=True, mask=mask, scale=p["g"], bias=p["b"])
    return jnp.tanh(h), moments


def bn_params(seed):
    r = np.random.default_rng(seed)
    return {"w": jnp.asarray(r.normal(size=(W, W)) / 2), "g": jnp.ones(W) * 1.1, "b": jnp.full(W, 0.1)}


@pytest.mark.parametrize("kind", ["heterogeneous", "homogeneous"])
@pytest.mark.parametrize("placement", ["mesh", "no-mesh"])
def test_stateful_stages(placement, kind):
    """Under every schedule, loss, gradients and every stage's statistics per micro-batch equal
    GPipe's (itself tested against numpy in test_deferred_batchnorm.py); the running statistics
    are updated once. Each reference (GPipe's, or circular's) is its own schedule's cell, compiled
    once for the schedules it serves."""
    _, h, t, _, _ = inputs()
    per_stage = [bn_params(s) for s in range(S)]
    state = [pj.batch_norm_init(W, jnp.float64) for _ in range(S)]
    if kind == "homogeneous":
        stages, kw = bn_stage, {"num_stages": S}
        params = jax.tree.map(lambda *a: jnp.stack(a), *per_stage)
        state = jax.tree.map(lambda *a: jnp.stack(a), *state)
    else:
        stages, kw, params = [bn_stage] * S, {}, per_stage
    refs = {}
    for name in SCHEDULES:  # "gpipe" and "circular" come before the schedules they serve
        repeats = REPEATS.get(name, 1)
        options = dict(chunks=CHUNKS + 1, repeats=repeats, stateful=True, **kw)  # uneven: 8 in 3s
        if placement == "mesh":
            options["mesh"] = mesh_for(name, False)
        pipe = pj.pipeline(stages, schedule=name, **options)
        step = jax.jit(pipe.value_and_grad(per_example))
        if placement == "mesh":  # inside the mesh context
            with jax.set_mesh(options["mesh"]):
                (loss, stats), grads = step(params, h, t, state=state)
        else:
            (loss, stats), grads = step(params, h, t, state=state)
        ref_name = GPIPE_OF.get(name, "gpipe")
        if name == ref_name:  # GPipe's (or circular's) autodiff is the reference
            _, fwd_stats = pipe(params, h, state=state)  # the forward call reports the same stats
            models.assert_trees_close(stats, fwd_stats, **TOL)
            refs[name] = (loss, grads, stats)
            continue
        ref_loss, ref_grads, ref_stats = refs[ref_name]
        models.assert_trees_close((loss, grads), (ref_loss, ref_grads), **TOL)
        models.assert_trees_close(stats, ref_stats, **TOL)
