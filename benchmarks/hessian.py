"""Cost of pipejax.hessian: HVP against gradient, Lanczos against bare HVPs, float32 and float64.

Run from the repository root::

    .venv/bin/python benchmarks/hessian.py           # full run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/hessian.py --quick   # smoke run

The model is an MLP (tanh, softmax cross-entropy) on one batch, on one device. Every function is
compiled once before timing; times are wall times measured in interleaved rounds in one process,
and every ratio is the median of per-round ratios (with quartiles): these machines are shared and
noisy, and ratios taken side by side survive that where absolute times do not.

* ``HVP / grad``: forward-over-reverse (``fwd_rev``) and reverse-over-reverse (``rev_rev``) HVPs
  against ``jax.grad`` of the same loss.
* ``Lanczos / m HVPs``: ``pipejax.hessian.lanczos`` with ``m`` steps (full reorthogonalisation)
  against ``m`` bare HVPs in one ``lax.fori_loop``: what the library adds to the HVPs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header, interleaved_times, ratio_stats, section, table

from pipejax import hessian as ph
from pipejax._src.hessian import tree


def make(sizes, batch, dtype, seed=0):
    rng = np.random.default_rng(seed)
    params = [
        {"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), dtype), "b": jnp.zeros(b, dtype)}
        for a, b in itertools.pairwise(sizes)
    ]
    x = jnp.asarray(rng.standard_normal((batch, sizes[0])), dtype)
    y = jnp.asarray(rng.integers(0, sizes[-1], batch))
    return params, x, y


def loss(params, x, y):
    for j, p in enumerate(params):
        x = x @ p["w"] + p["b"][None]
        if j < len(params) - 1:
            x = jnp.tanh(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


def fmt(stats):
    med, q1, q3 = stats
    return f"{med:.2f}x ({q1:.2f}-{q3:.2f})"


def run(sizes, batch, m, rounds, dtypes):
    rows_hvp, rows_lz = [], []
    for dtype in dtypes:
        params, x, y = make(sizes, batch, dtype)
        v = tree.normal(jax.random.key(1), params, dtype)
        n = tree.size(params)
        grad = jax.jit(jax.grad(loss))
        fwd = jax.jit(lambda p, v, x, y: ph.hvp(loss, p, v, x, y))
        rev = jax.jit(lambda p, v, x, y: ph.hvp(loss, p, v, x, y, mode="rev_rev"))
        fns = {"grad": lambda p, v, x, y, g=grad: g(p, x, y), "fwd_rev": fwd, "rev_rev": rev}
        t = interleaved_times(fns, (params, v, x, y), rounds)
        rows_hvp.append(
            [jnp.dtype(dtype).name, f"{n:,}", f"{1e3 * np.median(t['grad']):.2f}",
             fmt(ratio_stats(t["fwd_rev"], t["grad"])), fmt(ratio_stats(t["rev_rev"], t["grad"]))]
        )  # fmt: skip

        def matvec(p, x, y):
            return lambda u: ph.hvp(loss, p, u, x, y)

        @jax.jit
        def lanczos(p, v, x, y):
            return ph.lanczos(matvec(p, x, y), v, m).diag

        @jax.jit
        def bare(p, v, x, y):  # m HVPs, each fed the last (normalised) one: no reorthogonalisation
            def body(i, u):
                w = matvec(p, x, y)(u)
                return tree.scale(1 / tree.norm(w), w)

            return jax.lax.fori_loop(0, m, body, v)

        t = interleaved_times({"bare": bare, "lanczos": lanczos}, (params, v, x, y), max(3, rounds // 4))
        rows_lz.append(
            [jnp.dtype(dtype).name, f"{n:,}", m, f"{1e3 * np.median(t['bare']):.1f}",
             fmt(ratio_stats(t["lanczos"], t["bare"]))]
        )  # fmt: skip
    section("HVP / grad")
    print(table(["dtype", "params", "grad (ms)", "fwd_rev / grad", "rev_rev / grad"], rows_hvp))
    section("Lanczos / m HVPs")
    print(table(["dtype", "params", "m", "m HVPs (ms)", "Lanczos / m HVPs"], rows_lz))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # float64 rows; float32 rows stay float32
    header("pipejax.hessian benchmark", args.quick)
    if args.quick:
        sizes, batch, m, rounds = (16, 32, 10), 64, 10, 6
    else:
        sizes, batch, m, rounds = (32, 256, 256, 10), 256, 90, 20
    print(f"\nMLP {' -> '.join(map(str, sizes))}, batch {batch}, Lanczos steps m = {m}, {rounds} rounds.")
    run(sizes, batch, m, rounds, (jnp.float32, jnp.float64))


if __name__ == "__main__":
    main()
