"""No surprise recompiles: a train step compiles on its first call only.

A jitted step whose first inputs live on one device returns them replicated over the mesh, so
the second step would compile again (silently, and for a real model for tens of seconds). These
tests count XLA compilations (``jax.monitoring``'s backend-compile events) per call of each
jitted train step:

* of the docs' own code: ``tests/test_examples.py::test_docs_code_runs`` runs ``docs/flax.md``
  (Linen and NNX) and ``docs/quickstart.md`` with ``jax.jit``/``nnx.jit`` wrapped to count the
  compilations of each call (one run of each page serves both checks);
* of pretrained weights pipelined with ``from_sequential`` (Linen) and modules built outside
  the mesh (NNX), with the train state put on the mesh by ``pipejax.flax.on_mesh``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline, on_mesh

COMPILE = "/jax/core/compile/backend_compile_duration"


class Counter:
    """Counts XLA compilations while it is active."""

    def __init__(self):
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, name, *args, **kwargs):
        if self.active and name == COMPILE:
            self.count += 1

    def per_call(self, fn, calls):
        counts = []
        for i in range(calls):
            self.count, self.active = 0, True
            try:
                fn(i)
            finally:
                self.active = False
            counts.append(self.count)
        return counts


COUNTER = None


def counter():
    global COUNTER
    if COUNTER is None:
        COUNTER = Counter()
    return COUNTER


D, V = 8, 11


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        return h + nn.Dropout(0.1)(jnp.tanh(nn.Dense(D)(h)), deterministic=deterministic)


class Plain(nn.Module):
    """The pretrained model: embedding, 4 blocks named as nn.Sequential names them, head."""

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(V, D, name="embed")(tokens).mean(axis=1)
        for i in range(4):
            h = Block(name=f"layers_{i}")(h)
        return nn.Dense(3, name="head")(h)


def test_linen_from_sequential_with_on_mesh_compiles_once():
    mesh = jax.make_mesh((2,), ("stage",))
    stack = LinenPipeline([Block() for _ in range(4)], balance=[2, 2], chunks=2, mesh=mesh, name="blocks")

    class Piped(nn.Module):
        @nn.compact
        def __call__(self, tokens, train=False):
            h = nn.Embed(V, D, name="embed")(tokens).mean(axis=1)
            blocks = [Block() for _ in range(4)]
            h = LinenPipeline(blocks, balance=[2, 2], chunks=2, mesh=mesh, name="blocks")(
                h, deterministic=not train
            )
            return nn.Dense(3, name="head")(h)

    tokens = jnp.arange(12).reshape(6, 2) % V
    labels = jnp.arange(6) % 3
    pre = jax.jit(Plain().init)(jax.random.key(0), tokens)["params"]  # on one device
    layers = {name: pre[name] for name in pre if name.startswith("layers_")}
    params = {"embed": pre["embed"], "head": pre["head"], **stack.from_sequential({"params": layers})}
    params["blocks"] = params.pop("params")
    optimizer = optax.sgd(0.1)
    state = on_mesh((params, optimizer.init(params)), mesh)  # the embedding and head: onto the mesh
    model = Piped()

    @jax.jit
    def step(params, opt_state, key):
        def loss(params):
            logits = model.apply({"params": params}, tokens, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    keys = [jax.random.fold_in(jax.random.key(1), i) for i in range(3)]

    def run(i):
        state[:] = step(*state, keys[i])
        jax.block_until_ready(state)

    state = list(state)
    assert counter().per_call(run, 3)[1:] == [0, 0]


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, h):
        return h + self.dropout(jnp.tanh(self.linear(h)))


def test_nnx_modules_built_outside_the_mesh_compile_once():
    """The pipeline places what it creates (rng streams); on_mesh places the rest of the model."""
    mesh = jax.make_mesh((2,), ("stage",))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.blocks = NNXPipeline(
                [NBlock(rngs) for _ in range(4)], balance=[2, 2], chunks=2, mesh=mesh, rngs=rngs
            )
            self.head = nnx.Linear(D, 3, rngs=rngs)

        def __call__(self, tokens):
            return self.head(self.blocks(self.embed(tokens).mean(axis=1)))

    model = Model(nnx.Rngs(0))  # outside jax.set_mesh: embedding and head on one device
    nnx.update(model, on_mesh(nnx.state(model), mesh))
    rng_state = nnx.state(model.blocks, nnx.RngState)
    assert all(a.sharding.device_set == set(mesh.devices.flat) for a in jax.tree.leaves(rng_state))
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    tokens = jnp.arange(12).reshape(6, 2) % V
    labels = jnp.arange(6) % 3

    @nnx.jit
    def step(model, optimizer):
        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(tokens), labels).mean()

        optimizer.update(model, nnx.grad(loss)(model))

    model.train()
    assert counter().per_call(lambda i: step(model, optimizer), 3)[1:] == [0, 0]
