"""``carry=``: which part of a layer's output is the activation passed on (issue 24).

Layers that return more than the activation (Gemma's blocks return ``(cache, x)``) are pipelined
without wrapper layers by naming the activation: an index into a tuple output, a key into a dict
output, or a function. Checked here, without a mesh (the selection happens inside each layer's
step, before any stage boundary, so meshes change nothing; ``tests/test_flax_gemma.py`` runs it on
a mesh):

* each form equals the layers run in sequence with the same selection by hand, the last layer's
  output included; outputs of another kind (an array, for an index) pass whole;
* Linen: ``init`` (which runs the layers in sequence) and ``apply`` both select;
* the errors: a bad ``carry`` (``TypeError``), an index or key the output lacks, dropped parts
  that hold arrays (an aux loss would be lost: refused without ``aux=``, which collects them;
  see ``tests/test_flax_aux.py``),
  and a tuple with ``None`` passed on without ``carry`` (the message says to use ``carry=``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline

F = jnp.float64
WIDTH, BATCH, CHUNKS = 4, 5, 2
TOL = dict(rtol=1e-14, atol=1e-14)


class Lin(nnx.Module):
    """Returns its activation inside another structure, as ``shape`` says."""

    def __init__(self, seed, shape):
        self.lin = nnx.Linear(WIDTH, WIDTH, param_dtype=F, rngs=nnx.Rngs(seed))
        self.shape = shape

    def __call__(self, x):
        y = jnp.tanh(self.lin(x))
        if self.shape == "tuple":
            return None, y  # (cache, x)
        if self.shape == "dict":
            return {"cache": None, "x": y, "step": 3}  # a Python value beside it is dropped too
        if self.shape == "aux":
            return y, jnp.sum(y**2)  # an aux loss: an array
        return y


def x_data():
    return jax.random.normal(jax.random.key(1), (BATCH, WIDTH), F)


def sequential(layers, x, pick):
    for layer in layers:
        x = pick(layer(x))
    return x


@pytest.mark.parametrize(
    "shape, carry, pick",
    [
        ("tuple", 1, lambda out: out[1] if isinstance(out, tuple) else out),
        ("tuple", -1, lambda out: out[-1] if isinstance(out, tuple) else out),
        ("dict", "x", lambda out: out["x"] if isinstance(out, dict) else out),
        (
            "aux",
            lambda out: out[0] if isinstance(out, tuple) else out,
            lambda out: out[0] if isinstance(out, tuple) else out,
        ),
    ],
    ids=["index", "negative-index", "key", "function-drops-an-aux-loss-explicitly"],
)
def test_nnx_carry_forms_equal_the_layers_by_hand(shape, carry, pick):
    # an array-returning first layer (an embedding's place) passes whole; the last layer selects too
    layers = [Lin(0, "plain"), Lin(1, shape), Lin(2, shape), Lin(3, shape)]
    pipe = NNXPipeline(layers, balance=[2, 2], chunks=CHUNKS, carry=carry)
    x = x_data()
    np.testing.assert_allclose(pipe(x), sequential(layers, x, pick), **TOL)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return None, jnp.tanh(nn.Dense(WIDTH, param_dtype=F)(x))


def test_linen_carry_in_init_and_apply():
    layers = [nn.Dense(WIDTH, param_dtype=F), LinenBlock(), LinenBlock(), LinenBlock()]
    pipe = LinenPipeline(layers, balance=[2, 2], chunks=CHUNKS, carry=1)
    x = x_data()
    y_init, variables = pipe.init_with_output(jax.random.key(0), x)
    seq = pipe.to_sequential(variables)["params"]
    h = layers[0].apply({"params": seq["layers_0"]}, x)
    for index in (1, 2, 3):
        _, h = LinenBlock().apply({"params": seq[f"layers_{index}"]}, h)
    np.testing.assert_allclose(y_init, h, **TOL)
    np.testing.assert_allclose(pipe.apply(variables, x), h, **TOL)
    with pytest.raises(TypeError, match=r"`carry` of LinenPipeline .* but got tuple \(1, 'x'\)"):
        LinenPipeline(layers, balance=[2, 2], carry=(1, "x"))


@pytest.mark.parametrize("carry", [True, 1.0, [1], (0, 1)])
def test_bad_carry_is_a_type_error(carry):
    with pytest.raises(TypeError, match=r"`carry` of NNXPipeline says which part .* but got"):
        NNXPipeline([Lin(0, "tuple")], balance=[1], carry=carry)


@pytest.mark.parametrize(
    "shape, carry, match",
    [
        (
            "tuple",
            2,
            r"`carry=2` selects item 2 .* layer 0 returned a tuple of 2 item\(s\): "
            r"\(None, 'float64\[3, 4\]'\)",
        ),
        (
            "dict",
            "h",
            r"`carry='h'` selects the entry 'h' .* layer 0 returned a dict with the keys "
            r"\['cache', 'step', 'x'\]",
        ),
        (
            "aux",
            0,
            r"Layer 0 returned .*item 1 would be dropped, but it holds arrays.* only with the `aux=` option",
        ),
    ],
    ids=["index-out-of-range", "missing-key", "dropped-aux-loss"],
)
def test_bad_selection_is_a_value_error(shape, carry, match):
    pipe = NNXPipeline([Lin(0, shape), Lin(1, "plain")], balance=[1, 1], chunks=CHUNKS, carry=carry)
    with pytest.raises(ValueError, match=match):
        pipe(x_data())


def test_a_cache_tuple_without_carry_says_to_use_carry():
    pipe = NNXPipeline([Lin(0, "tuple"), Lin(1, "tuple")], balance=[1, 1], chunks=CHUNKS)
    with pytest.raises(
        ValueError,
        match=r"(?s)Layer 1 could not be applied to the output of layer 0, "
        r"\(None, 'float64\[3, 4\]'\).*`carry=1`",
    ):
        pipe(x_data())
    pipe = NNXPipeline([Lin(0, "tuple"), Lin(1, "tuple")], balance=[2], chunks=CHUNKS)  # within a stage
    with pytest.raises(ValueError, match=r"Layer 1 could not be applied to the output of layer 0"):
        pipe(x_data())


class AddOne(nnx.Module):
    def __call__(self, x):
        return x + 1.0  # on a tuple: Python's own TypeError


def test_the_hint_keeps_the_errors_type():
    pipe = NNXPipeline([Lin(0, "tuple"), AddOne()], balance=[2], chunks=CHUNKS)
    with pytest.raises(
        TypeError, match=r"(?s)Layer 1 could not be applied .*can only concatenate tuple.*`carry=1`"
    ):
        pipe(x_data())
