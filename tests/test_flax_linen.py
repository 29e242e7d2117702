"""``pipejax.flax.LinenPipeline``: Linen layers run as a pipeline equal the same layers in sequence.

The reference is always the layers applied by hand, one after the other, with the parameters
that ``to_sequential`` maps out of the pipelined variables:

* without dropout, forward and gradients (w.r.t. parameters and input) match on no mesh, a
  2-stage and a 4-stage mesh, in float64 (``rtol=1e-12``: the pipeline multiplies micro-batches,
  the reference the whole batch, which may round differently in the last bits);
* with dropout, the pipeline equals the layers run per micro-batch with the documented keys
  ``fold_in(pj.stage_key(key, i, s), j)``, and the checkpoint modes ``"always"`` and ``"never"``
  are bitwise the same, forward and gradients;
* one optax adam step of a bigger model (embedding -> pipeline -> head) equals the same step on
  the plain model.
"""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.flax import LinenPipeline

F = jnp.float64
WIDTH, IN, CLASSES, BATCH, CHUNKS = 16, 5, 10, 10, 4  # BATCH=10, CHUNKS=4: an uneven batch
DROP = 0.25
TOL = dict(rtol=1e-12, atol=1e-12)  # float64, micro-batch vs whole-batch rounding


class Block(nn.Module):
    """Dense -> tanh -> dropout; ``deterministic`` switches dropout off."""

    width: int

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        h = jnp.tanh(nn.Dense(self.width, param_dtype=F)(x))
        return nn.Dropout(DROP)(h, deterministic=deterministic)


class Scale(nn.Module):
    """A layer with a ``train`` flag: doubles its input when training."""

    @nn.compact
    def __call__(self, x, *, train: bool):
        return x * jnp.asarray(2.0 if train else 1.0, x.dtype)


def make_layers():
    """Heterogeneous: three 5->16->16->16 blocks with dropout, then a Dense(10) head."""
    return [Block(WIDTH), Block(WIDTH), Block(WIDTH), nn.Dense(CLASSES, param_dtype=F)]


def run_by_hand(layers, seq, x, key=None, pipe=None, deterministic=True):
    """The layers in sequence; with ``key``, per micro-batch with the documented layer keys."""

    def apply(layer, index, h, rng):
        p = seq["params"].get(f"layers_{index}", {})
        kw = {"deterministic": deterministic} if isinstance(layer, Block) else {}
        return layer.apply({"params": p}, h, rngs={} if rng is None else {"dropout": rng}, **kw)

    if key is None:
        for index, layer in enumerate(layers):
            x = apply(layer, index, x, None)
        return x
    xs, _, plan = pj.split_microbatches(x, pipe.pipeline_options["chunks"])
    sizes = pipe.stage_sizes()
    outs = []
    for i in range(plan.num_micro):
        h, index = xs[i], 0
        for s, size in enumerate(sizes):
            for j in range(size):
                h = apply(layers[index], index, h, jax.random.fold_in(pj.stage_key(key, i, s), j))
                index += 1
        outs.append(h)
    return pj.merge_microbatches(jnp.stack(outs), plan)


def data():
    kx, kw = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (BATCH, IN), F), jax.random.normal(kw, (BATCH, CLASSES), F)


@pytest.mark.parametrize(
    "stages, split",
    [(None, {"num_stages": 3}), (4, {"balance": [1, 1, 1, 1]})],  # (a 2-stage mesh: the tests below)
    ids=["no-mesh-3-uneven", "mesh-4"],
)
def test_matches_sequential_forward_and_grads(stages, split):
    mesh = None if stages is None else jax.make_mesh((stages,), ("stage",))
    layers = make_layers()
    pipe = LinenPipeline(layers, chunks=CHUNKS, mesh=mesh, **split)
    x, w = data()
    variables = jax.jit(pipe.init)(jax.random.key(0), x)

    packed = variables["params"]["stages"].value  # (the box of its sharding metadata)
    assert pipe.stage_sizes() == ((2, 1, 1) if mesh is None else (1, 1, 1, 1))  # uneven: first stage +1
    assert packed.num_stages == len(pipe.stage_sizes())
    if mesh is not None:  # each device holds exactly its stage's row of every buffer
        for buf in packed.buffers:
            assert buf.sharding.spec[0] == "stage"
            for shard in buf.addressable_shards:
                s = shard.index[0].start
                assert shard.data.shape == (1, buf.shape[1])
                assert shard.device == mesh.devices[s]

    def loss(v, x):
        y = pipe.apply(v, x, deterministic=True)
        return jnp.sum(y * w), y

    def loss_ref(seq, x):
        y = run_by_hand(layers, seq, x)
        return jnp.sum(y * w), y

    seq = pipe.to_sequential(variables)
    (_, y), (g_v, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(variables, x)
    (_, r_y), (r_seq, r_x) = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1), has_aux=True))(seq, x)
    np.testing.assert_allclose(y, r_y, **TOL)
    got = pipe.to_sequential(g_v)  # the same mapping carries gradients
    assert jax.tree.structure(got) == jax.tree.structure(r_seq)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, r_seq)
    np.testing.assert_allclose(g_x, r_x, **TOL)


