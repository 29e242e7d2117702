"""Train a Glow-style multi-scale flow on 8x8 digit images, with constant-memory backpropagation.

This is the tutorial example of ``pipejax.invertible``:

1. make a small image set: 8x8 digits drawn from a 3x5 bitmap font with random position, size,
   stroke blur, intensity and noise, quantised to 16 grey levels (generated here from a fixed
   seed: no download, no data file);
2. build a two-level multi-scale flow (Glow, RealNVP): ``Squeeze`` then K steps of
   ``ActNorm -> Inv1x1Conv -> AffineCoupling``, factor out half the channels, ``Squeeze`` then K
   more steps. The K steps of each level are a ``Chain(..., repeat=K, memory="constant")``: the
   backward pass rebuilds their activations through the inverses instead of storing them;
3. check at step 0 that the constant-memory gradient equals plain autodiff's
   (``memory="linear"``), and compare the compiled memory of the two training steps;
4. train with optax's Adam on dequantised data, report bits per dimension on held-out images,
   and save a PNG grid of samples.

Run it with ``python examples/train_glow_digits.py`` (a few minutes on 2 CPU cores); ``--short``
runs 30 steps of a K=2 flow (the tests use it). Bits per dimension are of 4-bit data: a uniform
model scores 4.0.
"""

import os

# Inv1x1Conv's inverse (used by the constant-memory backward pass) makes two tiny LAPACK triangular
# solves per step of flow; OpenBLAS's spinning threads only slow those down. Set before JAX loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax.invertible as inv

NUM_BINS = 16  # grey levels of the images (4 bits)
TOLERANCE = 1e-4  # step-0 check: constant vs linear gradients, relative, float32

# --- the data -------------------------------------------------------------------------------------

FONT = [  # 3x5 bitmaps of the digits 0-9, one string per row
    ["111", "101", "101", "101", "111"],
    ["010", "110", "010", "010", "111"],
    ["111", "001", "111", "100", "111"],
    ["111", "001", "111", "001", "111"],
    ["101", "101", "111", "001", "001"],
    ["111", "100", "111", "001", "111"],
    ["111", "100", "111", "101", "111"],
    ["111", "001", "010", "010", "010"],
    ["111", "101", "111", "101", "111"],
    ["111", "101", "111", "001", "111"],
]


