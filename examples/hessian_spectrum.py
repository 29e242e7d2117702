"""Hessian spectrum of a model trained through a 3-stage pipeline: top eigenvalues, trace, density.

1. Train a small MLP classifier, cut into 3 stage functions, through ``pj.pipeline`` on a mesh of 3
   simulated CPU devices (checkpointing every stage), with optax's Adam.
2. With the parameters still sharded over the stages (``apply.place``), compute with
   ``pipejax.hessian``: the top eigenvalues (Lanczos with full reorthogonalisation), the trace
   (Hutchinson, with its standard error) and the eigenvalue density (stochastic Lanczos
   quadrature), all through the pipeline and its checkpoints.
3. Save a plot of the density with a log-scale y axis, as Ghorbani et al. (2019) plot it: a bulk
   near zero and a few outliers.

Run ``python examples/hessian_spectrum.py`` (``--short`` for a quick run, which the tests use;
``--out`` for the PNG's path). No downloads, no accelerator.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from pipejax import hessian as ph

jax.config.update("jax_enable_x64", True)  # Lanczos accumulates in float64; the model stays float32
SIZES = (8, 32, 32, 4)  # input features, two hidden layers, classes


def dense(p, h):
    return h @ p["w"] + p["b"][None]


def hidden(p, h, key):
    return jnp.tanh(dense(p, h))


def head(p, h, key):
    return dense(p, h)


def make_data(n, seed):
    """Points in 8 dimensions, labelled by the quadrant of their first two coordinates."""
    x = np.random.default_rng(seed).standard_normal((n, SIZES[0])).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) * 2 + (x[:, 1] > 0).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a quick run (fewer steps and runs)")
    parser.add_argument("--out", default="hessian_density.png", help="where to save the plot")
    args = parser.parse_args()
    steps, runs, lanczos_steps, probes = (50, 3, 40, 20) if args.short else (500, 10, 90, 100)

    mesh = jax.make_mesh((3,), ("stage",))
    apply = pj.pipeline([hidden, hidden, head], chunks=4, checkpoint="always", mesh=mesh)
    rng = np.random.default_rng(0)
    params = [
        {"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32), "b": jnp.zeros(b)}
        for a, b in itertools.pairwise(SIZES)
    ]
    params = apply.place(params)  # each device stores its own stage
    x, y = make_data(256, 1)

    def loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    optimizer = optax.adam(1e-2)
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for i in range(steps):
        params, opt_state, value = step(params, opt_state)
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {float(value):.4f}")

    n = sum(a.size for a in jax.tree.leaves(params.unpack()))
    print(f"\nHessian of the training loss: {n} parameters, sharded over 3 stages")
    key = jax.random.key(0)
    top = ph.eigenvalues(loss, params, x, y, key=key, k=5, num_steps=lanczos_steps, dtype=jnp.float64)
    print("top-5 eigenvalues:", np.array2string(np.asarray(top), precision=5))
    k1 = jax.random.fold_in(key, 1)
    est, err = ph.trace(loss, params, x, y, key=k1, num_probes=probes, dtype=jnp.float64)
    print(f"trace: {float(est):.4f} +- {float(err):.4f} (Hutchinson, {probes} probes, standard error)")
    d = ph.density(
        loss, params, x, y, key=jax.random.fold_in(key, 2), num_steps=lanczos_steps, num_runs=runs,
        dtype=jnp.float64, progress=True,
    )  # fmt: skip
    grid, values = ph.smooth_density(d, num_points=2000)  # sigma^2 = 1e-5 * max(1, range), as PyHessian
    print(f"density: {runs} runs of {lanczos_steps} steps; spectral range {float(ph.spectral_range(d)):.4f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.semilogy(np.asarray(grid), np.maximum(np.asarray(values), 1e-12))
    ax.set_ylim(1e-6, None)
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("density (log scale)")
    ax.set_title(f"Hessian eigenvalue density (SLQ, {runs} x {lanczos_steps})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
