"""Auxiliary outputs of stages (``pipeline(..., aux=...)``, ``value_and_grad(..., aux_loss=)``):
the values per (stage, micro-batch), their sums and means, and the aux loss's gradient under
every schedule, against the stages composed on each micro-batch (float64, rtol 1e-10)."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

S, D = 4, 3  # stages, features
SCHEDULES = [
    ("gpipe", 1),
    ("circular", 2),
    ("1f1b", 1),
    ("zb-h1", 1),
    ("interleaved-1f1b", 2),
    ("v-half", 2),
    ("zb-v", 2),
]
CHUNKS = 4  # batch 10 -> micro-batches of 3, 3, 3, 1 (+ 2 padding rows); batch 12 -> 4 of 3
MICRO = 3


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def masked_stage(p, x, key, state, mask):
    """A stage that reports its mean squared activation over the micro-batch's real rows."""
    y = layer(p, x)
    sq = jnp.sum(y**2, axis=-1)
    n = jnp.sum(mask).astype(y.dtype)
    return y, None, {"sq": jnp.sum(jnp.where(mask, sq, 0.0)) / n, "peak": jnp.max(jnp.abs(y))}


def plain_stage(p, x, key):
    y = layer(p, x)
    return y, {"sq": jnp.mean(jnp.sum(y**2, axis=-1))}


def make_params():
    keys = jax.random.split(jax.random.key(0), S)
    return [
        {"w": 0.8 * jax.random.normal(k, (D, D), jnp.float64), "b": 0.1 * jnp.ones(D, jnp.float64)}
        for k in keys
    ]


PARAMS = make_params()
STACKED = jax.tree.map(lambda *a: jnp.stack(a), *PARAMS)
X10 = jax.random.normal(jax.random.key(1), (10, D), jnp.float64)
X12 = jax.random.normal(jax.random.key(2), (12, D), jnp.float64)
T10, T12 = jnp.ones((10, D)), jnp.ones((12, D))


def per_example(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def aux_loss(aux):
    return 0.7 * aux["sq"]


def reference(params, x, masked):
    """``(y, aux per stage stacked (m, ...), weights)``: the stages composed on each micro-batch's
    real rows."""
    ys, auxs, weights = [], [[] for _ in range(S)], []
    for start in range(0, x.shape[0], MICRO):
        h = x[start : start + MICRO]
        weights.append(h.shape[0] / x.shape[0])
        for s in range(S):
            if masked:
                h, _, a = masked_stage(params[s], h, None, None, jnp.ones(h.shape[0], bool))
            else:
                h, a = plain_stage(params[s], h, None)
            auxs[s].append(a)
        ys.append(h)
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *per) for per in auxs]
    return jnp.concatenate(ys), stacked, jnp.asarray(weights)


def reference_loss(params, x, t, masked):
    y, auxs, w = reference(params, x, masked)
    return jnp.mean(per_example(y, t)) + sum(jnp.sum(w * jax.vmap(aux_loss)(a)) for a in auxs)


@pytest.fixture(scope="module")
def mesh4():
    return jax.make_mesh((4,), ("stage",))


@pytest.fixture(scope="module")
def mesh2():
    return jax.make_mesh((2,), ("stage",))


def build(form, schedule, repeats, mesh, aux):
    if form == "masked":  # heterogeneous, stateful (reads the row mask), uneven batch
        return pj.pipeline(
            [masked_stage] * S,
            chunks=CHUNKS,
            stateful=True,
            aux=aux,
            schedule=schedule,
            repeats=repeats,
            mesh=mesh,
        )
    return pj.pipeline(
        plain_stage, num_stages=S, chunks=CHUNKS, aux=aux, schedule=schedule, repeats=repeats, mesh=mesh
    )


def case(form):
    if form == "masked":
        return PARAMS, X10, T10, True
    return STACKED, X12, T12, False


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-13)


REFS = {}


def ref_grads(form):
    if form not in REFS:
        _, x, t, masked = case(form)
        REFS[form] = jax.value_and_grad(lambda p: reference_loss(p, x, t, masked))(PARAMS)
    return REFS[form]


def stacked_like(form, grads):
    return grads if form == "masked" else jax.tree.map(lambda *a: jnp.stack(a), *grads)


