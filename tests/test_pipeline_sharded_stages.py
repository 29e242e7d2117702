"""Parameters sharded inside their stage over the mesh's other axes (``param_specs``).

Tensor parallelism (Megatron column/row splits over a ``"model"`` axis) and FSDP (weights stored
split over the data axis), for homogeneous and heterogeneous stages, against the stages composed
in plain JAX; the compiled programs' collectives say that no tensor-parallel weight is gathered.
The 2 x 2 x 2 (data, stage, model) mesh runs in ``examples/pipeline_3d_mesh.py`` (8 devices; its
single- and two-process runs are compared in ``tests/test_multihost.py``).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pipejax as pj
from pipejax._src.containers import _from_blocks, _to_blocks

D, H, B = 4, 8, 12
COL, ROW = P(None, "model"), P("model", None)


def mlp(p, x, key):
    """A Megatron MLP: column-parallel ``w1`` (and ``b1``), row-parallel ``w2``."""
    return x + jnp.tanh(x @ p["w1"] + p["b1"][None]) @ p["w2"]


def gate(p, x, key):
    """A different second stage: a row-parallel matrix and a whole scale."""
    return jnp.tanh(x @ p["w"]) * p["s"][None]


def mlp_params(seed):
    r = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(r.normal(size=(D, H)) / 2),
        "b1": jnp.asarray(r.normal(size=(H,))),
        "w2": jnp.asarray(r.normal(size=(H, D)) / 3),
    }


def gate_params(seed):
    r = np.random.default_rng(seed)
    return {"w": jnp.asarray(r.normal(size=(D, D)) / 2), "s": jnp.asarray(r.normal(size=(D,)))}


MLP_SPECS = {"w1": COL, "b1": P("model"), "w2": ROW}


def mesh_of(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def composed(stages, params_list, x):
    for stage, p in zip(stages, params_list, strict=True):
        x = stage(p, x, None)
    return jnp.sum(x**2)


def x_batch():
    return jnp.asarray(np.random.default_rng(9).normal(size=(B, D)))


def collectives(fn, *args) -> dict[str, int]:
    hlo = fn.lower(*args).compile().as_text()
    kinds = re.findall(
        r"= \S+ (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(", hlo
    )
    return {k: kinds.count(k) for k in set(kinds)}


def first_device_bytes(tree) -> int:
    first = jax.devices()[0]
    return sum(
        s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == first
    )


def check_against_composition(apply, placed, stages, per_stage):
    """The jitted loss and gradients of ``apply`` equal those of the composed stages; returns
    ``(step, x, grads)``."""
    step = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(apply(p, x) ** 2)))
    x = x_batch()
    value, grads = step(placed, x)
    ref_value, ref_grads = jax.value_and_grad(lambda ps, x: composed(stages, ps, x))(per_stage, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    got = (
        grads.unpack()
        if isinstance(grads, pj.StageParams)
        else [apply.stage_params(grads, s) for s in range(2)]
    )
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)
    return step, x, grads


def test_tensor_parallel_homogeneous_stages_match_the_composition():
    mesh = mesh_of((2, 2), ("stage", "model"))
    per_stage = [mlp_params(0), mlp_params(1)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_stage)
    apply = pj.pipeline(mlp, num_stages=2, chunks=3, mesh=mesh, param_specs=MLP_SPECS)
    placed = apply.place(stacked)
    assert placed["w1"].sharding.spec == P("stage", None, "model")
    assert placed["w2"].sharding.spec == P("stage", "model")
    whole = sum(a.nbytes for a in jax.tree.leaves(per_stage[0]))
    assert first_device_bytes(placed) == whole // 2  # every leaf split over "model"
    step, x, grads = check_against_composition(apply, placed, [mlp, mlp], per_stage)
    assert grads["w1"].sharding.spec == P("stage", None, "model")  # gradients stay split
    kinds = collectives(step, placed, x)
    # no weight is gathered: the one all-gather XLA may place is of the pipeline's output,
    # which leaves the loop split over the stage axis ((micro-batches, rows of 4, D) blocks)
    gathered = re.findall(
        r"= f64\[([\d,]*)\]\S* all-gather(?:-start)?\(", step.lower(placed, x).compile().as_text()
    )
    assert all(tuple(map(int, g.split(",")))[1:] == (4, D) for g in gathered), gathered
    assert kinds.get("all-reduce", 0) >= 1  # the row-parallel partial sums


def test_tensor_parallel_heterogeneous_stages_match_the_composition():
    mesh = mesh_of((2, 2), ("stage", "model"))
    params = [mlp_params(0), gate_params(1)]
    specs = [MLP_SPECS, {"w": ROW, "s": None}]
    apply = pj.pipeline([mlp, gate], chunks=4, mesh=mesh, param_specs=specs)
    placed = apply.place(params)
    # one buffer of whole leaves and one of leaves split over "model", blocks leading
    shapes = sorted((b.shape for b in placed.buffers), key=len)
    assert shapes == [(2, D), (2, 2, (D * H + H + H * D) // 2)], shapes  # "s"; the rest split
    for got, want in zip(placed.unpack(), params, strict=True):
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    _, _, grads = check_against_composition(apply, placed, [mlp, gate], params)
    split = next(b for b in grads.buffers if b.ndim == 3)
    assert split.sharding.spec == P("stage", "model")


def test_fsdp_over_the_data_axis_stores_halves_and_reduce_scatters_gradients():
    mesh = mesh_of((2, 2), ("data", "stage"))
    per_stage = [mlp_params(3), mlp_params(4)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_stage)
    specs = {"w1": P("data", None), "b1": None, "w2": P("data", None)}
    apply = pj.pipeline(mlp, num_stages=2, chunks=4, mesh=mesh, data_axis_name="data", param_specs=specs)
    placed = apply.place(stacked)
    assert placed["w1"].sharding.spec == P("stage", "data")
    step, x, grads = check_against_composition(apply, placed, [mlp, mlp], per_stage)
    assert grads["w2"].sharding.spec == P("stage", "data")
    kinds = collectives(step, placed, x)
    assert kinds.get("all-gather", 0) == 2 and kinds.get("reduce-scatter", 0) == 2, kinds


@pytest.mark.parametrize(
    "specs, error, message",
    [
        ({"w1": P(None, "tensor")}, ValueError, "'tensor', which is not an axis of the mesh"),
        ({"w1": P(None, "stage")}, ValueError, "shards parameter ['w1'] over the stage axis"),
        ({"w1": P(None, None, "model")}, ValueError, "more entries than the parameter has dimensions"),
        ({"b1": P("model"), "w1": P(("model", "model"))}, ValueError, "uses mesh axis 'model' twice"),
        ({"w1": "model"}, TypeError, "must be a `jax.sharding.PartitionSpec`"),
        ({"w1": COL, "extra": None}, ValueError, "must be a pytree prefix"),
    ],
)
def test_bad_param_specs(specs, error, message):
    mesh = mesh_of((2, 2), ("stage", "model"))
    full = {"w1": None, "b1": None, "w2": None} | specs if "extra" not in specs else specs
    apply = pj.pipeline(mlp, num_stages=2, mesh=mesh, param_specs=full)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), mlp_params(0), mlp_params(1))
    with pytest.raises(error, match=re.escape(message)):
        apply.place(stacked)


def test_param_specs_that_do_not_divide_or_do_not_fit_the_pipeline():
    mesh = mesh_of((2, 2), ("stage", "model"))
    odd = [{"w": jnp.ones((D, 3))}, {"w": jnp.ones((3, D))}]
    apply = pj.pipeline([gate, gate], mesh=mesh, param_specs=[{"w": COL}, {"w": ROW}])
    with pytest.raises(ValueError, match=re.escape("over ('model',) (2 devices), which does not divide 3")):
        apply.place(odd)
    with pytest.raises(ValueError, match="one entry per stage"):
        pj.pipeline([gate, gate], mesh=mesh, param_specs=[{"w": COL}]).place([gate_params(0)] * 2)
    with pytest.raises(ValueError, match="`mesh` is None"):
        pj.pipeline(mlp, num_stages=2, param_specs=MLP_SPECS)
    packed = pj.pipeline([gate, gate], mesh=mesh).place([gate_params(0), gate_params(1)])
    with pytest.raises(ValueError, match="packed with other parameter shardings"):
        pj.pipeline([gate, gate], mesh=mesh, param_specs=[{"w": ROW, "s": None}, None]).place(packed)
    mesh3 = mesh_of((1, 2, 2), ("data", "stage", "model"))
    apply = pj.pipeline(
        mlp,
        num_stages=2,
        mesh=mesh3,
        data_axis_name="data",
        param_specs={"w1": P(("data", "model")), "b1": None, "w2": None},
    )
    with pytest.raises(ValueError, match="mixing the data axis 'data' with other axes"):
        apply.place(jax.tree.map(lambda *a: jnp.stack(a), mlp_params(0), mlp_params(1)))


@pytest.mark.parametrize(
    "shape, split",
    [
        ((6, 4), ((1, ("m",), 2),)),
        ((2, 6, 4), ((1, ("m",), 3),)),
        ((4, 3, 6), ((0, ("d",), 2), (2, ("m",), 3))),
    ],
)
def test_split_leaves_are_stored_as_the_blocks_devices_hold(shape, split):
    leaf = jnp.arange(np.prod(shape)).reshape(shape)
    blocks = _to_blocks(leaf, split)
    assert blocks.shape[: len(split)] == tuple(t for _, _, t in split)
    np.testing.assert_array_equal(_from_blocks(blocks, shape, split), leaf)
    # block [i, ...] holds exactly the i-th slice of every split dimension
    index = [slice(None)] * len(shape)
    for (dim, _, t), i in zip(split, [1] * len(split), strict=True):
        size = shape[dim] // t
        index[dim] = slice(i * size, (i + 1) * size)
    want = np.sort(np.asarray(leaf[tuple(index)]).ravel())
    np.testing.assert_array_equal(np.sort(np.asarray(blocks[(1,) * len(split)])), want)


def dense(features, names):
    """A Linen Dense whose kernel carries logical axes (``nn.with_logical_partitioning``)."""
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    return nn.Dense(features, kernel_init=init, use_bias=False, param_dtype=jnp.float64)


class Block(nn.Module):
    """A Megatron MLP in Linen's logical axes: column- then row-parallel over "mlp"."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(dense(H, ("embed", "mlp"))(x))  # Dense_0: column-parallel
        return x + dense(D, ("mlp", "embed"))(h)  # Dense_1: row-parallel