def test_dropout_uses_documented_keys_and_checkpoint_modes_agree():
    mesh = jax.make_mesh((2,), ("stage",))
    layers = make_layers()
    x, w = data()
    key = jax.random.key(7)
    results = {}
    variables = jax.jit(LinenPipeline(layers, balance=[3, 1], mesh=mesh).init)(jax.random.key(0), x)
    for mode in ("always", "never"):  # everything recomputed vs nothing once the pipeline is full
        pipe = LinenPipeline(layers, balance=[3, 1], chunks=3, checkpoint=mode, mesh=mesh)

        def loss(v, x, key, pipe=pipe):
            y = pipe.apply(v, x, deterministic=False, rngs={"dropout": key})
            return jnp.sum(y * w), y

        (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables, x, key)
        results[mode] = (y, g["params"]["stages"].value.buffers)

    ref_y, ref_g = results["always"]
    for mode, (y, g) in results.items():  # recomputation replays the same masks: bitwise
        np.testing.assert_array_equal(y, ref_y, err_msg=mode)
        jax.tree.map(lambda a, b, mode=mode: np.testing.assert_array_equal(a, b, err_msg=mode), g, ref_g)

    # The key the module draws: its own make_rng("dropout"), reproduced outside the pipeline.
    pipe_key = nn.apply(lambda m: m.make_rng("dropout"), pipe)(variables, rngs={"dropout": key})
    seq = pipe.to_sequential(variables)
    by_hand = jax.jit(lambda seq, x, k: run_by_hand(layers, seq, x, k, pipe, deterministic=False))
    expected = by_hand(seq, x, pipe_key)
    np.testing.assert_allclose(ref_y, expected, rtol=1e-14, atol=1e-14)  # same shapes: exact in practice
    plain = jax.jit(lambda seq, x: run_by_hand(layers, seq, x))(seq, x)
    assert not np.allclose(ref_y, plain)  # dropout was on


def test_from_sequential_round_trip_and_nn_sequential():
    layers = make_layers()
    pipe = LinenPipeline(layers, balance=[2, 2], chunks=3)
    x, _ = data()
    seq = nn.Sequential(layers).init(jax.random.key(3), x)  # Sequential passes no flags: dropout off
    variables = pipe.from_sequential(seq)
    np.testing.assert_allclose(pipe.apply(variables, x), nn.Sequential(layers).apply(seq, x), **TOL)
    back = pipe.to_sequential(variables)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, dict(seq)))