@pytest.mark.parametrize("on_mesh", [False, True], ids=["no-mesh", "mesh"])
@pytest.mark.parametrize("form", ["masked", "homogeneous"])
@pytest.mark.parametrize("schedule,repeats", SCHEDULES)
def test_aux_loss_gradient_every_schedule(schedule, repeats, form, on_mesh, request):
    """``value_and_grad(loss_fn, aux_loss=)``: the loss and gradients of the mean loss plus
    ``sum_s sum_i w_i aux_loss(aux_si)`` equal ``jax.grad`` of the composed model's."""
    mesh = request.getfixturevalue("mesh2" if repeats > 1 else "mesh4") if on_mesh else None
    params, x, t, masked = case(form)
    pipe = build(form, schedule, repeats, mesh, "stack")
    out, grads = pipe.value_and_grad(per_example, aux_loss=aux_loss)(params, x, t)
    loss, aux = (out[0], out[2]) if form == "masked" else out
    ref_loss, ref_g = ref_grads(form)
    close(loss, ref_loss)
    jax.tree.map(close, grads, stacked_like(form, ref_g))
    _, ref_aux, _ = reference(PARAMS, x, masked)
    jax.tree.map(close, aux, ref_aux if form == "masked" else stacked_like(form, ref_aux))


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_jax_grad_through_returned_aux(schedule, repeats, mesh2):
    """GPipe and circular: ``jax.grad`` of a loss of the returned aux is autodiff of the loop."""
    mesh = mesh2 if repeats > 1 else None
    pipe = build("masked", schedule, repeats, mesh, "mean")

    def loss(p):
        y, _, aux = pipe(p, X10, state=None)
        return jnp.mean(per_example(y, T10)) + sum(aux_loss(a) for a in aux)

    close(jax.jit(jax.grad(loss))(PARAMS)[2]["w"], ref_grads("masked")[1][2]["w"])


@pytest.mark.parametrize("mode", ["stack", "sum", "mean"])
def test_forward_reductions(mode, mesh4):
    """``aux="stack"``: every (stage, micro-batch); ``"sum"``: the sum over micro-batches;
    ``"mean"``: ``sum_i w_i aux_i``, ``w_i`` the real rows' share (padding rows do not count)."""
    _, ref_aux, w = reference(PARAMS, X10, True)
    want = {
        "stack": ref_aux,
        "sum": [jax.tree.map(lambda a: jnp.sum(a, 0), a) for a in ref_aux],
        "mean": [jax.tree.map(lambda a: jnp.sum(w * a, 0), a) for a in ref_aux],
    }[mode]
    for mesh in (None, mesh4):
        _, stats, aux = build("masked", "gpipe", 1, mesh, mode)(PARAMS, X10)
        assert not jax.tree.leaves(stats)
        jax.tree.map(close, aux, want)


def test_homogeneous_mean_is_weighted(mesh4):
    _, ref_aux, w = reference(PARAMS, X12, False)
    _, aux = build("homogeneous", "gpipe", 1, mesh4, "mean")(STACKED, X12)
    close(aux["sq"], jnp.stack([jnp.sum(w * a["sq"]) for a in ref_aux]))


def test_hvp_of_value_and_grad():
    """``jax.jvp`` of the 1F1B step (aux loss included) gives the Hessian-vector product."""
    pipe = build("masked", "1f1b", 1, None, "sum")
    step = pipe.value_and_grad(per_example, aux_loss=aux_loss)
    flat, unravel = jax.flatten_util.ravel_pytree(PARAMS)
    v = jax.random.normal(jax.random.key(3), flat.shape, jnp.float64)
    _, hvp = jax.jvp(lambda f: ravel(step(unravel(f), X10, T10)[1]), (flat,), (v,))
    # jitted: one compile instead of op-by-op autodiff of the per-micro-batch loop
    hess = jax.jit(jax.hessian(lambda f: reference_loss(unravel(f), X10, T10, True)))(flat)
    close(hvp, hess @ v)


def ravel(tree):
    return jax.flatten_util.ravel_pytree(tree)[0]


# --- validation -------------------------------------------------------------------------------


