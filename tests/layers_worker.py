"""One process of the 2-process checkpoint test: a train state moves from 4 stages to 2 x 2.

Run by ``tests/test_checkpoint_layouts.py`` as::

    python -m pipejax.launch --processes 2 --devices-per-process 2 tests/layers_worker.py FOLDER

Layout A: 4 homogeneous stages on the 4 global devices (process p holds stages 2p and 2p + 1).
Layout B: 2 stages x 2-way tensor parallel on a ("stage", "model") mesh whose stage p is
process p's two devices. The train state (parameters and Adam's state) trains 2 steps under A,
is saved in layer form with orbax (each process writing the shards it holds), restored into B
(each process reading the chunks its devices need) and trains 2 more steps; every process checks:

- the layer-form arrays it saved and restored hold, on its devices, only its own layers (and,
  under B, only its half of each sharded dimension);
- each process wrote its own data files (orbax's per-process OCDBT folders);
- the losses and parameters after 2 more steps equal those of A trained on (float64, 1e-12).

Then heterogeneous stages (``pj.partition``) move between balances across the processes in
memory (see ``listed_layers``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipejax import launch

info = launch.initialize()  # before any JAX computation

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipejax as pj  # noqa: E402

L, D, B = 4, 4, 8
RTOL = 1e-12
me = jax.process_index()
failures = []


def check(ok, what):
    print(f"{what}: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        failures.append(what)


def stage(p, x, key):
    h, _ = lax.scan(lambda h, q: (jnp.tanh(h @ q["w"] + q["b"][None]), None), x, p)
    return h


def init_layers():
    r = np.random.default_rng(0)
    return {
        "w": jnp.asarray(r.normal(size=(L, D, D)) / np.sqrt(D)),
        "b": jnp.asarray(r.normal(size=(L, D)) * 0.1),
    }


def make_step(pipe, opt):
    grad = pipe.value_and_grad(lambda y, t: jnp.sum((y - t) ** 2, axis=-1))

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(state, x, t):
        loss, grads = grad(state["params"], x, t)
        params, opt_state = update(state["params"], state["opt_state"], grads)
        return {"params": params, "opt_state": opt_state}, float(loss.addressable_data(0))

    return step


def train(step, state, batches):
    losses = []
    for x, t in batches:
        state, loss = step(state, x, t)
        losses.append(loss)
    return state, losses


def layers_held(a):
    """The layer indices (axis 0) of ``a``'s shards on this process's devices."""
    return sorted({i for s in a.addressable_shards for i in range(*s.index[0].indices(a.shape[0]))})


def layer(p, x, key):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def listed_layers(devices) -> None:
    """Heterogeneous stages across processes, moved in memory (orbax refuses to save an array
    that lives on one process's devices only, as a listed layer of a one-host stage does): 4
    stages of one layer on 4 devices -> balance [2, 2] on a mesh with one device per process.
    Each process unpacks and packs only its own stages."""
    mesh_a = jax.make_mesh((4,), ("stage",), devices=devices)
    mesh_b = jax.make_mesh((2,), ("stage",), devices=[devices[0], devices[2]])
    pipe_a = pj.pipeline(pj.partition([layer] * L, [1, 1, 1, 1]).stages, chunks=2, mesh=mesh_a)
    pipe_b = pj.pipeline(pj.partition([layer] * L, [2, 2]).stages, chunks=2, mesh=mesh_b)
    init = init_layers()
    listed = [jax.tree.map(lambda a, i=i: a[i], init) for i in range(L)]
    params_a = pj.from_layers(pipe_a, listed, balance=[1, 1, 1, 1])
    layers = pj.to_layers(pipe_a, params_a)
    mine = [i for i, one in enumerate(layers) if jax.tree.leaves(one)[0].addressable_shards]
    check(mine == [2 * me, 2 * me + 1], f"process {me} holds listed layers {mine}")
    params_b = pj.from_layers(pipe_b, layers, balance=[2, 2])
    x = np.random.default_rng(2).normal(size=(B, D))
    on = lambda mesh: jax.device_put(x, jax.sharding.NamedSharding(mesh, P()))
    y_a = multihost_utils.process_allgather(pipe_a(params_a, on(mesh_a)), tiled=True)
    y_b = multihost_utils.process_allgather(pipe_b(params_b, on(mesh_b)), tiled=True)
    check(
        np.allclose(y_a, y_b, rtol=RTOL, atol=0),
        "listed layers, balance [1, 1, 1, 1] -> [2, 2]: same outputs",
    )


def main(folder: Path) -> int:
    devices = jax.devices()  # process 0's two devices first
    mesh_a = jax.make_mesh((4,), ("stage",), devices=devices)
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh_b = jax.make_mesh((2, 2), ("stage", "model"), devices=devices, axis_types=auto)
    pipe_a = pj.pipeline(stage, num_stages=4, chunks=2, mesh=mesh_a)
    specs = {"w": P(None, None, "model"), "b": P(None, "model")}
    pipe_b = pj.pipeline(stage, num_stages=2, chunks=2, mesh=mesh_b, param_specs=specs)

    opt = optax.adam(1e-2)
    r = np.random.default_rng(1)
    batches = [(r.normal(size=(B, D)), r.normal(size=(B, D))) for _ in range(4)]
    on = lambda mesh, bs: jax.device_put(bs, jax.sharding.NamedSharding(mesh, P()))  # every process: all
    params = pj.from_layers(pipe_a, init_layers())
    with jax.set_mesh(mesh_a):
        state = {"params": params, "opt_state": opt.init(params)}
    step_a = make_step(pipe_a, opt)
    with jax.numpy_dtype_promotion("standard"):
        state, _ = train(step_a, state, on(mesh_a, batches[:2]))

    # Save in layer form: each process writes the shards it holds.
    layers = pj.to_layers(pipe_a, state, params=state["params"])
    check(
        layers_held(layers["params"]["w"]) == [2 * me, 2 * me + 1],
        f"process {me} saves layers {layers_held(layers['params']['w'])}",
    )
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(folder, layers)
    ckpt.wait_until_finished()
    multihost_utils.sync_global_devices("saved")
    written = {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        for p in folder.glob("ocdbt.process_*")
    }
    print(f"data files per process: {written}", flush=True)
    check(
        written.get(f"ocdbt.process_{me}", 0) > 0 and len(written) == 2,
        f"process {me} wrote its own data files",
    )

    # Restore into 2 stages x 2-way tensor parallel: each process reads its own chunks.
    init = init_layers()
    shapes = jax.eval_shape(lambda: {"params": init, "opt_state": opt.init(init)})
    target = pj.layers_target(pipe_b, shapes, params=shapes["params"])
    restored = ckpt.restore(folder, target)
    w = restored["params"]["w"]
    check(layers_held(w) == [2 * me, 2 * me + 1], f"process {me} reads layers {layers_held(w)}")
    check(
        {s.data.shape for s in w.addressable_shards} == {(2, D, D // 2)},
        f"process {me} reads half of each layer per device",
    )
    state_b = pj.from_layers(pipe_b, restored, params=restored["params"])

    with jax.numpy_dtype_promotion("standard"):
        reference, ref_losses = train(step_a, state, on(mesh_a, batches[2:]))
        moved, losses = train(make_step(pipe_b, opt), state_b, on(mesh_b, batches[2:]))
    print(f"losses under B {losses}, under A {ref_losses}", flush=True)
    check(np.allclose(losses, ref_losses, rtol=RTOL, atol=0), "losses after the move equal layout A's")
    got = multihost_utils.process_allgather(pj.to_layers(pipe_b, moved["params"]), tiled=True)
    want = multihost_utils.process_allgather(pj.to_layers(pipe_a, reference["params"]), tiled=True)
    same = all(
        np.allclose(g, w_, rtol=RTOL, atol=1e-14)
        for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    check(same, "parameters after the move equal layout A's")
    listed_layers(devices)
    if failures:
        print(f"process {me}: FAILED {failures}", flush=True)
        return 1
    print(f"process {me}: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).absolute()))
