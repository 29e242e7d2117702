"""Run by test_hessian_sharding.py in a fresh process (XLA prints its partitioner warnings there).

The demo's pipelined Flax classifier on a 4-device Auto mesh: top eigenvalues and density, the
two calls whose basis products XLA used to reshard at every Lanczos step.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import numpy as np

import pipejax.demo as demo
import pipejax.hessian as ph

mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("stage",))
model = demo.Classifier(4 * demo.BLOCKS_PER_STAGE, 4, 2, "always", mesh)
x, y = demo.spirals(64, seed=0)
with jax.set_mesh(mesh):
    params = jax.jit(model.init)(jax.random.key(0), x[:8])["params"]


def loss(p, xb, yb):
    return demo.loss_fn(model, p, xb, yb)


# init returns the stage parameters replicated; one jitted gradient step, as training does, returns
# them sharded over the stages (P('stage')): the layout in which the basis products were resharded
sgd = jax.jit(lambda p: jax.tree.map(lambda a, g: a - 1e-3 * g, p, jax.grad(loss)(p, x, y)))
params = sgd(params)


# both functions and both kinds of reorthogonalisation, two compiles (one for each pair would
# double the test's time: compiling the pipelined HVP inside Lanczos dominates it); and density's
# default, without a basis (its vectors pinned all the same)
top = ph.eigenvalues(loss, params, x, y, key=jax.random.key(1), k=2, num_steps=6, reorthogonalise="partial")
dens = ph.density(loss, params, x, y, key=jax.random.key(2), num_steps=5, num_runs=1, reorthogonalise="full")
plain = ph.density(loss, params, x, y, key=jax.random.key(2), num_steps=5, num_runs=1)
jax.block_until_ready((top, dens, plain))
print("done", [float(v) for v in top])
