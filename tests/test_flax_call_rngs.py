"""Call-time rngs (issue 24): layers that take ``rngs=`` when called, as current NNX layers do.

``nnx.Dropout(rate)`` built without ``rngs`` holds no stream and draws from the ``rngs=`` of its
call. ``NNXPipeline`` hands every layer whose ``__call__`` names ``rngs`` an ``nnx.Rngs`` of its
own per-(micro-batch, stage, layer) key, reseeded as a held stream is reseeded. Checked here:

* a layer that takes ``rngs`` at call time draws bitwise the masks of the same layer holding a
  stream, with one key per micro-batch and with ``per_example_keys=True``;
* the checkpoint modes give bitwise the same outputs and gradients, and the pipeline equals the
  layers run by hand per micro-batch with the documented rngs (to ``1e-14``: the same shapes,
  exact in practice);
* every stream of a call's ``nnx.Rngs`` reaches the layers, each seeded from the call's one key
  (drawn from the ``rng_collection`` stream);
* without any key the layers are called without ``rngs`` (dropout off works, dropout on is
  Flax's own error, as outside a pipeline);
* Linen, whose layers draw with ``self.make_rng``: ``apply(..., rngs={"dropout": key})`` reaches
  them under GPipe and 1F1B alike, the loss and gradients of ``value_and_grad`` with "1f1b" equal
  those of ``jax.value_and_grad`` of the GPipe call (float64, ``1e-12``: the schedules sum the
  micro-batches in another order);
* the rngs a layer needs but does not get keep Flax's error (``KeyError``, ``AttributeError``,
  Linen's ``InvalidRngError``) and gain a note naming the layer (index, stage, class) and the
  stream and ``rngs=`` to pass: a call's or constructor's ``nnx.Rngs`` without the
  ``rng_collection`` stream, a layer drawing a stream its call-time ``nnx.Rngs`` lacks, a Linen
  ``apply`` without the ``dropout`` rng or with a layer drawing another rng.
"""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pipejax as pj
from pipejax.flax import LinenPipeline, NNXPipeline

F = jnp.float64
WIDTH, BATCH, CHUNKS, DROP = 8, 5, 2, 0.5  # 5 rows in 2 micro-batches: the last one padded


class CallBlock(nnx.Module):
    """Linear -> tanh -> dropout, the dropout holding no stream: ``rngs`` comes with the call."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, param_dtype=F, rngs=rngs)
        self.drop = nnx.Dropout(DROP)

    def __call__(self, x, rngs=None):
        return self.drop(jnp.tanh(self.lin(x)), rngs=rngs)


class HeldBlock(nnx.Module):
    """The same block in the older style: its dropout holds a ``dropout`` stream."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, param_dtype=F, rngs=rngs)
        self.drop = nnx.Dropout(DROP, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.lin(x)))


class Noise(nnx.Module):
    """Adds Gaussian noise from the ``noise`` stream of the call's rngs (not ``dropout``)."""

    def __call__(self, x, *, rngs):
        return x + jax.random.normal(rngs.noise(), x.shape, x.dtype)


def blocks(kind, n=4):
    rngs = nnx.Rngs(params=0, dropout=1)  # same params for both kinds
    return [kind(rngs) for _ in range(n)]


def x_data():
    return jax.random.normal(jax.random.key(1), (BATCH, WIDTH), F)


def layer_rngs(key, i, s, j, streams=("dropout",)):
    """The rngs layer ``j`` of stage ``s`` receives on micro-batch ``i`` (the documented rule)."""
    k = jax.random.fold_in(pj.stage_key(key, i, s), j)
    rngs = nnx.Rngs(**{name: k for name in streams})
    nnx.reseed(rngs, **{name: k for name in streams})
    return rngs


def by_hand(layers, x, key, sizes, streams=("dropout",)):
    xs, _, plan = pj.split_microbatches(x, CHUNKS)
    outs = []
    for i in range(plan.num_micro):
        h, index = xs[i], 0
        for s, size in enumerate(sizes):
            for j in range(size):
                h = layers[index](h, rngs=layer_rngs(key, i, s, j, streams))
                index += 1
        outs.append(h)
    return pj.merge_microbatches(jnp.stack(outs), plan)


