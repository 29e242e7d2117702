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
* ``Lanczos / m HVPs``: ``pipejax.hessian.lanczos`` with ``m`` steps, partial (the default) and
  full reorthogonalisation, against ``m`` bare HVPs in one ``lax.fori_loop`` (same jit, same
  operator, each HVP fed the last normalised one). The difference is the reorthogonalisation: with
  ``"full"`` one Gram-Schmidt pass per step reads the ``(m + 1) x n`` basis twice, a memory-bound
  matrix-vector product whose cost grows with ``m n`` while the HVP's grows with ``batch n``
  (timed alone as the same Lanczos on a diagonal operator); with ``"partial"`` only the steps that
  Simon's estimate marks run that pass (their count is printed). Memory: the basis's size and
  XLA's compiled temp bytes. The full run has a second batch size (2048).
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
from _common import header, interleaved_times, ratio_stats, section, table, temp_bytes

from pipejax import hessian as ph
from pipejax._src.hessian import tree
from pipejax._src.hessian.lanczos import _lanczos


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


def hvp_rows(sizes, batch, rounds, dtype):
    params, x, y = make(sizes, batch, dtype)
    v = tree.normal(jax.random.key(1), params, dtype)
    grad = jax.jit(jax.grad(loss))
    fwd = jax.jit(lambda p, v, x, y: ph.hvp(loss, p, v, x, y))
    rev = jax.jit(lambda p, v, x, y: ph.hvp(loss, p, v, x, y, mode="rev_rev"))
    fns = {"grad": lambda p, v, x, y, g=grad: g(p, x, y), "fwd_rev": fwd, "rev_rev": rev}
    t = interleaved_times(fns, (params, v, x, y), rounds)
    return [jnp.dtype(dtype).name, f"{tree.size(params):,}", batch, f"{1e3 * np.median(t['grad']):.2f}",
            fmt(ratio_stats(t["fwd_rev"], t["grad"])), fmt(ratio_stats(t["rev_rev"], t["grad"]))]  # fmt: skip


def lanczos_row(sizes, batch, m, rounds, dtype):
    """Lanczos (partial and full reorthogonalisation) against m bare HVPs; passes and memory."""
    params, x, y = make(sizes, batch, dtype)
    v = tree.normal(jax.random.key(1), params, dtype)
    # a diagonal operator with a spread spectrum: Lanczos on it costs the reorthogonalisation only
    diag = tree.normal(jax.random.key(2), params, dtype)
    diag = jax.tree.map(lambda a: jnp.abs(a) + jnp.asarray(1, dtype), diag)

    def matvec(p, x, y):
        return lambda u: ph.hvp(loss, p, u, x, y)

    def lanczos(reorth):
        return jax.jit(lambda p, v, x, y: _lanczos(matvec(p, x, y), v, m, None, False, "", reorth))

    @jax.jit
    def reorth(p, v, x, y):  # full reorthogonalisation on the diagonal operator: the passes alone
        return ph.lanczos(lambda u: jax.tree.map(jnp.multiply, u, diag), v, m, reorthogonalise="full").diag

    @jax.jit
    def bare(p, v, x, y):  # m HVPs, each fed the last (normalised) one: no reorthogonalisation
        def body(i, u):
            w = matvec(p, x, y)(u)
            return tree.scale(1 / tree.norm(w), w)

        return jax.lax.fori_loop(0, m, body, v)

    fns = {"bare": bare, "partial": lanczos("partial"), "full": lanczos("full"), "reorth": reorth}
    t = interleaved_times(fns, (params, v, x, y), rounds, warmup=1)
    n = tree.size(params)
    per_step = {k: 1e3 * np.median(t[k]) / m for k in fns}
    passes = int(fns["partial"](params, v, x, y)[1])
    basis_bytes = (m + 1) * n * jnp.dtype(dtype).itemsize
    temp = {k: temp_bytes(fns[k], params, v, x, y) for k in ("bare", "partial", "full")}
    mib = lambda b: f"{b / 2**20:.1f}"
    return [jnp.dtype(dtype).name, f"{n:,}", batch, m, f"{per_step['bare']:.2f}", f"{per_step['reorth']:.2f}",
            f"{passes}/{m}", fmt(ratio_stats(t["partial"], t["bare"])),
            fmt(ratio_stats(t["full"], t["bare"])), mib(basis_bytes), mib(temp["bare"]),
            mib(temp["partial"]), mib(temp["full"])]  # fmt: skip


def run(sizes, batches, m, rounds, dtypes):
    rows_hvp = [hvp_rows(sizes, batches[0], rounds, dtype) for dtype in dtypes]
    section("HVP / grad")
    print(table(["dtype", "params", "batch", "grad (ms)", "fwd_rev / grad", "rev_rev / grad"], rows_hvp))
    rows_lz = [lanczos_row(sizes, b, m, max(3, rounds // 4), dtype) for b in batches for dtype in dtypes]
    section("Lanczos / m HVPs")
    print(
        table(
            ["dtype", "params", "batch", "m", "HVP (ms/step)", "full pass (ms/step)", "partial: passes",
             "partial / m HVPs", "full / m HVPs", "basis (MiB)", "temp bare (MiB)", "temp partial (MiB)",
             "temp full (MiB)"],
            rows_lz,
        )
    )  # fmt: skip
    print(
        "\nfull pass: Lanczos with full reorthogonalisation on a diagonal operator, i.e. one classical "
        "Gram-Schmidt\npass per step alone (it reads the (m + 1) x n basis twice). partial: passes = the "
        "steps where Simon's\nestimate of the lost orthogonality passed sqrt(eps) (each such step and the "
        "next run a pass).\nbasis: (m + 1) x n stored numbers; temp: XLA's compiled temp bytes of the whole "
        "jitted run\n(bare = m HVPs alone)."
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # float64 rows; float32 rows stay float32
    header("pipejax.hessian benchmark", args.quick)
    if args.quick:
        sizes, batches, m, rounds = (16, 32, 10), (64,), 10, 6
    else:
        sizes, batches, m, rounds = (32, 256, 256, 10), (256, 2048), 90, 20
    print(f"\nMLP {' -> '.join(map(str, sizes))}, Lanczos steps m = {m}, {rounds} rounds.")
    run(sizes, batches, m, rounds, (jnp.float32, jnp.float64))


if __name__ == "__main__":
    main()
