"""No surprise recompiles: a train step compiles on its first call only.

A jitted step whose first inputs live on one device returns them replicated over the mesh, so
the second step would compile again (silently, and for a real model for tens of seconds). These
tests count XLA compilations (``jax.monitoring``'s backend-compile events) per call of each
jitted train step:

* of the docs' own code: ``tests/test_examples.py::test_docs_code_runs`` runs the ``docs/flax_*.md`` pages
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


def test_linen_init_on_an_auto_mesh_compiles_the_step_once():
    """``jax.sharding.Mesh(devices, names)`` has Auto axes. ``jax.jit(model.init)`` then placed
    the stage parameters with a ``device_put``, which inside ``jit`` on Auto axes leaves them
    replicated; the optimizer's state followed, the first step returned them sharded over the stage
    axis, and the second step compiled again (found in the demo). ``place`` constrains them."""
    import numpy as np

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("stage",))
    blocks = [Block() for _ in range(4)]
    model = LinenPipeline(blocks, balance=[2, 2], chunks=2, mesh=mesh)
    h = jnp.ones((6, D), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(0), h)["params"]
    optimizer = optax.sgd(0.1, momentum=0.9)  # a parameter-shaped trace, as Adam has moments
    state = [params, optimizer.init(params)]  # eager: the trace is laid out as the parameters

    @jax.jit
    def step(params, opt_state, key):
        def loss(params):
            y = model.apply({"params": params}, h, deterministic=False, rngs={"dropout": key})
            return jnp.mean(y**2)

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run(i):
        state[:] = step(*state, jax.random.key(i))
        jax.block_until_ready(state)

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


# --- rebuilding and eager calls: the adapters' programs are built once (flax_common.program) --------


def counted(fn, calls):
    """(compiles per call, results) of ``fn()`` called ``calls`` times, each waited for."""
    out = []
    counts = counter().per_call(lambda i: out.append(jax.block_until_ready(fn())), calls)
    return counts, out


def blocks(rngs):
    return [NBlock(rngs) for _ in range(3)]


def nnx_pipe(mesh=None, **options):
    rngs = nnx.Rngs(0)
    return NNXPipeline(blocks(rngs), balance=[2, 1], chunks=2, mesh=mesh, rngs=rngs, **options)


def test_identically_built_nnx_pipelines_have_equal_hashable_graphdefs():
    mesh = jax.make_mesh((2,), ("stage",))
    a, b = nnx_pipe(mesh), nnx_pipe(mesh)
    assert nnx.graphdef(a) == nnx.graphdef(b)
    assert hash(nnx.graphdef(a)) == hash(nnx.graphdef(b))
    assert a.pipeline_options == {"chunks": 2, "mesh": mesh}  # still compares with a dict
    assert nnx.graphdef(a) != nnx.graphdef(nnx_pipe(mesh, checkpoint="always"))


def test_rebuilt_and_restored_nnx_pipelines_do_not_recompile_the_train_step():
    """A checkpoint restore (nnx.split/merge, or new modules updated with saved state) and an
    evaluation model built anew hit nnx.jit's cache: 0 more compiles, the same results."""
    mesh = jax.make_mesh((2,), ("stage",))
    x = jnp.linspace(-1, 1, 5 * D, dtype=jnp.float32).reshape(5, D)
    key = jax.random.key(3)

    @nnx.jit
    def step(model):
        return nnx.value_and_grad(lambda m: jnp.mean(m(x, rngs=key) ** 2))(model)

    model = nnx_pipe(mesh)
    model.train()
    counts, [_, (loss, grads)] = counted(lambda: step(model), 2)
    assert counts[1:] == [0]
    graphdef, state = nnx.split(model)
    restored = nnx.merge(graphdef, state)
    rebuilt = nnx_pipe(mesh)
    nnx.update(rebuilt, state)  # as a checkpoint restore into a new model does
    rebuilt.train()
    for other in (restored, rebuilt):
        counts, [(loss2, grads2), _] = counted(lambda m=other: step(m), 2)
        assert counts == [0, 0]
        assert jnp.array_equal(loss2, loss)
        assert all(map(jnp.array_equal, jax.tree.leaves(grads2), jax.tree.leaves(grads)))