def make_digits(n: int, seed: int) -> np.ndarray:
    """``n`` images of shape (8, 8, 1) with integer grey levels in ``[0, NUM_BINS)``."""
    rng = np.random.default_rng(seed)
    glyphs = [np.array([[c == "1" for c in row] for row in g], np.float64) for g in FONT]
    images = np.zeros((n, 8, 8))
    for i in range(n):
        glyph = glyphs[rng.integers(10)]
        height, width = rng.integers(5, 8), rng.integers(3, 6)  # nearest-neighbour stretch
        rows = (np.arange(height) * 5 // height)[:, None]
        cols = (np.arange(width) * 3 // width)[None, :]
        top, left = rng.integers(0, 9 - height), rng.integers(0, 9 - width)
        images[i, top : top + height, left : left + width] = glyph[rows, cols] * rng.uniform(0.6, 1.0)
    sigma = rng.uniform(0.3, 0.8, size=n)  # stroke blur, separable Gaussian per image
    offsets = np.arange(-2, 3)
    kernels = np.exp(-0.5 * (offsets[None, :] / sigma[:, None]) ** 2)
    kernels /= kernels.sum(axis=1, keepdims=True)
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    images = sum(kernels[:, k, None, None] * padded[:, k : k + 8, 2:-2] for k in range(5))
    padded = np.pad(images, ((0, 0), (0, 0), (2, 2)))
    images = sum(kernels[:, k, None, None] * padded[:, :, k : k + 8] for k in range(5))
    images = images / images.max(axis=(1, 2), keepdims=True) + rng.normal(0, 0.03, images.shape)
    return np.clip(np.floor(images * NUM_BINS), 0, NUM_BINS - 1).astype(np.int32)[..., None]


# --- the model ------------------------------------------------------------------------------------


def make_flow(steps: int, hidden: int, memory: str) -> inv.Flow:
    """Two levels: (8, 8, 1) -> squeeze (4, 4, 4) -> K steps -> factor out 2 channels ->
    squeeze (2, 2, 8) -> K steps. Latents: (4, 4, 2) and (2, 2, 8), 64 dimensions in all."""

    def level():
        step = [inv.ActNorm(), inv.Inv1x1Conv(), inv.AffineCoupling(hidden=hidden)]
        flow_steps = inv.Chain(step, repeat=steps, memory=memory)
        return inv.Chain([inv.Squeeze(), flow_steps], memory="linear")  # one repeat: a composition

    return inv.Flow(inv.MultiScale([level(), level()]), event_shape=(8, 8, 1), dtype=jnp.float32)


def loss_fn(flow):
    def loss(params, images, key):
        return jnp.mean(flow.bits_per_dim(params, images, key, num_bins=NUM_BINS))

    return loss


def save_grid(images: np.ndarray, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = int(math.sqrt(len(images)))
    grid = images[: n * n, :, :, 0].reshape(n, n, 8, 8).transpose(0, 2, 1, 3).reshape(8 * n, 8 * n)
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.imshow(grid, cmap="gray", vmin=-0.5, vmax=0.5, interpolation="nearest")
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def rel_err(a, b) -> float:
    a, b = (jnp.concatenate([v.ravel() for v in jax.tree.leaves(t)]) for t in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default: 1500)")
    parser.add_argument(
        "--short", action="store_true", help="run 30 steps of a K=2 flow only (for the tests)"
    )
    parser.add_argument(
        "--depth", type=int, default=None, help="steps of flow per level, K (default: 4; 2 with --short)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("out/glow_digits_samples.png"), help="PNG of samples"
    )
    args = parser.parse_args()
    steps, print_every = (30, 10) if args.short else (args.steps, 250)
    if args.depth is None:
        args.depth = 2 if args.short else 4
    batch, hidden = 128, 32

    train, test = make_digits(4000, seed=0), make_digits(1000, seed=1)
    flow = make_flow(args.depth, hidden, memory="constant")
    key = jax.random.key(0)
    init_batch = inv.dequantize(train[:512], jax.random.fold_in(key, 1), num_bins=NUM_BINS)
    params = jax.jit(flow.init)(jax.random.fold_in(key, 2), init_batch)  # ActNorm: data-dependent
    loss = loss_fn(flow)

    # Step 0: the constant-memory gradient is plain autodiff's, and takes less memory.
    linear_loss = loss_fn(make_flow(args.depth, hidden, memory="linear"))
    args0 = (params, jnp.asarray(train[:batch]), jax.random.fold_in(key, 3))
    programs = {
        name: jax.jit(jax.grad(fn)).lower(*args0).compile()
        for name, fn in (("constant", loss), ("linear", linear_loss))
    }
    err = rel_err(programs["constant"](*args0), programs["linear"](*args0))
    temp = {name: p.memory_analysis().temp_size_in_bytes for name, p in programs.items()}
    print(f"step-0 check: constant vs linear gradient, relative difference {err:.1e} (tolerance {TOLERANCE})")
    print(
        f"compiled temp memory of a training step: constant {temp['constant'] / 2**20:.2f} MiB, "
        f"linear {temp['linear'] / 2**20:.2f} MiB (K={args.depth} steps per level, batch {batch})"
    )
    if not err < TOLERANCE:
        print("step-0 check FAILED", file=sys.stderr)
        return 1
    reconstruction_error = jax.jit(lambda p, x: inv.reconstruction_error(flow.layer, p, x))  # compiled once
    error = reconstruction_error(params, init_batch)
    print(f"reconstruction error on a batch at init: {float(jnp.max(error)):.1e}")

    optimizer = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 2e-3, min(100, steps // 4), steps))
    state = optimizer.init(params)

    @jax.jit
    def train_step(params, state, images, key):
        value, grads = jax.value_and_grad(loss)(params, images, key)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    @jax.jit
    def test_bpd(params, key):
        return jnp.mean(flow.bits_per_dim(params, jnp.asarray(test), key, num_bins=NUM_BINS))

    rng = np.random.default_rng(2)
    start = time.perf_counter()
    print(f"test bpd {float(test_bpd(params, jax.random.key(9))):.3f} at step 0 (uniform model: 4.000)")
    for step in range(1, steps + 1):
        images = jnp.asarray(train[rng.integers(0, len(train), batch)])
        params, state, value = train_step(params, state, images, jax.random.fold_in(key, 100 + step))
        if step % print_every == 0 or step == steps:
            bpd = float(test_bpd(params, jax.random.key(9)))
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}  train bpd {float(value):.3f}  test bpd {bpd:.3f}  {elapsed:.0f}s")

    error = reconstruction_error(params, init_batch)  # the same program as at step 0
    print(f"reconstruction error on a batch after training: {float(jnp.max(error)):.1e}")
    samples = jax.jit(lambda p, k: flow.sample(p, k, 64, temperature=0.7))(params, jax.random.key(5))
    save_grid(np.asarray(samples), args.out, f"samples (T=0.7), test {bpd:.2f} bits/dim")
    print(f"saved 64 samples to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
