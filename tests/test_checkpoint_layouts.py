"""Checkpoints that move between layouts (issue 24): `to_layers`, `layers_target`, `from_layers`.

A train state (parameters and Adam's state) trains 2 steps under layout A, is saved in layer form
with orbax, restored into layout B and trains 2 more steps. The reference trains those 2 steps
under A. Same layout: bitwise. Another layout: float64 to 1e-12 (relative; the stages' sums
are the same, but XLA may fuse a stage of 2 layers differently from 2 stages of 1).

The layouts: 4 or 2 homogeneous stages (each stage's layers stacked, `(S, L / S, ...)`), 2
stages with a tensor-parallel `param_specs` on a ("stage", "model") mesh, 2 stages without a
mesh (one device), and heterogeneous
stages from `pj.partition` with balance [2, 2] or [1, 3]. The 2-process case is
`tests/layers_worker.py`, started by `test_two_processes_move_their_own_shards`.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import pipejax as pj
from tests.conftest import without_compilation_cache

ocp = pytest.importorskip("orbax.checkpoint")  # the optional extra pipejax[checkpoint]
optax = pytest.importorskip("optax")

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPT = optax.adam(1e-2)
L, D, B = 4, 4, 8  # layers, width, batch
RTOL = 1e-12  # float64, other layouts (see the module docstring)


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int and float
        yield


def layer(p, x, key):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def stacked_stage(p, x, key):  # a homogeneous stage: its layers stacked on axis 0
    h, _ = lax.scan(lambda h, q: (layer(q, h, None), None), x, p)
    return h


def init_layers():
    r = np.random.default_rng(0)
    return {
        "w": jnp.asarray(r.normal(size=(L, D, D)) / np.sqrt(D)),
        "b": jnp.asarray(r.normal(size=(L, D)) * 0.1),
    }


def unstack(layers):
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(L)]


TP_SPECS = {"w": P(None, None, "model"), "b": P(None, "model")}


@functools.cache  # one pipeline (and train step, below) per layout: each compiles once per module
def layout(name):
    """``(pipe, balance, layers)``: the pipeline of layout ``name``, its balance (heterogeneous
    stages), and the initial layers in its layer form (stacked, or a list of per-layer trees)."""
    devs = jax.devices()
    if name in ("4", "2"):
        n = int(name)
        mesh = jax.make_mesh((n,), ("stage",), devices=devs[:n])
        return pj.pipeline(stacked_stage, num_stages=n, chunks=2, mesh=mesh), None, init_layers()
    if name == "none":  # one device, no mesh: e.g. to evaluate a checkpoint
        return pj.pipeline(stacked_stage, num_stages=2, chunks=2), None, init_layers()
    if name == "2tp":
        auto = (jax.sharding.AxisType.Auto,) * 2  # XLA partitions each stage over "model"
        mesh = jax.make_mesh((2, 2), ("stage", "model"), devices=devs[:4], axis_types=auto)
        pipe = pj.pipeline(stacked_stage, num_stages=2, chunks=2, mesh=mesh, param_specs=TP_SPECS)
        return pipe, None, init_layers()
    balance = {"het22": [2, 2], "het13": [1, 3]}[name]
    part = pj.partition([layer] * L, balance)
    mesh = jax.make_mesh((2,), ("stage",), devices=devs[:2])
    return pj.pipeline(part.stages, chunks=2, mesh=mesh), balance, unstack(init_layers())


def data():
    r = np.random.default_rng(1)
    return [(jnp.asarray(r.normal(size=(B, D))), jnp.asarray(r.normal(size=(B, D)))) for _ in range(4)]


@functools.cache
def make_step(pipe, opt):
    grad = pipe.value_and_grad(lambda y, t: jnp.sum((y - t) ** 2, axis=-1))

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(state, x, t):
        loss, grads = grad(state["params"], x, t)
        params, opt_state = update(state["params"], state["opt_state"], grads)
        return {"params": params, "opt_state": opt_state}, loss

    return step


def train(step, state, batches):
    losses = []
    for x, t in batches:
        state, loss = step(state, x, t)
        losses.append(float(loss))
    return state, losses


def start(name, opt):
    pipe, balance, layers = layout(name)
    params = pj.from_layers(pipe, layers, balance=balance)
    if pipe.mesh is None:
        return pipe, balance, {"params": params, "opt_state": opt.init(params)}
    with jax.set_mesh(pipe.mesh):
        state = {"params": params, "opt_state": opt.init(params)}
    return pipe, balance, state


def save(pipe, state, folder):
    layers = pj.to_layers(pipe, state, params=state["params"])
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(folder, layers)
    ckpt.wait_until_finished()
    return layers


def restore(name, opt, folder):
    pipe, balance, init = layout(name)
    shapes = jax.eval_shape(lambda: {"params": init, "opt_state": opt.init(init)})
    target = pj.layers_target(pipe, shapes, params=shapes["params"], balance=balance)
    layers = ocp.StandardCheckpointer().restore(folder, target)
    return pipe, pj.from_layers(pipe, layers, params=layers["params"], balance=balance), layers, target


def flat_layers(pipe, params):
    """The parameters as one numpy ``(L, ...)`` stack per leaf, whatever the layout."""
    layers = jax.device_get(pj.to_layers(pipe, params))
    if not pipe.homogeneous:
        layers = jax.tree.map(lambda *ls: np.stack(ls), *layers)
    return layers


@pytest.mark.parametrize(
    "before, after",
    [("4", "4"), ("4", "2"), ("2", "4"), ("2", "2tp"), ("2tp", "none"), ("het22", "het13")],
)
def test_training_continues_in_another_layout(before, after, tmp_path):
    opt = OPT
    batches = data()
    pipe_a, _, state = start(before, opt)
    step_a = make_step(pipe_a, opt)
    state, _ = train(step_a, state, batches[:2])
    save(pipe_a, state, tmp_path / "ckpt")
    reference, ref_losses = train(step_a, state, batches[2:])

    pipe_b, restored, _, _ = restore(after, opt, tmp_path / "ckpt")
    moved, losses = train(make_step(pipe_b, opt), restored, batches[2:])

    want, got = flat_layers(pipe_a, reference["params"]), flat_layers(pipe_b, moved["params"])
    if before == after:  # the same program on the same bits
        assert losses == ref_losses
        jax.tree.map(np.testing.assert_array_equal, got, want)
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-14), got, want)
    assert int(moved["opt_state"][0].count) == 4


def test_round_trip_is_exact_and_the_result_is_placed():
    """from_layers gives what place gives (values and shardings); to_layers gives back the layers."""
    for name in ("4", "2", "2tp", "none", "het13"):
        pipe, balance, layers = layout(name)
        placed = pj.from_layers(pipe, layers, balance=balance)
        if balance:
            stages = pj.partition([layer] * L, balance).group(layers)
        else:
            stages = jax.tree.map(lambda a, n=pipe.num_stages: a.reshape(n, -1, *a.shape[1:]), layers)
        reference = pipe.place(stages)
        for a, r in zip(jax.tree.leaves(placed), jax.tree.leaves(reference), strict=True):
            assert a.sharding.is_equivalent_to(r.sharding, a.ndim), (name, a.sharding, r.sharding)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
        back = pj.to_layers(pipe, placed)
        jax.tree.map(np.testing.assert_array_equal, back, layers)


def test_restored_arrays_carry_the_target_shardings_and_nothing_moves(tmp_path):
    """Each device reads its own blocks; converting to and from the layer form moves no data."""
    opt = OPT
    pipe, _, state = start("4", opt)
    with jax.transfer_guard("disallow_explicit"):  # no device_put, no device-to-device copy
        save(pipe, state, tmp_path / "ckpt")
    pipe_b, _, layers, target = restore("2tp", opt, tmp_path / "ckpt")
    for a, t in zip(jax.tree.leaves(layers), jax.tree.leaves(target), strict=True):
        assert a.sharding == t.sharding
    w = layers["params"]["w"]  # (4, D, D) over ("stage", -, "model"): 2 layers, half the columns
    assert w.sharding.spec == P("stage", None, "model") and not w.sharding.is_fully_replicated
    assert {s.data.shape for s in w.addressable_shards} == {(2, D, D // 2)}
    with jax.transfer_guard("disallow_explicit"):
        again = pj.from_layers(pipe_b, layers, params=layers["params"])
    wb = again["params"]["w"]
    assert wb.sharding.spec == P("stage", None, None, "model")
    assert {s.data.shape for s in wb.addressable_shards} == {(1, 2, D, D // 2)}
    assert again["opt_state"][0].mu["w"].sharding == wb.sharding  # the moments moved alike


def test_heterogeneous_stages_unpack_on_their_own_devices():
    pipe, balance, layers = layout("het13")
    placed = pj.from_layers(pipe, layers, balance=balance)
    with jax.transfer_guard("disallow_explicit"):
        back = pj.to_layers(pipe, placed)
    devices = pipe.mesh.devices
    for i, one in enumerate(back):
        stage = 0 if i < 1 else 1
        for a in jax.tree.leaves(one):
            assert a.sharding.device_set == {devices[stage]}, (i, a.sharding)


def test_circular_layout_round_trips():
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    pipe = pj.pipeline(stacked_stage, num_stages=4, mesh=mesh, schedule="circular", repeats=2)
    layers = init_layers()
    placed = pj.from_layers(pipe, layers)
    reference = pipe.place(jax.tree.map(lambda a: a.reshape(4, 1, *a.shape[1:]), layers))
    for a, r in zip(jax.tree.leaves(placed), jax.tree.leaves(reference), strict=True):
        assert a.shape == r.shape and a.sharding.is_equivalent_to(r.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    jax.tree.map(np.testing.assert_array_equal, pj.to_layers(pipe, placed), layers)
    target = pj.layers_target(pipe, layers)  # device d reads layers 2d, 2d + 1; XLA moves them
    restored = jax.device_put(layers, jax.tree.map(lambda t: t.sharding, target))
    jax.tree.map(np.testing.assert_array_equal, pj.from_layers(pipe, restored), placed)
    # heterogeneous stages, one layer each: device d holds stages d and d + 2
    het = pj.pipeline(pj.partition([layer] * L, [1] * L).stages, mesh=mesh, schedule="circular", repeats=2)
    listed = unstack(layers)
    packed = pj.from_layers(het, listed, balance=[1] * L)
    reference = het.place([[p] for p in listed])
    for a, r in zip(packed.buffers, reference.buffers, strict=True):
        assert a.shape == r.shape and a.sharding.is_equivalent_to(r.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    jax.tree.map(np.testing.assert_array_equal, pj.to_layers(het, packed), listed)


# --- under jax.set_mesh (issue 39) ---------------------------------------------------------------


def circular(kind):
    """A circular layout on 2 devices (4 stages): homogeneous, or heterogeneous one layer each."""
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    if kind == "circ":
        return pj.pipeline(stacked_stage, num_stages=4, mesh=mesh, schedule="circular", repeats=2), None
    part = pj.partition([layer] * L, [1] * L)
    return pj.pipeline(part.stages, mesh=mesh, schedule="circular", repeats=2), [1] * L


def any_layout(name):
    if name in ("circ", "circ-het"):
        pipe, balance = circular("circ" if name == "circ" else "het")
        return pipe, balance, init_layers() if balance is None else unstack(init_layers())
    return layout(name)


def assert_same_arrays(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape
        if isinstance(b, jax.ShapeDtypeStruct):
            assert a.dtype == b.dtype and a.sharding == b.sharding
            continue
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["4", "2", "2tp", "none", "het22", "het13", "circ", "circ-het"])
def test_conversions_under_set_mesh_give_what_they_give_outside(name):
    """Inside `jax.set_mesh` (Explicit axes from `jax.make_mesh`, or the pipeline's own mesh) the
    three conversions give bitwise what they give outside it, on the same devices."""
    pipe, balance, layers = any_layout(name)
    placed = pj.from_layers(pipe, layers, balance=balance)
    back = pj.to_layers(pipe, placed)
    target = pj.layers_target(pipe, layers, balance=balance)
    state = {"params": placed, "count": jnp.zeros((), jnp.int32)}
    saved = pj.to_layers(pipe, state, params=placed)
    contexts = [jax.make_mesh((4,), ("stage",))] + ([pipe.mesh] if pipe.mesh is not None else [])
    for context in contexts:
        with jax.set_mesh(context):
            assert_same_arrays(pj.from_layers(pipe, layers, balance=balance), placed)
            assert_same_arrays(pj.to_layers(pipe, placed), back)
            assert_same_arrays(pj.layers_target(pipe, layers, balance=balance), target)
            assert_same_arrays(pj.to_layers(pipe, state, params=placed), saved)
            again = pj.from_layers(pipe, saved, params=saved["params"], balance=balance)
            assert_same_arrays(again["params"], placed)
    jax.tree.map(np.testing.assert_array_equal, back, layers)


def test_under_jit_and_set_mesh_without_a_mesh_converts_and_on_a_mesh_says_why_not():
    """Without a mesh the conversions are reshapes (and lists), traceable under `jax.jit`; on a
    mesh they move each device's own shard, which needs concrete arrays: refused with the fix."""
    mesh = jax.make_mesh((4,), ("stage",))
    pipe, _, layers = layout("none")
    placed = pj.from_layers(pipe, layers)
    with jax.set_mesh(mesh):
        jitted = jax.jit(lambda t: pj.from_layers(pipe, t))(layers)
        jax.tree.map(np.testing.assert_array_equal, jitted, placed)
        back = jax.jit(lambda t: pj.to_layers(pipe, t))(placed)
        jax.tree.map(np.testing.assert_array_equal, back, layers)
    for name in ("4", "het22"):
        on_mesh, balance, layers = layout(name)
        placed = pj.from_layers(on_mesh, layers, balance=balance)
        with jax.set_mesh(mesh):
            with pytest.raises(TypeError, match=r"`tree` of to_layers is traced.*Call it outside `jax.jit`"):
                jax.jit(lambda t, p=on_mesh: pj.to_layers(p, t))(placed)
            with pytest.raises(TypeError, match=r"`tree` of from_layers is traced.*on a mesh"):
                jax.jit(lambda t, p=on_mesh, b=balance: pj.from_layers(p, t, balance=b))(layers)


# --- errors -------------------------------------------------------------------------------------


def test_a_layer_count_the_stages_cannot_share_is_refused():
    pipe = pj.pipeline(stacked_stage, num_stages=3)
    with pytest.raises(ValueError, match=r"layers \(4, axis 0.*3 homogeneous stages.*one of \[1, 2, 4\]"):
        pj.from_layers(pipe, init_layers())
    with pytest.raises(ValueError, match=r"layers \(4, axis 0.*3 homogeneous stages"):
        pj.layers_target(pipe, init_layers())


def test_heterogeneous_stages_need_a_balance_that_fits():
    part = pj.partition([layer] * L, [2, 2])
    pipe = pj.pipeline(part.stages)
    layers = unstack(init_layers())
    with pytest.raises(TypeError, match=r"`balance` is None.*2 stages.*`balance=\[2, 2\]`"):
        pj.from_layers(pipe, layers)
    with pytest.raises(ValueError, match=r"`balance` \[1, 2\] sums to 3 layers, but `layers` has 4"):
        pj.from_layers(pipe, layers, balance=[1, 2])
    with pytest.raises(ValueError, match=r"`balance` \[1, 1, 2\] has 3 stages, but the pipeline has 2"):
        pj.from_layers(pipe, layers, balance=[1, 1, 2])


def test_stages_without_a_layer_axis_are_refused():
    pipe = pj.pipeline(lambda p, x, key: x * p, num_stages=2)
    with pytest.raises(ValueError, match=r"shape \(2,\): no layer axis.*size 1 \(`a\[:, None\]`\)"):
        pj.to_layers(pipe, jnp.ones(2))
    het = pj.pipeline([layer, layer])
    with pytest.raises(TypeError, match=r"Stage 0's parameters are a dict, not a sequence of layer"):
        pj.to_layers(het, [{"w": 1.0}, {"w": 2.0}])


def test_param_specs_that_shard_the_layer_axis_are_refused():
    mesh = jax.make_mesh((2, 2), ("stage", "model"))
    specs = {"w": P("model"), "b": None}
    pipe = pj.pipeline(stacked_stage, num_stages=2, mesh=mesh, param_specs=specs)
    with pytest.raises(ValueError, match=r"`param_specs` shards the layer axis .*'model'.*Shard another"):
        pj.from_layers(pipe, init_layers())


LAYER_FORM = [pj.to_layers, pj.from_layers, pj.layers_target]


@pytest.mark.parametrize("fn", LAYER_FORM, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [stacked_stage, None, [1, 2]], ids=["function", "None", "list"])
def test_something_other_than_a_pipeline_is_refused_by_name(fn, bad):
    name = fn.__name__
    with pytest.raises(
        TypeError,
        match=rf"`pipe` of {name} must be the pj.Pipeline .*, but got {type(bad).__name__} .*"
        rf"`pj.{name}\(pipe, tree\)`.*`pipejax.flax.{name}`",
    ):
        fn(bad, init_layers())


def test_swapped_arguments_are_named():
    pipe, _, layers = layout("2")
    with pytest.raises(TypeError, match=r"`pipe` of to_layers .* got dict .*The arguments are swapped"):
        pj.to_layers(layers, pipe)


def test_params_that_match_nothing_are_refused_not_returned_unconverted():
    """`params=` names the parameters inside `tree` by structure and leaf shapes; one that matches
    no subtree used to give the tree back unconverted, still in stage form."""
    pipe, _, layers = layout("2")
    placed = pj.from_layers(pipe, layers)
    state = {"params": placed, "step": 3}
    got = r"`params` is \{'b': 'float64\[4, 4\]', 'w': 'float64\[4, 4, 4\]'\}"
    holds = r"`tree` holds \{'params': \{'b': 'float64\[2, 2, 4\]'.*'step': 'int'\}"
    with pytest.raises(ValueError, match=rf"`params` of to_layers matches no subtree.*{got}, and {holds}.*"):
        pj.to_layers(pipe, state, params=layers)  # layer-form params for a stage-form tree
    layer_state = {"params": layers}
    for fn in (pj.from_layers, pj.layers_target):  # stage-form params for a layer-form tree
        with pytest.raises(ValueError, match=rf"`params` of {fn.__name__} matches no subtree.*params=tree"):
            fn(pipe, layer_state, params=placed)
    with pytest.raises(ValueError, match=r"`params` of to_layers holds no arrays \(got \{\}\)"):
        pj.to_layers(pipe, state, params={})
    converted = pj.to_layers(pipe, state, params=placed)
    assert converted["step"] == 3
    jax.tree.map(np.testing.assert_array_equal, converted["params"], layers)


def test_trees_that_are_not_parameters_are_refused_by_name():
    pipe, _, _ = layout("2")
    for fn in LAYER_FORM:
        with pytest.raises(ValueError, match=rf"`tree` of {fn.__name__} holds no arrays \(got None\)"):
            fn(pipe, None)
    with pytest.raises(TypeError, match=r"`tree` of to_layers has leaf \['w'\] of type str"):
        pj.to_layers(pipe, {"w": "weights.npy"})
    # the stage axis, as the pipeline checks it (a (3, ...) tree used to give 6 layers silently)
    with pytest.raises(
        ValueError, match=r"take `tree` stacked on a leading stage axis of size 2.*\(3, 2, 4\)"
    ):
        pj.to_layers(pipe, jnp.ones((3, 2, 4)))
    het, balance, _ = layout("het22")
    with pytest.raises(TypeError, match=r"`tree` of to_layers must hold heterogeneous stage.*got dict"):
        pj.to_layers(het, {"w": 1.0})
    with pytest.raises(ValueError, match=r"`tree` of to_layers has 3 stage entries, but the pipeline has 2"):
        pj.to_layers(het, [[{}], [{}], [{}]])
    for fn in (pj.from_layers, pj.layers_target):
        with pytest.raises(TypeError, match=rf"`tree` of {fn.__name__} must hold the layer form.*NoneType"):
            fn(het, None, balance=balance)


def test_a_balance_for_homogeneous_stages_must_share_the_layers_equally():
    pipe, _, layers = layout("2")
    for fn in (pj.from_layers, pj.layers_target):
        with pytest.raises(
            ValueError,
            match=r"`balance` \[1, 3\] does not share the 4 layers equally.*"
            r"`balance=\[2, 2\]`",
        ):
            fn(pipe, layers, balance=[1, 3])
        with pytest.raises(TypeError, match=r"`balance` must be a sequence of positive ints"):
            fn(pipe, layers, balance="22")
    even = pj.from_layers(pipe, layers, balance=[np.int64(2), 2])
    jax.tree.map(np.testing.assert_array_equal, even, pj.from_layers(pipe, layers))


# --- two processes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_move_their_own_shards(tmp_path):
    """2 processes x 2 CPU devices: 4 stages saved, restored into 2 stages x 2-way tensor
    parallel; each process writes and reads its own shards (tests/layers_worker.py)."""
    env = without_compilation_cache(dict(os.environ, PYTHONPATH=str(ROOT)))  # (several processes)
    argv = [sys.executable, "-m", "pipejax.launch", "--processes", "2", "--devices-per-process", "2"]
    argv += ["--timeout", "240", str(ROOT / "tests" / "layers_worker.py"), str(tmp_path / "ckpt")]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False, cwd=ROOT)
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    for i in (0, 1):
        assert f"[{i}] process {i}: all checks passed" in proc.stdout, output