@pytest.mark.parametrize("per_example_keys", [False, True])
def test_call_time_rngs_draw_the_masks_of_held_streams(per_example_keys):
    x, key = x_data(), jax.random.key(7)
    run = nnx.jit(lambda pipe, x, key: pipe(x, deterministic=False, rngs=key))
    ys = {}
    for kind in (CallBlock, HeldBlock):
        pipe = NNXPipeline(blocks(kind), balance=[2, 2], chunks=CHUNKS, per_example_keys=per_example_keys)
        ys[kind] = run(pipe, x, key)
    np.testing.assert_array_equal(ys[CallBlock], ys[HeldBlock])
    assert (ys[CallBlock] == 0).mean() > 0.2  # dropout ran (rate 0.5)


def test_checkpoint_modes_bitwise_and_the_documented_keys():
    mesh = jax.make_mesh((2,), ("stage",))
    x, key = x_data(), jax.random.key(7)
    w = jax.random.normal(jax.random.key(2), (BATCH, WIDTH), F)

    def loss(pipe, x, key):
        y = pipe(x, deterministic=False, rngs=key)
        return jnp.sum(y * w), y

    results = {}
    for mode in ("always", "except_last", "never"):
        pipe = NNXPipeline(blocks(CallBlock), balance=[3, 1], chunks=CHUNKS, checkpoint=mode, mesh=mesh)
        (_, y), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(pipe, x, key)
        results[mode] = (y, jax.tree.leaves(g))
    for mode, result in results.items():  # recomputation replays the same masks: bitwise
        jax.tree.map(
            lambda a, b, mode=mode: np.testing.assert_array_equal(a, b, err_msg=mode),
            result,
            results["never"],
        )
    expected = nnx.jit(by_hand, static_argnums=3)(blocks(CallBlock), x, key, (3, 1))
    np.testing.assert_allclose(results["never"][0], expected, rtol=1e-14, atol=1e-14)


def test_every_stream_of_the_calls_rngs_reaches_the_layers():
    x = x_data()
    pipe = NNXPipeline([Noise(), Noise()], balance=[1, 1], chunks=CHUNKS)
    y = pipe(x, rngs=nnx.Rngs(dropout=3, noise=4))
    key = nnx.Rngs(dropout=3, noise=4)["dropout"]()  # the one key a call draws (`rng_collection`)
    expected = by_hand([Noise(), Noise()], x, key, (1, 1), streams=("dropout", "noise"))
    # the same draws; the normal sampler's last bits differ between compiled and eager (FMA)
    np.testing.assert_allclose(y, expected, rtol=1e-13, atol=1e-14)
    # one key per call, drawn from the `rng_collection` stream, seeds every stream of the layers
    np.testing.assert_array_equal(y, pipe(x, rngs=nnx.Rngs(dropout=3, noise=5)))
    assert not np.allclose(y, pipe(x, rngs=nnx.Rngs(dropout=4, noise=4)))


def test_without_a_key_the_layers_get_no_rngs():
    x = x_data()
    layers = blocks(CallBlock, 2)
    pipe = NNXPipeline(layers, balance=[1, 1], chunks=CHUNKS)  # no rngs: no key of its own
    h = x
    for layer in layers:  # the blocks with dropout off
        h = jnp.tanh(layer.lin(h))
    np.testing.assert_allclose(pipe(x, deterministic=True), h, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="no `rngs` argument was provided to Dropout") as err:
        pipe(x, deterministic=False)  # as outside a pipeline: Flax's own error, with a note
    assert any("had no key to give it: pass `rngs=` to the call" in note for note in err.value.__notes__)
    pipe = NNXPipeline(blocks(CallBlock, 2), balance=[1, 1], chunks=CHUNKS, rngs=nnx.Rngs(dropout=5))
    assert (pipe(x, deterministic=False) == 0).any()  # the pipeline's own stream gives the key


