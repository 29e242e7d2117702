"""Layer stacks as Flax builds them, pipelined and stacked back.

* Linen: a stack made with ``nn.scan`` (one parameter tree, leaves stacked on a layer axis) goes
  into a ``LinenPipeline`` with ``from_stacked``; the pipeline equals the scanned model, and
  ``to_stacked`` gives the scan's variables back (bitwise).
* NNX: a stack made with ``nnx.vmap`` + ``nnx.split_rngs`` (Flax's scan-over-layers idiom) is
  cut into layers with ``pipejax.flax.unstack``; the pipeline equals ``nnx.scan`` over the stack,
  and ``restack(pipe.to_sequential())`` runs in the same ``nnx.scan`` after a training step.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipejax.flax import LinenPipeline, NNXPipeline, restack, unstack

F = jnp.float64
W, L, BATCH = 5, 4, 6
TOL = dict(rtol=1e-12, atol=1e-12)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(
            nn.Dense(W, param_dtype=F)(
                nn.LayerNorm(param_dtype=F, dtype=F, force_float32_reductions=False)(h)
            )
        )


class ScanBlock(Block):  # the carry form nn.scan needs, same parameters
    def __call__(self, h, _):
        return super().__call__(h), None


Stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)


def test_linen_scan_stack_round_trip():
    mesh = jax.make_mesh((2,), ("stage",))
    x = jax.random.normal(jax.random.key(0), (BATCH, W), F)
    stacked = Stack().init(jax.random.key(1), x, None)
    y_scan, _ = Stack().apply(stacked, x, None)
    pipe = LinenPipeline([Block() for _ in range(L)], balance=[2, 2], chunks=3, mesh=mesh)
    variables = pipe.from_stacked(stacked)
    np.testing.assert_allclose(jax.jit(pipe.apply)(variables, x), y_scan, **TOL)
    back = pipe.to_stacked(variables)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, dict(stacked)))
    with pytest.raises(ValueError, match=r"leading axis of size 3.*has shape \(4,"):
        LinenPipeline([Block() for _ in range(3)], num_stages=1).from_stacked(stacked)


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(W, W, param_dtype=F, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h):
        return h + self.dropout(jnp.tanh(self.linear(h)))


@nnx.split_rngs(splits=L)
@nnx.vmap(in_axes=(0,), out_axes=0)
def create_stack(rngs):
    return NBlock(rngs)


@nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
def run_stack(block, h):
    return block(h)


def test_nnx_vmap_stack_round_trip():
    mesh = jax.make_mesh((2,), ("stage",))
    x = jax.random.normal(jax.random.key(0), (BATCH, W), F)
    stack = create_stack(nnx.Rngs(0))
    stack.eval()
    y_scan = run_stack(stack, x)
    layers = unstack(stack)
    assert len(layers) == L and layers[0].linear.kernel.shape == (W, W)
    pipe = NNXPipeline(layers, balance=[2, 2], chunks=3, mesh=mesh, deterministic=True, rngs=nnx.Rngs(1))
    np.testing.assert_allclose(nnx.jit(lambda p, x: p(x))(pipe, x), y_scan, **TOL)

    with jax.set_mesh(mesh):
        opt = nnx.Optimizer(pipe, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(pipe, opt):
        opt.update(pipe, nnx.grad(lambda p: jnp.sum(p(x) ** 2))(pipe))

    step(pipe, opt)
    trained = restack(pipe.to_sequential())
    trained.eval()
    with jax.set_mesh(mesh):
        y_trained = run_stack(trained, x)
    np.testing.assert_allclose(nnx.jit(lambda p, x: p(x))(pipe, x), y_trained, **TOL)
    assert not np.allclose(y_trained, y_scan)  # the step changed the parameters
    with pytest.raises(ValueError, match="layer stack"):
        unstack(NBlock(nnx.Rngs(0)))