def test_flax_logical_axes_give_the_param_specs():
    """A Linen block annotated with logical axes (``nn.with_logical_partitioning``, the lm1b
    idiom): ``nn.logical_to_mesh(nn.get_partition_spec(...), rules)`` of one layer's variables is
    the pipeline's ``param_specs``; gradients match the composed layers."""
    block = Block()
    boxed = [block.init(jax.random.key(s), jnp.ones((1, D))) for s in range(2)]
    rules = [("mlp", "model"), ("embed", None)]
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed[0]), rules)["params"]
    assert specs["Dense_0"]["kernel"] == P(None, "model")
    per_stage = [nn.unbox(v)["params"] for v in boxed]
    stage = lambda p, x, key: block.apply({"params": p}, x)
    mesh = mesh_of((2, 2), ("stage", "model"))
    apply = pj.pipeline(stage, num_stages=2, chunks=2, mesh=mesh, param_specs=specs)
    placed = apply.place(jax.tree.map(lambda *a: jnp.stack(a), *per_stage))
    assert placed["Dense_1"]["kernel"].sharding.spec == P("stage", "model")
    check_against_composition(apply, placed, [stage, stage], per_stage)


def test_linen_and_nnx_adapters_split_parameters_as_their_layers_metadata_says():
    """Layers annotated for tensor parallelism (Linen: logical axes and the rules in effect at
    ``init``; NNX: ``nnx.with_partitioning``) are stored split over ``"model"`` inside their
    stage by the adapters, and run to the layers' own results."""
    from flax import nnx

    from pipejax.flax import LinenPipeline, NNXPipeline

    mesh = mesh_of((2, 2), ("stage", "model"))
    x = x_batch()

    pipe = LinenPipeline([Block(), Block()], num_stages=2, chunks=3, mesh=mesh)
    with nn.logical_axis_rules([("mlp", "model"), ("embed", None)]):
        variables = pipe.init(jax.random.key(0), x)
    (buffer,) = nn.unbox(variables)["params"]["stages"].buffers
    assert buffer.shape == (2, 2, D * H) and buffer.sharding.spec == P("stage", "model")
    assert nn.get_partition_spec(variables)["params"]["stages"] == P("stage", "model")
    seq = nn.unbox(pipe.to_sequential(variables))
    np.testing.assert_allclose(
        pipe.apply(variables, x), nn.Sequential([Block(), Block()]).apply(seq, x), rtol=1e-12
    )

    class NNXBlock(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(
                D,
                H,
                use_bias=False,
                kernel_init=nnx.with_partitioning(init, (None, "model")),
                param_dtype=jnp.float64,
                rngs=rngs,
            )
            self.down = nnx.Linear(
                H,
                D,
                use_bias=False,
                kernel_init=nnx.with_partitioning(init, ("model", None)),
                param_dtype=jnp.float64,
                rngs=rngs,
            )

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    with jax.set_mesh(mesh):
        blocks = [NNXBlock(nnx.Rngs(s)) for s in range(2)]
    want = blocks[1](blocks[0](x))
    model = NNXPipeline(blocks, num_stages=2, chunks=3, mesh=mesh)
    (buffer,) = model.packed
    assert tuple(buffer[...].sharding.spec)[:2] == ("stage", "model")
    is_spec = lambda a: isinstance(a, P)
    reported = jax.tree.leaves(nnx.get_partition_spec(nnx.state(model, nnx.Param)), is_leaf=is_spec)
    assert any(tuple(spec)[:2] == ("stage", "model") for spec in reported), reported
    np.testing.assert_allclose(model(x), want, rtol=1e-12)


# --- the schedules that own the backward pass, with param_specs -------------------------------------


def SQ(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def _training_case(name, layout):
    """``(pipe, gpipe, params, x, targets)``: 4 homogeneous MLP stages (2 devices x 2 repeats for
    interleaved 1F1B), split for tensor parallelism (``"model"``) or FSDP (``"data"``)."""
    n, repeats = (2, 2) if name in ("interleaved-1f1b", "v-half", "zb-v") else (2, 1)
    if layout == "tensor":
        mesh, specs, data = mesh_of((2, 2), ("stage", "model")), MLP_SPECS, None
    else:
        mesh, data = mesh_of((2, 2), ("data", "stage")), "data"
        specs = {"w1": P("data", None), "b1": None, "w2": P("data", None)}
    stages = n * repeats
    params = jax.tree.map(lambda *a: jnp.stack(a), *[mlp_params(s) for s in range(stages)])
    options = dict(num_stages=stages, chunks=4, mesh=mesh, data_axis_name=data, param_specs=specs)
    pipe = pj.pipeline(mlp, schedule=name, repeats=repeats, **options)
    gpipe = pj.pipeline(mlp, schedule="circular" if repeats > 1 else "gpipe", repeats=repeats, **options)
    x = x_batch()
    return pipe, gpipe, params, x, jnp.flip(x, axis=0)


@pytest.mark.parametrize("layout", ["tensor", "fsdp"])
def test_training_schedules_with_param_specs_match_gpipe(layout):
    """1F1B, ZB-H1, interleaved 1F1B, V-Half and ZB-V against GPipe's (circular's) autodiff, each reference
    computed once for the schedules it serves (a compile each)."""
    refs = {}
    for name in ("1f1b", "zb-h1", "interleaved-1f1b", "v-half", "zb-v"):
        pipe, gpipe, params, x, t = _training_case(name, layout)
        placed = pipe.place(params)
        loss, grads = jax.jit(pipe.value_and_grad(SQ))(placed, x, t)
        if gpipe.repeats not in refs:
            refs[gpipe.repeats] = gpipe.value_and_grad(SQ)(gpipe.place(params), x, t)
        ref_loss, ref_grads = refs[gpipe.repeats]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-12, err_msg=name)
        for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            assert g.sharding.spec == want.sharding.spec, name  # gradients stay split as stored
            np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12, err_msg=name)
        if layout == "tensor":  # each device stores and updates its half of every leaf
            whole = sum(a.nbytes for a in jax.tree.leaves(params)) // pipe.num_devices
            assert first_device_bytes(grads) == whole // 2, name