class LinenBlock(nn.Module):
    """A Linen block that returns ``(cache, x)``; its dropout draws with ``self.make_rng``."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        h = nn.Dropout(DROP)(jnp.tanh(nn.Dense(WIDTH, param_dtype=F)(x)), deterministic=deterministic)
        return None, h


def test_linen_call_time_rngs_under_gpipe_and_1f1b():
    x, key = x_data(), jax.random.key(7)
    t = jax.random.normal(jax.random.key(2), (BATCH, WIDTH), F)
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)
    layers = [LinenBlock() for _ in range(4)]
    gpipe = LinenPipeline(layers, balance=[2, 2], chunks=CHUNKS, carry=1)
    variables = jax.jit(gpipe.init)(jax.random.key(0), x)

    def loss(v):
        return sq(gpipe.apply(v, x, deterministic=False, rngs={"dropout": key}), t).mean()

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(variables)
    onef1b = gpipe.clone(pipeline_options={**gpipe.pipeline_options, "schedule": "1f1b"})
    step = jax.jit(lambda v: onef1b.value_and_grad(sq)(v, x, t, deterministic=False, rngs={"dropout": key}))
    loss_1f1b, grads = step(variables)
    np.testing.assert_allclose(loss_1f1b, ref_loss, rtol=1e-12)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14), grads, ref_grads["params"]
    )
    # the layers drew the documented keys: fold_in(pj.stage_key(make_rng("dropout"), i, s), j)
    pipe_key = nn.apply(lambda m: m.make_rng("dropout"), gpipe)(variables, rngs={"dropout": key})
    seq = gpipe.to_sequential(variables)["params"]
    xs, _, plan = pj.split_microbatches(x, CHUNKS)
    outs = []
    for i in range(plan.num_micro):
        h = xs[i]
        for index in range(4):
            s, j = divmod(index, 2)
            rngs = {"dropout": jax.random.fold_in(pj.stage_key(pipe_key, i, s), j)}
            _, h = LinenBlock().apply({"params": seq[f"layers_{index}"]}, h, False, rngs=rngs)
        outs.append(h)
    y = gpipe.apply(variables, x, deterministic=False, rngs={"dropout": key})
    np.testing.assert_allclose(y, pj.merge_microbatches(jnp.stack(outs), plan), rtol=1e-14, atol=1e-14)
    assert (y == 0).any()  # dropout ran


def notes(err):
    return "\n".join(getattr(err.value, "__notes__", []))


@pytest.mark.parametrize("deterministic", [False, True])
def test_an_nnx_rngs_without_the_stream_says_which_layers_and_how(deterministic):
    """The call's ``nnx.Rngs(params=0)`` has no ``dropout`` stream (nor a default one) to draw the
    call's key from: Flax's ``KeyError`` is kept and gains a note naming the layers that need the key,
    their stages and class, and the stream to add, also with dropout off (the key is drawn anyway)."""
    x = x_data()
    pipe = NNXPipeline(blocks(CallBlock), balance=[2, 2], chunks=CHUNKS)
    with pytest.raises(KeyError, match="dropout") as err:
        pipe(x, deterministic=deterministic, rngs=nnx.Rngs(params=0))
    assert "with the streams ['params'] only" in notes(err)
    assert "from the stream 'dropout' (its `rng_collection`)" in notes(err)
    assert "layers 0-3 (stages 0-1, CallBlock), which take `rngs` at call time" in notes(err)
    assert "add the stream: `rngs=nnx.Rngs(params=..., dropout=...)`" in notes(err)
    assert "`rngs=jax.random.key(0)`" in notes(err)
    # the training step draws its key as a call does, with the same note; layers holding streams too
    mixed = [HeldBlock(nnx.Rngs(0)), CallBlock(nnx.Rngs(0)), CallBlock(nnx.Rngs(0)), Noise()]
    pipe = NNXPipeline(mixed, balance=[1, 3], chunks=CHUNKS, schedule="1f1b")
    step = pipe.value_and_grad(lambda y, t: jnp.sum((y - t) ** 2, axis=-1))
    with pytest.raises(KeyError, match="dropout") as err:
        step(x, x, deterministic=deterministic, rngs=nnx.Rngs(params=0))
    assert (
        "layer 0 (stage 0, HeldBlock), which holds rng streams; layers 1-2 (stage 1, CallBlock) and "
        "layer 3 (stage 1, Noise), which take `rngs` at call time"
    ) in notes(err)
    # a default stream stands in for the missing one, as `rngs["dropout"]` does in Flax
    assert jnp.isfinite(step(x, x, deterministic=deterministic, rngs=nnx.Rngs(0))[0])


def test_an_nnx_rngs_without_the_stream_given_to_the_constructor():
    with pytest.raises(KeyError, match="dropout") as err:
        NNXPipeline(blocks(HeldBlock), balance=[2, 2], chunks=CHUNKS, rngs=nnx.Rngs(params=0))
    assert "was built with `rngs=` an nnx.Rngs with the streams ['params'] only" in notes(err)
    assert "forks its own key stream from the stream 'dropout'" in notes(err)
    assert "`rngs=nnx.Rngs(params=..., dropout=...)`" in notes(err)


def test_a_layer_drawing_a_stream_its_call_time_rngs_lack():
    """A layer's call-time ``nnx.Rngs`` has ``rng_collection`` and the streams of the call's
    ``nnx.Rngs``: a layer drawing another stream keeps Flax's error (``KeyError`` for
    ``rngs["noise"]``, ``AttributeError`` for ``rngs.noise``) with a note naming the layer, its
    stage and class, the streams it got, and the ``nnx.Rngs`` to call with."""
    x, key = x_data(), jax.random.key(0)
    pipe = NNXPipeline([Noise(), Noise()], balance=[1, 1], chunks=CHUNKS)
    with pytest.raises(AttributeError, match="noise") as err:
        pipe(x, rngs=key)  # a key: the layers get the `dropout` stream only
    assert "layer 0 (stage 0, Noise) draws from the stream 'noise'" in notes(err)
    assert "has the streams ['dropout'] only" in notes(err)
    assert "`rngs=nnx.Rngs(dropout=..., noise=...)`" in notes(err)
    assert jnp.isfinite(pipe(x, rngs=nnx.Rngs(dropout=0, noise=1))).all()  # as the note says
    # Dropout draws `rngs["dropout"]`, but the pipeline's stream is named otherwise
    pipe = NNXPipeline(blocks(CallBlock), balance=[2, 2], chunks=CHUNKS, rng_collection="noise")
    with pytest.raises(KeyError, match="dropout") as err:
        pipe(x, deterministic=False, rngs=key)
    assert "layer 0 (stage 0, CallBlock) draws from the stream 'dropout'" in notes(err)
    assert "`rngs=nnx.Rngs(noise=..., dropout=...)`" in notes(err)


class NoiseBlock(nn.Module):
    """A Linen layer that draws from a ``noise`` rng (``self.make_rng("noise")``)."""

    @nn.compact
    def __call__(self, x):
        return x + jax.random.normal(self.make_rng("noise"), x.shape, x.dtype)


def test_linen_without_the_rng_a_layer_draws_says_which_layer_and_how():
    """``LinenPipeline`` hands each layer its ``rng_collection`` rng only, when ``apply`` has it:
    Flax's ``InvalidRngError`` is kept and gains a note naming the layer, its stage and class, and
    the ``rngs=`` to pass (``apply``'s, the ``value_and_grad`` step's; a bare key is the params rng)."""
    x, key = x_data(), jax.random.key(7)
    pipe = LinenPipeline([LinenBlock() for _ in range(4)], balance=[2, 2], chunks=CHUNKS, carry=1)
    variables = jax.jit(pipe.init)(jax.random.key(0), x)
    step = pipe.value_and_grad(lambda y, t: jnp.sum((y - t) ** 2, axis=-1))
    calls = {
        "apply, the params rng only": lambda: pipe.apply(
            variables, x, deterministic=False, rngs={"params": key}
        ),
        "apply, a bare key": lambda: pipe.apply(variables, x, deterministic=False, rngs=key),
        "apply, no rngs": lambda: pipe.apply(variables, x, deterministic=False),
        "value_and_grad step": lambda: step(variables, x, x, deterministic=False, rngs={"params": key}),
    }
    for name, call in calls.items():
        with pytest.raises(flax.errors.InvalidRngError, match='needs PRNG for "dropout"') as err:
            call()
        assert "layer 0 (stage 0, LinenBlock) draws from the rng 'dropout'" in notes(err), name
        assert "`module.apply(variables, x, rngs={'dropout': key})`" in notes(err), name
        assert "a bare key is Linen's 'params' rng" in notes(err), name
    # a layer drawing from another rng than the pipeline's `rng_collection`
    pipe = LinenPipeline([NoiseBlock(), NoiseBlock()], balance=[1, 1], chunks=CHUNKS)
    variables = pipe.init(jax.random.key(0), x)
    with pytest.raises(flax.errors.InvalidRngError, match='needs PRNG for "noise"') as err:
        pipe.apply(variables, x, rngs={"dropout": key, "noise": key})
    assert "layer 0 (stage 0, NoiseBlock) draws from the rng 'noise'" in notes(err)
    assert "hands each layer one rng only: a key of its `rng_collection` rng, 'dropout'" in notes(err)
    assert "build the pipeline with `rng_collection='noise'`" in notes(err)
    noisy = pipe.clone(rng_collection="noise")  # as the note says
    assert jnp.isfinite(noisy.apply(variables, x, rngs={"noise": key})).all()
