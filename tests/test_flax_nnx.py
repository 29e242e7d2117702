"""``pipejax.flax.NNXPipeline``: NNX modules run as a pipeline equal the same modules in sequence.

The reference is the same layers (built again from the same seeds, so with the same parameters)
called one after the other:

* without dropout, forward and gradients (w.r.t. parameters and input) match on no mesh and a
  4-stage mesh, in float64 (``rtol=1e-12``: micro-batches and the whole batch may round
  differently in the last bits); ``eval()`` and the call's ``deterministic`` both switch dropout off;
* with dropout, the pipeline equals the layers run per micro-batch after
  ``nnx.reseed(layer, dropout=fold_in(pj.stage_key(key, i, s), j))``, and the checkpoint modes
  ``"always"`` and ``"never"`` are bitwise the same, forward and gradients;
* one ``nnx.Optimizer`` adam step of a bigger model (embedding -> pipeline -> head) on a 2-stage
  mesh equals the same step on the plain model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pipejax as pj
from pipejax.flax import NNXPipeline

F = jnp.float64
WIDTH, IN, CLASSES, BATCH, CHUNKS = 16, 5, 10, 10, 4  # BATCH=10, CHUNKS=4: an uneven batch
DROP = 0.25
TOL = dict(rtol=1e-12, atol=1e-12)  # float64, micro-batch vs whole-batch rounding


class Block(nnx.Module):
    """Linear -> tanh -> dropout; the dropout holds its own ``dropout`` rng stream."""

    def __init__(self, din, dout, rngs):
        self.lin = nnx.Linear(din, dout, param_dtype=F, rngs=rngs)
        self.drop = nnx.Dropout(DROP, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.lin(x)))


class Scale(nnx.Module):
    """A layer with a ``train`` flag: doubles its input when training."""

    def __call__(self, x, *, train: bool):
        return x * jnp.asarray(2.0 if train else 1.0, x.dtype)


def make_layers(din=IN):
    """Heterogeneous: three blocks with dropout (din->16->16->16), then a Linear(16, 10) head."""
    rngs = nnx.Rngs(params=0, dropout=1)
    return [
        Block(din, WIDTH, rngs),
        Block(WIDTH, WIDTH, rngs),
        Block(WIDTH, WIDTH, rngs),
        nnx.Linear(WIDTH, CLASSES, param_dtype=F, rngs=rngs),
    ]


def params_of(layers):
    return [nnx.state(layer, nnx.Param) for layer in layers]


def by_hand(layers, x, key, sizes, chunks):
    """The layers per micro-batch, each reseeded with its documented key before it runs."""
    xs, _, plan = pj.split_microbatches(x, chunks)
    outs = []
    for i in range(plan.num_micro):
        h, index = xs[i], 0
        for s, size in enumerate(sizes):
            for j in range(size):
                layer = layers[index]
                if isinstance(layer, Block):
                    nnx.reseed(layer, dropout=jax.random.fold_in(pj.stage_key(key, i, s), j))
                h = layer(h)
                index += 1
        outs.append(h)
    return pj.merge_microbatches(jnp.stack(outs), plan)


def data():
    kx, kw = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (BATCH, IN), F), jax.random.normal(kw, (BATCH, CLASSES), F)


@pytest.mark.parametrize(
    "stages, split, switch_off",
    [(None, {"num_stages": 3}, "eval"), (4, {"balance": [1, 1, 1, 1]}, "call")],
    ids=["no-mesh-3-uneven-eval", "mesh-4-call"],
)
def test_matches_sequential_forward_and_grads(stages, split, switch_off):
    mesh = None if stages is None else jax.make_mesh((stages,), ("stage",))
    pipe = NNXPipeline(make_layers(), chunks=CHUNKS, mesh=mesh, rngs=nnx.Rngs(dropout=9), **split)
    assert pipe.stage_sizes() == ((2, 1, 1) if mesh is None else (1, 1, 1, 1))  # uneven: first stage +1
    ref = make_layers()  # same seeds: same parameters
    jax.tree.map(np.testing.assert_array_equal, pipe.layer_params(), params_of(ref))
    x, w = data()
    if mesh is not None:  # each device holds exactly its stage's row of every buffer
        for buf in pipe.stage_params().buffers:
            assert buf.sharding.spec[0] == "stage"
            for shard in buf.addressable_shards:
                assert shard.data.shape == (1, buf.shape[1])
                assert shard.device == mesh.devices[shard.index[0].start]

    if switch_off == "eval":
        pipe.eval()
        assert pipe.deterministic is True
        call_kw = {}
    else:
        call_kw = {"deterministic": True}

    def loss(pipe, x):
        y = pipe(x, **call_kw)
        return jnp.sum(y * w), y

    def loss_ref(params, x):
        for layer, p in zip(ref, params, strict=True):
            graphdef, _, rest = nnx.split(layer, nnx.Param, ...)
            x = nnx.merge(graphdef, p, rest)(x)
        return jnp.sum(x * w), x

    for layer in ref:
        layer.eval()
    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, y), (g_pipe, g_x) = step(pipe, x)
    ref_step = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1), has_aux=True))
    (_, r_y), (r_params, r_x) = ref_step(params_of(ref), x)
    np.testing.assert_allclose(y, r_y, **TOL)
    got = pipe.layer_params(g_pipe)  # the packed gradient, per layer
    assert jax.tree.structure(got) == jax.tree.structure(r_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, r_params)
    np.testing.assert_allclose(g_x, r_x, **TOL)


def test_dropout_uses_documented_keys_and_checkpoint_modes_agree():
    mesh = jax.make_mesh((2,), ("stage",))
    x, w = data()
    key = jax.random.key(7)

    def loss(pipe, x, key):
        y = pipe(x, deterministic=False, rngs=key)
        return jnp.sum(y * w), y

    results = {}
    for mode in ("always", "never"):  # everything recomputed vs nothing once the pipeline is full
        pipe = NNXPipeline(make_layers(), balance=[3, 1], chunks=3, checkpoint=mode, mesh=mesh)
        (_, y), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(pipe, x, key)
        results[mode] = (y, jax.tree.leaves(g))

    ref_y, ref_g = results["always"]
    for mode, (y, g) in results.items():  # recomputation replays the same masks: bitwise
        np.testing.assert_array_equal(y, ref_y, err_msg=mode)
        jax.tree.map(lambda a, b, mode=mode: np.testing.assert_array_equal(a, b, err_msg=mode), g, ref_g)

    expected = nnx.jit(by_hand, static_argnums=(3, 4))(make_layers(), x, key, (3, 1), 3)
    np.testing.assert_allclose(ref_y, expected, rtol=1e-14, atol=1e-14)  # same shapes: exact in practice
    plain = make_layers()
    for layer in plain:
        layer.eval()
    h = x
    for layer in plain:
        h = layer(h)
    assert not np.allclose(ref_y, h)  # dropout was on


def test_inside_a_bigger_model_one_adam_step_equals_plain_model():
    mesh = jax.make_mesh((2,), ("stage",))
    vocab = 13

    class Model(nnx.Module):
        def __init__(self, pipelined):
            rngs = nnx.Rngs(params=0, dropout=1)
            self.embed = nnx.Embed(vocab, WIDTH, param_dtype=F, rngs=rngs)
            self.blocks = nnx.List([Block(WIDTH, WIDTH, rngs), Block(WIDTH, WIDTH, rngs), Scale()])
            if pipelined:
                self.blocks = NNXPipeline(self.blocks, balance=[2, 1], chunks=2, mesh=mesh, rngs=rngs)
            self.head = nnx.Linear(WIDTH, CLASSES, param_dtype=F, rngs=rngs)

        def __call__(self, tokens):
            h = self.embed(tokens).mean(axis=1)
            if isinstance(self.blocks, NNXPipeline):
                h = self.blocks(h, train=True)
            else:
                for layer in self.blocks:
                    h = layer(h, train=True) if isinstance(layer, Scale) else layer(h)
            return self.head(h)

    tokens = jax.random.randint(jax.random.key(4), (6, 3), 0, vocab)
    labels = jnp.arange(6) % CLASSES

    def loss(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens), labels).mean()

    @nnx.jit
    def step(model, opt):
        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    results = []
    for pipelined in (True, False):
        model = Model(pipelined)
        model.eval()  # dropout off in both, so that the two steps are comparable
        # optax's bias correction raises a python float to an int32 power: standard promotion.
        with jax.numpy_dtype_promotion("standard"), jax.set_mesh(mesh):
            opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            value = step(model, opt)
        results.append((value, model))
    (value, model), (value_ref, model_ref) = results
    np.testing.assert_allclose(value, value_ref, **TOL)
    assert model.blocks.stage_params().buffers[0].sharding.spec[0] == "stage"  # still stage-sharded
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12),
        model.blocks.layer_params(),
        params_of(model_ref.blocks),
    )
    for name in ("embed", "head"):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12),
            nnx.state(getattr(model, name), nnx.Param),
            nnx.state(getattr(model_ref, name), nnx.Param),
        )


def test_to_sequential_and_view():
    pipe = NNXPipeline(make_layers(), balance=[2, 2], rngs=nnx.Rngs(dropout=0))
    layers = pipe.to_sequential()
    assert [type(layer) for layer in layers] == [Block, Block, Block, nnx.Linear]
    jax.tree.map(np.testing.assert_array_equal, params_of(layers), params_of(make_layers()))
    layers[0].lin.kernel[...] = jnp.zeros((IN, WIDTH), F)  # a copy: the pipeline keeps its own
    assert np.any(pipe.layer_params()[0]["lin"]["kernel"][...] != 0)
    assert nnx.view(pipe, deterministic=True).deterministic is True
    pipe.train()
    assert pipe.deterministic is False


# --- errors ------------------------------------------------------------------------------------


def test_bad_configuration():
    layers = make_layers()
    with pytest.raises(ValueError, match=r"`balance` \[2, 1\] sums to 3 layers, but `layers` has 4"):
        NNXPipeline(layers, balance=[2, 1])
    with pytest.raises(ValueError, match=r"every entry must be a positive int"):
        NNXPipeline(layers, balance=[4, 0])
    with pytest.raises(TypeError, match=r"exactly one of `balance`.*neither"):
        NNXPipeline(layers)
    with pytest.raises(ValueError, match=r"axis 'stage' has size 4, but the pipeline has 2 stages"):
        NNXPipeline(layers, num_stages=2, mesh=jax.make_mesh((4,), ("stage",)))


def test_bad_layers():
    import flax.linen as nn

    with pytest.raises(TypeError, match=r"`layers\[0\]` must be an nnx.Module.*LinenPipeline"):
        NNXPipeline([nn.Dense(3)], num_stages=1)
    with pytest.raises(TypeError, match=r"`layers\[1\]` must be an nnx.Module"):
        NNXPipeline([nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.tanh], num_stages=1)
    with pytest.raises(
        ValueError, match=r"Layer 1 \(BatchNorm\) holds nnx.BatchNorm statistics.*deferred_batch_norm"
    ):
        NNXPipeline([nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.BatchNorm(2, rngs=nnx.Rngs(0))], num_stages=2)

    class Counter(nnx.Module):  # mutable state that is not BatchNorm's
        def __init__(self):
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            return x

    with pytest.raises(
        NotImplementedError, match=r"Layer 0 \(Counter\) holds state of type\(s\) \['Variable'\]"
    ):
        NNXPipeline([Counter()], num_stages=1, deferred_batch_norm=True)


def test_bad_call():
    pipe = NNXPipeline(make_layers(), balance=[2, 2])  # layers hold rng streams, pipeline has no rngs
    x, _ = data()
    with pytest.raises(ValueError, match=r"Layers \[0, 1, 2\] hold rng streams.*rngs="):
        pipe(x)
    with pytest.raises(TypeError, match=r"\['train'\] are accepted by none of the layers"):
        pipe(x, train=True)
    with pytest.raises(ValueError, match="'packed' entry"):
        pipe.layer_params({"other": 1})


def test_bad_rngs():
    """An ``rngs`` of the wrong type, for the call or the constructor: a ``TypeError`` that names the
    argument, what it got and the fix (a Linen-style dict wrapped in ``nnx.Rngs``, a seed)."""
    pipe = NNXPipeline(make_layers(), balance=[2, 2])
    x, _ = data()
    key = jax.random.key(0)
    with pytest.raises(
        TypeError, match=r"`rngs` of an NNXPipeline call .* got dict with the keys \['dropout'\]"
    ):
        pipe(x, rngs={"dropout": key})  # Linen's form
    with pytest.raises(TypeError, match=r"Linen's form .*`rngs=nnx.Rngs\(\*\*rngs\)`"):
        pipe(x, rngs={"dropout": key})
    with pytest.raises(TypeError, match=r"got int 3\. For a seed, pass `rngs=nnx.Rngs\(dropout=3\)`"):
        pipe(x, rngs=3)
    with pytest.raises(
        TypeError, match=r"`rngs` of an NNXPipeline call must be None or a PRNG key .*float64"
    ):
        pipe(x, rngs=jnp.ones(3, F))  # an array that is no key: named `rngs`, not the pipeline's `key`
    with pytest.raises(
        TypeError, match=r"`rngs` of an NNXPipeline call must be a single PRNG key.*shape \(4,\)"
    ):
        pipe(x, rngs=jax.random.split(key, 4))
    with pytest.raises(
        TypeError, match=r"`rngs` of NNXPipeline\(\.\.\.\) .* got PRNGKeyArray\. For a key, pass "
    ):
        NNXPipeline(make_layers(), balance=[2, 2], rngs=key)
    with pytest.raises(
        TypeError, match=r"`rngs` of NNXPipeline\(\.\.\.\) .* got int 0\. .*nnx.Rngs\(noise=0\)"
    ):
        NNXPipeline(make_layers(), balance=[2, 2], rngs=0, rng_collection="noise")
    # no key anywhere: the message names the pipeline's stream (`rng_collection`), not always "dropout"
    with pytest.raises(ValueError, match=r"hold rng streams.*`rngs=nnx.Rngs\(noise=\.\.\.\)`"):
        NNXPipeline(make_layers(), balance=[2, 2], rng_collection="noise")(x)


@pytest.mark.parametrize("name", ["deterministic", "use_running_average"])
def test_bool_flags_must_be_bools_or_none(name):
    """A string flag is refused, not read by its truth (``bool('no')`` is True): at construction,
    at a call, in ``value_and_grad``'s step and in ``nnx.view``."""
    rule = rf"must be True, False or None \(None: the module's default\), but got str 'no'\. `{name}=True`"
    with pytest.raises(TypeError, match=rf"`{name}` of NNXPipeline\(\.\.\.\) {rule}"):
        NNXPipeline(make_layers(), balance=[2, 2], **{name: "no"})
    pipe = NNXPipeline(make_layers(), balance=[2, 2], rngs=nnx.Rngs(dropout=0))
    x, targets = data()
    with pytest.raises(TypeError, match=rf"`{name}` of an NNXPipeline call {rule}"):
        pipe(x, **{name: "no"})
    with pytest.raises(TypeError, match=rf"`{name}` of NNXPipeline.set_view {rule}"):
        nnx.view(pipe, **{name: "no"})
    if name == "deterministic":
        step = pipe.value_and_grad(lambda y, t: jnp.sum((y - t) ** 2, axis=-1))
        with pytest.raises(TypeError, match=rf"`{name}` of NNXPipeline.value_and_grad's step {rule}"):
            step(x, targets, deterministic="no")
    built = NNXPipeline(make_layers(), balance=[2, 2], **{name: np.bool_(True)})
    assert getattr(built, name) is True


@pytest.mark.parametrize(
    "value, error, match",
    [
        (5, TypeError, r"`rng_collection` of NNXPipeline .* non-empty str, but got int 5\. Pass"),
        ("", ValueError, r"`rng_collection` of NNXPipeline .* non-empty str, but got str ''\. Pass"),
    ],
)
def test_bad_rng_collection(value, error, match):
    with pytest.raises(error, match=match):
        NNXPipeline(make_layers(), balance=[2, 2], rng_collection=value)