def test_inside_a_bigger_model_one_adam_step_equals_plain_model():
    mesh = jax.make_mesh((2,), ("stage",))
    vocab = 13
    blocks = [Block(WIDTH), Block(WIDTH), Scale()]

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens, *, train: bool):
            h = nn.Embed(vocab, WIDTH, param_dtype=F)(tokens).mean(axis=1)
            h = LinenPipeline(blocks, balance=[2, 1], chunks=2, mesh=mesh, name="pipe")(
                h, deterministic=True, train=train
            )
            return nn.Dense(CLASSES, param_dtype=F, name="head")(h)

    tokens = jax.random.randint(jax.random.key(4), (6, 3), 0, vocab)
    labels = jnp.arange(6) % CLASSES
    model = Model()
    variables = jax.jit(lambda k, t: model.init(k, t, train=False))(jax.random.key(0), tokens)
    assert set(variables["params"]) == {"Embed_0", "pipe", "head"}
    pipe = LinenPipeline(blocks, balance=[2, 1], chunks=2, mesh=mesh)

    def ce(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def loss(params):
        return ce(model.apply({"params": params}, tokens, train=True))

    def loss_ref(params):  # the same model, the blocks applied in sequence
        h = nn.Embed(vocab, WIDTH, param_dtype=F).apply({"params": params["embed"]}, tokens).mean(axis=1)
        for index, layer in enumerate(blocks):
            kw = {"train": True} if isinstance(layer, Scale) else {"deterministic": True}
            h = layer.apply({"params": params["seq"].get(f"layers_{index}", {})}, h, **kw)
        return ce(nn.Dense(CLASSES, param_dtype=F).apply({"params": params["head"]}, h))

    opt = optax.adam(1e-2)

    def step(loss):
        @jax.jit
        def run(params, state):
            value, grads = jax.value_and_grad(loss)(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), value

        return run

    params = variables["params"]
    ref = {
        "embed": params["Embed_0"],
        "seq": pipe.to_sequential({"params": params["pipe"]})["params"],
        "head": params["head"],
    }
    # optax's bias correction raises a python float to an int32 power: standard promotion.
    with jax.numpy_dtype_promotion("standard"), jax.set_mesh(mesh):
        new, value = step(loss)(params, opt.init(params))
        new_ref, value_ref = step(loss_ref)(ref, opt.init(ref))
    np.testing.assert_allclose(value, value_ref, **TOL)
    got = {
        "embed": new["Embed_0"],
        "seq": pipe.to_sequential({"params": new["pipe"]})["params"],
        "head": new["head"],
    }
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12), got, new_ref)
    assert new["pipe"]["stages"].value.buffers[0].sharding.spec[0] == "stage"  # still stage-sharded


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"balance": [2, 0, 2]}, ValueError, r"`balance\[1\]` is 0; every entry must be a positive int"),
        ({"balance": [2, 1]}, ValueError, r"`balance` \[2, 1\] sums to 3 layers, but `layers` has 4"),
        ({}, TypeError, r"exactly one of `balance`.*neither"),
        ({"balance": [2, 2], "num_stages": 2}, TypeError, r"exactly one of `balance`.*both"),
        ({"num_stages": 5}, ValueError, r"between 1 and the number of layers \(4\)"),
        ({"balance": "22"}, TypeError, r"sequence of positive ints"),
        (
            {"balance": [2, 2], "mesh": "mesh-4"},
            ValueError,
            r"axis 'stage' has size 4, but the pipeline has 2 stages",
        ),
    ],
)
def test_bad_configuration(kwargs, error, match):
    if kwargs.get("mesh") == "mesh-4":
        kwargs = dict(kwargs, mesh=jax.make_mesh((4,), ("stage",)))
    with pytest.raises(error, match=match):
        LinenPipeline(make_layers(), **kwargs)


def test_bad_layers():
    with pytest.raises(TypeError, match=r"`layers\[1\]` must be a flax.linen.Module.*Wrap a function"):
        LinenPipeline([nn.Dense(3), nn.relu], num_stages=1)
    with pytest.raises(ValueError, match="empty"):
        LinenPipeline([], num_stages=1)
    from flax import nnx

    with pytest.raises(TypeError, match="NNXPipeline"):
        LinenPipeline([nnx.Linear(2, 2, rngs=nnx.Rngs(0))], num_stages=1)


def test_bad_flags():
    pipe = LinenPipeline(make_layers(), balance=[2, 2])
    x, _ = data()
    with pytest.raises(TypeError, match=r"\['determinstic'\] are accepted by none of the layers"):
        pipe.init(jax.random.key(0), x, determinstic=True)
    with pytest.raises(TypeError, match="`deterministic` is an array"):
        pipe.init(jax.random.key(0), x, deterministic=jnp.asarray(True))


def test_layer_state_needs_deferred_batch_norm_and_caches_are_not_supported():
    pipe = LinenPipeline([nn.Dense(4), nn.BatchNorm(use_running_average=False)], num_stages=2)
    with pytest.raises(
        ValueError, match=r"Layer 1 \(BatchNorm\) creates 'batch_stats'.*deferred_batch_norm=True"
    ):
        pipe.init(jax.random.key(0), jnp.ones((4, 3), jnp.float32))

    class Counter(nn.Module):  # mutable state that is not BatchNorm's
        @nn.compact
        def __call__(self, x):
            self.variable("cache", "calls", lambda: jnp.zeros((), jnp.int32))
            return x

    pipe = LinenPipeline([nn.Dense(4), Counter()], num_stages=2, deferred_batch_norm=True)
    with pytest.raises(NotImplementedError, match=r"Layer 1 \(Counter\).*\['cache'\]"):
        pipe.init(jax.random.key(0), jnp.ones((4, 3), jnp.float32))


