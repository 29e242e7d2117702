"""Save and restore a pipelined Flax train state with orbax-checkpoint (``pipejax[checkpoint]``).

A small Linen classifier (embedding -> 4 pipelined blocks -> head) trains on a 4-stage mesh
(simulated CPU devices). The script

1. saves the train state (parameters, with the stage-sharded ``StageParams``, and the AdamW
   state) with ``orbax.checkpoint.StandardCheckpointer`` after a few steps; orbax writes each
   array's shards from the process that holds them;
2. restores it onto the same mesh (a target with the shardings) and trains on: the losses equal
   those of a run that was never interrupted, bitwise;
3. restores it without a mesh (a target on one device) and evaluates: the same loss;
4. re-cuts it for a 2 x 2 data x stage mesh (2 stages) with ``to_sequential`` /
   ``from_sequential``, parameters and AdamW moments alike: the same eval loss; it trains on
   there.

Run ``python examples/checkpoint_orbax.py`` or with ``--short`` (fewer steps; the tests use it).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse
import sys
import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from pipejax.flax import LinenPipeline, on_mesh

V, D, C, BLOCKS = 50, 32, 5, 4


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        y = nn.Dropout(0.1)(nn.gelu(nn.Dense(D)(nn.LayerNorm()(h))), deterministic=deterministic)
        return h + y


class Classifier(nn.Module):
    stages: int
    mesh: jax.sharding.Mesh | None = None
    data_axis_name: str | None = None

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        h = nn.Embed(V, D)(tokens).mean(axis=1)
        options = {} if self.data_axis_name is None else {"data_axis_name": self.data_axis_name}
        h = LinenPipeline(
            [Block() for _ in range(BLOCKS)],
            num_stages=self.stages,
            chunks=4,
            mesh=self.mesh,
            name="blocks",
            **options,
        )(h, deterministic=not train)
        return nn.Dense(C, name="head")(h)


def make_step(model, optimizer):
    @jax.jit
    def step(state, tokens, labels, key):
        def loss_fn(params):
            logits = model.apply({"params": params}, tokens, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return step


def eval_loss(model, params, tokens, labels) -> float:
    logits = jax.jit(model.apply)({"params": params}, tokens)
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())


def train(step, state, batches, keys):
    losses = []
    for (tokens, labels), key in zip(batches, keys, strict=True):
        state, loss = step(state, tokens, labels, key)
        losses.append(float(loss))
    return state, losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps before and after the checkpoint")
    parser.add_argument("--short", action="store_true", help="4 steps each (for the tests)")
    parser.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: a temporary one)")
    args = parser.parse_args(argv)
    steps = 4 if args.short else args.steps

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2 * steps):
        tokens = rng.integers(0, V, size=(16, 6))
        batches.append((jnp.asarray(tokens), jnp.asarray(tokens[:, 0] % C)))
    keys = [jax.random.fold_in(jax.random.key(1), i) for i in range(2 * steps)]

    mesh = jax.make_mesh((4,), ("stage",))
    model = Classifier(stages=4, mesh=mesh)
    optimizer = optax.adamw(3e-3)
    params = jax.jit(model.init)(jax.random.key(0), batches[0][0])["params"]
    with jax.set_mesh(mesh):
        state = {"params": params, "opt_state": optimizer.init(params)}
    step = make_step(model, optimizer)
    state, first = train(step, state, batches[:steps], keys[:steps])
    _, uninterrupted = train(step, state, batches[steps:], keys[steps:])

    # 1. Save.
    folder = args.out or Path(tempfile.mkdtemp()) / "ckpt"
    folder = folder.absolute()
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(folder / "state", state, force=True)
    ckpt.wait_until_finished()
    print(f"saved the train state after {steps} steps (loss {first[-1]:.4f}) to {folder / 'state'}")

    # 2. The same mesh: the target is the state's own shapes, dtypes and shardings.
    restored = ckpt.restore(folder / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    _, resumed = train(step, restored, batches[steps:], keys[steps:])
    same = resumed == uninterrupted
    verdict = "bitwise equal to" if same else "DIFFER from"
    print(f"resumed on the same mesh: losses {verdict} the uninterrupted run")

    # 3. No mesh: a target of the mesh-less model on one device.
    plain = Classifier(stages=4)
    abstract = jax.eval_shape(lambda: plain.init(jax.random.key(0), batches[0][0])["params"])
    abstract = {"params": abstract, "opt_state": jax.eval_shape(optimizer.init, abstract)}
    device = SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    local = ckpt.restore(folder / "state", target)
    tokens, labels = batches[-1]
    saved_loss = eval_loss(model, state["params"], tokens, labels)
    local_loss = eval_loss(plain, local["params"], tokens, labels)
    print(f"restored without a mesh: eval loss {local_loss:.6f} (saved model {saved_loss:.6f})")

    # 4. 2 x 2 data x stage: 2 stages; every params-shaped subtree (parameters, AdamW moments) re-cut.
    mesh22 = jax.make_mesh((2, 2), ("data", "stage"))
    model22 = Classifier(stages=2, mesh=mesh22, data_axis_name="data")
    four = LinenPipeline([Block() for _ in range(BLOCKS)], num_stages=4)
    two = LinenPipeline([Block() for _ in range(BLOCKS)], num_stages=2, mesh=mesh22, data_axis_name="data")

    def recut(tree):
        if isinstance(tree, dict) and "blocks" in tree:  # the model's params, or a moment of them
            blocks = two.from_sequential(four.to_sequential({"params": tree["blocks"]}))["params"]
            return {**tree, "blocks": blocks}
        return tree

    state22 = jax.tree.map(recut, local, is_leaf=lambda t: isinstance(t, dict) and "blocks" in t)
    state22 = on_mesh(state22, mesh22)  # the embedding, head and step count onto the mesh too
    with jax.set_mesh(mesh22):
        loss22 = eval_loss(model22, state22["params"], tokens, labels)
        _, on22 = train(make_step(model22, optimizer), state22, batches[steps:], keys[steps:])
    # (Dropout masks differ from the 4-stage run's: a layer's key depends on its stage index.)
    print(
        f"re-cut for a 2 x 2 data x stage mesh: eval loss {loss22:.6f}; trained on: "
        f"{on22[0]:.4f} -> {on22[-1]:.4f}"
    )

    close = lambda a, b: abs(a - b) <= 1e-5 * abs(b)  # float32, micro-batches cut differently
    ok = same and close(local_loss, saved_loss) and close(loss22, saved_loss) and np.isfinite(on22).all()
    print("checks passed" if ok else "checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
