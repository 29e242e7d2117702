"""A train state saved under one pipeline layout, restored under others (``pipejax[checkpoint]``).

An 8-layer residual MLP trains with AdamW under a layout A. Its train state (parameters and
AdamW's moments) is saved with orbax in the layout-independent *layer form* (``pj.to_layers``:
each process writes the shards it holds), then restored (``pj.layers_target`` -> orbax ->
``pj.from_layers``: each process reads only its devices' chunks) into other layouts, where
training goes on. Two runs:

1. homogeneous stages (each stage's layers stacked; the layer form is one ``(8, ...)`` stack per
   leaf), A = 4 stages on 4 devices, restored into A again, 2 stages on a 2 x 2 ("data",
   "stage") mesh (another stage count and mesh shape), and 2 stages x 2-way tensor parallel on
   a ("stage", "model") mesh (``param_specs``);
2. heterogeneous stages from ``pj.partition`` (the layer form lists the layers), A = balance
   [4, 4] on 2 devices, restored into A again and into balance [3, 5].

Restored into A, the losses are bitwise those of the run that was never interrupted; in the
other layouts they match it to float32 rounding (the same sums, cut into other programs).

Run ``python examples/checkpoint_layouts.py`` or with ``--short`` (fewer steps; the tests use it).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pipejax as pj

L, D, BATCH = 8, 32, 32
AUTO = (AxisType.Auto, AxisType.Auto)  # XLA partitions the stages over the second axis


def layer(p, x, key):
    return x + jnp.tanh(x @ p["w"] + p["b"][None])


def stage(p, x, key):  # a homogeneous stage: its layers stacked on axis 0 of every leaf
    return lax.scan(lambda h, q: (layer(q, h, None), None), x, p)[0]


def init_layers(key):
    """The layer form: every leaf ``(L, ...)``, whatever the layout."""
    w = jax.random.normal(key, (L, D, D)) / np.sqrt(D)
    return {"w": w, "b": jnp.zeros((L, D))}


def layouts():
    """name -> (pipeline, balance): layout A first, then the layouts its checkpoint moves to.

    Homogeneous stages stack their layers (the layer form is one ``(L, ...)`` stack per leaf);
    heterogeneous stages from ``pj.partition`` list them (the layer form is a list of per-layer
    pytrees), so their checkpoints move between balances."""
    devices = jax.devices()
    mesh4 = jax.make_mesh((4,), ("stage",))
    mesh_ds = jax.make_mesh((2, 2), ("data", "stage"), axis_types=AUTO)
    mesh_sm = jax.make_mesh((2, 2), ("stage", "model"), axis_types=AUTO)
    mesh2 = jax.make_mesh((2,), ("stage",), devices=devices[:2])
    tp = {"w": P(None, None, "model"), "b": P(None, "model")}
    stacked = {
        "4 stages": (pj.pipeline(stage, num_stages=4, chunks=4, mesh=mesh4), None),
        "2 stages x 2 data": (
            pj.pipeline(stage, num_stages=2, chunks=4, mesh=mesh_ds, data_axis_name="data"),
            None,
        ),
        "2 stages x 2 model": (
            pj.pipeline(stage, num_stages=2, chunks=4, mesh=mesh_sm, param_specs=tp),
            None,
        ),
    }
    listed = {
        f"balance {b}": (pj.pipeline(pj.partition([layer] * L, b).stages, chunks=4, mesh=mesh2), b)
        for b in ([4, 4], [3, 5])
    }
    return [stacked, listed]


def make_step(pipe, optimizer):
    grad = pipe.value_and_grad(lambda y, t: jnp.sum((y - t) ** 2, axis=-1))

    @jax.jit
    def update(state, grads):
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    def step(state, x, t):
        loss, grads = grad(state["params"], x, t)
        return update(state, grads), float(loss)

    return step


def train(step, state, batches):
    losses = []
    for x, t in batches:
        state, loss = step(state, x, t)
        losses.append(loss)
    return state, losses


def init_state(pipe, balance, optimizer):
    layers = init_layers(jax.random.key(0))
    if balance is not None:  # heterogeneous stages: the layer form lists the layers
        layers = [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(L)]
    return {"params": layers, "opt_state": optimizer.init(layers)}


def move(folder, layouts, batches, steps, optimizer) -> bool:
    """Train under the first layout, save in layer form, restore into each layout, train on."""
    names = list(layouts)
    pipe_a, balance_a = layouts[names[0]]
    layer_state = init_state(pipe_a, balance_a, optimizer)
    params = pj.from_layers(pipe_a, layer_state["params"], balance=balance_a)  # any layout's start
    with jax.set_mesh(pipe_a.mesh):
        state = {"params": params, "opt_state": optimizer.init(params)}
    step_a = make_step(pipe_a, optimizer)
    state, _ = train(step_a, state, batches[:steps])
    _, uninterrupted = train(step_a, state, batches[steps:])

    # Save in layer form: the parameters and every params-shaped subtree (AdamW's moments).
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(folder, pj.to_layers(pipe_a, state, params=state["params"]), force=True)
    ckpt.wait_until_finished()
    print(f"{names[0]}: saved the train state after {steps} steps in layer form to {folder}")

    ok = True
    for name in names:
        pipe, balance = layouts[name]
        # The layer form's shapes do not depend on the layout; the target's shardings do.
        shapes = jax.eval_shape(lambda pipe=pipe, balance=balance: init_state(pipe, balance, optimizer))
        target = pj.layers_target(pipe, shapes, params=shapes["params"], balance=balance)
        restored = ckpt.restore(folder, target)
        state_b = pj.from_layers(pipe, restored, params=restored["params"], balance=balance)
        _, losses = train(make_step(pipe, optimizer), state_b, batches[steps:])
        if name == names[0]:
            same = losses == uninterrupted
            ok &= same
            print(f"{name}: losses {'bitwise equal to' if same else 'DIFFER from'} the uninterrupted run")
        else:
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, uninterrupted, strict=True))
            ok &= err <= 1e-6  # float32 rounding of the same sums in other programs
            print(f"{name}: losses {losses[0]:.6f} -> {losses[-1]:.6f}, max relative difference {err:.1e}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps before and after the checkpoint")
    parser.add_argument("--short", action="store_true", help="3 steps each (for the tests)")
    parser.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: temporary)")
    args = parser.parse_args(argv)
    steps = 3 if args.short else args.steps

    rng = np.random.default_rng(0)
    batches = [
        (
            jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32),
            jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32),
        )
        for _ in range(2 * steps)
    ]
    optimizer = optax.adamw(1e-3)
    folder = (args.out or Path(tempfile.mkdtemp()) / "ckpt").absolute()
    ok = True
    for i, layouts_ in enumerate(layouts()):
        ok &= move(folder / f"layers{i}", layouts_, batches, steps, optimizer)
    print("checks passed" if ok else "checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