def test_bad_aux_option():
    with pytest.raises(
        ValueError, match=r"`aux` must be None or one of 'stack', 'sum', 'mean', but got 'avg'"
    ):
        pj.pipeline([plain_stage], aux="avg")
    with pytest.raises(TypeError, match=r"`aux` must be None .* but got bool True"):
        pj.pipeline([plain_stage], aux=True)


def test_aux_loss_needs_aux():
    pipe = pj.pipeline([layer_stage], chunks=2)
    with pytest.raises(ValueError, match=r"`aux_loss` was given, but the pipeline was built without `aux=`"):
        pipe.value_and_grad(per_example, aux_loss=aux_loss)
    with pytest.raises(TypeError, match=r"`aux_loss` must be a callable .* but got float 0.1"):
        build("homogeneous", "gpipe", 1, None, "sum").value_and_grad(per_example, aux_loss=0.1)


def layer_stage(p, x, key):
    return layer(p, x)


def test_stage_must_return_aux():
    pipe = pj.pipeline([layer_stage], chunks=2, aux="sum")
    with pytest.raises(
        ValueError,
        match=r"Stage 0 returned .* has `aux=` set, so every stage must return a pair `\(y, aux\)`",
    ):
        pipe([PARAMS[0]], X12)
    pipe = pj.pipeline(
        [lambda p, x, key, state, mask: (layer(p, x), None)], chunks=2, stateful=True, aux="sum"
    )
    with pytest.raises(ValueError, match=r"must return a triple `\(y, stats, aux\)`"):
        pipe([PARAMS[0]], X12)


def test_aux_loss_must_be_scalar():
    pipe = build("homogeneous", "1f1b", 1, None, "sum")
    with pytest.raises(ValueError, match=r"`aux_loss\(aux\)` must return a scalar .* returned shape \(2,\)"):
        pipe.value_and_grad(per_example, aux_loss=lambda a: jnp.stack([a["sq"]] * 2))(STACKED, X12, T12)


def test_mean_refuses_integer_aux():
    def counting(p, x, key):
        return layer(p, x), jnp.sum(x > 0)

    with pytest.raises(TypeError, match=r"`aux='mean'` averages every aux leaf .* dtype int"):
        pj.pipeline([counting], chunks=2, aux="mean")([PARAMS[0]], X12)
    _, count = pj.pipeline([counting], chunks=2, aux="sum")([PARAMS[0]], X12)
    assert int(count[0]) == int(jnp.sum(X12 > 0))


# --- a weighted loss (`loss_fn` returns `(losses, weights)`) with an aux loss ---------------------

# random 0/1 weights carried in the targets' last column (a padding mask), batch 10 (uneven)
W10 = (jax.random.uniform(jax.random.key(5), (10,)) > 0.4).astype(jnp.float64)
TW10 = jnp.concatenate([T10, W10[:, None]], axis=1)


def weighted(y, t):
    """A token-weighted loss: per-example sums and weights from the targets' mask column."""
    return per_example(y, t[:, :D]) * t[:, D], t[:, D]


def weighted_reference_loss(params, x, t, masked):
    """``sum(w l) / sum(w) + sum_s sum_i w_i aux_loss(aux_si)`` of the composed model."""
    y, auxs, w = reference(params, x, masked)
    losses, weights = weighted(y, t)
    return jnp.sum(losses) / jnp.sum(weights) + sum(jnp.sum(w * jax.vmap(aux_loss)(a)) for a in auxs)


WREFS = {}


def weighted_ref(form):
    if form not in WREFS:
        _, _, _, masked = case(form)
        WREFS[form] = jax.value_and_grad(lambda p: weighted_reference_loss(p, X10, TW10, masked))(PARAMS)
    return WREFS[form]


