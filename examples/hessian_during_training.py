"""The Hessian during training: top eigenvalue and trace rise, then fall (scikit-learn's digits).

A known qualitative result (Jastrzebski et al. 2019, "On the relation between the sharpest
directions of DNN loss and the SGD step length"; Ghorbani et al. 2019; Cohen et al. 2021,
"progressive sharpening"): from a small initialisation, the curvature of the training loss grows
early in training (the top eigenvalue and the trace of the Hessian rise), then falls as the
classifier becomes confident (softmax cross-entropy saturates, so its Hessian shrinks).

1. Load scikit-learn's digits (1,797 images of 8x8 pixels, bundled with the package: no download),
   train an MLP 64 -> 32 -> 32 -> 10 cut into 3 stages through ``pj.pipeline`` on 3 simulated
   CPU devices, with SGD and momentum; the parameters stay sharded over the stages.
2. Every 50 steps (every 10 in the first 100), on a fixed batch of 512 training images: the top
   eigenvalue (Lanczos), the trace (Hutchinson, with its standard error) and the trace of each
   stage's diagonal block (``blocks=ph.stage_blocks(...)``, all stages in one call).
3. Plot the top eigenvalue and the trace against the step, and the per-stage traces, to a PNG.

Run ``python examples/hessian_during_training.py`` (``--short`` for the quick run the tests use;
``--out`` for the PNG's path). Needs scikit-learn (``pip install pipejax[examples]``) and matplotlib.
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

SIZES = (64, 32, 32, 10)  # pixels, two hidden layers, classes


def dense(p, h):
    return h @ p["w"] + p["b"][None]


def hidden(p, h, key):
    return jnp.tanh(dense(p, h))


def head(p, h, key):
    return dense(p, h)


def load_digits():
    from sklearn.datasets import load_digits as sklearn_digits

    d = sklearn_digits()
    x = (d.data / 16.0 - 0.5).astype(np.float32)  # pixels 0..16 -> [-0.5, 0.5]
    return jnp.asarray(x), jnp.asarray(d.target.astype(np.int32))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a quick run (a few steps, small estimates)")
    parser.add_argument("--out", default="hessian_during_training.png", help="where to save the plot")
    args = parser.parse_args()
    # steps, evaluations, Lanczos steps, Hutchinson probes
    steps, every, lanczos_steps, probes = (6, 3, 8, 4) if args.short else (1000, 50, 30, 30)
    early = every // 5 if every >= 5 else every  # the rise is fast: measure 5x as often at first

    mesh = jax.make_mesh((3,), ("stage",))
    apply = pj.pipeline([hidden, hidden, head], chunks=4, checkpoint="always", mesh=mesh)
    rng = np.random.default_rng(0)
    init = [
        # a small initialisation, so that training starts in a flat region
        {"w": jnp.asarray(0.3 * rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32), "b": jnp.zeros(b)}
        for a, b in itertools.pairwise(SIZES)
    ]
    params = apply.place(init)  # each device stores its own stage
    support = apply.place(jax.tree.map(jnp.ones_like, init))  # 1 at real entries, 0 at padding
    blocks = ph.stage_blocks(params, support)
    x, y = load_digits()
    probe_x, probe_y = x[:512], y[:512]  # the fixed batch the curvature is measured on

    def loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    optimizer = optax.sgd(0.1, momentum=0.9)
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        value, grads = jax.value_and_grad(loss)(params, xb, yb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    @jax.jit
    def curvature(params, key):
        k1, k2, k3 = jax.random.split(key, 3)
        args = (params, probe_x, probe_y)
        top = ph.eigenvalues(loss, *args, key=k1, k=1, num_steps=lanczos_steps)[0]
        est, err = ph.trace(loss, *args, key=k2, num_probes=probes)
        per_stage, _ = ph.trace(loss, *args, key=k3, num_probes=probes, blocks=blocks)
        return top, est, err, per_stage

    rows = []
    order = np.random.default_rng(1).permutation(x.shape[0])
    for i in range(steps + 1):
        if i % every == 0 or (i < 2 * every and i % early == 0):
            top, est, err, per_stage = curvature(params, jax.random.fold_in(jax.random.key(0), i))
            value = float(loss(params, probe_x, probe_y))
            rows.append((i, value, float(top), float(est), float(err), np.asarray(per_stage)))
            stages = ", ".join(f"{t:.3f}" for t in rows[-1][5])
            print(
                f"step {i:5d}  loss {value:.4f}  top eigenvalue {float(top):.4f}  "
                f"trace {float(est):.3f} +- {float(err):.3f}  stage traces [{stages}]",
                flush=True,
            )
        if i < steps:
            idx = order[(i * 64) % (x.shape[0] - 64) :][:64]  # mini-batches of 64
            params, opt_state, _ = step(params, opt_state, x[idx], y[idx])

    tops = np.array([r[2] for r in rows])
    traces = np.array([r[3] for r in rows])
    peak = int(np.argmax(tops))
    print(
        f"top eigenvalue: {tops[0]:.4f} at step 0, peak {tops[peak]:.4f} at step {rows[peak][0]}, "
        f"{tops[-1]:.4f} at step {rows[-1][0]}"
    )
    peak_t = int(np.argmax(traces))
    print(
        f"trace: {traces[0]:.3f} at step 0, peak {traces[peak_t]:.3f} at step {rows[peak_t][0]}, "
        f"{traces[-1]:.3f} at step {rows[-1][0]}"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at = [r[0] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(at, tops, "o-", ms=3, label="top eigenvalue", color="C0")
    ax1.set_xlabel("SGD step")
    ax1.set_ylabel("top eigenvalue", color="C0")
    twin = ax1.twinx()
    twin.errorbar(at, traces, yerr=[r[4] for r in rows], fmt="s-", ms=3, color="C1", label="trace")
    twin.set_ylabel("trace (Hutchinson)", color="C1")
    ax1.set_title("Hessian of the training loss (digits, 3-stage pipeline)")
    for s in range(len(SIZES) - 1):
        ax2.plot(at, [r[5][s] for r in rows], "o-", ms=3, label=f"stage {s}")
    ax2.set_xlabel("SGD step")
    ax2.set_ylabel("trace of the stage's block")
    ax2.set_title("layer-wise (per-stage) trace")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