def test_to_sequential_rejects_other_variables():
    pipe = LinenPipeline(make_layers(), balance=[2, 2])
    with pytest.raises(ValueError, match="own variables"):
        pipe.to_sequential({"params": {"Dense_0": {}}})
    with pytest.raises(ValueError, match=r"\['layers_9'\] that match no layer"):
        pipe.from_sequential({"params": {"layers_9": {}}})


@pytest.mark.parametrize(
    "value, error, match",
    [
        (3, TypeError, r"`rng_collection` of LinenPipeline .* non-empty str, but got int 3\. Pass"),
        ("", ValueError, r"`rng_collection` of LinenPipeline .* non-empty str, but got str ''\. Pass"),
    ],
)
def test_bad_rng_collection(value, error, match):
    with pytest.raises(error, match=match):
        LinenPipeline(make_layers(), balance=[2, 2], rng_collection=value)


def test_bad_bool_options_name_the_fix():
    with pytest.raises(
        TypeError, match=r"`unbiased_variance` must be a bool \(True or False\), but got int 1\. Pass"
    ):
        LinenPipeline(make_layers(), balance=[2, 2], unbiased_variance=1)


def test_apply_without_variables_notes_init():
    pipe = LinenPipeline(make_layers(), balance=[2, 2])
    x, _ = data()
    with pytest.raises(flax.errors.ScopeCollectionNotFound) as info:  # Flax's own error, kept
        pipe.apply({}, x)
    assert "`variables = pipe.init(key, x)`" in "\n".join(info.value.__notes__)


def test_from_sequential_with_wrong_shapes_is_refused_naming_the_layer():
    pipe = LinenPipeline(make_layers(), balance=[2, 2])
    x, _ = data()
    seq = pipe.to_sequential(pipe.init(jax.random.key(0), x))
    bad = jax.tree.map(lambda a: jnp.ones((*a.shape, 1), a.dtype), seq)
    with pytest.raises(flax.errors.ScopeParamShapeError, match=r"\(5, 16\).*\(5, 16, 1\)") as info:
        pipe.apply(pipe.from_sequential(bad), x)
    assert "in layer 0 (Block), whose parameters are 'layers_0'" in "\n".join(info.value.__notes__)


def test_from_sequential_refuses_a_leaf_an_equal_layer_has_not():
    """A misspelt or extra leaf in one of several equal layers is refused, not carried along."""
    pipe = LinenPipeline([nn.Dense(4, param_dtype=F)] * 3, num_stages=3)
    seq = pipe.to_sequential(pipe.init(jax.random.key(0), jnp.ones((2, 4), F)))
    pipe.from_sequential(seq)
    params = dict(seq["params"])
    params["layers_2"] = {**params["layers_2"], "kernal": params["layers_2"]["kernel"]}
    with pytest.raises(
        ValueError, match=r"layers_0 and layers_2 are equal layers \(Dense\).*layers_2 has \['kernal'\]"
    ):
        pipe.from_sequential({"params": params})


class CacheLayer(nn.Module):
    @nn.compact
    def __call__(self, h, cache=None):
        return cache, h + nn.Dense(IN, param_dtype=F)(h)


class ShapeCacheLayer(nn.Module):
    @nn.compact
    def __call__(self, h, cache=None):
        return cache, h + nn.Dense(h.shape[-1], param_dtype=F)(h)  # on a tuple: AttributeError


@pytest.mark.parametrize(
    "carry, match",
    [
        (None, r"A layer's whole output is passed on"),
        ("x", r"`carry='x'` selects an entry of a dict output; .* tuple, is passed on whole"),
    ],
)
def test_a_cache_tuple_in_init_says_to_use_carry(carry, match):
    pipe = LinenPipeline([CacheLayer(), CacheLayer()], num_stages=2, carry=carry)
    x, _ = data()
    with pytest.raises(
        ValueError,
        match=r"(?s)Layer 1 could not be applied to the output of layer 0, \(None, 'float64\[10, 5\]'\)"
        rf".*{match}.*`carry=1` for `\(cache, x\)`",
    ):
        pipe.init(jax.random.key(0), x)
    # the user's own error keeps its type and gains the hint as a note
    pipe = LinenPipeline([ShapeCacheLayer(), ShapeCacheLayer()], num_stages=2, carry=carry)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'shape'") as info:
        pipe.init(jax.random.key(0), x)
    assert "`carry=1` for `(cache, x)`" in "\n".join(info.value.__notes__)
