"""Side inputs of the Flax adapters: ``context={"name": array}`` reaches each layer as ``name=``.

The layers are tiny and of three kinds, so that routing is checked too: ``Mix`` takes ``mask=``
(``bool[b, L, L]``, an attention-mask-like side input), ``Shift`` takes ``offset=`` (``[b]``,
keyword-only), ``Dense`` neither. References, in float64:

* the layers in a Python loop on the whole batch, each called with the side inputs it takes
  (forward rtol ``1e-12``; gradients w.r.t. parameters, ``x`` and the float side input ``1e-10``:
  micro-batching reorders batch sums), with no mesh and on a 2-stage mesh, the batch of 5 in
  ``chunks=3`` (micro-batches of 2, one padding row), for Linen and NNX;
* with ``per_example_keys=True`` and dropout on, the pipeline with ``chunks=1`` (no micro-batching):
  each row draws its own mask, so ``chunks=3`` must agree, side inputs row by row;
* with deferred BatchNorm (the stateful stages), ``chunks=1`` equals ``nn.BatchNorm`` in the
  plain loop in training, outputs and the updated running statistics;
* the errors: a context that is not a dict, an entry no layer takes (the message names the
  layers and what they take), an entry also given as a flag, an array flag, a context whose batch
  differs from ``x``'s.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline
from tests import models

F = jnp.float64
B, L, W, CHUNKS = 5, 4, 3, 3  # batch, positions, width; 5 rows in chunks=3: micro-batches of 2
FWD = dict(rtol=1e-12, atol=1e-12)
GRAD = dict(rtol=1e-10, atol=1e-12)


def inputs():
    kx, km, ko = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, L, W), F)
    mask = jax.random.bernoulli(km, 0.7, (B, L, L)) | jnp.eye(L, dtype=jnp.bool_)[None]
    return x, {"mask": mask, "offset": jax.random.normal(ko, (B,), F)}


def mix(h, mask):
    """Each position averages the positions its mask row allows (an attention stand-in)."""
    m = mask.astype(h.dtype)
    return jnp.einsum("bqk,bkd->bqd", m, h) / jnp.sum(m, axis=-1, keepdims=True)


# --- Linen ------------------------------------------------------------------------------------


class Mix(nn.Module):
    @nn.compact
    def __call__(self, h, mask=None, deterministic: bool = True):
        y = jnp.tanh(nn.Dense(W, param_dtype=F)(mix(h, mask)))
        return h + nn.Dropout(0.5)(y, deterministic=deterministic)


class Shift(nn.Module):
    @nn.compact
    def __call__(self, h, *, offset):
        return nn.Dense(W, param_dtype=F)(h) + offset[:, None, None]


def linen_layers():
    return [Mix(), Shift(), Mix(), nn.Dense(W, param_dtype=F)]


def linen_by_hand(layers, seq, x, context):
    for index, layer in enumerate(layers):
        kw = {"mask": context["mask"]} if isinstance(layer, Mix) else {}
        kw = {"offset": context["offset"]} if isinstance(layer, Shift) else kw
        x = layer.apply({"params": seq["params"][f"layers_{index}"]}, x, **kw)
    return x


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_linen_layers_receive_the_side_inputs_they_take(placement):
    mesh = models.make_mesh(placement, 2)
    layers = linen_layers()
    pipe = LinenPipeline(layers, balance=[2, 2], chunks=CHUNKS, mesh=mesh)
    x, context = inputs()
    variables = pipe.init(jax.random.key(1), x, context=context)  # init sees the whole batch's
    seq = pipe.to_sequential(variables)

    def loss(v, x, offset):
        y = pipe.apply(v, x, context={**context, "offset": offset}, deterministic=True)
        return jnp.sum(y**3), y

    def loss_ref(seq, x, offset):
        y = linen_by_hand(layers, seq, x, {**context, "offset": offset})
        return jnp.sum(y**3), y

    with jax.set_mesh(mesh) if mesh is not None else _no_mesh():
        (_, y), g = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
            variables, x, context["offset"]
        )
        (_, r), w = jax.jit(jax.value_and_grad(loss_ref, (0, 1, 2), has_aux=True))(seq, x, context["offset"])
    np.testing.assert_allclose(y, r, **FWD)
    models.assert_trees_close((pipe.to_sequential(g[0]), *g[1:]), w, **GRAD)


def test_linen_per_example_keys_do_not_depend_on_chunks_with_side_inputs():
    layers = linen_layers()
    x, context = inputs()
    ys = []
    for chunks in (1, CHUNKS):
        pipe = LinenPipeline(layers, balance=[2, 2], chunks=chunks, per_example_keys=True)
        variables = pipe.init(jax.random.key(1), x, context=context)
        apply = jax.jit(
            lambda v, x, c, pipe=pipe: pipe.apply(
                v, x, context=c, deterministic=False, rngs={"dropout": jax.random.key(2)}
            )
        )
        ys.append(apply(variables, x, context))
    deterministic = linen_by_hand(layers, pipe.to_sequential(variables), x, context)
    assert not np.allclose(ys[0], deterministic)  # dropout ran
    np.testing.assert_allclose(ys[1], ys[0], **FWD)


class NormMix(nn.Module):
    @nn.compact
    def __call__(self, h, mask=None, train: bool = False):
        h = nn.BatchNorm(use_running_average=not train, param_dtype=F, force_float32_reductions=False)(h)
        return mix(h, mask)


def test_linen_deferred_batch_norm_with_side_inputs():
    layers = [NormMix(), Shift(), NormMix()]
    x, context = inputs()
    pipe = LinenPipeline(layers, balance=[2, 1], chunks=1, deferred_batch_norm=True)
    variables = pipe.init(jax.random.key(1), x, context=context)
    y, updated = jax.jit(lambda v, x, c: pipe.apply(v, x, context=c, train=True, mutable=["batch_stats"]))(
        variables, x, context
    )
    seq, h, stats = pipe.to_sequential(variables), x, {}
    for index, layer in enumerate(layers):
        name = f"layers_{index}"
        if isinstance(layer, NormMix):
            v = {"params": seq["params"][name], "batch_stats": seq["batch_stats"][name]}
            h, new = layer.apply(v, h, context["mask"], True, mutable=["batch_stats"])
            stats[name] = new["batch_stats"]
        else:
            h = layer.apply({"params": seq["params"][name]}, h, offset=context["offset"])
    np.testing.assert_allclose(y, h, **FWD)
    got = pipe.to_sequential({"params": variables["params"], **updated})["batch_stats"]
    models.assert_trees_close(got, stats, **FWD)


def test_linen_context_errors_name_the_entry_and_the_fix():
    pipe = LinenPipeline(linen_layers(), balance=[2, 2], chunks=CHUNKS)
    x, context = inputs()
    variables = pipe.init(jax.random.key(1), x, context=context)
    with pytest.raises(TypeError, match=r"`context` must be a dict .* but got ArrayImpl"):
        pipe.apply(variables, x, context=context["mask"])
    with pytest.raises(TypeError, match=r"\['masks'\] is a keyword argument that none of the layers") as info:
        pipe.apply(variables, x, context={**context, "masks": context["mask"]})
    message = str(info.value)
    assert "layers 0 (Mix) take" not in message  # (layers 0 and 2 are not neighbours)
    assert "layer 0 (Mix) takes deterministic, mask; layer 1 (Shift) takes offset" in message
    assert "layer 3 (Dense) takes" in message and "rename the entry" in message
    with pytest.raises(TypeError, match=r"`mask` is given both as a keyword argument"):
        pipe.apply(variables, x, context=context, mask=True)
    with pytest.raises(TypeError, match=r"side input, `context=\{'offset': \.\.\.\}`"):
        pipe.apply(variables, x, context={"mask": context["mask"]}, offset=context["offset"])
    with pytest.raises(ValueError, match=r"`context` has a batch of 4 examples but `x` has 5"):
        pipe.apply(variables, x, context=jax.tree.map(lambda a: a[:4], context))


# --- NNX --------------------------------------------------------------------------------------


class NMix(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(W, W, param_dtype=F, rngs=rngs)

    def __call__(self, h, mask=None):
        return h + jnp.tanh(self.dense(mix(h, mask)))


class NShift(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(W, W, param_dtype=F, rngs=rngs)

    def __call__(self, h, *, offset):
        return self.dense(h) + offset[:, None, None]


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_nnx_layers_receive_the_side_inputs_they_take(placement):
    mesh = models.make_mesh(placement, 2)
    rngs = nnx.Rngs(0)
    layers = [NMix(rngs), NShift(rngs), NMix(rngs), nnx.Linear(W, W, param_dtype=F, rngs=rngs)]
    x, context = inputs()
    with jax.set_mesh(mesh) if mesh is not None else _no_mesh():
        pipe = NNXPipeline(layers, balance=[2, 2], chunks=CHUNKS, mesh=mesh)
        plain = pipe.to_sequential()

        @nnx.jit
        def run(pipe, x, offset):
            def loss(pipe, x, offset):
                y = pipe(x, context={**context, "offset": offset})
                return jnp.sum(y**3), y

            return nnx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(pipe, x, offset)

        @nnx.jit
        def run_ref(plain, x, offset):
            def loss(plain, x, offset):
                h = x
                for layer in plain:
                    kw = {"mask": context["mask"]} if isinstance(layer, NMix) else {}
                    h = layer(h, **({"offset": offset} if isinstance(layer, NShift) else kw))
                return jnp.sum(h**3), h

            return nnx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(plain, x, offset)

        (_, y), g = run(pipe, x, context["offset"])
        (_, r), w = run_ref(nnx.List(plain), x, context["offset"])
    np.testing.assert_allclose(y, r, **FWD)
    got = [jax.tree.leaves(p) for p in pipe.layer_params(g[0])]
    models.assert_trees_close((got, *g[1:]), ([jax.tree.leaves(w[0][i]) for i in range(4)], *w[1:]), **GRAD)
    with pytest.raises(TypeError, match=r"\['offst'\] is a keyword argument that none of the layers"):
        pipe(x, context={"mask": context["mask"], "offst": context["offset"]})


class _no_mesh:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