def test_training_schedules_with_param_specs_heterogeneous():
    """1F1B and ZB-H1 against one GPipe reference."""
    mesh = mesh_of((2, 2), ("stage", "model"))
    params = [mlp_params(0), gate_params(1)]
    specs = [MLP_SPECS, {"w": ROW, "s": None}]
    gpipe = pj.pipeline([mlp, gate], chunks=4, mesh=mesh, param_specs=specs)
    x = x_batch()
    ref = None
    for name in ("1f1b", "zb-h1"):
        pipe = pj.pipeline([mlp, gate], chunks=4, mesh=mesh, param_specs=specs, schedule=name)
        placed = pipe.place(params)
        step = jax.jit(pipe.value_and_grad(SQ))
        loss, grads = step(placed, x, jnp.flip(x, axis=0))
        if ref is None:  # GPipe takes the parameters as the training schedule placed them
            ref = gpipe.value_and_grad(SQ)(placed, x, jnp.flip(x, axis=0))
        ref_loss, ref_grads = ref
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-12, err_msg=name)
        for g, want in zip(grads.unpack(), ref_grads.unpack(), strict=True):
            for k in want:
                np.testing.assert_allclose(g[k], want[k], rtol=1e-10, atol=1e-12, err_msg=name)
        split = next(b for b in grads.buffers if b.ndim == 3)
        assert split.sharding.spec == P("stage", "model"), name
        # no tensor-parallel weight is gathered: only activations of a micro-batch (3 rows), which
        # the slots pack into their message containers
        hlo = step.lower(placed, x, jnp.flip(x, axis=0)).compile().as_text()
        gathered = re.findall(r"= \S+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)
        assert all(shape.split(",")[0] == str(B // 4) for shape in gathered), (name, gathered)


def col(p, x, key):
    """A column-parallel layer whose output stays split over ``"model"`` (on Explicit axes its
    type says so): the next stage reads it, whole."""
    return jnp.tanh(x @ p["w"] + p["b"][None])


@pytest.mark.parametrize(
    "name, repeats, checkpoint",
    [
        ("gpipe", 1, "always"),
        ("circular", 2, "never"),
        ("1f1b", 1, "never"),
        ("zb-h1", 1, "dots_saveable"),
        ("interleaved-1f1b", 2, "always"),
    ],
)
def test_homogeneous_stage_whose_output_is_split_over_the_model_axis(name, repeats, checkpoint):
    """On Explicit axes a homogeneous stage's output may be typed split over an inner axis while
    its input is whole; the pipeline passes it on whole (as the heterogeneous containers do).
    (This failed under every schedule with "select cases must have the same shardings" or
    "switch branches must have equal output types"; and the training schedules' F slot with
    ``"never"`` or a policy failed with ``param_specs`` on any axes: a read pinned outside the
    ``shard_map``, and a cotangent seed typed whole for an output typed split.)"""
    if checkpoint == "dots_saveable":
        checkpoint = jax.checkpoint_policies.dots_saveable
    mesh = jax.make_mesh((2, 2), ("stage", "model"), axis_types=(AxisType.Explicit,) * 2)
    S = 2 * repeats
    r = np.random.default_rng(5)
    per_stage = [
        {"w": jnp.asarray(r.normal(size=(D, D)) / 2), "b": jnp.asarray(r.normal(size=(D,)))} for _ in range(S)
    ]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_stage)
    specs = {"w": COL, "b": P("model")}
    pipe = pj.pipeline(
        col,
        num_stages=S,
        chunks=4,
        mesh=mesh,
        param_specs=specs,
        schedule=name,
        repeats=repeats,
        checkpoint=checkpoint,
    )
    x = x_batch()
    t = jnp.flip(x, axis=0)
    loss, grads = jax.jit(pipe.value_and_grad(SQ))(pipe.place(stacked), x, t)

    def ref(ps, x):
        for p in ps:
            x = col(p, x, None)
        return jnp.mean(SQ(x, t))

    ref_loss, ref_grads = jax.value_and_grad(ref)(per_stage, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    for s in range(S):
        for g, w in zip(
            jax.tree.leaves(pipe.stage_params(grads, s)), jax.tree.leaves(ref_grads[s]), strict=True
        ):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_stateful_stage_with_aux_outputs_split_over_the_model_axis_on_auto_axes():
    """A column-parallel stateful stage with aux outputs on Auto axes: its stats and aux values
    are split over ``"model"`` until they are recorded. GPipe (and 1F1B) match the composition.
    (This deadlocked: XLA placed the resharding of the records inside the stage's switch branch,
    the devices of the two stages waited at different collectives, and XLA's CPU runtime
    aborted after its collective timeout. The records are now pinned whole before packing.)"""
    mesh = mesh_of((2, 2), ("stage", "model"))

    def stage(p, x, key, state, mask):
        y = jnp.tanh(x @ p["w"] + p["b"][None])
        return y, {"sum": jnp.sum(jnp.where(mask[:, None], y, 0), 0)}, {"bal": jnp.mean(y**2)}

    r = np.random.default_rng(3)
    per_stage = [
        {"w": jnp.asarray(r.normal(size=(D, D)) / 2), "b": jnp.asarray(r.normal(size=(D,)))} for _ in range(2)
    ]
    specs = [{"w": COL, "b": P("model")}] * 2
    state = [{"sum": jnp.zeros((D,))}] * 2
    x = x_batch()
    t = jnp.flip(x, axis=0)

    def ref(ps):
        h, bal = x, 0.0
        for p in ps:
            h = jnp.tanh(h @ p["w"] + p["b"][None])
            bal = bal + jnp.mean(h**2)  # one micro-batch of 3 rows per chunk: mean of the means
        return jnp.mean(SQ(h, t)) + bal

    ref_loss, ref_grads = jax.value_and_grad(ref)(per_stage)
    for name in ("gpipe", "1f1b"):
        pipe = pj.pipeline(
            [stage, stage], chunks=4, mesh=mesh, param_specs=specs, stateful=True, aux="mean", schedule=name
        )
        step = pipe.value_and_grad(SQ, aux_loss=lambda a: a["bal"])
        head, grads = jax.jit(step)(pipe.place(per_stage), x, t, state=state)
        np.testing.assert_allclose(head[0], ref_loss, rtol=1e-12, err_msg=name)
        for g, w in zip(jax.tree.leaves(grads.unpack()), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)


def test_dropout_in_a_stage_split_over_the_model_axis_under_1f1b_never():
    """Explicit axes, a column-parallel stage with dropout, ``checkpoint="never"``: 1F1B's F slot
    stashes residuals split over ``"model"`` (the mask among them), and B must read them with
    that type. 1F1B equals GPipe (the same keys draw the same masks). (The stash gave them back
    replicated, and the pullback's select refused them.)"""
    mesh = jax.make_mesh((2, 2), ("stage", "model"), axis_types=(AxisType.Explicit,) * 2)

    def stage(p, x, key):
        h = col(p, x, key)
        return jnp.where(jax.random.bernoulli(key, 0.25, h.shape), 0, h / 0.75)

    r = np.random.default_rng(4)
    per_stage = [
        {"w": jnp.asarray(r.normal(size=(D, D)) / 2), "b": jnp.asarray(r.normal(size=(D,)))} for _ in range(2)
    ]
    specs = [{"w": COL, "b": P("model")}] * 2
    x = x_batch()
    t, key = jnp.flip(x, axis=0), jax.random.key(8)
    got = {}
    for name in ("gpipe", "1f1b"):
        pipe = pj.pipeline(
            [stage, stage], chunks=4, mesh=mesh, param_specs=specs, schedule=name, checkpoint="never"
        )
        got[name] = jax.jit(pipe.value_and_grad(SQ))(pipe.place(per_stage), x, t, key)
    np.testing.assert_allclose(got["1f1b"][0], got["gpipe"][0], rtol=1e-12)
    for a, b in zip(
        jax.tree.leaves(got["1f1b"][1].unpack()), jax.tree.leaves(got["gpipe"][1].unpack()), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_bfloat16_stats_of_stages_sharded_inside():
    """bfloat16 stats of a stateful pipeline with ``param_specs``: XLA:CPU crashed compiling the
    bfloat16 all-reduce that gathers them over the stage axis ("Invalid binary instruction opcode
    copy", the process aborted). They are gathered in float32 (exact) and returned in bfloat16,
    equal to the stages' own."""
    mesh = mesh_of((2, 2), ("stage", "model"))
    bf = jnp.bfloat16

    def stage(p, x, key, state, mask):
        y = jnp.tanh(x @ p["w"])
        return y, {"sum": jnp.sum(jnp.where(mask[:, None], y, 0), 0)}

    r = np.random.default_rng(6)
    per_stage = [{"w": jnp.asarray(r.normal(size=(D, D)) / 2, bf)} for _ in range(2)]
    pipe = pj.pipeline([stage, stage], chunks=4, mesh=mesh, stateful=True, param_specs=[{"w": ROW}] * 2)
    x = x_batch().astype(bf)
    state = [{"sum": jnp.zeros((D,), bf)}] * 2
    y, stats = jax.jit(lambda p: pipe(p, x, state=state))(pipe.place(per_stage))
    h = x
    for s in range(2):
        want = [stage(per_stage[s], h[i : i + 3], None, None, jnp.ones(3, bool)) for i in range(0, B, 3)]
        h = jnp.concatenate([w[0] for w in want])
        assert stats[s]["sum"].dtype == bf
        np.testing.assert_allclose(
            np.asarray(stats[s]["sum"], np.float32),
            np.stack([np.asarray(w[1]["sum"], np.float32) for w in want]),
            rtol=2e-2,
            atol=2e-2,
        )
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(h, np.float32), rtol=2e-2, atol=2e-2)