# checkpoint: the default (the training schedules' is "always": B rebuilds the stage's pullback)
# and "never" (B reads the residuals F stashed), the two paths that seed the aux term
@pytest.mark.parametrize("checkpoint", [None, "never"])
@pytest.mark.parametrize("on_mesh", [False, True], ids=["no-mesh", "mesh"])
@pytest.mark.parametrize("form", ["masked", "homogeneous"])
@pytest.mark.parametrize("schedule,repeats", SCHEDULES)
def test_weighted_loss_with_aux_loss(schedule, repeats, form, on_mesh, checkpoint, request):
    """A weighted loss plus an aux loss gives one loss under every schedule: the training
    schedules scale each aux term by the batch's total weight, computed up front from the
    targets, and equal GPipe's autodiff and the composed model."""
    if checkpoint is not None and schedule not in ("1f1b", "zb-h1"):
        pytest.skip("the stashed-residual path once per training schedule is enough")
    mesh = request.getfixturevalue("mesh2" if repeats > 1 else "mesh4") if on_mesh else None
    params = PARAMS if form == "masked" else STACKED
    if form == "masked":
        pipe = pj.pipeline(
            [masked_stage] * S,
            chunks=CHUNKS,
            stateful=True,
            aux="sum",
            schedule=schedule,
            repeats=repeats,
            mesh=mesh,
            checkpoint=checkpoint,
        )
    else:
        pipe = pj.pipeline(
            plain_stage,
            num_stages=S,
            chunks=CHUNKS,
            aux="sum",
            schedule=schedule,
            repeats=repeats,
            mesh=mesh,
            checkpoint=checkpoint,
        )
    out, grads = pipe.value_and_grad(weighted, aux_loss=aux_loss)(params, X10, TW10)
    ref_loss, ref_g = weighted_ref(form)
    close(out[0], ref_loss)
    jax.tree.map(close, grads, stacked_like(form, ref_g))


def test_weighted_loss_with_aux_loss_data_axis():
    """With a data axis the total weight is the whole batch's (every data shard's micro-batches)."""
    mesh = jax.make_mesh((2, 2), ("data", "stage"))
    pipe = pj.pipeline(
        plain_stage,
        num_stages=S,
        chunks=CHUNKS,
        aux="sum",
        schedule="interleaved-1f1b",
        repeats=2,
        mesh=mesh,
        data_axis_name="data",
    )
    (loss, _), grads = pipe.value_and_grad(weighted, aux_loss=aux_loss)(STACKED, X10, TW10)
    ref_loss, ref_g = weighted_ref("homogeneous")
    close(loss, ref_loss)
    jax.tree.map(close, grads, stacked_like("homogeneous", ref_g))


@pytest.mark.parametrize("schedule,repeats", [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_weights_from_outputs_with_aux_loss_refused(schedule, repeats):
    """Weights computed from the outputs are not known before the loop: a clear refusal (GPipe
    supports them)."""

    def from_outputs(y, t):
        return per_example(y, t), jnp.where(y[:, 0] > 0, 1.0, 0.5)

    pipe = build("homogeneous", schedule, repeats, None, "sum")
    with pytest.raises(
        NotImplementedError,
        match=r"`aux_loss` with a `loss_fn` whose weights depend on its `outputs` is not supported "
        r"under `schedule='" + schedule + r"'`.* from `targets`, or train with `schedule='gpipe'`",
    ):
        pipe.value_and_grad(from_outputs, aux_loss=aux_loss)(STACKED, X12, T12)
    # without an aux loss the training schedules take such weights (divided at the end)
    gpipe = build("homogeneous", "gpipe", 1, None, "sum")
    (loss, _), _ = pipe.value_and_grad(from_outputs)(STACKED, X12, T12)
    (gpipe_loss, _), _ = gpipe.value_and_grad(from_outputs)(STACKED, X12, T12)
    close(loss, gpipe_loss)


@pytest.mark.parametrize("schedule", ["circular", "interleaved-1f1b", "v-half"])
def test_data_axis(schedule):
    """With a data axis each data shard records its own micro-batches: the same aux and grads."""
    mesh = jax.make_mesh((2, 2), ("data", "stage"))
    pipe = pj.pipeline(
        plain_stage,
        num_stages=S,
        chunks=CHUNKS,
        aux="stack",
        schedule=schedule,
        repeats=2,
        mesh=mesh,
        data_axis_name="data",
    )
    (loss, aux), grads = pipe.value_and_grad(per_example, aux_loss=aux_loss)(STACKED, X12, T12)
    ref_loss, ref_g = ref_grads("homogeneous")
    close(loss, ref_loss)
    jax.tree.map(close, grads, stacked_like("homogeneous", ref_g))
    _, ref_aux, _ = reference(PARAMS, X12, False)
    jax.tree.map(close, aux, stacked_like("homogeneous", ref_aux))