def test_nnx_eager_calls_compile_once():
    """A forward call, an nnx.value_and_grad step and the module's value_and_grad step, eagerly:
    each compiles on its first call only, also for a model built anew (an evaluation model)."""
    x = jnp.linspace(-1, 1, 5 * D, dtype=jnp.float32).reshape(5, D)
    t = jnp.zeros((5, D), jnp.float32)
    key = jax.random.key(3)
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)
    model = nnx_pipe()
    model.train()
    counts, ys = counted(lambda: model(x, rngs=key), 3)
    assert counts[1:] == [0, 0]
    assert jnp.array_equal(ys[0], ys[2])
    assert jnp.array_equal(nnx.jit(lambda m: m(x, rngs=key))(model), ys[0])  # as under jit

    counts, [(loss, _), *_] = counted(
        lambda: nnx.value_and_grad(lambda m: sq(m(x, rngs=key), t).mean())(model), 3
    )
    assert counts[1:] == [0, 0]

    step = model.value_and_grad(sq)
    counts, losses = counted(lambda: step(x, t, rngs=key), 3)
    assert counts[1:] == [0, 0]
    assert jnp.array_equal(losses[0][0], losses[2][0])
    assert jnp.allclose(losses[0][0], loss, rtol=1e-6)  # float32, by another program (sum order)

    evaluation = nnx_pipe()  # built anew: the programs of the first are reused
    nnx.update(evaluation, nnx.state(model))
    evaluation.train()
    counts, out = counted(lambda: evaluation(x, rngs=key), 2)
    assert counts == [0, 0]
    assert jnp.array_equal(out[0], ys[0])


def test_linen_eager_calls_compile_once():
    x = jnp.linspace(-1, 1, 5 * D, dtype=jnp.float32).reshape(5, D)
    t = jnp.zeros((5, D), jnp.float32)
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)
    pipe = LinenPipeline([Block() for _ in range(3)], balance=[2, 1], chunks=2)
    variables = pipe.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(3)}
    counts, ys = counted(lambda: pipe.apply(variables, x, rngs=rngs, deterministic=False), 3)
    assert counts[1:] == [0, 0]
    assert jnp.array_equal(ys[0], ys[2])
    again = LinenPipeline([Block() for _ in range(3)], balance=[2, 1], chunks=2)  # rebuilt: no compile
    counts, out = counted(lambda: again.apply(variables, x, rngs=rngs, deterministic=False), 1)
    assert counts == [0]
    assert jnp.array_equal(out[0], ys[0])

    step = pipe.value_and_grad(sq)
    counts, out = counted(lambda: step(variables, x, t, rngs=rngs, deterministic=False), 3)
    assert counts[1:] == [0, 0]
    loss = sq(ys[0], t).mean()
    assert jnp.allclose(out[2][0], loss, rtol=1e-6)  # float32, by another program (sum order)


def test_programs_are_cached_by_configuration():
    """Equal configurations share one pipeline; a different option, mesh or flag builds another,
    and an unhashable flag builds one for its call only (as before there was a cache)."""
    from pipejax._src.flax import common as flax_common

    mesh = jax.make_mesh((2,), ("stage",))
    a, b = nnx_pipe(mesh), nnx_pipe(mesh)
    run = lambda m, det=None: m._run_layer(det, None)
    assert a._stack.pipeline(run(a)) is b._stack.pipeline(run(b))
    others = [
        nnx_pipe(mesh)._stack.pipeline(run(a, det=True)),
        nnx_pipe(mesh, checkpoint="always")._stack.pipeline(run(a)),
        nnx_pipe(jax.make_mesh((2,), ("stage",), devices=jax.devices()[2:]))._stack.pipeline(run(a)),
        a._stack.pipeline(run(a), [{"flag": 1}] * 3),
    ]
    assert len({id(p) for p in [a._stack.pipeline(run(a)), *others]}) == 5
    unhashable = [{"flag": [1]}] * 3
    assert a._stack.pipeline(run(a), unhashable) is not a._stack.pipeline(run(a), unhashable)
    assert flax_common._cached.cache_info().maxsize == flax_common.PROGRAM_CACHE_SIZE
